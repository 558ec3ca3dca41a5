"""Precision policies: which dtype params are stored in, computed in, and returned in.

A `Policy` is a small frozen dataclass; it is hashable so it can sit in a static field of the
`TrainState` and be part of a jit cache key. Casting only ever touches floating-point leaves:
token ids, labels and masks pass through with their integer or boolean dtype intact.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

_DTYPES = {
    "f32": np.dtype(jnp.float32),
    "float32": np.dtype(jnp.float32),
    "bf16": np.dtype(jnp.bfloat16),
    "bfloat16": np.dtype(jnp.bfloat16),
    "f16": np.dtype(jnp.float16),
    "float16": np.dtype(jnp.float16),
}
_KEYS = {"p": "params", "params": "params", "c": "compute", "compute": "compute"}
_KEYS |= {"o": "output", "output": "output"}

PRESETS = {
    "fp32": ("float32", "float32", "float32"),
    "bf16-mixed": ("float32", "bfloat16", "float32"),
    "fp16-mixed": ("float32", "float16", "float32"),
    "bf16-pure": ("bfloat16", "bfloat16", "float32"),
}


def _cast_floating(tree: Any, dtype: np.dtype) -> Any:
    def cast(x):
        if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype:
            return x.astype(dtype)
        return x

    return jax.tree.map(cast, tree)


@dataclasses.dataclass(frozen=True)
class Policy:
    """Where each kind of value lives: master params, the forward/backward pass, and outputs."""

    param_dtype: np.dtype
    compute_dtype: np.dtype
    output_dtype: np.dtype

    def __post_init__(self):
        for field in dataclasses.fields(self):
            object.__setattr__(self, field.name, np.dtype(getattr(self, field.name)))

    def cast_to_param(self, tree: Any) -> Any:
        return _cast_floating(tree, self.param_dtype)

    def cast_to_compute(self, tree: Any) -> Any:
        return _cast_floating(tree, self.compute_dtype)

    def cast_to_output(self, tree: Any) -> Any:
        return _cast_floating(tree, self.output_dtype)

    def __str__(self) -> str:
        return (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"output={self.output_dtype.name}"
        )


def _dtype(name: str, part: str) -> np.dtype:
    try:
        return _DTYPES[name.strip().lower()]
    except KeyError:
        raise ValueError(
            f"unknown dtype {name!r} in precision part {part!r}; valid dtypes: "
            f"{', '.join(sorted(_DTYPES))}"
        ) from None


def get_policy(spec: str | Policy) -> Policy:
    """Parses a preset name or the explicit `params=...,compute=...,output=...` form."""
    if isinstance(spec, Policy):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"precision must be a string, got {spec!r} ({type(spec).__name__})")
    text = spec.strip().lower()
    if text in PRESETS:
        return Policy(*(_DTYPES[name] for name in PRESETS[text]))
    if "=" not in text:
        raise ValueError(
            f"unknown precision {spec!r}; valid presets: {', '.join(PRESETS)}, or the explicit "
            "form 'params=float32,compute=bfloat16,output=float32' (keys p,c,o also accepted)"
        )
    found: dict[str, np.dtype] = {}
    for part in text.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in _KEYS:
            raise ValueError(
                f"bad part {part.strip()!r} in precision {spec!r}: expected key=dtype with key "
                f"one of params/p, compute/c, output/o; valid presets: {', '.join(PRESETS)}"
            )
        if _KEYS[key] in found:
            raise ValueError(f"part {part.strip()!r} repeats {_KEYS[key]!r} in precision {spec!r}")
        found[_KEYS[key]] = _dtype(value, part.strip())
    missing = [k for k in ("params", "compute", "output") if k not in found]
    if missing:
        raise ValueError(f"precision {spec!r} does not set {', '.join(missing)}")
    return Policy(found["params"], found["compute"], found["output"])
