"""The mesh, what each of its axes splits, and the batch laid out on it.

The mesh has five axes, `AXES = ("data", "fsdp", "expert", "context", "tensor")`, `tensor`
the innermost, so a tensor group is devices that neighbour (four collectives a layer each way
ride a node's links), `context` next (its keys and values), then `expert` (its token exchange).
One table, `RULES`, maps the logical names of what is split to mesh axes; it is the only place
that says which axis splits what. The names are those of the batch's dimensions and of each
param's dimensions, as the param declared them where it was created (`parallel.axes`):

    rows         the batch's examples                                   data x fsdp x expert
    length       a sequence's tokens                                    context
    experts      a mixture's experts                                    expert
    embed        the model's width, split to store a param (FSDP)       fsdp x expert x context
                 beside `experts` (the expert axis is taken)            fsdp x context
    rank         an adapter's rank, split to store a factor without a width
                                                                        fsdp x expert x context
    q_heads, kv_heads, mlp, vocab
                 attention's heads, the MLP's hidden units, the vocabulary        tensor
    layers       a stack's layers (walked one at a time)                nothing

A dimension takes the first rule for its name whose axes no other dimension of the param took
(MaxText's `logical_axis_rules`, flax's `logical_to_mesh_axes`), and of them the most that
divide it evenly. `embed` and `rank` are split only to store (`STORED`): a device gathers the
whole width of a param before it computes with it (`sharding._gather`), and an adapter's rank
where its factor has no width to split (the rank's rule comes after the width's, so it is never
split beside one); every other split is a device's own part, which it computes with as it is
(its experts, its heads). Between the blocks a tensor group splits its part of each sequence
by tokens (`mptrain.parallel.tensor`).

So a context group still shards weights (as MaxText puts `embed` on `[fsdp, context]`): the
70B's state is split over all eight devices of a node whichever way the node splits its
batch. An expert group holds rows of its own as data parallelism does, shards the weights the
experts share as FSDP does, and keeps its experts apart (`mptrain.models.decoder.moe`: each device
runs its experts on the tokens of the whole group). A tensor group holds the same rows and
sequences (the batch is replicated over it) and splits the work of every layer
(`mptrain.parallel.tensor`): each device its heads, its part of the MLP, its part of the
vocabulary, and between the blocks its part of the tokens (Megatron's sequence parallelism).

A sequence split over `context` devices is balanced first (`balanced_order`): cut into
`2 x context` chunks, device `i` holds chunks `i` and `2 x context - 1 - i`, so every device
has as many causal scores to compute (torchtitan's head-tail order, MaxText's dual chunk swap).
The batch is reordered once, on the host, as it is loaded (`device_batch`): the inputs, targets,
positions and segment ids alike (`SEQUENCE_KEYS`), positions added where a batch has none, so
attention masks by positions (`attention.causal_attention`) and never needs the order back.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from mptrain.parallel import axes as axes_lib

AXES = ("data", "fsdp", "expert", "context", "tensor")
RULES = (  # (logical name, the mesh axes it is split over): the module doc
    ("rows", ("data", "fsdp", "expert")),
    ("length", ("context",)),
    (axes_lib.EXPERTS, ("expert",)),
    (axes_lib.EMBED, ("fsdp", "expert", "context")),
    (axes_lib.EMBED, ("fsdp", "context")),
    (axes_lib.RANK, ("fsdp", "expert", "context")),
    (axes_lib.Q_HEADS, ("tensor",)),
    (axes_lib.KV_HEADS, ("tensor",)),
    (axes_lib.MLP, ("tensor",)),
    (axes_lib.VOCAB, ("tensor",)),
    (axes_lib.LAYERS, ()),
)
# split to store, gathered to compute (the module doc)
STORED = frozenset({axes_lib.EMBED, axes_lib.RANK})
# the batch keys laid out along a sequence: split over `length`, reordered by `balanced_order`
SEQUENCE_KEYS = ("inputs", "targets", "positions", "segment_ids")
KEYS = tuple(f"mesh.{axis}" for axis in AXES)


def mesh_shape(mesh: Any, batch_size: int, num_devices: int | None = None) -> tuple[int, ...]:
    """`(data, fsdp, expert, context, tensor)` of a config's `mesh` section (a mapping of the
    axes' sizes) with -1 resolved (the default `mesh.data=-1`: every device the other axes
    leave, data parallel); a `ValueError` naming the keys when they do not fit the devices or
    do not divide `batch_size`. `num_devices`: default all of JAX's."""
    num_devices = jax.device_count() if num_devices is None else num_devices
    sizes = [mesh.get(axis, 1) for axis in AXES]
    for key, value in zip(KEYS, sizes, strict=True):
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            raise ValueError(f"{key}={value!r}: must be a positive integer or -1 (all the rest)")
    if sizes.count(-1) > 1:
        named = " and ".join(k for k, v in zip(KEYS, sizes, strict=True) if v == -1)
        raise ValueError(f"{named} are -1: at most one mesh axis takes all the rest")
    given = math.prod(v for v in sizes if v != -1)
    if -1 in sizes:  # the others must divide the devices
        rest = KEYS[sizes.index(-1)]
        if num_devices % given:
            fits = [n for n in range(1, num_devices + 1) if num_devices % n == 0]
            named = " x ".join(
                f"{k}={v}" for k, v in zip(KEYS, sizes, strict=True) if v not in (1, -1)
            )
            raise ValueError(
                f"{named}: does not divide the {num_devices} devices, so {rest}=-1 (all the "
                f"devices the other axes leave) is no whole number; use one of "
                f"{', '.join(map(str, fits))}"
            )
        sizes[sizes.index(-1)] = num_devices // given
    data, fsdp, expert, context, tensor = sizes
    devices = data * fsdp * expert * context * tensor
    if devices > num_devices:
        raise ValueError(
            f"{_named(mesh)}: a mesh of {devices} devices, more than the {num_devices} there are"
        )
    if batch_size % (data * fsdp * expert):
        every = " (mesh.data=-1: every device)" if mesh.get("data", 1) == -1 else ""
        raise ValueError(
            f"batch_size={batch_size}: the global batch's rows must divide evenly over "
            f"the data x fsdp x expert = {data}x{fsdp}x{expert} devices that split it{every}; "
            f"make it a multiple of {data * fsdp * expert}, or set mesh.data, mesh.fsdp and "
            "mesh.expert to use fewer devices"
        )
    return data, fsdp, expert, context, tensor


