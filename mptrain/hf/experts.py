"""The mixture-of-experts families' config.json keys and tensor names, both ways: one `Experts`
record a family (`Family.experts` in `mptrain.hf.families`), read from transformers'
`configuration_*.py` and `modeling_*.py` (5.24; DeepSeek-V3's 5.25):

  * Qwen3-MoE (Qwen3MoeForCausalLM): Qwen3's attention; `num_experts` (5.x writes it as
    `num_local_experts`) experts of `moe_intermediate_size`, `num_experts_per_tok` a token,
    their weights renormalised where `norm_topk_prob` (transformers' default: false; Qwen3's
    published checkpoints: true); the layers in `mlp_only_layers`, and those off every
    `decoder_sparse_step`-th, keep a dense MLP of `intermediate_size`. Tensors under
    `mlp.`: the router `gate.weight` `[E, D]`, each expert's `experts.j.{gate,up,down}_proj`;
  * Qwen2-MoE (Qwen2MoeForCausalLM: Qwen1.5-MoE, Qwen2-57B-A14B): Qwen2's attention (q, k, v
    biases where `qkv_bias`, its default) and Qwen3-MoE's routing and names, with a shared
    expert of `shared_expert_intermediate_size` every token takes (`mlp.shared_expert.*`),
    its output times the sigmoid of `mlp.shared_expert_gate.weight` `[1, D]`;
  * DeepSeek-V3 (DeepseekV3ForCausalLM): latent attention (`mptrain.hf.families`) and its own
    routing (`_deepseek`): sigmoid scores, a correction bias that chooses (the tensor
    `mlp.gate.e_score_correction_bias`), groups, a routed scale, shared experts
    (`mlp.shared_experts.*`), dense first layers; the experts' names Qwen's;
  * gpt-oss (GptOssForCausalLM): every layer's experts in one tensor each (gate and up
    interleaved in `gate_up_proj`, biases beside: `GPT_OSS_NAMES`), a biased router, the
    clamped SwiGLU; as gpt-oss ships them, in MXFP4 (`*_blocks`, `*_scales`), dequantised as
    they are read (`mptrain.hf.tensors`);
  * Mixtral (MixtralForCausalLM): Mistral's attention; `num_local_experts` experts of
    `intermediate_size`, `num_experts_per_tok` a token, always renormalised; tensors under
    `block_sparse_moe.`: `gate.weight`, each expert's `experts.j.w1` (gate), `w3` (up), `w2`
    (down).

Both weight the load-balancing loss by `router_aux_loss_coef` (0.001). transformers adds it to
the loss only with `output_router_logits`; mptrain always does (0 turns it off), as a run
that trains the router needs it. Keys of routings mptrain does not build are refused by name
(`UNBUILT`), as is Mixtral's `router_jitter_noise`: one line each, not a model that runs and
routes otherwise than its checkpoint was trained to.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mptrain import errors
from mptrain.hf.family import checked, unlike

# Keys of other routings (shared experts, group-limited top-k: DeepSeek's, Qwen2-MoE's, ...)
UNBUILT = {
    "shared_expert_intermediate_size": "shared experts",
    "n_shared_experts": "shared experts",
    "num_shared_experts": "shared experts",
    "n_group": "group-limited routing",
    "topk_group": "group-limited routing",
}
SHARED = ("shared_expert_intermediate_size",)  # Qwen2-MoE's shared expert (and its gate)
# a softmax over the router's logits, top-k of all experts, no bias, no scale
SOFTMAX = {"router_scoring": "softmax", "router_bias": False, "router_groups": 1,
           "router_groups_per_token": 1, "routed_scale": 1.0}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Experts:
    """How a family's checkpoints give and store their experts."""

    read: Callable[[Path, dict, int], dict]  # (file, config.json, layers) -> the decoder's keys
    write: Callable[[dict], dict]  # the decoder's checked settings -> config.json's keys
    # {param path under a layer: (HF name under the layer, transposed?[, (offset, parts)])};
    # an expert's name holds `{}` where the expert's number goes
    names: dict
    unlike: Callable[[dict], str | None]  # why the settings' experts are not this family's


def _names(module: str, parts: tuple, shared: str | None = None, gated: bool = False,
           bias: bool = False) -> dict:  # fmt: skip
    """An expert layer's names where each expert is tensors of its own: the router
    `{module}.gate`, the experts' gate, up and down `parts`, the `shared` expert's module (and
    the sigmoid gate that weighs it, `gated`), the routing `bias`."""
    names = {("moe", "router"): (f"{module}.gate.weight", True)}
    for param, part in zip(("gate", "up", "down"), parts, strict=True):
        names[("moe", param)] = (f"{module}.experts.{{}}.{part}.weight", True)
        if shared:
            names[("moe", f"shared_{param}")] = (f"{module}.{shared}.{part}.weight", True)
    if gated:
        names[("moe", "shared_expert_gate")] = (f"{module}.shared_expert_gate.weight", True)
    if bias:  # DeepSeek's routing bias (`moe.Routing`), kept in fp32 as it is
        names[("moe", "router_bias")] = (f"{module}.gate.e_score_correction_bias", False)
    return names


