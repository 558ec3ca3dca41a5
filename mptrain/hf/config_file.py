"""A folder's config.json, both ways: `read_model_config` reads either of transformers' forms
(4.x's `rope_theta` and `rope_scaling`, 5.x's `rope_parameters`) into the decoder's
`config.model` keys, with the family's own keys (`mptrain.hf.families`); `config_json` writes
the 4.x form, which transformers 4.x and 5.x both load."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from mptrain import errors
from mptrain.hf import families, multimodal
from mptrain.hf.tensors import read_json
from mptrain.models import decoder

FULL, SLIDING = families.FULL, families.SLIDING
_ROPE_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def read_model_config(file: Path) -> dict[str, Any]:
    """`mptrain.hf.read_config`'s dict from the config.json `file` (the doc is there)."""
    raw = multimodal.text(file, read_json(file))  # a multimodal folder's: its text model's
    family = families.of_config(file, raw)
    gemma = family.name.startswith("gemma")
    # the MLP's activation: SiLU, or Gemma's GELU (tanh), which it names hidden_activation
    act = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
    for key, fine in (act, ("mlp_bias", False)):
        if raw.get(key, fine) not in (fine, None):
            raise errors.ConfigError(
                f"{file}: {key}={raw[key]!r}: mptrain's decoder has {key}={fine!r} only"
            )
    defaults = dict(family.defaults)
    raw = {**defaults, **raw}  # keys it leaves out, as transformers' config class has them

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        """`raw[key]`, else `default` (transformers' own; None: the key is required)."""
        default = defaults.get(key, default)
        value = default if raw.get(key) is None else raw[key]
        if value is None:
            raise errors.ConfigError(
                f"{file}: no {key!r}, which a {family.architecture}'s config.json must give"
            )
        return families.checked(file, key, value, kind)

    hidden, heads, layers = get("hidden_size"), get("num_attention_heads"), get("num_hidden_layers")
    theta, scaling, local = _rope(file, raw, gemma)
    return {
        "name": decoder.RECORD.name,
        "family": family.name,
        "vocab_size": get("vocab_size"),
        "d_model": hidden,
        "num_layers": layers,
        "num_heads": heads,
        "num_kv_heads": get("num_key_value_heads", heads),
        "head_dim": get("head_dim", hidden // heads),
        "d_ff": get("intermediate_size"),
        "max_len": get("max_position_embeddings", 2048),
        "rope_theta": families.checked(file, "rope_theta", theta, float),
        "rope_scaling": scaling,
        "norm_eps": get("rms_norm_eps", 1e-6, float),
        "tie_embeddings": get("tie_word_embeddings", False, bool),
        "attn_bias": "none",
        "qk_norm": False,
        "sliding_window": None,
        "layer_types": None,
        "rope_local_theta": local and families.checked(file, "rope_local_base_freq", local, float),
        **dict.fromkeys(("query_pre_attn_scalar", "attn_softcap", "final_softcap")),
        **dict.fromkeys(("norm_plus_one", "post_norms", "embed_scale", "qk_norm_width"), False),
        "pre_norms": True,
        "nope_layers": None,
        "mlp_act": "silu",
        "token_ids": _token_ids(raw),
        "partial_rotary_factor": 1.0,
        **family.read(file, raw, layers),
        **(family.experts.read(file, raw, layers) if family.experts else {}),
    }


def _token_ids(raw: dict) -> tuple | None:
    """config.json's (pad, bos, eos) ids, an eos list as a tuple; None where none is given."""
    ids = [raw.get(f"{k}_token_id") for k in ("pad", "bos", "eos")]
    ids = [tuple(i) if isinstance(i, list) else i for i in ids]
    return None if ids == [None] * 3 else tuple(ids)


def _rope(file: Path, raw: dict, gemma: bool = False) -> tuple[float, tuple | None, Any]:
    """`(rope_theta, rope_scaling, the sliding layers' base or None)` from either form of
    config.json: Gemma 3 gives the sliding layers a base of their own (`rope_local_base_freq`,
    or 5.x's `rope_parameters` per layer type), unscaled."""
    rope, local = raw.get("rope_parameters"), raw.get("rope_local_base_freq")
    if gemma and isinstance(rope, dict) and {FULL, SLIDING} & set(rope):
        for kind in (FULL, SLIDING):
            if not isinstance(rope.get(kind, {}), dict):
                raise errors.ConfigError(f"{file}: rope_parameters.{kind}: an object expected")
        local_rope = rope.get(SLIDING, {})
        theta, scaling = _rope_of(file, f"rope_parameters.{SLIDING}", local_rope, raw)
        if scaling is not None:
            raise errors.ConfigError(
                f"{file}: rope_parameters.{SLIDING}.rope_type={local_rope.get('rope_type')!r}: "
                "mptrain's sliding layers take RoPE type 'default' only"
            )
        return (*_rope_of(file, f"rope_parameters.{FULL}", rope.get(FULL, {}), raw), theta)
    if rope is not None:  # transformers 5.x: rope_theta inside
        return (*_rope_of(file, "rope_parameters", rope, raw), local)
    return (*_rope_of(file, "rope_scaling", raw.get("rope_scaling") or {}, raw, apart=True), local)


def _rope_of(file: Path, key: str, rope: Any, raw: dict, apart: bool = False) -> tuple:
    """`(rope_theta, rope_scaling)` of one RoPE object `rope` (config.json's `key`); `apart`:
    4.x's form, rope_theta beside it."""
    if not isinstance(rope, dict):
        raise errors.ConfigError(f"{file}: {key}={rope!r}: an object expected")
    theta = None if apart else rope.get("rope_theta")
    theta = raw.get("rope_theta", 10_000.0) if theta is None else theta
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return theta, None
    if kind == "linear":
        return theta, ("linear", families.checked(file, f"{key}.factor", rope.get("factor"), float))
    if kind in ("longrope", "su"):  # Phi-3's ("su" its older name)
        return theta, _longrope(file, key, rope, raw)
    if kind == "yarn":
        return theta, _yarn(file, key, rope, raw)
    if kind == "dynamic":
        raise errors.ConfigError(
            f"{file}: {key}.rope_type='dynamic': not implemented; its frequencies change with "
            "the length decoded, so a token's logits would depend on how far decoding has gone"
        )
    if kind != "llama3":
        raise errors.ConfigError(
            f"{file}: {key}.rope_type={kind!r}: not implemented; mptrain's decoder has RoPE "
            "types 'default', 'linear', 'llama3', 'longrope' and 'yarn'"
        )
    missing = [k for k in _ROPE_KEYS if rope.get(k) is None]
    if missing:
        raise errors.ConfigError(f"{file}: no {key}.{missing[0]}, which rope_type 'llama3' needs")
    kinds = (float, float, float, int)
    factor, low, high, original = (
        families.checked(file, f"{key}.{k}", rope[k], kind)
        for k, kind in zip(_ROPE_KEYS, kinds, strict=True)
    )
    return theta, (factor, low, high, original)


def _longrope(file: Path, key: str, rope: dict, raw: dict) -> tuple:
    """`("longrope", short, long, original_max_len, attention_factor)` as transformers computes
    them: the attention factor, where not given, sqrt(1 + ln(factor) / ln(original)), the
    factor, where not given, max_position_embeddings / original."""
    factors = []
    for name in ("short_factor", "long_factor"):
        value = rope.get(name)
        if not isinstance(value, list) or not value:
            raise errors.ConfigError(f"{file}: {key}.{name}={value!r}: a list of numbers")
        factors.append(tuple(families.checked(file, f"{key}.{name}", f, float) for f in value))
    original = rope.get(
        "original_max_position_embeddings", raw.get("original_max_position_embeddings")
    )
    if original is None:
        raise errors.ConfigError(
            f"{file}: no original_max_position_embeddings, which longrope needs"
        )
    original = families.checked(file, "original_max_position_embeddings", original, int)
    factor = rope.get("factor") or raw.get("max_position_embeddings", original) / original
    scale = rope.get("attention_factor")
    if scale is None:
        scale = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return (
        "longrope",
        *factors,
        original,
        families.checked(file, f"{key}.attention_factor", scale, float),
    )


def _yarn(file: Path, key: str, rope: dict, raw: dict) -> tuple:
    """`("yarn", factor, original_max_len, beta_fast, beta_slow, attention_factor, truncate)` as
    transformers computes them: the factor, where not given, max_position_embeddings /
    original; the attention factor, where not given, 0.1 ln(factor) + 1 (DeepSeek's `mscale`
    and `mscale_all_dim`: the ratio of two such, each times its mscale); beta_fast 32 and
    beta_slow 1 where not given (or 0)."""
    # a key of that name beside the RoPE object wins over the object's own, as in transformers
    original = raw.get("original_max_position_embeddings")
    original = original or rope.get("original_max_position_embeddings")
    original = original or raw.get("max_position_embeddings")
    if original is None:
        raise errors.ConfigError(f"{file}: no {key}.original_max_position_embeddings for yarn")
    original = families.checked(file, f"{key}.original_max_position_embeddings", original, int)
    factor = rope.get("factor")
    factor = raw.get("max_position_embeddings", original) / original if factor is None else factor
    factor = families.checked(file, f"{key}.factor", factor, float)
    mscale = lambda m: 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0
    scale, m, m_all = rope.get("attention_factor"), rope.get("mscale"), rope.get("mscale_all_dim")
    if scale is None:
        scale = mscale(m) / mscale(m_all) if m and m_all else mscale(1)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise errors.ConfigError(f"{file}: {key}.truncate={truncate!r}: true or false expected")
    fast, slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
    return (
        "yarn",
        factor,
        original,
        families.checked(file, f"{key}.beta_fast", fast, float),
        families.checked(file, f"{key}.beta_slow", slow, float),
        families.checked(file, f"{key}.attention_factor", scale, float),
        truncate,
    )


def config_json(c: dict[str, Any], dtype: str) -> dict[str, Any]:
    """config.json's content, transformers 4.x's form, for the decoder's checked settings `c`,
    as its family (`model.family`) writes it."""
    family = families.FAMILIES[c["family"]]
    scaling = c["rope_scaling"]
    rope = None
    if scaling is not None and scaling[0] == "linear":
        rope = {"rope_type": "linear", "factor": float(scaling[1])}
    elif scaling is not None and scaling[0] == "yarn":
        keys = ("factor", "original_max_position_embeddings", "beta_fast", "beta_slow")
        rope = {"rope_type": "yarn", **dict(zip(keys, scaling[1:5], strict=True))}
        rope |= {"attention_factor": scaling[5], "truncate": scaling[6]}
        if c["kv_lora_rank"] is not None and c["query_pre_attn_scalar"]:  # DeepSeek's scores'
            mscale = (c["head_dim"] / c["query_pre_attn_scalar"]) ** 0.25  # scale, as it reads
            rope["mscale_all_dim"] = (mscale - 1) / (0.1 * math.log(scaling[1]))
    elif scaling is not None and scaling[0] == "longrope":
        _, short, long, original, scale = scaling
        rope = {"rope_type": "longrope", "short_factor": list(short), "long_factor": list(long)}
        rope |= {"original_max_position_embeddings": original, "attention_factor": scale}
    elif scaling is not None:
        rope = {"rope_type": "llama3", **dict(zip(_ROPE_KEYS, scaling, strict=True))}
    return {
        "architectures": [family.architecture],
        "model_type": family.model_type,
        "vocab_size": c["vocab_size"],
        "hidden_size": c["d_model"],
        "intermediate_size": c["d_ff"],
        "num_hidden_layers": c["num_layers"],
        "num_attention_heads": c["num_heads"],
        "num_key_value_heads": c["num_kv_heads"],
        "head_dim": c["head_dim"],
        "max_position_embeddings": c["max_len"],
        "rms_norm_eps": float(c["norm_eps"]),
        "rope_theta": float(c["rope_theta"]),
        "rope_scaling": rope,
        # Phi-3's config takes the longrope switch from its own key, over rope_scaling's
        **(
            {"original_max_position_embeddings": rope["original_max_position_embeddings"]}
            if rope and rope["rope_type"] == "longrope"
            else {}
        ),
        "tie_word_embeddings": c["tie_embeddings"],
        **{
            f"{k}_token_id": list(i) if isinstance(i, tuple) else i
            for k, i in zip(("pad", "bos", "eos"), c["token_ids"] or (), strict=False)
        },
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        **family.write(c),
        **(family.experts.write(c) if family.experts else {}),
        "torch_dtype": dtype,
        "dtype": dtype,
    }
