"""A model's stacked blocks walked by `jax.lax.scan`, and the fp8 state they carry.

The blocks' params are stacks (under `sharding.STACKED`, the layer on each leaf's leading
axis): one where every layer's params have one shape, else one for each run of layers that do
(`stacks`: a mixture of experts whose first layers are dense, Qwen3-MoE's `mlp_only_layers` or
DeepSeek-V3's, has a dense stack and an expert stack, MaxText's `dense_layers` and
`moe_layers`), each named by the layers it holds (`STACKED/<first>-<stop>`) and scanned on its
own. Each layer's slice is cast (under FSDP, gathered) inside the loop
(`sharding.layer_params`). Under
fp8-mixed the blocks between the first and last `fp8.bf16_layers` run their selected matmuls
in fp8: the stack then runs as three scans over static slices (bf16, fp8, bf16), and the fp8
blocks' scaling state and probes (`fp8.META`, `fp8.PROBES`) are stacked on the same layer axis
under `STACKED/layers_<a>-<b>` (`fp8_names.stack_name`), carried through their scan as its
per-layer inputs, as MaxText, Levanter and flax carry an amax history per scanned layer.

Layers of more than one kind (Gemma's sliding and global layers, each with its own window and
RoPE base) repeat with a period: the scan walks super-blocks of that many layers, each step
applying the period's blocks in turn to consecutive rows of the stack (reshaped ``[n, ...]`` to
``[n / p, p, ...]``, no copy), and the rows left over (``n % p``) as one more step. MaxText
scans Gemma 3's six-layer pattern and its remainder the same way. Row ``i`` of the stack stays
layer ``i`` (the HuggingFace folder's), and each block is rematerialised on its own.
"""

from __future__ import annotations

import dataclasses
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain.parallel import sharding
from mptrain.recipe import fp8 as fp8_lib
from mptrain.recipe import fp8_names, numerics_scan


@dataclasses.dataclass(frozen=True)
class Stack:
    """Layers `first .. stop - 1`, whose params are one stack: `key`, its path under
    `sharding.STACKED` (() for a model's one stack; `("<first>-<stop>",)` for each of several)."""

    first: int
    stop: int
    key: tuple[str, ...] = ()


def stacks(shapes: list) -> tuple[Stack, ...]:
    """The stacks of layers with `shapes` (a `blocks.Shape` a layer): the runs of layers whose
    params have one shape, those whose shapes differ only in what no param holds (the window,
    the RoPE frequencies)."""
    kind = lambda s: dataclasses.replace(s, window=None, inv_freq=(), longrope=None)
    runs, start = [], 0
    for i in range(1, len(shapes) + 1):
        if i == len(shapes) or kind(shapes[i]) != kind(shapes[start]):
            runs.append((start, i))
            start = i
    if len(runs) == 1:
        return (Stack(0, len(shapes)),)
    return tuple(Stack(a, b, (sharding.stack_key(a, b),)) for a, b in runs)


def period(kinds: list) -> int:
    """The fewest layers after which `kinds` (one a layer) repeat: 1 where all are alike."""
    return next(p for p in range(1, len(kinds) + 1) if kinds[p:] == kinds[:-p])