def _read(file: Path, raw: dict, layers: int, family: str, shared: bool = False,
          mixtral: bool = False) -> dict:  # fmt: skip
    """Qwen3-MoE's and Qwen2-MoE's keys (`shared`: Qwen2's gated shared expert), or with
    `mixtral` Mixtral's (its experts `intermediate_size` wide, always renormalised, in every
    layer); `family` names the architecture in a message."""
    for key, what in UNBUILT.items():
        harmless = (None, 0, 1) if what.startswith("group") else (None, 0)  # 1 group: none
        if raw.get(key) not in harmless and not (shared and key in SHARED):
            raise errors.ConfigError(
                f"{file}: {key}={raw[key]!r}: {what} is not built in mptrain's mixture of experts"
            )
    if raw.get("router_jitter_noise") not in (None, 0, 0.0):
        raise errors.ConfigError(
            f"{file}: router_jitter_noise={raw['router_jitter_noise']!r}: noise on the router's "
            "input in training is not built; set it to 0"
        )
    get = lambda key, default=None: raw.get(key) if raw.get(key) is not None else default
    experts_key = "num_local_experts" if get("num_local_experts") is not None else "num_experts"
    experts = get(experts_key)
    d_ff_key = "intermediate_size" if mixtral else "moe_intermediate_size"
    d_ff = get(d_ff_key)
    for key, value in (("num_experts", experts), ("expert d_ff", d_ff)):
        if value is None:
            raise errors.ConfigError(f"{file}: no {key}, which a {family} config.json must give")
    out = {
        "num_experts": checked(file, experts_key, experts, int),  # the file's own key
        "experts_per_token": checked(
            file, "num_experts_per_tok", get("num_experts_per_tok", 2), int
        ),
        "expert_d_ff": checked(file, d_ff_key, d_ff, int),
        # as they are: the decoder's own rules check them (`moe.check`), naming this file
        "norm_topk_prob": True if mixtral else get("norm_topk_prob", False),
        "router_aux_loss_coef": get("router_aux_loss_coef", 0.001),
        "dense_layers": None,
    }
    if shared:  # transformers' default width, and always gated
        width = get("shared_expert_intermediate_size", 5632)
        out["shared_expert_d_ff"] = checked(file, "shared_expert_intermediate_size", width, int)
        out["shared_expert_gate"] = True
    if not mixtral:  # transformers' rule: a layer is sparse where neither key keeps it dense
        only = get("mlp_only_layers", [])
        step = checked(file, "decoder_sparse_step", get("decoder_sparse_step", 1), int)
        if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
            raise errors.ConfigError(f"{file}: mlp_only_layers={only!r}: a list of layer numbers")
        dense = [i for i in range(layers) if i in only or (i + 1) % step]
        out["dense_layers"] = tuple(dense) or None
    return out  # dense and expert layers scan as stacks of their own (`decoder.stack.stacks`)


def _common(c: dict) -> dict:
    return {
        "num_experts_per_tok": c["experts_per_token"],
        "router_aux_loss_coef": c["router_aux_loss_coef"],
        "output_router_logits": False,
    }


def _write_qwen(c: dict, shared: bool = False) -> dict[str, Any]:
    out = _common(c)
    if shared:
        out["shared_expert_intermediate_size"] = c["shared_expert_d_ff"]
    return {
        **out,
        "num_experts": c["num_experts"],
        "moe_intermediate_size": c["expert_d_ff"],
        "norm_topk_prob": c["norm_topk_prob"],
        "mlp_only_layers": list(c["dense_layers"] or ()),
        "decoder_sparse_step": 1,
    }


def _has(c: dict, experts: bool = True) -> str | None:
    if (c["num_experts"] is not None) != experts:
        return f"model.num_experts={c['num_experts']!r}"
    return None


def plain(c: dict, experts: bool = True, shared: bool = False) -> str | None:
    """Why the settings are not Qwen's softmax routing over experts, or with `shared` its
    gated shared expert; with `experts=False`, why they are not a dense family's (no expert
    setting at all)."""
    why = _has(c, experts) or unlike(c, swiglu_limit=None, **SOFTMAX, router_logit_bias=False,
                                     expert_bias=False)  # fmt: skip
    has_shared = c["shared_expert_d_ff"] is not None
    if why is None and (has_shared != shared or c["shared_expert_gate"] != shared):
        why = f"model.shared_expert_d_ff={c['shared_expert_d_ff']!r}"
    return why


