"""The families of HuggingFace causal LMs that mptrain's decoder reads and writes, as data: a
`Family` a folder's `architectures` (or `model_type`) names, which reads its config.json's own
keys into the decoder's switches (`mptrain.models.blocks`) and writes them back.

  * llama (LlamaForCausalLM): with `attention_bias`, the four attention projections biased;
  * mistral (MistralForCausalLM): `sliding_window` on every layer when set (4,096 if absent);
  * qwen2 (Qwen2ForCausalLM): q, k, v with bias, o without; a window by `use_sliding_window`;
  * qwen3 (Qwen3ForCausalLM): RMSNorm over each head's q and k before RoPE; `attention_bias`;
    the window as Qwen2's. (What differs is read from transformers' `modular_*.py`.)

A window is read as transformers reads it: Qwen's `layer_types`, else `use_sliding_window`
with `sliding_window` on the layers from `max_window_layers` on. The decoder takes one window
for every layer, so a folder whose layers mix sliding and full attention is refused, naming the
key, rather than run as another model. The tensor names are `mptrain.hf`'s table.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mptrain import errors

SLIDING, FULL = "sliding_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class Family:
    name: str  # config.model.family
    architecture: str
    model_type: str
    read: Callable[[Path, dict, int], dict]  # (file, config.json, layers) -> switches
    write: Callable[[dict], dict]  # the decoder's settings -> config.json's own keys
    can: Callable[[dict], str | None]  # why the settings' switches are not this family's


def _bias(file: Path, raw: dict, fixed: str | None = None) -> str:
    """`attn_bias` from `attention_bias` (a bool: the four projections), or the family's."""
    if fixed is not None:
        return fixed
    value = raw.get("attention_bias", False)
    if not isinstance(value, bool):
        raise errors.ConfigError(f"{file}: attention_bias={value!r}: must be true or false")
    return "all" if value else "none"


def _window(file: Path, raw: dict, layers: int, qwen: bool) -> int | None:
    """The one sliding window of every layer, or None (the module doc)."""
    if qwen:
        window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
        first = raw.get("max_window_layers", 28)
        kinds = raw.get("layer_types")
        if kinds is None:
            kinds = [SLIDING if window is not None and i >= first else FULL for i in range(layers)]
        if not isinstance(kinds, list) or len(kinds) != layers or {*kinds} - {SLIDING, FULL}:
            raise errors.ConfigError(
                f"{file}: layer_types={kinds!r}: a list of {layers} of {SLIDING!r}, {FULL!r}"
            )
        if len(set(kinds)) > 1:
            sliding = [i for i, kind in enumerate(kinds) if kind == SLIDING]
            raise errors.ConfigError(
                f"{file}: layer_types mixes sliding and full attention (layers {sliding[0]} to "
                f"{sliding[-1]} of {layers} slide): mptrain's decoder takes one kind for every "
                "layer"
            )
        window = raw.get("sliding_window") if kinds[0] == SLIDING else None
    else:
        window = raw.get("sliding_window", 4096)
    if window is None:
        return None
    try:
        return errors.check_integer("sliding_window", window, 1, errors.INT32_MAX)
    except ValueError as e:
        raise errors.ConfigError(f"{file}: {e}") from None


def _qwen_window_json(c: dict) -> dict:
    window, layers = c["sliding_window"], c["num_layers"]
    return {
        "use_sliding_window": window is not None,
        "sliding_window": window,
        "max_window_layers": 0 if window is not None else layers,
        "layer_types": [SLIDING if window is not None else FULL] * layers,
    }


def _unlike(c: dict, **want: Any) -> str | None:
    """The first switch of `c` that differs from `want` (a value, or a tuple of allowed ones)."""
    for key, allowed in want.items():
        allowed = allowed if isinstance(allowed, tuple) else (allowed,)
        if c[key] not in allowed:
            return f"model.{key}={c[key]!r}"
    return None


FAMILIES = {
    f.name: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            "llama",
            read=lambda file, raw, n: {"attn_bias": _bias(file, raw)},
            write=lambda c: {"attention_bias": c["attn_bias"] == "all", "mlp_bias": False},
            can=lambda c: _unlike(c, attn_bias=("none", "all"), qk_norm=False, sliding_window=None),
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            "mistral",
            read=lambda file, raw, n: {"sliding_window": _window(file, raw, n, qwen=False)},
            write=lambda c: {"sliding_window": c["sliding_window"]},
            can=lambda c: _unlike(c, attn_bias="none", qk_norm=False),
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            "qwen2",
            read=lambda file, raw, n: {
                "attn_bias": "qkv",
                "sliding_window": _window(file, raw, n, qwen=True),
            },
            write=_qwen_window_json,
            can=lambda c: _unlike(c, attn_bias="qkv", qk_norm=False),
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            "qwen3",
            read=lambda file, raw, n: {
                "attn_bias": _bias(file, raw),
                "qk_norm": True,
                "sliding_window": _window(file, raw, n, qwen=True),
            },
            write=lambda c: {"attention_bias": c["attn_bias"] == "all", **_qwen_window_json(c)},
            can=lambda c: _unlike(c, attn_bias=("none", "all"), qk_norm=True),
        ),
    )
}
ARCHITECTURES = {f.architecture: f for f in FAMILIES.values()}
MODEL_TYPES = {f.model_type: f for f in FAMILIES.values()}


def of_config(file: Path, raw: dict) -> Family:
    """The family a config.json names (its `architectures`, else its `model_type`); a
    `ConfigError` naming the file and what it names otherwise."""
    architectures = raw.get("architectures")
    if architectures is not None:
        found = [ARCHITECTURES[a] for a in architectures or () if a in ARCHITECTURES]
        if not found:
            raise errors.ConfigError(
                f"{file}: architectures={architectures!r}: mptrain.hf reads "
                f"{', '.join(ARCHITECTURES)}"
            )
        return found[0]
    if raw.get("model_type") not in MODEL_TYPES:
        raise errors.ConfigError(
            f"{file}: model_type={raw.get('model_type')!r} and no architectures: mptrain.hf "
            f"reads model_type {', '.join(map(repr, MODEL_TYPES))}"
        )
    return MODEL_TYPES[raw["model_type"]]


def check(c: dict) -> None:
    """A `ConfigError` where the decoder's settings `c` are not what `model.family` writes."""
    if why := FAMILIES[c["family"]].can(c):
        raise errors.ConfigError(
            f"{why}: a {FAMILIES[c['family']].architecture} has no such setting "
            f"(model.family={c['family']!r})"
        )
