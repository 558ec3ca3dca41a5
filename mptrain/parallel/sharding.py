"""Shardings of the state and the sharded gradient. Each param is split as the logical names
it declared where it was created say (`mptrain.parallel.axes`), by the one table of what each
mesh axis splits (`layout.RULES`): its width over `fsdp` (x `expert` x `context`) to store
it, a mixture's experts over `expert`, each layer's heads, MLP and vocabulary over `tensor`
(`mptrain.parallel.tensor`). Every leaf of the state takes the names of the param its path
ends with (an optimizer's moments, a frozen base); a leaf of no declared param is held whole.
The width is gathered before a param computes; an expert's kernel and a tensor group's part
are a device's own, never gathered. On one device the mesh is 1x1x1x1x1, and nothing is split.

On a mesh of several devices the gradients are computed per device and reduced explicitly, the
way PyTorch FSDP2's mixed-precision policy does (`param_dtype` bf16, `reduce_dtype` fp32), so the
compiled program cannot quietly do otherwise:
- each param shard is cast to the compute dtype *before* it is all-gathered (half the bytes
  of gathering fp32 and casting after);
- each gradient is cast to fp32 *before* it is reduce-scattered over `fsdp` (x `context`)
  and summed over `data`. Left to XLA, the reduction happens in whatever dtype the gradient
  matmul returns; under fp16 compute that is an fp16 sum of loss-scaled values across
  devices, where overflow and rounding both bite;
- the finiteness of every gradient and updated param is one count and one all-reduce, not one
  reduction per leaf.
Inside the per-device function a model reads how the mesh splits its work from JAX's own
abstract mesh (`parallel.view`). Cross-example statistics stay global: BatchNorm averages its
batch statistics over the view's `batch` axes, so the model sees the same numbers as on one
device; a token mean (`layers.masked_mean`) divides by the count of tokens on every device, so
packed rows whose devices hold different numbers of loss tokens weigh each token as one device
would. On a context axis attention gathers each layer's keys and values over it
(`View.sequence`); on a tensor axis each block gathers its tokens (`View.tensor`): 16 bits
forward, fp32 backward.

Stacked layers (the top-level param `STACKED`, its leading axis the layer, walked by a scan)
are never split on that axis nor cast or gathered before the loss: they reach the model as
`Layers`, the stack as stored with what makes one layer's slice the params a block computes
with, which the model applies inside its loop, so no step holds every layer's 16-bit copy at
once; gradients are reduce-scattered per layer, as FSDP2 does.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mptrain.parallel import axes as axes_lib
from mptrain.parallel import layout

AXES = layout.AXES
STACKED = "stacked_layers"  # the top-level param of a model's stacked layers (module doc)


def one_tensor(x: Any) -> bool:
    """Whether `x` stands for one tensor in several arrays that split as it does (it has
    `shape` and `shardings(spec, mesh)`: an 8-bit moment or frozen kernel, `optim.q8.Q8`)."""
    return callable(getattr(x, "shardings", None)) and not isinstance(x, jax.Array)


def merge(a: Any, b: Any) -> Any:
    """The union of two nested dicts with no leaf in common: a model's params from the ones
    that train and the frozen ones (`recipe.frozen.split`'s inverse)."""
    if not b:
        return a
    if not a:
        return b
    out = dict(a)
    for key, value in b.items():
        out[key] = merge(out[key], value) if key in out else value
    return out


def sharded_init(create: Callable, mesh: Mesh, *args: Any) -> tuple[Callable, tuple]:
    """`(init, args)` with `init(*args) == create(*args)` made directly in `state_shardings`.

    The state is traced abstractly first (`jax.eval_shape`), its shardings are derived from
    its params' declared axes (the state's `axes`), and `create` is jitted with those as its
    output shardings: each device computes only its own shards, so no device ever holds the
    whole state, not even during start-up.
    """
    shapes = jax.eval_shape(create, *args)
    return jax.jit(create, out_shardings=state_shardings(mesh, shapes)), args


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


def is_stacked(path: tuple) -> bool:  # a params or optimizer-state leaf of stacked layers
    return any(getattr(key, "key", None) == STACKED for key in path)


def stack_key(first: int, stop: int) -> str:
    """The key, under `STACKED`, of the stack of layers `first .. stop - 1` of a model whose
    layers make several stacks (one alone is `STACKED` itself): `"<first>-<stop>"`."""
    return f"{first}-{stop}"


def stack_of(keys: tuple[str, ...]) -> tuple[tuple[str, ...], int]:
    """`(the keys of its stack, the stack's first layer)` of a leaf at `keys` (a path's names)
    under `STACKED`: `(STACKED,)` and 0, or `(STACKED, "<first>-<stop>")` and `first`."""
    at = keys.index(STACKED)
    nxt = keys[at + 1] if at + 1 < len(keys) else ""
    first, sep, stop = nxt.partition("-")
    if sep and first.isdigit() and stop.isdigit():
        return keys[: at + 2], int(first)
    return keys[: at + 1], 0


def axes_of(tree: Any, axes: axes_lib.Axes | None = None) -> axes_lib.Axes:
    """`axes`, else the declared axes a train state carries (`tree.axes`), else none."""
    if axes is not None:
        return axes
    found = getattr(tree, "axes", None)
    return found if isinstance(found, axes_lib.Axes) else axes_lib.Axes()


def state_shardings(mesh: Mesh, state: Any, axes: axes_lib.Axes | None = None) -> Any:
    """Per leaf of `state` (a train state, or any tree of its params' paths), its
    `NamedSharding`: split as the declared names of the param its path ends with say
    (`layout.param_spec`; `axes`: the declared params, default the state's own), held whole
    where none. A leaf that stands for one tensor in several arrays (an 8-bit moment,
    `optim.q8.Q8`: codes and scales) is split as that tensor, each of its arrays as its
    `shardings(spec, mesh)` says. `mesh`: any of the five axes (`layout.full_mesh`)."""
    axes = axes_of(state, axes)
    mesh = layout.full_mesh(mesh)

    def one(path, x):
        shape = x.shape if one_tensor(x) else np.shape(x)
        spec = layout.param_spec(axes.of(path), tuple(shape), mesh)
        if not one_tensor(x):
            return NamedSharding(mesh, spec)
        return x.shardings(spec, mesh)

    return jax.tree_util.tree_map_with_path(one, state, is_leaf=one_tensor)


def specs(mesh: Mesh, tree: Any, axes: axes_lib.Axes | None = None) -> Any:
    """`state_shardings`' partition specs."""
    return jax.tree.map(lambda s: s.spec, state_shardings(mesh, tree, axes))


def _gather(
    spec: PartitionSpec, names: tuple | None, compute_dtype: np.dtype, mesh: Mesh,
    manual: tuple[str, ...] = AXES,
) -> Callable:  # fmt: skip
    """`fp32 shard -> whole param in compute_dtype`, whose gradient is reduced in fp32.

    Forward: cast the local shard, then all-gather it over the axes that split its width to
    store it (`layout.STORED`: `fsdp`, `expert`, `context`), if any. Backward: cast the
    gradient to fp32, reduce-scatter it over those axes (or sum it there, for a param that is
    not split) and sum it over the rest but the device's own part's (its experts, its heads),
    then divide by the devices: each computed the gradient of its share of the loss
    (`layers.masked_mean`). The reduced gradient is stored in the shard's dtype where that is
    bf16 (`bf16-pure`: 2 bytes a parameter until the update, not 4, and what one device's
    `jax.grad` returns too); fp32 elsewhere, fp16 params included: their gradients still carry
    the loss scale, which the step unscales in fp32 (fp16's range cannot hold a scaled
    gradient unrounded). `names`: the param's logical names (`spec`'s dimensions); `manual`:
    the mesh axes the per-device function is manual over (`grad_fn`), the rest XLA's.
    """
    spec = _manual(spec, manual)
    part = lambda axis: () if axis is None else axis if isinstance(axis, tuple) else (axis,)
    names = names if names is not None and len(names) == len(spec) else (None,) * len(spec)
    stored = [
        d for d, (a, n) in enumerate(zip(spec, names, strict=True)) if a and n in layout.STORED
    ]
    dim = stored[0] if stored else None
    split = () if dim is None else part(spec[dim])
    # a device's own part, never gathered nor summed: an expert's, a tensor group's
    own = [a for d, axis in enumerate(spec) if d != dim for a in part(axis)]
    # XLA:CPU has no bf16 collectives and would gather in fp32: move the same 16 bits as uint16.
    as_bits = compute_dtype == jnp.bfloat16 and layout.platform(mesh) == "cpu"

    @jax.custom_vjp
    def gather(shard):
        x = shard.astype(compute_dtype)
        if dim is None:
            return x
        if as_bits:
            x = jax.lax.bitcast_convert_type(x, jnp.uint16)
        x = jax.lax.all_gather(x, split, axis=dim, tiled=True)
        return jax.lax.bitcast_convert_type(x, compute_dtype) if as_bits else x

    def backward(like, grad):  # `like`: a scalar of the shard's dtype
        grad = grad.astype(jnp.float32)
        if dim is not None:
            grad = jax.lax.psum_scatter(grad, split, scatter_dimension=dim, tiled=True)
        summed = [a for a in manual if a not in (*split, *own) and mesh.shape[a] > 1]
        devices = math.prod(mesh.shape[a] for a in manual)
        grad = (jax.lax.psum(grad, tuple(summed)) if summed else grad) / devices
        return (grad.astype(like.dtype) if like.dtype == jnp.bfloat16 else grad,)

    gather.defvjp(lambda shard: (gather(shard), jnp.zeros((), shard.dtype)), backward)
    return gather


def stacks(stacked: Any) -> dict[tuple[str, ...], tuple[Any, int]]:
    """The stacks in a model's `STACKED` params (or a state's tree of them): `{key: (tree,
    first layer)}`, the key `()` for a model's one stack, `(stack_key(first, stop),)` for each
    of several."""
    keys = list(stacked) if isinstance(stacked, Mapping) else []
    named = [stack_of((STACKED, key)) for key in keys]
    if not keys or any(len(k) != 2 for k, _ in named):
        return {(): (stacked, 0)}
    return {(key,): (stacked[key], first) for key, (_, first) in zip(keys, named, strict=True)}


@struct.dataclass
class Layers:
    """A model's stacked layers as the step hands them to it: `stacked`, as the state stores
    them (this device's shards, not cast), and `layer(slice, where)`, what makes one layer's
    slice of the stack `where` (its key under `STACKED`: () for a model's one stack) the params
    a block computes with: cast by the policy, on a mesh gathered in the compute dtype, its
    gradient reduced in fp32 (`_gather`). A model walks the stack and asks for each layer's
    params inside its loop, so that no step holds every layer's 16-bit copy at once (the module
    doc); params handed over by hand are a plain tree, each layer as it is."""

    stacked: Any
    layer: Callable = struct.field(pytree_node=False)


def layers_of(params: Any) -> tuple[Any, Callable]:
    """`(the stacked params as stored, the per-layer function)` of a model's `STACKED` param:
    a `Layers`' own, or a plain tree's with each layer as it is."""
    if isinstance(params, Layers):
        return params.stacked, params.layer
    return params, lambda layer, where: layer


def _within(tree: Any, where: tuple[str, ...]) -> Any:
    for key in where:
        tree = tree[key]
    return tree


def _unstacked(params: Any) -> tuple[Any, Any]:  # (the rest, the stacked layers or None)
    if isinstance(params, Mapping) and STACKED in params:
        return {k: v for k, v in params.items() if k != STACKED}, params[STACKED]
    return params, None


def cast_params(policy: Any, params: Any) -> Any:
    """`params` as the model gets them (`policy.cast_params`), but stacked layers, cast one
    layer at a time when the model asks inside its loop (`Layers`)."""
    rest, stacked = _unstacked(params)
    if stacked is None:
        return policy.cast_params(params)
    dtypes = policy.compute_dtypes(params)[STACKED]
    cast = lambda layer, where: policy.cast_as(layer, _within(dtypes, where))
    return {**policy.cast_params(rest), STACKED: Layers(stacked, cast)}


def _manual(spec: PartitionSpec, manual: tuple[str, ...]) -> PartitionSpec:
    """`spec` over the `manual` axes alone: the split along the others is XLA's to place."""
    if manual == AXES:
        return spec
    keep = lambda entry: tuple(a for a in entry if a in manual)
    part = lambda e: () if e is None else keep(e if isinstance(e, tuple) else (e,))
    return PartitionSpec(*(layout._entry(part(e)) for e in spec))


def _gathering(
    policy: Any, mesh: Mesh, param_specs: Any, params: Any, axes, manual: tuple = AXES
) -> Callable:
    """`run(fn, params)`: `fn` of `params` (this device's shards, in `param_specs`; their
    declared `axes`) gathered in the compute dtype, a stack's layers one at a time inside the
    model's loop (`Layers`); gradients reduced in fp32 (`_gather`)."""

    def gather(path, spec, dtype):
        if dtype is None:  # an 8-bit frozen kernel is never split (config.validate refuses
            return lambda q: q  # it): it goes on as is
        names = axes.of(path)
        if is_stacked(path):  # one layer's slice: its spec and names without the layer axis
            spec, names = PartitionSpec(*spec[1:]), names and names[1:]
        return _gather(spec, names, dtype, mesh, manual)

    gathers = jax.tree_util.tree_map_with_path(
        gather,
        param_specs,
        policy.compute_dtypes(params),
        is_leaf=lambda x: isinstance(x, PartitionSpec) or one_tensor(x),
    )
    gather_all = lambda gathers, tree: jax.tree.map(
        lambda g, p: g(p), gathers, tree, is_leaf=one_tensor
    )

    def run(fn: Callable, params: Any) -> Any:
        (whole, stacked), (outer, per_layer) = _unstacked(params), _unstacked(gathers)
        whole = gather_all(outer, whole)
        if stacked is None:
            return fn(whole)
        gathered = lambda layer, where: gather_all(_within(per_layer, where), layer)
        return fn({**whole, STACKED: Layers(stacked, gathered)})

    return run


def forward_fn(
    metric_fn: Callable, policy: Any, mesh: Mesh, per_row: bool = False, axes=None
) -> Callable:
    """`(params, model_state, batch) -> metrics`: `metric_fn(params, model_state, batch)` laid
    out as `grad_fn` lays out the loss (each device its rows and its part of each sequence,
    params gathered in the compute dtype, the keys and values over a context axis), floating
    metrics averaged over the devices: the evaluation of a split sequence, whose memory is
    then the training's, not the unsplit model's. `per_row`: the metrics are per row
    (`[B, ...]`), each device's for its own rows, laid out as the batch's rows are (DPO's
    reference log-probabilities; no context axis). `axes`: the params' declared axes
    (`parallel.axes`, a train state's `axes`)."""
    mean = lambda x: jax.lax.pmean(x, AXES) if jnp.issubdtype(x.dtype, jnp.floating) else x
    axes = axes_of(None, axes)
    out_specs = layout.batch_spec(mesh) if per_row else PartitionSpec()

    def sharded(params, model_state, batch):
        param_specs = specs(mesh, params, axes)

        def local(params, model_state, batch):
            run = _gathering(policy, mesh, param_specs, params, axes)
            metrics = run(lambda p: metric_fn(p, model_state, batch), params)
            return metrics if per_row else jax.tree.map(mean, metrics)

        in_specs = (param_specs, PartitionSpec(), layout.batch_specs(mesh, batch))
        local = jax.shard_map(
            local, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False
        )
        return local(params, model_state, batch)

    return sharded


def grad_fn(
    loss_fn: Callable, policy: Any, mesh: Mesh | None, combine: Callable | None = None, axes=None,
    manual: tuple[str, ...] = AXES,
) -> Callable:  # fmt: skip
    """`(params, probes, batch, rng, *rest) -> (grads, probe_grads, aux)`: the fp32 gradient of
    `loss_fn`'s first output with respect to fp32 `params`, which
    `loss_fn(params, probes, batch, rng, *rest)` receives cast as `policy` says (the compute
    dtype, fp32 for params its `keep_fp32` rule matches: `Policy.compute_dtypes`), and with
    respect to `probes` (None, or float32 arrays that the loss reads only to be differentiated:
    the per-layer numerics' taps); `aux` is the loss's second output. `frozen=` (keyword):
    params that do not train (`recipe.frozen`), merged into `params` for the loss, cast and
    gathered alike, never differentiated.

    Without a mesh, or on one device, this is `jax.grad` through the cast. On a larger mesh it is
    a `shard_map` manual over all five axes (`layout.AXES`): each device runs `loss_fn` on its
    rows of the batch and its part of each sequence, with params gathered in the compute dtype
    (its own part of a tensor group's or an expert's), and the gradients are reduced in fp32
    (see the module doc). Floating leaves of `aux` are averaged over the devices, `probe_grads`
    combined by `combine(probe_grads, mesh axes)`; `rng` is folded with the device's index, so
    dropout masks differ between devices. `axes`: the params' declared axes (`parallel.axes`,
    a train state's `axes`), by which they are split. `manual`: the axes the `shard_map` is
    manual over (default all; fewer leaves the others' collectives to XLA, whose layers then
    run whole along them: an experiment, `docs/measured/tensor_auto.py`).
    """
    axes = axes_of(None, axes)
    if mesh is None or mesh.size == 1:

        def single(params, probes, batch, rng, *rest, frozen=None):
            def loss(params, probes):
                cast = cast_params(policy, merge(params, frozen))
                return loss_fn(cast, probes, batch, rng, *rest)

            (grads, probe_grads), aux = jax.grad(loss, (0, 1), has_aux=True)(params, probes)
            return grads, probe_grads, aux

        return single

    def sharded(params, probes, batch, rng, *rest, frozen=None):
        param_specs, frozen_specs = specs(mesh, params, axes), specs(mesh, frozen or {}, axes)
        only = lambda tree: jax.tree.map(
            lambda s: _manual(s, manual), tree, is_leaf=lambda x: isinstance(x, PartitionSpec)
        )

        def local(params, frozen, probes, batch, rng, *rest):
            rng = jax.random.fold_in(rng, jax.lax.axis_index(manual))
            specs_ = merge(param_specs, frozen_specs)
            run = _gathering(policy, mesh, specs_, merge(params, frozen), axes, manual)

            def gathered_loss(params, probes):
                params = merge(params, frozen)
                return run(lambda p: loss_fn(p, probes, batch, rng, *rest), params)

            grad = jax.grad(gathered_loss, (0, 1), has_aux=True)
            (grads, probe_grads), aux = grad(params, probes)
            pmean = lambda x: jax.lax.pmean(x, manual)
            mean = lambda x: pmean(x) if jnp.issubdtype(x.dtype, jnp.floating) else x
            if probes is not None:
                probe_grads = combine(probe_grads, manual)
            return grads, probe_grads, jax.tree.map(mean, aux)

        replicated = PartitionSpec()
        rows = only(layout.batch_specs(mesh, batch))
        in_specs = (
            *(only(param_specs), only(frozen_specs), replicated, rows, replicated),
            *(replicated for _ in rest),
        )
        local = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=in_specs,
            out_specs=(only(param_specs), replicated, replicated),
            axis_names=frozenset(manual),
            check_vma=False,
        )
        return local(params, frozen or {}, probes, batch, rng, *rest)

    return sharded