def _named(mesh) -> str:
    return ", ".join(f"mesh.{axis}={mesh.get(axis, 1)}" for axis in AXES)


def create_mesh(mesh: Any, batch_size: int, devices: Any = None) -> Mesh:
    """The run's `(data, fsdp, expert, context, tensor)` mesh, as a config's `mesh` section
    asks for a batch of `batch_size` rows (`mesh_shape`), over the first devices of `devices`
    (default: all of JAX's; `mptrain.plan` passes the compile-only devices of an accelerator
    not here)."""
    devices = jax.devices() if devices is None else list(devices)
    shape = mesh_shape(mesh, batch_size, len(devices))
    return Mesh(np.asarray(devices[: math.prod(shape)]).reshape(shape), AXES)


def full_mesh(mesh: Mesh) -> Mesh:
    """`mesh` with the five axes (`AXES`, in that order): a user's own mesh of some of them
    (`Mesh(devices, ("data", "fsdp"))`, say) gets the others at size 1. A `ValueError` names an
    axis that is none of the five."""
    if mesh.axis_names == AXES:
        return mesh
    unknown = [name for name in mesh.axis_names if name not in AXES]
    if unknown:
        raise ValueError(
            f"mesh axes {tuple(mesh.axis_names)}: {', '.join(map(repr, unknown))} is none of "
            f"mptrain's {AXES} (parallel.layout); name the mesh's axes from them (an axis left "
            "out has size 1)"
        )
    order = sorted(range(len(mesh.axis_names)), key=lambda i: AXES.index(mesh.axis_names[i]))
    devices = np.transpose(mesh.devices, order)
    shape = [mesh.shape.get(axis, 1) for axis in AXES]
    return Mesh(devices.reshape(shape), AXES)


def axes(mesh: Mesh, name: str) -> tuple[str, ...]:
    """The mesh axes `RULES` first gives the logical `name`, those of more than one device."""
    return tuple(axis for axis in _first(name) if mesh.shape[axis] > 1)


def size(mesh: Mesh, name: str) -> int:
    """How many ways the logical `name` is split on `mesh` (by its first rule)."""
    return math.prod(mesh.shape[axis] for axis in _first(name))


def _first(name: str) -> tuple[str, ...]:
    return next(split for rule, split in RULES if rule == name)


def entry(mesh: Mesh, name: str) -> str | tuple[str, ...] | None:
    """A `PartitionSpec` entry for the logical `name`: its split axes (one as its name)."""
    return _entry(axes(mesh, name))


def _entry(split: tuple[str, ...]) -> str | tuple[str, ...] | None:
    return None if not split else split[0] if len(split) == 1 else split


