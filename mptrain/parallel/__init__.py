"""Parallelism: the mesh and what each of its axes splits, the state's shardings, and the
collectives a split step takes.

`layout` (the five mesh axes, the one table of what each splits, the batch laid out on the
mesh), `sharding` (the state's shardings, the per-device gradient with params gathered in the
compute dtype and gradients reduced in fp32) and `tensor` (a tensor group's collectives,
Megatron's sequence parallelism). It imports only the base modules: the optimizers, the recipe
and the models build on it, and hand it what it needs (a policy, an 8-bit tensor's own
`shardings`) as values.
"""

from mptrain.parallel import cpu_channels

cpu_channels.install()  # before any step is lowered: the CPU's collectives each their own id
