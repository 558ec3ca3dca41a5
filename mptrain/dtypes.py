"""The dtypes mptrain names, the fp32 upcast, and the rounding rules: one home for each.

`F32`, `BF16`, `F16` and their names in configs (`DTYPES`, `parse_dtype`); `to_f32`, the upcast
of metrics and of fp32 arithmetic; `round_to`, rounding to a narrower float that no compiler
pass removes; and stochastic rounding to bf16 (`stochastic_round_to_bf16`), which the
optimizers' moments and the bf16 params' updates share. The precision policy
(`mptrain.recipe.precision`) and the optimizers (`mptrain.optim`) build on them.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

F32, BF16, F16 = np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)
DTYPES = {"f32": F32, "float32": F32, "bf16": BF16, "bfloat16": BF16, "f16": F16, "float16": F16}


def parse_dtype(value: Any, key: str) -> np.dtype:
    """One of float32/bfloat16/float16 from a name in `DTYPES` or a dtype; errors name `key`."""
    if isinstance(value, str):
        found = DTYPES.get(value.strip().lower())
    else:
        try:
            found = np.dtype(value)
        except TypeError:
            found = None
    if found not in (F32, BF16, F16):
        raise ValueError(f"{key}={value!r}: valid dtypes are {', '.join(DTYPES)}")
    return found


def to_f32(tree: Any) -> Any:
    """Every leaf as a float32 array (ints and bools too: for metrics and fp32 arithmetic)."""
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), tree)


# --------------------------------------------------------------------------- rounding


def round_to(x: jax.Array, dtype: Any) -> jax.Array:
    """`x` rounded to the nearest value of the narrower float `dtype`, kept in `x`'s dtype.

    The same numbers as `x.astype(dtype).astype(x.dtype)`, but that round trip is one XLA may
    drop when it allows excess precision (XLA:GPU's default), and a trick that needs the rounded
    value itself, such as Kahan's compensation, would then silently do nothing. Rounding with
    `reduce_precision` is an operation of its own that no compiler pass removes.
    """
    info = jnp.finfo(dtype)
    rounded = jax.lax.reduce_precision(x, exponent_bits=info.nexp, mantissa_bits=info.nmant)
    if info.nexp < jnp.finfo(x.dtype).nexp:
        # reduce_precision flushes the narrower type's subnormals to zero where a cast keeps
        # them; they sit on one evenly spaced grid, so round them there (scaling by a power of
        # two is exact, and jnp.round breaks ties to even as the cast does)
        step = float(info.smallest_subnormal)
        tiny = jnp.abs(x) < float(info.smallest_normal)
        rounded = jnp.where(tiny, jnp.round(x / step) * step, rounded)
    return rounded


# --------------------------------------------------------------------------- stochastic rounding


def stochastic_round_to_bf16(x: jax.Array, key: jax.Array) -> jax.Array:
    """Rounds fp32 to bf16 up or down with probability given by the distance to each.

    bf16 keeps the top 16 bits of an fp32 number. Adding uniform noise to the 16 bits that are
    dropped and then truncating rounds up exactly when the noise carries into the kept bits,
    which happens with probability equal to the dropped fraction: unbiased in expectation, so
    updates far below bf16's resolution still move the weights on average.
    """
    bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    noise = jax.random.bits(key, x.shape, jnp.uint32) & jnp.uint32(0xFFFF)
    rounded = (bits + noise) & jnp.uint32(0xFFFF0000)
    rounded = jnp.where(jnp.isfinite(x), rounded, bits)  # leave inf/nan as they are
    return jax.lax.bitcast_convert_type(rounded, jnp.float32).astype(jnp.bfloat16)


def stochastic_round_tree(tree: Any, key: jax.Array) -> Any:
    """`stochastic_round_to_bf16` on every leaf, each with its own key split from `key`."""
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    keys = jax.random.split(key, len(leaves))
    rounded = [stochastic_round_to_bf16(x, k) for x, k in zip(leaves, keys, strict=True)]
    return jax.tree.unflatten(treedef, rounded)