def scan(
    blocks, *, x, args, stacked, dropout=None, policy=None, fp8=None, first=0, where=Stack(0, 0)
) -> jax.Array:
    """`x` through the blocks once per layer of `stacked` (layers `first`, `first + 1`, ...):
    a block, or a tuple of them that layers take in turn (the module doc), each applied as
    `block.apply(variables, h, *args)`; `fp8`: the layers' stacked fp8 collections; `dropout`:
    a key, folded with each layer's number; `policy`: the remat policy, per block; `where`:
    the `Stack` the rows are of (its key and first layer)."""
    blocks = blocks if isinstance(blocks, tuple) else (blocks,)
    layers, p = jax.tree.leaves(stacked)[0].shape[0], len(blocks)
    run = functools.partial(_scan, args=args, dropout=dropout, policy=policy, where=where)
    if p == 1:
        return run(blocks, x=x, stacked=stacked, fp8=fp8, first=first, grouped=False)

    def rows(a, b, steps):  # [b - a, ...] -> [steps, (b - a) / steps, ...]
        cut = lambda t: t[a:b].reshape(steps, (b - a) // steps, *t.shape[1:])
        return {"stacked": jax.tree.map(cut, stacked), "fp8": jax.tree.map(cut, fp8)}

    whole = layers // p * p
    if whole:
        x = run(blocks, x=x, first=first, **rows(0, whole, whole // p))
    if whole < layers:  # the rows after the last whole period: one step of its first blocks
        x = run(blocks[: layers - whole], x=x, first=first + whole, **rows(whole, layers, 1))
    return x


def _scan(
    blocks, *, x, args, stacked, fp8, first, dropout, policy, where, grouped=True
) -> jax.Array:
    """`x` through `stacked`, a step a row: `[steps, len(blocks), ...]`, the blocks in turn
    (`grouped`), or one block's layers `[steps, ...]`."""
    steps, p = jax.tree.leaves(stacked)[0].shape[0], len(blocks)
    # per-layer numerics: their own rows, each layer's gradients in its stack's rows
    taps = numerics_scan.begin(steps, first, stride=p, key=where.key, offset=where.first)

    def one(j, h, layer, state, index, rows):
        variables = {"params": sharding.layer_params(layer, where.key), **(state or {})}
        rngs = {} if dropout is None else {"dropout": jax.random.fold_in(dropout, index)}
        with numerics_scan.layer(taps, rows):
            return blocks[j].apply(variables, h, *args, rngs=rngs)

    if policy is not None:
        one = jax.checkpoint(one, policy=policy, prevent_cse=False, static_argnums=(0,))

    def body(h, xs):
        layer, state, index, rows = xs
        if not grouped:
            return one(0, h, layer, state, index, rows), None
        for j in range(p):
            at = lambda tree, j=j: jax.tree.map(lambda t: t[j], tree)
            h = one(j, h, at(layer), at(state), None if index is None else index + j, rows)
        return h, None

    index = None
    if dropout is not None:
        index = jnp.arange(first, first + steps * p, p, dtype=jnp.int32)
    rows = None if taps is None else taps.rows
    x = jax.lax.scan(body, x, (stacked, fp8, index, rows))[0]
    numerics_scan.end(taps)
    return x


def fp8_state(module: nn.Module, spans: list, init_args: tuple) -> dict:
    """`{(start, stop): {collection: stacked tree} or None}`: each span's fp8 scaling state and
    probes, one layer a row, for `spans` of `(block, start, stop)` (blocks `start..stop-1`,
    each of one kind), variables of `module` (in the Trainer's `model_state` like any other):
    None for a span whose block the size filter left without an fp8 matmul."""
    blocks = {}
    for block, start, stop in spans:
        if block.fp8.block:  # the state's init runs the blocks under vmap, which JAX's MXFP8
            # matmul cannot batch: the emulation's values are the same shapes (and unused)
            block = block.clone(fp8=dataclasses.replace(block.fp8, emulate=True))
        if fp8_lib.META in jax.eval_shape(lambda b=block: b.init(jax.random.key(0), *init_args)):
            blocks[start, stop] = block
    found = {(start, stop): None for _, start, stop in spans} | {span: {} for span in blocks}
    if not blocks:
        return found
    for collection in (fp8_lib.META, fp8_lib.PROBES):

        def init(collection=collection):  # what `fp8.DotGeneral` starts from: no randomness
            out = {}
            for (start, stop), block in blocks.items():
                keys = jax.random.split(jax.random.key(0), stop - start)
                one = lambda k, block=block: block.init(k, *init_args)[collection]
                out[fp8_names.stack_name(start, stop)] = jax.vmap(one)(keys)
            return out

        value = module.variable(collection, sharding.STACKED, init).value
        for start, stop in blocks:
            found[start, stop][collection] = value[fp8_names.stack_name(start, stop)]
    return found


def pieces(stacks: tuple[Stack, ...], start: int, stop: int) -> list[tuple[Stack, int, int, bool]]:
    """`(stack, a, b, fp8)` in the order of the layers: each stack cut where the fp8 layers
    `[start, stop)` begin and end (the first and last `fp8.bf16_layers` stay in bf16), each
    piece a static slice of its stack scanned on its own."""
    found = []
    for s in stacks:
        for a, b, fp8 in ((0, start, False), (start, stop, True), (stop, s.stop, False)):
            a, b = max(a, s.first), min(b, s.stop)
            if a < b:
                found.append((s, a, b, fp8))
    return found
