"""A model's stacked blocks walked by `jax.lax.scan`, and the fp8 state they carry.

The blocks' params are stacks (under `sharding.STACKED`, the layer on each leaf's leading
axis): one where every layer's params have one shape, else one for each run of layers that do
(`stacks`: a mixture of experts whose first layers are dense, Qwen3-MoE's `mlp_only_layers` or
DeepSeek-V3's, has a dense stack and an expert stack, MaxText's `dense_layers` and
`moe_layers`), each named by the layers it holds (`STACKED/<first>-<stop>`) and scanned on its
own. Each layer's slice is cast (under FSDP, gathered) inside the loop, as the step's
`sharding.Layers` says. A scan carries per-layer state as its per-layer inputs where it is
given some: under fp8-mixed the fp8 blocks' scaling state and probes, stacked on the layer
axis (the decoder's `model` makes them and cuts its stacks into bf16 and fp8 pieces), as
MaxText, Levanter and flax carry an amax history per scanned layer.

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

import jax
import jax.numpy as jnp

from mptrain.parallel import sharding
from mptrain.recipe import numerics_scan


@dataclasses.dataclass(frozen=True)
class Stack:
    """Layers `first .. stop - 1`, whose params are one stack: `key`, its path under
    `sharding.STACKED` (() for a model's one stack; `("<first>-<stop>",)` for each of several)."""

    first: int
    stop: int
    key: tuple[str, ...] = ()


def stacks(specs: list) -> tuple[Stack, ...]:
    """The stacks of layers with `specs` (a `blocks.BlockSpec` a layer): the runs of layers
    whose params have one shape, those whose specs differ only in what no param holds (the
    attention's window and RoPE)."""
    plain = lambda a: dataclasses.replace(a, window=None, inv_freq=(), longrope=None, rope_scale=1)
    kind = lambda s: dataclasses.replace(s, attention=plain(s.attention))
    runs, start = [], 0
    for i in range(1, len(specs) + 1):
        if i == len(specs) or kind(specs[i]) != kind(specs[start]):
            runs.append((start, i))
            start = i
    if len(runs) == 1:
        return (Stack(0, len(specs)),)
    return tuple(Stack(a, b, (sharding.stack_key(a, b),)) for a, b in runs)


def period(kinds: list) -> int:
    """The fewest layers after which `kinds` (one a layer) repeat: 1 where all are alike."""
    return next(p for p in range(1, len(kinds) + 1) if kinds[p:] == kinds[:-p])


def scan(
    blocks, *, x, args, stacked, dropout=None, policy=None, fp8=None, first=0,
    where=Stack(0, 0), per_layer=lambda layer, where: layer,
) -> jax.Array:  # fmt: skip
    """`x` through the blocks once per layer of `stacked` (layers `first`, `first + 1`, ...):
    a block, or a tuple of them that layers take in turn (the module doc), each applied as
    `block.apply(variables, h, *args)`; `fp8`: the layers' stacked fp8 collections; `dropout`:
    a key, folded with each layer's number; `policy`: the remat policy, per block; `where`:
    the `Stack` the rows are of (its key and first layer); `per_layer(slice, key)`: a layer's
    params as its block computes with them (`sharding.Layers`: the step's cast and gather)."""
    blocks = blocks if isinstance(blocks, tuple) else (blocks,)
    layers, p = jax.tree.leaves(stacked)[0].shape[0], len(blocks)
    run = functools.partial(
        _scan, args=args, dropout=dropout, policy=policy, where=where, per_layer=per_layer
    )
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
    blocks, *, x, args, stacked, fp8, first, dropout, policy, where, per_layer, grouped=True
) -> jax.Array:
    """`x` through `stacked`, a step a row: `[steps, len(blocks), ...]`, the blocks in turn
    (`grouped`), or one block's layers `[steps, ...]`."""
    steps, p = jax.tree.leaves(stacked)[0].shape[0], len(blocks)
    # per-layer numerics: their own rows, each layer's gradients in its stack's rows
    taps = numerics_scan.begin(steps, first, stride=p, key=where.key, offset=where.first)

    def one(j, h, layer, state, index, rows):
        variables = {"params": per_layer(layer, where.key), **(state or {})}
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
