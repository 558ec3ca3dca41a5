"""A LoRA run's state: the adapters train, the base is frozen, stored once and checked on resume.

With `config.lora.rank` set the model has adapters (`mptrain.models.lora`), and the state splits
its params (`mptrain.recipe.frozen`): `params` are the adapters (masters, gradients, optimizer
state as the precision says), `frozen` the base, in the compute dtype or with the projections'
kernels in 8 bits (`lora.base_dtype="q8"`).

A checkpoint holds what trains (the adapters, their optimizer state, the scaler, the counters)
and, in its meta, the base's fingerprint (`base`): the base itself is `config.init_from`'s (or
the model's own init from the seed), read again on every start. A resume whose base is not the
one the adapters were trained on (the folder changed) is a `ConfigError` naming it, exit 2.
"""

from __future__ import annotations

from typing import Any

import jax

from mptrain import errors
from mptrain.models import lora as lora_lib
from mptrain.optim import q8
from mptrain.parallel import sharding
from mptrain.recipe import frozen as frozen_lib
from mptrain.recipe import precision
from mptrain.train import fingerprints

BASE = "base"  # the meta key of the base's fingerprint


def _stacked(path: str) -> bool:  # a leaf of the scanned layers' stack
    return path.split("/")[0] == sharding.STACKED


def _fixed(axes: Any) -> Any:  # the params declared never trained (`parallel.axes`)
    return axes.is_fixed if axes is not None else lambda path: False


def split(model: Any, policy: Any, config: Any, params: Any, axes: Any = None) -> dict[str, Any]:
    """`{"params": trainable, "frozen": frozen}` of a model's fresh `params` (traced inside the
    state's init, for `TrainState.create`): everything trains without adapters; with them, the
    adapters, and the base is stored as `lora.base_dtype` says (a `fixed` param of `axes`, the
    params' declared ones, in fp32)."""
    spec = getattr(model, "lora", None)
    if spec is None:
        return {"params": params, "frozen": {}}
    trainable, frozen = frozen_lib.split(params, lora_lib.is_adapter)
    eight_bit = lora_lib.settings(config.lora)["base_dtype"] == "q8"
    tied = getattr(model, "tie_embeddings", False)  # the table is the head's kernel too

    def quantized(path: str, shape: tuple) -> bool:  # the projections, the token table
        if path.endswith("/kernel"):
            return eight_bit and lora_lib.module_path(path) in spec.projections
        rows = shape[-1] % q8.BLOCK_SIZE == 0  # a row is whole blocks: looked up, then decoded
        return eight_bit and path.endswith("/embedding") and rows and not tied

    stored = frozen_lib.store(frozen, policy.compute_dtype, quantized, _stacked, _fixed(axes))
    return {"params": trainable, "frozen": stored}


def base_target(frozen: Any, compute_dtype: Any) -> Any:
    """The abstract params a base is read into (`init_from.load`): the frozen tree's leaves,
    an 8-bit kernel as the 16-bit tensor it is quantized from."""

    def one(x):
        if q8.is_q8(x):
            return jax.ShapeDtypeStruct(x.shape, compute_dtype, sharding=x.codes.sharding)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=getattr(x, "sharding", None))

    return jax.tree.map(one, frozen, is_leaf=q8.is_q8)


def with_base(state: Any, base: Any) -> Any:
    """`state` with `base` (read into `base_target`) as its frozen params, stored as its fresh
    ones are (`frozen.store`: the same kernels in 8 bits, in the same shardings); the fresh ones
    are deleted first. Eagerly, leaf by leaf: no program of its own."""
    like = jax.tree_util.tree_flatten_with_path(state.frozen, is_leaf=q8.is_q8)[0]
    eight = {precision.path_name(path) for path, x in like if q8.is_q8(x)}
    places = [getattr(x, "sharding", None) for x in jax.tree.leaves(state.frozen)]
    for x in jax.tree.leaves(state.frozen):  # a restored state's are abstract: nothing to delete
        if isinstance(x, jax.Array):
            x.delete()
    stored = frozen_lib.store(
        base, state.policy.compute_dtype, lambda path, shape: path in eight, _stacked,
        _fixed(state.axes),
    )  # fmt: skip
    leaves, tree = jax.tree.flatten(stored)
    placed = [x if p is None else jax.device_put(x, p) for x, p in zip(leaves, places, strict=True)]
    return state.replace(frozen=jax.tree.unflatten(tree, placed))


def fingerprint(state: Any) -> str | None:
    """The frozen base's fingerprint (None: no frozen params)."""
    frozen = getattr(state, "frozen", None)
    return fingerprints.fingerprint(frozen) if jax.tree.leaves(frozen) else None


def check_base(meta: dict, state: Any, where: str, source: str | None) -> None:
    """A `ConfigError` when the checkpoint at `where` (its `meta`) was trained over another base
    than `state`'s frozen params, read from `source` (`config.init_from`)."""
    saved, now = meta.get(BASE), fingerprint(state)
    if saved == now:
        return
    what = f"config.init_from={source!r}" if source else "the base (the model's init, seed)"
    raise errors.ConfigError(
        f"{what}: the adapters of the checkpoint {where} were trained over another base "
        f"(fingerprint {saved}, now {now}); resume over the folder they were trained on, or use "
        "another --workdir to start a new run"
    )
