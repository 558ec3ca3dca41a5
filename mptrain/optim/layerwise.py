"""The optimizer's update applied to a stack of layers one layer at a time.

A stack (`sharding.STACKED`, its leading axis the layer) is updated whole by default: the
gradient upcast, the moments loaded to fp32 and stored again, the step, the new params before
their rounding, each an fp32 array the size of the stack. For the 70B on 8 devices that is
8.75 GiB a tensor of its MLP stack, and the step's peak was the update's, not the layers'.
Where a stack's leaf has `LAYERWISE_MIN` elements or more, `update` runs the whole update
(clipping, AdamW, the learning rate, the params' rounding) in a loop over the layers whose
carry is the stacks: each layer's slices of the params, gradients, moments and compensation
go through the same optimizer and are written back in place, so the temporaries are one
layer's and the new state takes no second copy of the old (a `jax.lax.map` would write a new
stack beside the old one, which its later layers still read). The rest of the tree is updated
once, as it always was.

What makes a slice's update the stack's: AdamW and SGD are elementwise; an 8-bit moment's
blocks run along its trailing dims (`q8.split`: a leaf whose blocks would cross layers is not
sliced); the gradient clipping reads the whole tree's norm (`clip_by_global_norm`, handed
`global_norm`); the scalars (the optimizer's count) are shared. What differs is the random
bits of stochastic rounding: each layer's are drawn with its index folded into the keys
(`layer`), where the whole stack drew one stream. Each call sees the whole tree's structure,
the leaves it does not update standing in as empty arrays, so every leaf keeps the key it
always had.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mptrain import dtypes
from mptrain.optim import q8
from mptrain.parallel import sharding

# elements of one leaf of a stack (its global shape): from here its update is a layer's. The
# 70B's MLP stacks (1.9e10) and attention's q and o (5.4e9) are above it; the 8B's (1.9e9) are
# not: its plan peaks elsewhere, and a loop over its layers added 1,631 kernels a step (4,723
# -> 6,354 on 8 H100s) for no memory.
LAYERWISE_MIN = 2**31


def norm(tree: Any) -> jax.Array:
    """`optax.tree.norm` of `tree` summed in fp32 (a leaf upcast where XLA fuses it into the
    sum: bf16 gradients stay bf16 in memory); of fp32 leaves, optax's to the bit."""
    return optax.tree.norm(dtypes.to_f32(tree))


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
    """`optax.clip_by_global_norm` (the same formula and empty state) that takes the norm from
    `global_norm=` where its caller has it: a layer's slice of a tree has not its norm."""

    def update_fn(updates, state, params=None, *, global_norm=None, **extra):
        del params, extra
        total = norm(updates) if global_norm is None else global_norm
        trigger = jnp.squeeze(total < max_norm)
        clip = lambda t: jax.lax.select(trigger, t, (t / total.astype(t.dtype)) * max_norm)
        return jax.tree.map(clip, updates), state

    return optax.GradientTransformationExtraArgs(lambda params: optax.EmptyState(), update_fn)


def applies(params: Any, gated: bool) -> bool:
    """Whether `update` takes this update: a stack with a leaf of `LAYERWISE_MIN` elements or
    more, under an optimizer that takes `layer=` and `global_norm=` (`gated`: an `optim.Gated`;
    not gradient accumulation's)."""
    stack = params.get(sharding.STACKED) if isinstance(params, Mapping) else None
    big = stack is not None and any(np.size(x) >= LAYERWISE_MIN for x in jax.tree.leaves(stack))
    return big and gated