def param_spec(names: tuple | None, shape: tuple[int, ...], mesh: Mesh) -> PartitionSpec:
    """How a param (or a state leaf standing for one) of `shape`, whose dimensions are named
    `names` (`parallel.axes`; None: undeclared, held whole), is split on `mesh`: each named
    dimension over the axes of the first rule for its name that are still free, as many of
    them as divide it evenly (the module doc)."""
    if names is None or len(names) != len(shape):
        return PartitionSpec()
    splits: list[tuple[str, ...] | None] = [None] * len(names)
    taken: set[str] = set()
    for name, rule in RULES:
        if name not in names:
            continue
        dim = names.index(name)
        if splits[dim] is not None or taken & set(rule):
            continue
        split = tuple(axis for axis in rule if mesh.shape[axis] > 1)
        while split and shape[dim] % math.prod(mesh.shape[axis] for axis in split):
            split = split[:-1]  # the most of its axes that divide the dimension evenly
        splits[dim], taken = split, taken | set(rule)
    return PartitionSpec(*(_entry(split or ()) for split in splits))


def platform(mesh: Mesh) -> str:
    """ "cpu", "gpu" or "tpu": what the mesh's devices are, which every choice made by backend
    follows (never the host that builds the step: a plan for an H100 is built on a CPU)."""
    return mesh.devices.flat[0].platform


def batch_spec(mesh: Mesh, key: Any = None, ndim: int = 1, stacked: bool = False):
    """A batch leaf's `PartitionSpec`: rows over `RULES["rows"]`, and a sequence key's
    (`SEQUENCE_KEYS`) second dimension over `RULES["length"]`; `stacked`: under a leading axis
    of batches for consecutive steps."""
    spec = [_first("rows")]
    if key in SEQUENCE_KEYS and ndim >= 2 and mesh.shape["context"] > 1:
        spec.append(entry(mesh, "length"))
    return PartitionSpec(*([None] if stacked else []), *spec)


def batch_specs(mesh: Mesh, batch: Any, stacked: bool = False) -> Any:
    """`batch_spec` of every leaf of `batch` (keyed by its top-level dict key)."""

    def one(path, x):
        key = getattr(path[0], "key", None) if path else None
        return batch_spec(mesh, key, np.ndim(x) - stacked, stacked)

    return jax.tree_util.tree_map_with_path(one, batch)


def batch_sharding(mesh: Mesh, stacked: bool = False) -> NamedSharding:
    """The rows of a batch leaf split over `RULES["rows"]` (a sequence's tokens, on a context
    axis, take `batch_shardings`). `mesh`: any of the five axes (`full_mesh`)."""
    mesh = full_mesh(mesh)
    return NamedSharding(mesh, batch_spec(mesh, stacked=stacked))


def batch_shardings(mesh: Mesh, batch: Any, stacked: bool = False) -> Any:
    """`batch_specs` as `NamedSharding`s. `mesh`: any of the five axes (`full_mesh`)."""
    mesh = full_mesh(mesh)
    specs = batch_specs(mesh, batch, stacked)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)


def balanced_order(length: int, context: int) -> np.ndarray:
    """The order of a sequence of `length` split over `context` devices: `2 x context` chunks,
    device `i` taking chunks `i` and `2 x context - 1 - i` (see the module doc). A length that
    `2 x context` does not divide is a `ValueError`."""
    if length % (2 * context):
        raise ValueError(
            f"a sequence of {length} tokens: mesh.context={context} balances it as "
            f"{2 * context} equal chunks, which {length} does not divide"
        )
    chunks = np.arange(length).reshape(2 * context, -1)
    pairs = [(i, 2 * context - 1 - i) for i in range(context)]
    return np.concatenate([chunks[list(pair)].ravel() for pair in pairs])


def balanced(batch: Any, context: int) -> Any:
    """`batch` (a dict of `[B, L]` arrays) in `balanced_order`, with `positions` (0 .. L - 1
    where it has none); unchanged where `context` is 1."""
    if context == 1 or not isinstance(batch, dict) or "inputs" not in batch:
        return batch
    length = np.shape(batch["inputs"])[1]
    order = balanced_order(length, context)
    if "positions" not in batch:
        rows = np.shape(batch["inputs"])[0]
        batch = {
            **batch,
            "positions": np.broadcast_to(np.arange(length, dtype=np.int32), (rows, length)),
        }
    return {k: np.asarray(v)[:, order] if k in SEQUENCE_KEYS else v for k, v in batch.items()}