def _unlike_mixtral(c: dict) -> str | None:
    if why := plain(c):
        return why
    if not c["norm_topk_prob"]:
        return "model.norm_topk_prob=False"
    if c["dense_layers"]:
        return f"model.dense_layers={c['dense_layers']!r}"
    if c["expert_d_ff"] != c["d_ff"]:
        return f"model.expert_d_ff={c['expert_d_ff']!r} (Mixtral's experts are model.d_ff wide)"
    return None


def _write_mixtral(c: dict) -> dict[str, Any]:
    return {**_common(c), "num_local_experts": c["num_experts"], "router_jitter_noise": 0.0}


def _deepseek(file: Path, raw: dict, layers: int) -> dict[str, Any]:
    """DeepSeek-V3's routing (transformers' `DeepseekV3TopkRouter`, its defaults where a key
    is absent): sigmoid scores, the correction bias that chooses, `n_group` groups of which a
    token takes its `topk_group` best, the weights renormalised (`norm_topk_prob`) and times
    `routed_scaling_factor`; `n_shared_experts` shared experts of `moe_intermediate_size`
    (one SwiGLU of their summed width, as transformers builds them); the first
    `first_k_dense_replace` layers dense. No load-balancing loss: transformers' DeepSeek adds
    none, and DeepSeek-V3 balances by the bias."""
    for key, want in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(key) not in (None, want):
            raise errors.ConfigError(
                f"{file}: {key}={raw[key]!r}: mptrain's DeepSeek-V3 routes by {key}={want!r} "
                "(transformers' DeepseekV3TopkRouter) only"
            )
    get = lambda key, default: raw.get(key) if raw.get(key) is not None else default
    experts_key = (
        "n_routed_experts" if raw.get("n_routed_experts") is not None else "num_local_experts"
    )
    experts = checked(file, experts_key, get(experts_key, 256), int)
    d_ff = checked(file, "moe_intermediate_size", get("moe_intermediate_size", 2048), int)
    shared = get("n_shared_experts", 1)
    if isinstance(shared, bool) or not isinstance(shared, int) or shared < 0:
        raise errors.ConfigError(f"{file}: n_shared_experts={shared!r}: a count, 0 or more")
    dense = get("first_k_dense_replace", 3)
    if isinstance(dense, bool) or not isinstance(dense, int) or not 0 <= dense <= layers:
        raise errors.ConfigError(
            f"{file}: first_k_dense_replace={dense!r}: a count of layers, 0 to {layers}"
        )
    return {
        "num_experts": experts,
        "experts_per_token": checked(
            file, "num_experts_per_tok", get("num_experts_per_tok", 8), int
        ),
        "expert_d_ff": d_ff,
        "norm_topk_prob": get("norm_topk_prob", True),
        "router_aux_loss_coef": 0.0,
        "dense_layers": tuple(range(dense)) or None,
        "shared_expert_d_ff": d_ff * shared or None,
        "shared_expert_gate": False,
        "router_scoring": "sigmoid",
        "router_bias": True,
        "router_groups": checked(file, "n_group", get("n_group", 8), int),
        "router_groups_per_token": checked(file, "topk_group", get("topk_group", 4), int),
        "routed_scale": checked(
            file, "routed_scaling_factor", get("routed_scaling_factor", 2.5), float
        ),
    }


def _gpt_oss(file: Path, raw: dict) -> dict[str, Any]:
    """gpt-oss's experts (transformers' `GptOssMLP`, its defaults where a key is absent):
    `num_local_experts` of `intermediate_size` in every layer, `num_experts_per_tok` a token
    weighed by a softmax over the chosen logits (the renormalised softmax), the router's logits
    biased, each expert's gate, up and down biased, and the clamped SwiGLU (`swiglu_limit`,
    `swiglu_alpha`)."""
    get = lambda key, default: raw.get(key) if raw.get(key) is not None else default
    quantized = raw.get("quantization_config")
    if quantized is not None and (quantized or {}).get("quant_method") != "mxfp4":
        raise errors.ConfigError(
            f"{file}: quantization_config.quant_method={(quantized or {}).get('quant_method')!r}"
            ": mptrain reads gpt-oss's experts in bf16, fp32 or MXFP4 (dequantised on load)"
        )
    return {
        "num_experts": checked(file, "num_local_experts", get("num_local_experts", 128), int),
        "experts_per_token": checked(
            file, "num_experts_per_tok", get("num_experts_per_tok", 4), int
        ),
        "expert_d_ff": checked(file, "intermediate_size", get("intermediate_size", 2880), int),
        "norm_topk_prob": True,
        "router_aux_loss_coef": get("router_aux_loss_coef", 0.001),
        "dense_layers": None,
        "router_logit_bias": True,
        "expert_bias": True,
        "swiglu_limit": checked(file, "swiglu_limit", get("swiglu_limit", 7.0), float),
        "swiglu_alpha": checked(file, "swiglu_alpha", get("swiglu_alpha", 1.702), float),
    }


