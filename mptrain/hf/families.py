"""The families of HuggingFace causal LMs that mptrain's decoder reads and writes, as data: a
`Family` a folder's `architectures` (or `model_type`) names, which reads its config.json's own
keys into the decoder's switches (`mptrain.models.decoder.blocks`) and writes them back.

  * llama (LlamaForCausalLM): with `attention_bias`, the four attention projections biased;
  * mistral (MistralForCausalLM): `sliding_window` on every layer when set (4,096 if absent);
  * qwen2 (Qwen2ForCausalLM): q, k, v with bias, o without; a window by `use_sliding_window`;
  * qwen3 (Qwen3ForCausalLM): RMSNorm over each head's q and k before RoPE; `attention_bias`;
    the window as Qwen2's;
  * gemma2 (Gemma2ForCausalLM): RMSNorm by `1 + w`, four norms a block, embeddings times
    sqrt(hidden_size), scores scaled by `query_pre_attn_scalar ** -0.5` and soft-capped
    (`attn_logit_softcapping`), the logits too (`final_logit_softcapping`), a GELU (tanh) MLP,
    a window on alternate layers (`layer_types`);
  * gemma3 (Gemma3ForCausalLM, model_type gemma3_text): Gemma 2 with `1 + w` norms on each
    head's q and k, no soft-caps by default, five sliding layers to a global one (`layer_types`,
    or the older `sliding_window_pattern`), the sliding layers' RoPE base their own
    (`rope_local_base_freq`, or `rope_parameters.sliding_attention`), unscaled; a multimodal
    folder's text model too (`mptrain.hf.multimodal`);
  * olmo2 (Olmo2ForCausalLM): norms after the attention and after the MLP only, none before;
    q and k norms over the whole projection, before the split into heads;
  * smollm3 (SmolLM3ForCausalLM): no RoPE on the layers `no_rope_layers` marks 0 (every
    `no_rope_layer_interval`-th, 4th by default); tied embeddings by default;
  * phi3 (Phi3ForCausalLM): q, k, v fused in one `qkv_proj` and gate, up in `gate_up_proj`
    (split on load, fused again on export: `Family.fused`); `partial_rotary_factor`; a window
    on every layer when `sliding_window` is set; `longrope` (Phi-4-mini's RoPE); every
    family takes YaRN (`rope_type: "yarn"`: `config_file`);
  * qwen3_moe (Qwen3MoeForCausalLM) and mixtral (MixtralForCausalLM): Qwen3's and Mistral's
    attention with a mixture of experts' MLP (`mptrain.hf.experts`); qwen2_moe
    (Qwen2MoeForCausalLM) with a gated shared expert;
  * deepseek_v3 (DeepseekV3ForCausalLM: DeepSeek-V3 and R1, Kimi K2, Moonlight): multi-head
    latent attention (`blocks.LatentSpec`), RoPE in interleaved pairs, YaRN's mscale on the
    scores, and sigmoid routing with a correction bias and groups, shared experts, dense
    first layers (`mptrain.hf.experts`);
  * gpt_oss (GptOssForCausalLM): attention sinks, biases on q, k, v and o, sliding (128) and
    full layers in turn, YaRN; experts in every layer with a biased router, biased experts
    (fused and interleaved in the folder: `mptrain.hf.experts.GPT_OSS_NAMES`) and the
    clamped SwiGLU.
(What differs is read from transformers' `modeling_*.py` / `modular_*.py`.)

A window is read as transformers reads it: `layer_types` where given, else Qwen's
`use_sliding_window` with `sliding_window` on the layers from `max_window_layers` on, Gemma's
pattern. Layers that mix sliding and full attention are the decoder's `layer_types`. A key
whose value the decoder does not implement is refused, naming the file and the key, rather
than run as another model. The tensor names are `mptrain.hf`'s table.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mptrain import errors
from mptrain.hf import deepseek, experts
from mptrain.hf.family import Family, bias, checked, unlike
from mptrain.models.decoder import FULL, SLIDING

_PARTIAL = "partial_rotary_factor"  # Phi-3's part of a head that RoPE rotates


def _layers(file: Path, raw: dict, layers: int, default: list[str], window: Any) -> dict:
    """`sliding_window` and `layer_types` from `raw`'s `layer_types` (else `default`): one
    window for every layer where all slide, `layer_types` where they mix."""
    kinds = raw.get("layer_types")
    kinds = default if kinds is None else kinds
    if not isinstance(kinds, list) or len(kinds) != layers or {*kinds} - {SLIDING, FULL}:
        raise errors.ConfigError(
            f"{file}: layer_types={kinds!r}: a list of {layers} of {SLIDING!r}, {FULL!r}"
        )
    if SLIDING not in kinds:
        return {"sliding_window": None, "layer_types": None}
    if window is None:
        raise errors.ConfigError(
            f"{file}: layer_types has {SLIDING!r} layers but no sliding_window"
        )
    window = checked(file, "sliding_window", window, int)
    return {"sliding_window": window, "layer_types": None if FULL not in kinds else tuple(kinds)}


def _qwen(file: Path, raw: dict, layers: int) -> dict:
    window = raw.get("sliding_window") if raw.get("use_sliding_window") else None
    first = raw.get("max_window_layers", 28)
    default = [SLIDING if window is not None and i >= first else FULL for i in range(layers)]
    return _layers(file, raw, layers, default, raw.get("sliding_window"))


def _mistral(file: Path, raw: dict) -> dict:
    window = raw.get("sliding_window", 4096)
    return {
        "sliding_window": None if window is None else checked(file, "sliding_window", window, int)
    }


def _kinds(c: dict) -> list[str]:
    if c["layer_types"] is not None:
        return list(c["layer_types"])
    return [SLIDING if c["sliding_window"] is not None else FULL] * c["num_layers"]


def _qwen_window_json(c: dict) -> dict:
    kinds = _kinds(c)
    sliding = [i for i, kind in enumerate(kinds) if kind == SLIDING]
    return {
        "use_sliding_window": bool(sliding),
        "sliding_window": c["sliding_window"],
        "max_window_layers": sliding[0] if sliding else c["num_layers"],
        "layer_types": kinds,
    }


def _number(file: Path, raw: dict, key: str, default: Any) -> float | None:
    value = raw.get(key, default)
    return None if value is None else checked(file, key, value, float)


def _gemma(file: Path, raw: dict, layers: int, version: int) -> dict:
    if raw.get("use_bidirectional_attention"):
        raise errors.ConfigError(
            f"{file}: use_bidirectional_attention=true: an encoder (EmbeddingGemma); mptrain's "
            "decoder is causal"
        )
    every = raw.get("sliding_window_pattern", 2 if version == 2 else 6)
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise errors.ConfigError(f"{file}: sliding_window_pattern={every!r}: a positive integer")
    default = [SLIDING if (i + 1) % every else FULL for i in range(layers)]
    caps = (50.0, 30.0) if version == 2 else (None, None)
    return {
        "attn_bias": bias(file, raw),
        "qk_norm": version == 3,
        "norm_plus_one": True,
        "post_norms": True,
        "embed_scale": True,
        "mlp_act": "gelu_tanh",
        "query_pre_attn_scalar": _number(file, raw, "query_pre_attn_scalar", 256),
        "attn_softcap": _number(file, raw, "attn_logit_softcapping", caps[0]),
        "final_softcap": _number(file, raw, "final_logit_softcapping", caps[1]),
        **_layers(file, raw, layers, default, raw.get("sliding_window", 4096)),
    }


def _gemma_json(c: dict, version: int) -> dict:
    scalar = c["query_pre_attn_scalar"] or c["head_dim"]  # an int where whole: transformers'
    out = {
        "attention_bias": c["attn_bias"] == "all",
        "hidden_activation": "gelu_pytorch_tanh",
        "hidden_act": "gelu_pytorch_tanh",
        "query_pre_attn_scalar": int(scalar) if float(scalar).is_integer() else scalar,
        "attn_logit_softcapping": c["attn_softcap"],
        "final_logit_softcapping": c["final_softcap"],
        "sliding_window": c["sliding_window"] or 4096,
        "layer_types": _kinds(c),
    }
    if version == 3:
        out["rope_local_base_freq"] = float(c["rope_local_theta"] or c["rope_theta"])
    return out


def _phi3(file: Path, raw: dict) -> dict:
    """Phi-3's window (every layer, none by default) and the part of a head RoPE rotates (at
    the top in 4.x's form, inside `rope_parameters` in 5.x's)."""
    rope = raw.get("rope_parameters") if isinstance(raw.get("rope_parameters"), dict) else {}
    factor = checked(file, _PARTIAL, rope.get(_PARTIAL, raw.get(_PARTIAL, 1.0)), float)
    window = raw.get("sliding_window")
    window = None if window is None else checked(file, "sliding_window", window, int)
    return {"sliding_window": window, _PARTIAL: factor}


def _smollm3(file: Path, raw: dict, layers: int) -> dict:
    every = raw.get("no_rope_layer_interval", 4)
    marks = raw.get("no_rope_layers")  # 1: the layer takes RoPE, 0: it does not
    if marks is None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise errors.ConfigError(f"{file}: no_rope_layer_interval={every!r}: a positive int")
        marks = [int((i + 1) % every != 0) for i in range(layers)]
    if not isinstance(marks, list) or len(marks) != layers or {*marks} - {0, 1}:
        raise errors.ConfigError(f"{file}: no_rope_layers={marks!r}: a list of {layers} of 1, 0")
    window = {"sliding_window": None, "layer_types": None}
    if raw.get("use_sliding_window"):
        default = [SLIDING if not rope else FULL for rope in marks]
        window = _layers(file, raw, layers, default, raw.get("sliding_window"))
    nope = tuple(i for i, rope in enumerate(marks) if not rope)
    return {"attn_bias": bias(file, raw), "nope_layers": nope or None, **window}


def _smollm3_json(c: dict) -> dict:
    nope, kinds = set(c["nope_layers"] or ()), _kinds(c)
    return {
        "attention_bias": c["attn_bias"] == "all",
        "mlp_bias": False,
        "no_rope_layers": [int(i not in nope) for i in range(c["num_layers"])],
        "use_sliding_window": SLIDING in kinds,
        "sliding_window": c["sliding_window"],
        "layer_types": kinds,
    }


# The decoder's switches as a family that is not Gemma has them
_PLAIN = {
    "norm_plus_one": False,
    "post_norms": False,
    "embed_scale": False,
    "mlp_act": "silu",
    "query_pre_attn_scalar": None,
    "attn_softcap": None,
    "final_softcap": None,
    "rope_local_theta": None,
    **{"pre_norms": True, "qk_norm_width": False, "nope_layers": None, _PARTIAL: 1.0},
}
_NOT_SCALED = {k: v for k, v in _PLAIN.items() if k != "query_pre_attn_scalar"}  # DeepSeek's
_NOT_NOPE = {k: v for k, v in _PLAIN.items() if k != "nope_layers"}  # SmolLM3's NoPE layers
_NOT_PARTIAL = {k: v for k, v in _PLAIN.items() if k != _PARTIAL}  # Phi-3's partial RoPE
_GEMMA = {"norm_plus_one": True, "post_norms": True, "embed_scale": True, "mlp_act": "gelu_tanh"}
# transformers' defaults of the Gemma configs where they are not the Llama's
_GEMMA_DEFAULTS = (("head_dim", 256), ("rms_norm_eps", 1e-6), ("tie_word_embeddings", True))
# Gemma3TextConfig's: a multimodal folder's text_config often gives only what differs from them
_GEMMA3_DEFAULTS = (
    *{"vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216}.items(),
    *{"num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4}.items(),
    *{"max_position_embeddings": 131_072, "rope_theta": 1e6}.items(),
    ("rope_local_base_freq", 10_000.0),
)


FAMILIES = {
    f.name: f
    for f in (
        Family(
            "llama",
            "LlamaForCausalLM",
            "llama",
            read=lambda file, raw, n: {"attn_bias": bias(file, raw)},
            write=lambda c: {"attention_bias": c["attn_bias"] == "all", "mlp_bias": False},
            can=lambda c: unlike(
                c, attn_bias=("none", "all"), qk_norm=False, sliding_window=None, **_PLAIN
            ),
        ),
        Family(
            "mistral",
            "MistralForCausalLM",
            "mistral",
            read=lambda file, raw, n: _mistral(file, raw),
            write=lambda c: {"sliding_window": c["sliding_window"]},
            can=lambda c: unlike(c, attn_bias="none", qk_norm=False, layer_types=None, **_PLAIN),
        ),
        Family(
            "qwen2",
            "Qwen2ForCausalLM",
            "qwen2",
            read=lambda file, raw, n: {"attn_bias": "qkv", **_qwen(file, raw, n)},
            write=_qwen_window_json,
            can=lambda c: unlike(c, attn_bias="qkv", qk_norm=False, **_PLAIN),
        ),
        Family(
            "qwen3",
            "Qwen3ForCausalLM",
            "qwen3",
            read=lambda file, raw, n: {
                "attn_bias": bias(file, raw),
                "qk_norm": True,
                **_qwen(file, raw, n),
            },
            write=lambda c: {"attention_bias": c["attn_bias"] == "all", **_qwen_window_json(c)},
            can=lambda c: unlike(c, attn_bias=("none", "all"), qk_norm=True, **_PLAIN),
            defaults=(("head_dim", 128),),
        ),
        Family(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "qwen3_moe",
            read=lambda file, raw, n: {
                "attn_bias": bias(file, raw),
                "qk_norm": True,
                **_qwen(file, raw, n),
            },
            write=lambda c: {
                "attention_bias": c["attn_bias"] == "all",
                **_qwen_window_json(c),
            },
            can=lambda c: unlike(c, attn_bias=("none", "all"), qk_norm=True, **_PLAIN),
            experts=experts.QWEN3_MOE,
        ),
        Family(
            "qwen2_moe",
            "Qwen2MoeForCausalLM",
            "qwen2_moe",
            read=lambda file, raw, n: {
                "attn_bias": "qkv"
                if checked(file, "qkv_bias", raw.get("qkv_bias", True), bool)
                else "none",
                **_qwen(file, raw, n),
            },
            write=lambda c: {
                "qkv_bias": c["attn_bias"] == "qkv",
                **_qwen_window_json(c),
            },
            can=lambda c: unlike(c, attn_bias=("none", "qkv"), qk_norm=False, **_PLAIN),
            experts=experts.QWEN2_MOE,
        ),
        Family(
            "deepseek_v3",
            "DeepseekV3ForCausalLM",
            "deepseek_v3",
            read=lambda file, raw, n: deepseek.read(file, raw, n),
            write=deepseek.write,
            can=lambda c: deepseek.can(
                c,
                unlike(
                    c, attn_bias=("none", "all"), qk_norm=False, sliding_window=None, **_NOT_SCALED
                ),
            ),
            defaults=(("max_position_embeddings", 4096),),
            experts=experts.DEEPSEEK_V3,
            latent=True,
            unread_layers="DeepSeek's multi-token prediction",
        ),
        Family(
            "gpt_oss",
            "GptOssForCausalLM",
            "gpt_oss",
            read=lambda file, raw, n: {
                "attn_bias": bias(file, {"attention_bias": True, **raw}),
                "attn_sinks": True,
                **_layers(
                    file,
                    raw,
                    n,
                    [SLIDING if (i + 1) % 2 else FULL for i in range(n)],
                    raw.get("sliding_window", 128),
                ),
            },
            write=lambda c: {
                "attention_bias": c["attn_bias"] == "all",
                "sliding_window": c["sliding_window"],
                "layer_types": _kinds(c),
            },
            can=lambda c: unlike(c, attn_bias=("none", "all"), qk_norm=False, **_PLAIN),
            defaults=(
                ("head_dim", 64),
                ("rms_norm_eps", 1e-5),
                ("max_position_embeddings", 131072),
            ),
            experts=experts.GPT_OSS,
            sinks=True,
        ),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            "mixtral",
            # no window unless given, as MixtralConfig has it
            read=lambda file, raw, n: _mistral(file, {"sliding_window": None, **raw}),
            write=lambda c: {"sliding_window": c["sliding_window"]},
            can=lambda c: unlike(c, attn_bias="none", qk_norm=False, layer_types=None, **_PLAIN),
            experts=experts.MIXTRAL,
        ),
        Family(
            "olmo2",
            "Olmo2ForCausalLM",
            "olmo2",
            read=lambda file, raw, n: {
                "attn_bias": bias(file, raw),
                "qk_norm": True,
                "qk_norm_width": True,
                "pre_norms": False,
                "post_norms": True,
            },
            write=lambda c: {"attention_bias": c["attn_bias"] == "all"},
            can=lambda c: unlike(
                c,
                attn_bias=("none", "all"),
                sliding_window=None,
                **{**_PLAIN, "qk_norm_width": True, "pre_norms": False, "post_norms": True},
            ),
            defaults=(("rms_norm_eps", 1e-5),),
        ),
        Family(
            "smollm3",
            "SmolLM3ForCausalLM",
            "smollm3",
            read=lambda file, raw, n: _smollm3(file, raw, n),
            write=_smollm3_json,
            can=lambda c: unlike(c, attn_bias=("none", "all"), qk_norm=False, **_NOT_NOPE),
            defaults=(("tie_word_embeddings", True),),
        ),
        Family(
            "phi3",
            "Phi3ForCausalLM",
            "phi3",
            read=lambda file, raw, n: _phi3(file, raw),
            write=lambda c: {
                "sliding_window": c["sliding_window"],
                "partial_rotary_factor": c["partial_rotary_factor"],
            },
            can=lambda c: unlike(
                c, attn_bias="none", qk_norm=False, layer_types=None, **_NOT_PARTIAL
            ),
            defaults=(("rms_norm_eps", 1e-5),),
            fused=(
                (("attn", "self_attn.qkv_proj"), ("q", "k", "v")),
                (("mlp", "mlp.gate_up_proj"), ("gate", "up")),
            ),
        ),
        Family(
            "gemma2",
            "Gemma2ForCausalLM",
            "gemma2",
            read=lambda file, raw, n: _gemma(file, raw, n, 2),
            write=lambda c: _gemma_json(c, 2),
            can=lambda c: unlike(
                c, attn_bias=("none", "all"), qk_norm=False, rope_local_theta=None, **_GEMMA
            ),
            defaults=(*_GEMMA_DEFAULTS, ("max_position_embeddings", 8192)),
        ),
        Family(
            "gemma3",
            "Gemma3ForCausalLM",
            "gemma3_text",
            read=lambda file, raw, n: _gemma(file, raw, n, 3),
            write=lambda c: _gemma_json(c, 3),
            can=lambda c: unlike(c, attn_bias=("none", "all"), qk_norm=True, **_GEMMA),
            defaults=(*_GEMMA_DEFAULTS, *_GEMMA3_DEFAULTS),
        ),
    )
}
ARCHITECTURES = {f.architecture: f for f in FAMILIES.values()}
MODEL_TYPES = {f.model_type: f for f in FAMILIES.values()}


# Folders that hold one of these families' decoders inside a larger model: named, not read
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
    family = FAMILIES[c["family"]]
    moe = family.experts.unlike(c) if family.experts else experts.plain(c, experts=False)
    why = family.can(c) or moe
    if why is None and (c["kv_lora_rank"] is not None) != family.latent:
        why = f"model.kv_lora_rank={c['kv_lora_rank']!r}"
    if why is None and c["rope_interleave"] != family.latent:
        why = f"model.rope_interleave={c['rope_interleave']!r}"
    if why is None and c["attn_sinks"] != family.sinks:  # gpt-oss's
        why = f"model.attn_sinks={c['attn_sinks']!r}"
    if why:
        raise errors.ConfigError(
            f"{why}: a {family.architecture} has no such setting (model.family={c['family']!r})"
        )
