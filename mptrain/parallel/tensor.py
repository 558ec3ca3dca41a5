"""Tensor parallelism with sequence-parallel norms (`mesh.tensor`): what a tensor group splits,
and the four collectives its layers take.

A tensor group of `t` devices holds the same rows and sequences (the batch is replicated over
it, `layout.batch_spec`) and splits each layer's work the way Megatron-LM does:

  * the projections into attention's heads and the MLP's hidden units (q, k, v, gate, up) by
    their output: each device computes `heads / t` of q's heads, `kv_heads / t` of k's and v's
    (whole groups of queries with their key-value head), `d_ff / t` of the MLP's units;
  * the projections out of them (o, down) by their input: each device's product is a partial
    sum of the output, which the group adds up (`scatter`);
  * the vocabulary: the embedding's rows and the head's columns, `vocab / t` each
    (`mptrain.models.lm_loss`: the logsumexp over a split vocabulary, in fp32);
  * between the blocks, the tokens: each device holds `1 / t` of its part of every sequence, on
    which the norms and the residual adds run (sequence parallelism: no device holds the
    `[B, L, D]` activations whole, and a norm runs on `1 / t` of the tokens, not all of them).

A block then moves its tokens through four collectives each way (two in attention, two in the
MLP), as Megatron's sequence parallelism does:

    gather   [B, l/t, D] -> [B, l, D]: all-gather the normed tokens over the group (16 bits);
             backward, their gradient's partial sums reduce-scattered in fp32
    scatter  [B, l, D] partial -> [B, l/t, D]: the out projection's partial sums added over the
             group in fp32 and scattered by tokens, cast once to the compute dtype (Megatron
             reduces them in the activations' dtype, a rounding a device); backward, all-gather

`part` keeps a device's own tokens of a value that every device of the group holds whole (the
head's per-token losses), its gradient the group's all-gathered. Each token's loss is then
counted once: `layers.masked_mean` sums counts over every mesh axis.

The weights a device holds are its part over `tensor` and, over `fsdp` (x `context`), shards
of that part, gathered one layer at a time as under FSDP alone (`sharding._gather`, which never
gathers over `tensor`); a weight the group shares (the norms' scales, a LoRA factor on the
unsplit side) is summed over the group in the gradient's fp32 reduction, as over `data`. What
the group splits is what each param declared (`parallel.axes`: `q_heads`, `kv_heads`, `mlp`,
`vocab`), and an adapter's factors declare their kernel's names: `lora_b` splits with a
head-or-unit projection's output, `lora_a` with an out projection's input, so `(x A) B` stays
a partial sum of the same kind as `x W`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np

from mptrain.parallel import layout

AXIS = "tensor"


class Split(NamedTuple):
    """A tensor group, as a model sees it per device (`parallel.view`)."""

    axis: str
    size: int
    gather: Callable  # [B, l/t, ...] -> [B, l, ...]; gradient reduce-scattered in fp32
    scatter: Callable  # [B, l, ...] partial sums -> [B, l/t, ...] summed in fp32
    part: Callable  # [B, l, ...] whole on every device -> [B, l/t, ...] this device's

    def index(self) -> jax.Array:
        return jax.lax.axis_index(self.axis)

    def own(self, x: jax.Array) -> jax.Array:  # `part` of a value without a gradient
        return _own(x, self.axis, self.size)


def split(size: int, as_bits: bool) -> Split | None:
    """A tensor group of `size` devices' `Split` (None for one: layers run whole); `as_bits`:
    its 16-bit collectives move uint16 (XLA:CPU has none of bf16)."""
    if size == 1:
        return None
    return Split(AXIS, size, layout.sequence_gather(AXIS, as_bits), _scatter(AXIS, as_bits),
                 _part(AXIS, size))  # fmt: skip


def _scatter(axis: str, as_bits: bool) -> Callable:
    @jax.custom_vjp
    def scatter(x):
        total = jax.lax.psum_scatter(x.astype(np.float32), axis, scatter_dimension=1, tiled=True)
        return total.astype(x.dtype)

    def backward(_, grad):
        return (layout.all_gather(grad, axis, as_bits),)

    scatter.defvjp(lambda x: (scatter(x), None), backward)
    return scatter


def _own(x: jax.Array, axis: str, size: int) -> jax.Array:
    length = x.shape[1] // size
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(axis) * length, length, axis=1)


def _part(axis: str, size: int) -> Callable:
    @jax.custom_vjp
    def part(x):
        return _own(x, axis, size)

    def backward(_, grad):
        return (jax.lax.all_gather(grad, axis, axis=1, tiled=True),)

    part.defvjp(lambda x: (part(x), None), backward)
    return part
