"""A model's stacked blocks walked by `jax.lax.scan`, and the fp8 state they carry.

The blocks' params are one stack (`sharding.STACKED`, the layer on the leading axis); each
layer's slice is cast (under FSDP, gathered) inside the loop (`sharding.layer_params`). Under
fp8-mixed the blocks between the first and last `fp8.bf16_layers` run their selected matmuls
in fp8: the stack then runs as three scans over static slices (bf16, fp8, bf16), and the fp8
blocks' scaling state and probes (`fp8.META`, `fp8.PROBES`) are stacked on the same layer axis
under `STACKED/layers_<a>-<b>` (`fp8_names.stack_name`), carried through their scan as its
per-layer inputs, as MaxText, Levanter and flax carry an amax history per scanned layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain.recipe import fp8 as fp8_lib
from mptrain.recipe import fp8_names, numerics_scan, sharding


def scan(block, *, x, args, stacked, dropout=None, policy=None, fp8=None, first=0) -> jax.Array:
    """`x` through `block` once per layer of `stacked` (blocks `first`, `first + 1`, ...), each
    applied as `block.apply(variables, h, *args)`; `fp8`: the layers' stacked fp8 collections;
    `dropout`: a key, folded with each block's number; `policy`: the remat policy, per block."""
    layers = jax.tree.leaves(stacked)[0].shape[0]
    taps = numerics_scan.begin(layers, first)  # per-layer numerics: each layer's own rows

    def body(h, xs):
        layer, state, index, rows = xs
        variables = {"params": sharding.layer_params(layer), **(state or {})}
        rngs = {} if dropout is None else {"dropout": jax.random.fold_in(dropout, index)}
        with numerics_scan.layer(taps, rows):
            return block.apply(variables, h, *args, rngs=rngs), None

    if policy is not None:
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    index = jnp.arange(first, first + layers, dtype=jnp.int32) if dropout is not None else None
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


def spans(run: Callable, stacked, blocks: tuple, fp8, start: int, stop: int, policy) -> Any:
    """The stack as three scans: blocks `[0, start)` and `[stop, layers)` with `blocks[0]`
    (bf16), `[start, stop)` with `blocks[1]` and its `fp8` state; each over a static slice of
    the stacked params."""
    layers, x = jax.tree.leaves(stacked)[0].shape[0], None
    parts = ((0, start, blocks[0], None), (start, stop, blocks[1], fp8))
    for a, b, block, state in (*parts, (stop, layers, blocks[0], None)):
        if a < b:
            params = jax.tree.map(lambda p, a=a, b=b: p[a:b], stacked)
            kwargs = {} if x is None else {"x": x}
            x = run(block, stacked=params, policy=policy, fp8=state, first=a, **kwargs)
    return x
