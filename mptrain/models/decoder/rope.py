"""Rotary positions (RoPE) as the zoo's Llama applies them: the inverse frequencies, with
Llama 3's scaling, computed on the host; the rotation, an fp32 island (the Llama module doc).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from mptrain import errors


def rope_frequencies(head_dim: int, theta: float, scaling: tuple | None = None) -> np.ndarray:
    """The inverse frequencies ``[head_dim // 2]`` (float32) of RoPE, with Llama 3's scaling
    ``(factor, low_freq_factor, high_freq_factor, original_max_len)``: wavelengths longer than
    ``original_max_len / low_freq_factor`` are stretched by ``factor``, those shorter than
    ``original_max_len / high_freq_factor`` kept, and those between interpolated smoothly
    (Meta's rule for Llama 3.1, also HF's ``rope_type="llama3"``); or ``("linear", factor)``,
    every frequency divided by ``factor`` (HF's ``"linear"``: Gemma 3's global layers).
    Computed in float64 on the host, a constant of the program."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    if scaling is not None and scaling[0] == "yarn":
        return _yarn(head_dim, theta, *scaling[1:5], scaling[6])
    if scaling is not None and scaling[0] == "longrope":  # its short factors (`LongRope`)
        inv = inv / np.asarray(scaling[1], np.float64)
    elif scaling is not None and scaling[0] == "linear":
        inv = inv / float(scaling[1])
    elif scaling is not None:
        factor, low, high, original = (float(v) for v in scaling)
        wavelen = 2 * np.pi / inv
        smooth = (original / wavelen - low) / (high - low)
        mixed = (1 - smooth) * inv / factor + smooth * inv
        inv = np.where(wavelen > original / low, inv / factor, inv)
        between = (wavelen <= original / low) & (wavelen >= original / high)
        inv = np.where(between, mixed, inv)
    return inv.astype(np.float32)


def _yarn(
    dim: int, theta: float, factor: float, original: int, fast: float, slow: float, truncate: bool
) -> np.ndarray:
    """YaRN's frequencies (Peng et al. 2023, as transformers computes them): each frequency
    between its own and its interpolation (divided by `factor`), by a ramp over the dimensions
    whose wavelengths turn between `fast` and `slow` times over `original` positions (those
    turning faster kept, slower interpolated). Float32 as transformers' ramp."""
    at = lambda turns: dim * np.log(original / (turns * 2 * np.pi)) / (2 * np.log(theta))
    low, high = at(fast), at(slow)
    if truncate:
        low, high = np.floor(low), np.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    high = high + 0.001 if low == high else high
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolated = 1 - ramp.astype(np.float32)
    pos = (theta ** (np.arange(0, dim, 2).astype(np.int64).astype(np.float32) / dim)).astype(
        np.float32
    )
    inv, interpolated = 1.0 / pos, 1.0 / (factor * pos)
    return (interpolated * (1 - extrapolated) + inv * extrapolated).astype(np.float32)


def attention_scale(scaling: tuple | None) -> float:
    """What YaRN multiplies cos and sin by (its `attention_factor`), 1 for the others."""
    return float(scaling[5]) if scaling is not None and scaling[0] == "yarn" else 1.0


class LongRope(NamedTuple):
    """Phi-3's ``longrope`` (transformers' rule): past ``switch`` positions (its
    ``original_max_position_embeddings``) the frequencies divided by ``long`` factors, not the
    short ones, and cos and sin times ``scale`` (its ``attention_factor``). A row takes the long
    frequencies where its own largest position is past ``switch`` (transformers asks the
    batch's largest: the same for a row alone, and a row's result then never depends on the
    rows beside it)."""

    long_inv_freq: tuple[float, ...]
    switch: int
    scale: float


def longrope(head_dim: int, theta: float, scaling: tuple) -> LongRope:
    """The `LongRope` of ``("longrope", short, long, original_max, attention_factor)``."""
    _, _, long, switch, scale = scaling
    inv = rope_frequencies(head_dim, theta, ("longrope", long))
    return LongRope(tuple(float(f) for f in inv), int(switch), float(scale))


def apply_rope(
    x: jax.Array,
    positions: jax.Array,
    inv_freq: np.ndarray,
    long: LongRope | None = None,
    scale: float = 1.0,
    interleaved: bool = False,
) -> jax.Array:
    """``x [B, L, H, Dh]`` rotated by RoPE at ``positions`` (``[L]``, or ``[B, L]`` for rows of
    packed examples, each from 0): an fp32 island (see the module doc), HF's rotate-half
    pairing; the result in ``x``'s dtype. Fewer frequencies than ``Dh / 2`` rotate only the
    first ``2 * len(inv_freq)`` dimensions of each head and pass the rest (partial RoPE,
    Phi-3's ``partial_rotary_factor``), as transformers does. ``interleaved``: DeepSeek's
    pairs of adjacent dimensions (``2i``, ``2i + 1``), each rotated by frequency ``i``, the
    result in transformers' order (the rotated evens, then the rotated odds): the same
    rotate-half on the dimensions taken evens first, so a checkpoint loads unpermuted."""
    inv = jnp.asarray(inv_freq)
    if long is not None:  # the row's largest position decides (`LongRope`)
        past = jnp.max(positions, axis=-1, keepdims=True)[..., None] + 1 > long.switch
        inv = jnp.where(past, jnp.asarray(long.long_inv_freq, jnp.float32), inv)
    angles = positions.astype(jnp.float32)[..., None] * inv
    cos, sin = jnp.cos(angles)[..., None, :], jnp.sin(angles)[..., None, :]  # [(B,) L, 1, R/2]
    scale = scale * (long.scale if long is not None else 1.0)  # YaRN's, or longrope's
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    rotary = 2 * len(inv_freq)
    x32 = x.astype(jnp.float32)
    part = x32[..., :rotary]
    if interleaved:
        a, b = part[..., 0::2], part[..., 1::2]
    else:
        a, b = jnp.split(part, 2, axis=-1)
    out = [a * cos - b * sin, b * cos + a * sin]
    if rotary < x.shape[-1]:
        out.append(x32[..., rotary:])
    return jnp.concatenate(out, axis=-1).astype(x.dtype)


def scaling(value: Any) -> tuple | None:
    key = "model.rope_scaling"
    if value is None or (isinstance(value, str) and value.strip().lower() in ("", "none")):
        return None
    if isinstance(value, tuple | list) and len(value) == 2 and value[0] == "linear":
        return "linear", errors.check_number(f"{key}[1] (factor)", value[1], 1.0)
    if isinstance(value, tuple | list) and len(value) == 7 and value[0] == "yarn":
        factor = errors.check_number(f"{key}[1] (factor)", value[1], 1.0)
        original = errors.check_integer(f"{key}[2] (original_max_len)", value[2], 1, 2**31 - 1)
        fast = errors.check_number(f"{key}[3] (beta_fast)", value[3], 0.0, open_low=True)
        slow = errors.check_number(f"{key}[4] (beta_slow)", value[4], 0.0, open_low=True)
        scale = errors.check_number(f"{key}[5] (attention_factor)", value[5], 0.0, open_low=True)
        if not isinstance(value[6], bool):
            raise ValueError(f"{key}[6] (truncate)={value[6]!r}: must be True or False")
        return "yarn", factor, original, fast, slow, scale, value[6]
    if isinstance(value, tuple | list) and len(value) == 5 and value[0] == "longrope":
        short, long = (tuple(errors.check_number(key, f, 0.0, open_low=True) for f in v)
                       for v in value[1:3])  # fmt: skip
        if len(short) != len(long):
            raise ValueError(f"{key}: {len(short)} short factors but {len(long)} long ones")
        switch = errors.check_integer(f"{key}[3] (original_max_len)", value[3], 1, 2**31 - 1)
        scale = errors.check_number(f"{key}[4] (attention_factor)", value[4], 0.0, open_low=True)
        return "longrope", short, long, switch, scale
    if not isinstance(value, tuple | list) or len(value) != 4:
        raise ValueError(
            f"{key}={value!r}: None, Llama 3's (factor, low_freq_factor, high_freq_factor, "
            "original_max_len), e.g. (8.0, 1.0, 4.0, 8192), ('linear', factor), or ('yarn', "
            "factor, original_max_len, beta_fast, beta_slow, attention_factor, truncate)"
        )
    factor = errors.check_number(f"{key}[0] (factor)", value[0], 1.0)
    low = errors.check_number(f"{key}[1] (low_freq_factor)", value[1], 0.0, open_low=True)
    high = errors.check_number(f"{key}[2] (high_freq_factor)", value[2], low, open_low=True)
    original = errors.check_integer(f"{key}[3] (original_max_len)", value[3], 1, 2**31 - 1)
    return factor, low, high, original
