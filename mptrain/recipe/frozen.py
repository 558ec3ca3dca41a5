"""Params that do not train: a frozen base stored once, beside the params that do.

Training adapters (`mptrain.models.lora`) splits a model's params in two. The trainable ones
are the state's `params`: fp32 masters (or what the policy says), with gradients and optimizer
state. The rest are the state's `frozen`: stored once, in the compute dtype or, for large
kernels, block-quantized to 8 bits (`q8.Q8`, the format of the 8-bit moments, rounded to
nearest), with no master copy, no gradient and no optimizer state. The step hands the model
both, merged back into one tree (`parallel.sharding.merge`), cast as the policy says
(`Policy.compute_dtypes`: an 8-bit leaf goes on as it is, and the model dequantizes it inside
its matmul).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mptrain.optim import q8
from mptrain.recipe import precision


def split(params: Any, trains: Callable[[str], bool]) -> tuple[dict, dict]:
    """`(trainable, frozen)`: the leaves of the nested dicts `params` whose "/"-joined path
    `trains`, and the others, each as nested dicts (empty branches left out)."""
    train, frozen = {}, {}
    for key, value in params.items():
        if isinstance(value, Mapping) and not q8.is_q8(value):
            t, f = split(value, lambda p, key=key: trains(f"{key}/{p}"))
            train.update({key: t} if t else {})
            frozen.update({key: f} if f else {})
        else:
            (train if trains(str(key)) else frozen)[key] = value
    return train, frozen


def store(
    frozen: Any,
    dtype: Any,
    quantized: Callable[[str, tuple], bool] = lambda path, shape: False,
    stacked: Callable[[str], bool] = lambda path: False,
    fixed: Callable[[tuple], bool] = lambda path: False,
) -> Any:
    """`frozen` (fp32 leaves) as a state keeps it: in `dtype`, or as a `q8.Q8` where
    `quantized(path, shape)` (one layer's shape) and the tensor is large enough
    (`q8.quantized`). A `stacked` kernel (the layers of a scan on its leading axis) is
    quantized layer by layer, so each layer's slice is a `Q8` of its own. A param whose role
    is `fixed` (`parallel.axes`: DeepSeek's routing bias, whose every bit chooses experts)
    stays in fp32."""

    def one(path, x):
        if fixed(path):
            return x.astype(jnp.float32)
        name = precision.path_name(path)
        layered = stacked(name)
        shape = x.shape[1:] if layered else x.shape
        if not quantized(name, shape) or not q8.quantized(shape):
            return x.astype(dtype)
        quantize = lambda w: q8.quantize(w.astype(jnp.float32), "signed")
        return jax.vmap(quantize)(x) if layered else quantize(x)

    return jax.tree_util.tree_map_with_path(one, frozen)
