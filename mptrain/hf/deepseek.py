"""DeepSeek-V3's attention in a folder's config.json, both ways (`mptrain.hf.families`'
deepseek_v3; its experts are `mptrain.hf.experts`'): multi-head latent attention's sizes, RoPE
in interleaved pairs, and YaRN's mscale on the scores, read from transformers'
`configuration_deepseek_v3.py` and `modeling_deepseek_v3.py` (5.25)."""

from __future__ import annotations

import math
from pathlib import Path

from mptrain import errors
from mptrain.hf.family import bias, checked


def read(file: Path, raw: dict, layers: int) -> dict:
    """DeepSeek-V3's multi-head latent attention (transformers' `DeepseekV3Attention`, its
    defaults where a key is absent; its experts: `experts.DEEPSEEK_V3`): q and k heads of
    `qk_nope_head_dim + qk_rope_head_dim`, RoPE on the last part in interleaved pairs
    (`rope_interleave`), v of `v_head_dim`; under YaRN with `mscale_all_dim` the scores'
    scale `head ** -0.5` times its mscale squared (`query_pre_attn_scalar`: `head / mscale ** 4`).
    config.json's `head_dim` (transformers sets it to `qk_rope_head_dim`) is not read."""
    size = lambda key, default: checked(file, key, raw.get(key, default), int)
    nope, rope = size("qk_nope_head_dim", 128), size("qk_rope_head_dim", 64)
    q_rank = raw.get("q_lora_rank", 1536)
    interleave = checked(file, "rope_interleave", raw.get("rope_interleave", True), bool)
    heads = size("num_attention_heads", 128)
    if raw.get("num_key_value_heads") not in (None, heads):
        raise errors.ConfigError(
            f"{file}: num_key_value_heads={raw['num_key_value_heads']!r}: latent attention "
            f"expands k and v for each of the {heads} heads (num_attention_heads)"
        )
    parameters = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = parameters.get("rope_type", parameters.get("type", "default"))
    scalar, factor = None, parameters.get("factor") or 1.0
    if kind not in ("default", None) and parameters.get("mscale_all_dim") and factor > 1:
        mscale = 0.1 * float(parameters["mscale_all_dim"]) * math.log(factor) + 1.0
        scalar = (nope + rope) / mscale**4  # scale (nope + rope) ** -0.5 * mscale ** 2
    return {
        "head_dim": nope + rope,
        "num_kv_heads": heads,
        "kv_lora_rank": size("kv_lora_rank", 512),
        "q_lora_rank": None if q_rank is None else checked(file, "q_lora_rank", q_rank, int),
        "qk_rope_head_dim": rope,
        "v_head_dim": size("v_head_dim", 128),
        "rope_interleave": interleave,
        "attn_bias": bias(file, raw),
        "query_pre_attn_scalar": scalar,
    }


def write(c: dict) -> dict:
    return {
        "kv_lora_rank": c["kv_lora_rank"],
        "q_lora_rank": c["q_lora_rank"],
        "qk_rope_head_dim": c["qk_rope_head_dim"],
        "qk_nope_head_dim": c["head_dim"] - c["qk_rope_head_dim"],
        "v_head_dim": c["v_head_dim"],
        "head_dim": c["qk_rope_head_dim"],  # as transformers' DeepseekV3Config sets it
        "rope_interleave": c["rope_interleave"],
        "attention_bias": c["attn_bias"] == "all",
    }


def can(c: dict, why: str | None) -> str | None:
    """`why` (the switches a DeepSeek-V3 has not, `families`' check), or why the scores' scale
    is not one its config.json can say."""
    scalar = c["query_pre_attn_scalar"]
    if why is None and scalar is not None and (c["rope_scaling"] or ("",))[0] != "yarn":
        why = f"model.query_pre_attn_scalar={scalar!r} (DeepSeek scales by YaRN's mscale only)"
    return why