def process_rows(mesh: Mesh, global_rows: int) -> slice:
    """The rows of a `global_rows` batch that this process's devices hold (one block: the mesh
    takes devices in `jax.devices()` order, which groups them by process)."""
    indices = batch_sharding(mesh).addressable_devices_indices_map((global_rows,)).values()
    blocks = {
        (index[0].start or 0, global_rows if index[0].stop is None else index[0].stop)
        for index in indices
    }
    rows = slice(min(a for a, _ in blocks), max(b for _, b in blocks))
    if sum(b - a for a, b in blocks) != rows.stop - rows.start:
        raise ValueError(f"this process's rows of the batch are not one block: {sorted(blocks)}")
    return rows


def device_batch(
    mesh: Mesh, source: Any, index: int, global_rows: int, count: int | None = None
) -> Any:
    """Batch `index` of `source` on the mesh, laid out as `batch_shardings` says (its sequences
    `balanced` on a context axis); with `count`, batches `index .. index + count - 1` stacked on
    a new leading axis.

    With several processes each builds only its own rows, through `get_batch(index, rows=)`
    when the source takes `rows` (the built-in ones do), else by cutting the whole batch; a
    process holds whole sequences (the context axis is the mesh's innermost).
    """
    context = mesh.shape["context"]
    indices = [index] if count is None else range(index, index + count)
    if jax.process_count() == 1:
        batches = [balanced(source.get_batch(i), context) for i in indices]
        batch = batches[0] if count is None else _stack(batches)
        return jax.device_put(batch, batch_shardings(mesh, batch, count is not None))
    rows = process_rows(mesh, global_rows)
    if "rows" in inspect.signature(source.get_batch).parameters:
        batches = [source.get_batch(i, rows=rows) for i in indices]
    else:
        batches = [jax.tree.map(lambda x: x[rows], source.get_batch(i)) for i in indices]
    batches = [balanced(b, context) for b in batches]
    batch, lead = (batches[0], ()) if count is None else (_stack(batches), (count,))
    where = batch_shardings(mesh, batch, count is not None)
    return jax.tree.map(
        lambda x, s: jax.make_array_from_process_local_data(
            s, x, (*lead, global_rows, *x.shape[len(lead) + 1 :])
        ),
        batch,
        where,
    )


def _stack(batches: list) -> Any:
    return jax.tree.map(lambda *xs: np.stack(xs), *batches)


def all_gather(x: jax.Array, axis: str | tuple[str, ...], as_bits: bool) -> jax.Array:
    """`x [B, l, ...]` gathered along its second dimension over `axis`, in its own 16 bits
    (as uint16 where `as_bits`: XLA:CPU has no bf16 collectives)."""
    dtype = x.dtype
    if as_bits and dtype == np.dtype("bfloat16"):
        x = jax.lax.bitcast_convert_type(x, np.uint16)
    x = jax.lax.all_gather(x, axis, axis=1, tiled=True)
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def sequence_gather(axis: str | tuple[str, ...], as_bits: bool) -> Callable:
    """`x [B, l, ...] -> [B, l x context, ...]`: a split sequence's keys or values gathered over
    the context `axis` (in their 16 bits; as uint16 where `as_bits`: XLA:CPU has no bf16
    collectives). The gradient is reduce-scattered back in fp32, then cast to x's dtype: the
    partial gradients of a key from every device's queries are summed unrounded, as the
    params' are (torch and MaxText reduce them in the activations' dtype)."""

    @jax.custom_vjp
    def gather(x):
        return all_gather(x, axis, as_bits)

    def backward(like, grad):  # `like`: a scalar of x's dtype
        grad = jax.lax.psum_scatter(grad.astype(np.float32), axis, scatter_dimension=1, tiled=True)
        return (grad.astype(like.dtype),)

    gather.defvjp(lambda x: (gather(x), np.zeros((), x.dtype)), backward)
    return gather


class ExpertSplit(NamedTuple):
    """Experts split over an expert axis, as a mixture of experts sees it per device."""

    gather: Callable  # [1, T, D] tokens -> [1, T x size, D] (`layout.sequence_gather`)
    axis: str  # the mesh axis (`jax.lax.axis_index`, `all_gather`, `psum_scatter` take it)
    size: int  # the devices the experts are split over


class SequenceSplit(NamedTuple):
    """A sequence split over a context axis, as a model's attention sees it per device."""

    gather: Callable  # [B, l, ...] keys or values -> [B, l x size, ...] (`layout.sequence_gather`)
    ints: Callable  # the same for positions and segment ids (no gradient)
    axis: str | tuple[str, ...]  # the mesh axes of the split (`jax.lax.axis_index` takes them)
    size: int  # the devices a sequence is split over