def update(step: Callable, params, grads, opt_state, compensation, total) -> tuple:
    """`step(params, grads, opt_state, compensation, **extra) -> (params, opt_state,
    compensation)`, the update of whole trees, run on the stack a layer at a time and on the
    rest once (module doc), every call's clip reading `total`, the whole tree's norm; the same
    three trees out."""
    trees = (params, grads, opt_state, compensation)
    whole = _whole(opt_state)
    stacks = {  # a model's stacks (one, or several: `sharding.stacks`), each its leaves' paths
        key: [_stack_paths(t, whole, key) for t in trees]
        for key in sharding.stacks(params[sharding.STACKED])
    }
    every = [set().union(*(paths[i] for paths in stacks.values())) for i in range(len(trees))]
    rest = step(*(_view(t, p, False) for t, p in zip(trees, every, strict=True)), global_norm=total)
    kept = (params, opt_state, compensation)  # what the loops rewrite, a layer at a time
    done = list(rest)
    for key, paths in stacks.items():
        stack = sharding.stacks(params[sharding.STACKED])[key][0]
        (count,) = {np.shape(x)[0] for x in jax.tree.leaves(stack)}
        outputs = [paths[0], *paths[2:]]

        def one(i, carry, paths=paths, outputs=outputs):  # layer i of the stack it carries,
            now = [_merge(t, c, p) for t, c, p in zip(kept, carry, outputs, strict=True)]
            now.insert(1, grads)  # written back in place
            views = (_view(t, p, True, i) for t, p in zip(now, paths, strict=True))
            out = step(*views, global_norm=total, layer=i)
            put = lambda full, new: jax.lax.dynamic_update_index_in_dim(full, new, i, 0)
            return [
                [jax.tree.map(put, full, new) for full, new in zip(c, _pick(t, p), strict=True)]
                for c, t, p in zip(carry, out, outputs, strict=True)
            ]

        carry = [_pick(t, p) for t, p in zip(kept, outputs, strict=True)]
        stacked = jax.lax.fori_loop(0, count, one, carry)
        done = [_merge(*parts) for parts in zip(done, stacked, outputs, strict=True)]
    return tuple(done)


def _flat(tree: Any) -> list:
    return jax.tree_util.tree_flatten_with_path(tree, is_leaf=q8.is_q8)[0]


def _param(path) -> str:
    """The stack's param a leaf's path is of (from `sharding.STACKED` on: an optimizer state's
    leaf mirrors a param's path under its own prefix)."""
    keys = [getattr(k, "key", None) for k in path]
    return jax.tree_util.keystr(tuple(path[keys.index(sharding.STACKED) :]))


def _whole(opt_state: Any) -> set[str]:
    """The stack's params whose 8-bit moments' blocks cross its layers (`q8.split` 0: a small
    leaf of no multiple of the block size): updated whole, with the rest."""
    return {
        _param(path)
        for path, x in _flat(opt_state)
        if q8.is_q8(x) and sharding.is_stacked(path) and q8.split(x.shape, x.block_size) == 0
    }


def _stack_paths(tree: Any, whole: set[str], key: tuple[str, ...] = ()) -> set[str]:
    """The paths of `tree`'s leaves updated a layer at a time: those of the stack `key`
    (`sharding.stacks`), not scalars, not of the params `whole` names."""
    return {
        jax.tree_util.keystr(path)
        for path, x in _flat(tree)
        if sharding.is_stacked(path)
        and _stack_key(path) == key
        and np.ndim(x.codes if q8.is_q8(x) else x) > 0
        and _param(path) not in whole
    }


def _stack_key(path) -> tuple[str, ...]:
    """The key of the stack a stacked leaf is of, under `sharding.STACKED`."""
    keys = tuple(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)
    stack = sharding.stack_of(keys[keys.index(sharding.STACKED) :])[0]
    return stack[1:]


def _view(tree: Any, paths: set[str], stacked: bool, index: Any = None) -> Any:
    """`tree` with the leaves at `paths` (`stacked`: layer `index` of each) or the others, the
    rest empty arrays; scalars (a count) as they are."""

    def one(path, x):
        if (jax.tree_util.keystr(path) in paths) != stacked:
            if np.ndim(x.codes if q8.is_q8(x) else x) == 0:
                return x
            if q8.is_q8(x):
                return q8.zeros((0,), x.kind, x.block_size)
            return jnp.zeros((0,), x.dtype)
        if index is None:
            return x
        return jax.tree.map(lambda a: a[index], x)  # a Q8's codes and scales alike

    return jax.tree_util.tree_map_with_path(one, tree, is_leaf=q8.is_q8)


def _pick(tree: Any, paths: set[str]) -> list:
    return [x for path, x in _flat(tree) if jax.tree_util.keystr(path) in paths]


def _merge(rest: Any, stacked: list, paths: set[str]) -> Any:
    """`rest`'s tree with the leaves at `paths` (empty there) replaced by `stacked`'s."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(rest, is_leaf=q8.is_q8)
    layers = iter(stacked)
    leaves = [next(layers) if jax.tree_util.keystr(p) in paths else x for p, x in flat]
    return jax.tree.unflatten(treedef, leaves)
