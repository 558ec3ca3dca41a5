"""A model's stacked blocks walked by `jax.lax.scan`, and the fp8 state they carry.

The blocks' params are one stack (`sharding.STACKED`, the layer on the leading axis); each
layer's slice is cast (under FSDP, gathered) inside the loop (`sharding.layer_params`). Under
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
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain.parallel import sharding
from mptrain.recipe import fp8 as fp8_lib
from mptrain.recipe import fp8_names, numerics_scan


def period(kinds: list) -> int:
    """The fewest layers after which `kinds` (one a layer) repeat: 1 where all are alike."""
    return next(p for p in range(1, len(kinds) + 1) if kinds[p:] == kinds[:-p])


def scan(blocks, *, x, args, stacked, dropout=None, policy=None, fp8=None, first=0) -> jax.Array:
    """`x` through the blocks once per layer of `stacked` (layers `first`, `first + 1`, ...):
    a block, or a tuple of them that layers take in turn (the module doc), each applied as
    `block.apply(variables, h, *args)`; `fp8`: the layers' stacked fp8 collections; `dropout`:
    a key, folded with each layer's number; `policy`: the remat policy, per block."""
    blocks = blocks if isinstance(blocks, tuple) else (blocks,)
    layers, p = jax.tree.leaves(stacked)[0].shape[0], len(blocks)
    run = functools.partial(_scan, args=args, dropout=dropout, policy=policy)
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


def _scan(blocks, *, x, args, stacked, fp8, first, dropout, policy, grouped=True) -> jax.Array:
    """`x` through `stacked`, a step a row: `[steps, len(blocks), ...]`, the blocks in turn
    (`grouped`), or one block's layers `[steps, ...]`."""
    steps, p = jax.tree.leaves(stacked)[0].shape[0], len(blocks)
    taps = numerics_scan.begin(steps, first, stride=p)  # per-layer numerics: their own rows

    def one(j, h, layer, state, index, rows):
        variables = {"params": sharding.layer_params(layer), **(state or {})}
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


def fp8_state(module: nn.Module, block: nn.Module, init_args: tuple, start: int, stop: int):
    """`{collection: stacked tree}`: blocks `start..stop-1`'s fp8 scaling state and probes, one
    layer a row, variables of `module` (in the Trainer's `model_state` like any other)."""
    name = fp8_names.stack_name(start, stop)
    if block.fp8.block:  # the state's init runs the blocks under vmap, which JAX's MXFP8
        # matmul cannot batch: the emulation's values are the same shapes (and unused)
        block = block.clone(fp8=dataclasses.replace(block.fp8, emulate=True))
    found = {}
    if fp8_lib.META not in jax.eval_shape(lambda: block.init(jax.random.key(0), *init_args)):
        return None  # the size filter left no fp8 matmul in the block: no state to carry
    for collection in (fp8_lib.META, fp8_lib.PROBES):

        def init(collection=collection):  # what `fp8.DotGeneral` starts from: no randomness
            keys = jax.random.split(jax.random.key(0), stop - start)
            one = lambda k: block.init(k, *init_args)[collection]
            return {name: jax.vmap(one)(keys)}

        found[collection] = module.variable(collection, sharding.STACKED, init).value[name]
    return found


def spans(run: Callable, stacked, blocks: Callable, fp8, start: int, stop: int, policy) -> Any:
    """The stack as three scans: layers `[0, start)` and `[stop, layers)` in bf16, `[start,
    stop)` in fp8 with its `fp8` state; each over a static slice of the stacked params, with
    `blocks(a, b)`: layers a..b-1's blocks (one period of them)."""
    layers, x = jax.tree.leaves(stacked)[0].shape[0], None
    for a, b, state in ((0, start, None), (start, stop, fp8), (stop, layers, None)):
        if a < b:
            params = jax.tree.map(lambda p, a=a, b=b: p[a:b], stacked)
            kwargs = {} if x is None else {"x": x}
            x = run(blocks(a, b), stacked=params, policy=policy, fp8=state, first=a, **kwargs)
    return x
