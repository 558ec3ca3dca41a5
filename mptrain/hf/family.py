"""What a family of HuggingFace causal LMs is to `mptrain.hf.families` (the table is there), and
the checks its readers share."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mptrain import errors


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # config.model.family
    architecture: str
    model_type: str
    read: Callable[[Path, dict, int], dict]  # (file, config.json, layers) -> switches
    write: Callable[[dict], dict]  # the decoder's settings -> config.json's own keys
    can: Callable[[dict], str | None]  # why the settings' switches are not this family's
    defaults: tuple = ()  # config.json's keys that default otherwise than the Llama's
    # fused tensors: ((module, HF name under the layer), the parts in the order of their rows)
    fused: tuple = ()
    experts: Any = None  # its experts' keys and names (`mptrain.hf.experts.Experts`); None: none
    latent: bool = False  # multi-head latent attention (DeepSeek's) in every layer
    sinks: bool = False  # attention sinks (gpt-oss's) in every layer
    # what the tensors of layers past num_hidden_layers are, left unread with a log line as
    # transformers leaves them (None: such tensors are refused)
    unread_layers: str | None = None


def bias(file: Path, raw: dict, fixed: str | None = None) -> str:
    """`attn_bias` from `attention_bias` (a bool: the four projections), or the family's."""
    if fixed is not None:
        return fixed
    value = raw.get("attention_bias", False)
    if not isinstance(value, bool):
        raise errors.ConfigError(f"{file}: attention_bias={value!r}: must be true or false")
    return "all" if value else "none"


def checked(file: Path, key: str, value: Any, kind: type) -> Any:
    """`value` when it is a positive int, a positive number (as a float) or a bool, as `kind`
    says; else a `ConfigError` naming the file and the key."""
    try:
        if kind is bool and not isinstance(value, bool):
            raise ValueError(f"{key}={value!r}: must be true or false")
        if kind is int:
            return errors.check_integer(key, value, 1)
        return errors.check_number(key, value, 0.0, open_low=True) if kind is float else value
    except ValueError as e:
        raise errors.ConfigError(f"{file}: {e}") from None


def unlike(c: dict, **want: Any) -> str | None:
    """The first switch of `c` that differs from `want` (a value, or a tuple of allowed ones)."""
    for key, allowed in want.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if c[key] not in allowed:
            return f"model.{key}={c[key]!r}"
    return None
