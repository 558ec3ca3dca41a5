"""Content fingerprints of a training state, computed where its arrays live.

A checkpoint stores `fingerprint(state)` and `array_specs(state)` in its meta; a restore
recomputes them on what it read. The sums behind the fingerprint are computed on the devices,
shard by shard, and only two numbers per array come back, so a state split over many devices
and hosts is never gathered to a host, and the result does not depend on how it is split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def _leaf_spec(leaf: Any) -> str:
    """`float32[4,3]` for an array, a ShapeDtypeStruct or a Python/numpy scalar."""
    if not (hasattr(leaf, "dtype") and hasattr(leaf, "shape")):
        leaf = np.asarray(leaf)
    return f"{np.dtype(leaf.dtype).name}[{','.join(str(d) for d in leaf.shape)}]"


def array_specs(tree: Any) -> dict[str, str]:
    """`{leaf path: "dtype[shape]"}` for every array leaf: what a checkpoint must hold to fit."""
    return {
        jax.tree_util.keystr(path): _leaf_spec(leaf)
        for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
    }


def _mix(h: jax.Array) -> jax.Array:
    """A bijection of uint32 that scatters every input bit over the output (murmur3's final
    mixing step): equal inputs give equal outputs, different inputs different outputs."""
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def _leaf_sums(x: jax.Array) -> jax.Array:
    """uint32[2]: two independent sums over the elements of `mix(bits ^ mix(index, lane))`.

    `bits` is the element's own bit pattern (NaN payloads and signed zeros included), `index`
    its row-major position in the whole array. Sums of uint32 wrap around exactly and in any
    order, so the result is the same however the array is split over devices and processes,
    and nothing leaves the devices but these two numbers. A change to one element always
    changes both sums (`mix` is a bijection); several changes cancel with odds of 2**-64.
    """
    x = jnp.asarray(x)
    if x.dtype == jnp.bool_ or x.dtype.itemsize == 1:
        bits = x.astype(jnp.uint8).astype(jnp.uint32)
    elif x.dtype.itemsize in (2, 4):
        width = jnp.uint16 if x.dtype.itemsize == 2 else jnp.uint32
        bits = jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32)
    else:
        raise ValueError(f"cannot fingerprint {x.dtype} arrays")
    index = jnp.zeros(x.shape, jnp.uint32)
    for dim in range(x.ndim):  # row-major position, modulo 2**32
        stride = int(np.prod(x.shape[dim + 1 :], dtype=np.int64)) % 2**32
        index = index + jax.lax.broadcasted_iota(jnp.uint32, x.shape, dim) * jnp.uint32(stride)
    lanes = [
        jnp.sum(
            _mix(bits ^ _mix(index * jnp.uint32(0x9E3779B9) + jnp.uint32(salt))), dtype=jnp.uint32
        )
        for salt in (0x2545F491, 0x6C8E9CF5)
    ]
    return jnp.stack(lanes)


_leaf_sums_jit = jax.jit(lambda leaves: [_leaf_sums(x) for x in leaves])


def _on_their_devices(fn, leaves) -> list:
    """`fn(leaves)` fetched to the host, called once per group of leaves that share devices
    (a jitted call takes arrays of one device set; host arrays join any group)."""
    groups: dict[Any, list[int]] = {}
    for i, leaf in enumerate(leaves):
        devices = leaf.sharding.device_set if isinstance(leaf, jax.Array) else None
        groups.setdefault(None if devices is None else frozenset(devices), []).append(i)
    if None in groups and len(groups) > 1:  # host arrays go along with the first device group
        groups[next(k for k in groups if k is not None)] += groups.pop(None)
    found = [None] * len(leaves)
    for members in groups.values():
        for i, value in zip(members, jax.device_get(fn([leaves[i] for i in members])), strict=True):
            found[i] = value
    return found


def fingerprint(state: Any) -> str:
    """A content hash of `state`: sha256 over each array leaf's path, dtype, shape and sums.

    The sums (`_leaf_sums`) are computed where the arrays live, shard by shard; a state split
    over many devices and hosts is never gathered. Two states have the same fingerprint when
    they have the same leaf paths, dtypes and shapes and every element is bit-identical; any
    single changed element, bit or position changes it. Every process must call this.
    """
    paths, leaves = zip(*jax.tree_util.tree_flatten_with_path(state)[0], strict=True)
    sums = _on_their_devices(_leaf_sums_jit, leaves)
    digest = hashlib.sha256()
    for path, leaf, lanes in zip(paths, leaves, sums, strict=True):
        spec = f"{jax.tree_util.keystr(path)}|{_leaf_spec(leaf)}|{lanes[0]:08x}{lanes[1]:08x}|"
        digest.update(spec.encode())
    return "sums-sha256:" + digest.hexdigest()


def nonfinite_params(state: Any) -> list[str]:
    """Paths of floating leaves of the state's params holding a NaN or an inf (on the device)."""
    params = state.get("params") if isinstance(state, Mapping) else getattr(state, "params", None)
    if params is None:
        return []
    found = jax.tree_util.tree_flatten_with_path(params)[0]
    found = [(p, x) for p, x in found if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    finite = _on_their_devices(_all_finite_jit, [x for _, x in found])
    return [jax.tree_util.keystr(p) for (p, _), ok in zip(found, finite, strict=True) if not ok]


_all_finite_jit = jax.jit(lambda leaves: [jnp.isfinite(x).all() for x in leaves])