def _write_deepseek(c: dict) -> dict[str, Any]:
    return {
        "num_experts_per_tok": c["experts_per_token"],
        "n_routed_experts": c["num_experts"],
        "moe_intermediate_size": c["expert_d_ff"],
        "n_shared_experts": (c["shared_expert_d_ff"] or 0) // c["expert_d_ff"],
        "norm_topk_prob": c["norm_topk_prob"],
        "first_k_dense_replace": len(c["dense_layers"] or ()),
        "n_group": c["router_groups"],
        "topk_group": c["router_groups_per_token"],
        "routed_scaling_factor": c["routed_scale"],
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
    }


def _unlike_deepseek(c: dict) -> str | None:
    """Sigmoid scores, the bias; shared experts of the routed ones' width; dense layers first."""
    why = _has(c) or unlike(c, swiglu_limit=None, router_scoring="sigmoid", router_bias=True,
                            router_logit_bias=False, expert_bias=False)  # fmt: skip
    if why:
        return why
    shared, width = c["shared_expert_d_ff"], c["expert_d_ff"]
    if c["shared_expert_gate"] or (shared is not None and shared % width):
        return f"model.shared_expert_d_ff={shared!r} (a multiple of model.expert_d_ff, ungated)"
    dense = c["dense_layers"] or ()
    if dense != tuple(range(len(dense))):
        return f"model.dense_layers={dense!r} (DeepSeek's dense layers come first)"
    return None


def _write_gpt_oss(c: dict) -> dict[str, Any]:
    return {
        **_common(c),
        "num_local_experts": c["num_experts"],
        "intermediate_size": c["expert_d_ff"],
        "swiglu_limit": c["swiglu_limit"],
        "swiglu_alpha": c["swiglu_alpha"],
    }


def _unlike_gpt_oss(c: dict) -> str | None:
    """Every layer's experts, renormalised, unshared, biased, clamped; of model.d_ff or not."""
    if why := _has(c):
        return why
    if c["swiglu_limit"] is None:
        return "model.swiglu_limit=None"
    return unlike(c, **SOFTMAX, router_logit_bias=True, expert_bias=True, norm_topk_prob=True,
                  dense_layers=None, shared_expert_d_ff=None)  # fmt: skip


# gpt-oss's names: every expert in one tensor, [experts, in, out] as the params are (not
# transposed); gate and up interleaved along the last axis of gate_up_proj (gate the even
# columns, as transformers' `GptOssExperts._apply_gate` reads them), their biases likewise
GPT_OSS_NAMES = {
    ("moe", "router"): ("mlp.router.weight", True),
    ("moe", "router_logit_bias"): ("mlp.router.bias", False),
    ("moe", "gate"): ("mlp.experts.gate_up_proj", False, (0, 2)),
    ("moe", "up"): ("mlp.experts.gate_up_proj", False, (1, 2)),
    ("moe", "down"): ("mlp.experts.down_proj", False),
    ("moe", "gate_bias"): ("mlp.experts.gate_up_proj_bias", False, (0, 2)),
    ("moe", "up_bias"): ("mlp.experts.gate_up_proj_bias", False, (1, 2)),
    ("moe", "down_bias"): ("mlp.experts.down_proj_bias", False),
}
QWEN = ("mlp", ("gate_proj", "up_proj", "down_proj"))
QWEN3_MOE = Experts(
    read=functools.partial(_read, family="qwen3_moe"),
    write=_write_qwen,
    names=_names(*QWEN),
    unlike=plain,
)
QWEN2_MOE = Experts(
    read=functools.partial(_read, family="qwen2_moe", shared=True),
    write=functools.partial(_write_qwen, shared=True),
    names=_names(*QWEN, shared="shared_expert", gated=True),
    unlike=functools.partial(plain, shared=True),
)
DEEPSEEK_V3 = Experts(
    read=_deepseek,
    write=_write_deepseek,
    names=_names(*QWEN, shared="shared_experts", bias=True),
    unlike=_unlike_deepseek,
)
GPT_OSS = Experts(read=lambda file, raw, layers: _gpt_oss(file, raw), write=_write_gpt_oss,
                  names=GPT_OSS_NAMES, unlike=_unlike_gpt_oss)  # fmt: skip
MIXTRAL = Experts(
    read=functools.partial(_read, family="mixtral", mixtral=True),
    write=_write_mixtral,
    names=_names("block_sparse_moe", ("w1", "w3", "w2")),
    unlike=_unlike_mixtral,
)
