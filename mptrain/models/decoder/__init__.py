"""The one decoder (`model.name="llama"`): the Llama and the families that differ from it by a
few switches (Mistral, Qwen2, Qwen3, Gemma 2 and 3, OLMo 2, SmolLM3, Phi-3, and the mixtures of
experts Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3 and gpt-oss: `FAMILIES`), with its fp32
islands, its layers scanned (a period of layer kinds at a time where they differ: `stack`) and
rematerialised by name.

The package: this module (its keys, `settings`, `create_model` and its `RECORD`), `layouts`
(what a layout needs of it), `model` (the module, `Llama`), `blocks` (norms, attention, the MLP
and each layer's `BlockSpec` of parts), `stack` (the scanned layers), `moe` and `grouped` (a
mixture of experts and its grouped matmuls), `rope`, `context_attention` (cuDNN's attention
over a split sequence) and `decode` (the KV cache). It is the zoo's: it may import
`mptrain.models`' shared parts and below.

The blocks (`blocks`): RMSNorm, grouped-query attention with rotary positions (RoPE, with
Llama 3's frequency scaling), RMSNorm, a SwiGLU MLP; tied or untied embeddings; and the
families' switches: biases on the attention's projections, RMSNorm on each head's q and k, a
sliding window (on the layers `layer_types` names, each with its own RoPE base), Gemma's norms,
scales, soft-caps and GELU, OLMo 2's norm placement, NoPE layers, partial RoPE and longrope.
Every matmul takes compute-dtype (``dtype``) operands, as in ``transformer_lm``. The fp32
islands:

  * RMSNorm: the mean square, its rsqrt and the scaling in fp32 (the scale is a param the
    default casting rule keeps in fp32; Gemma's ``1 + w`` too); only the result is cast back;
  * RoPE: the angles ``position * inv_freq`` from fp32 positions, their sin and cos in fp32, and
    the rotation of q and k applied in fp32, cast back to ``dtype`` just before the attention
    matmul (torchtitan rotates in fp32; HF transformers casts cos/sin to the activations' dtype
    and rotates in bf16). At position 8,000 an angle has fp32 rounding of about 5e-4 rad; in
    bf16 a cos/sin value keeps 8 bits. ``docs/models-and-data.md`` gives the measured error of
    q.k scores both ways;
  * attention's softmax statistics (``attention.causal_attention``: cuDNN, the Pallas TPU
    kernel and the materialised path all keep them in fp32);
  * soft-caps (Gemma 2's): on the fp32 scores and on the fp32 logits;
  * the logits: 16-bit operands, fp32 accumulation and result, never rounded to 16 bits;
    with targets, ``lm_loss.token_loss`` computes them chunk by chunk, so the fp32
    ``[tokens, vocab]`` array never exists.

Layout (what a HuggingFace ``LlamaForCausalLM`` checkpoint maps onto, each torch ``[out, in]``
weight transposed to flax's ``[in, out]`` kernel, nothing else reordered; ``L`` is
``stacked_layers`` with layer ``i`` on each array's leading axis, or ``layers_i`` unscanned):

    embed/embedding [V, D]         model.embed_tokens.weight
    L/attn_norm/scale [D]          model.layers.i.input_layernorm.weight
    L/attn/{q,k,v,o}/kernel        model.layers.i.self_attn.{q,k,v,o}_proj.weight (T)
    L/mlp_norm/scale [D]           model.layers.i.post_attention_layernorm.weight
    L/mlp/{gate,up,down}/kernel    model.layers.i.mlp.{gate,up,down}_proj.weight (T)
    L/attn/{q,k,v,o}/bias          model.layers.i.self_attn.{q,k,v,o}_proj.bias (attn_bias)
    L/attn/{q,k}_norm/scale        model.layers.i.self_attn.{q,k}_norm.weight (qk_norm)
    with post_norms (Gemma): L/attn_post_norm/scale is post_attention_layernorm.weight,
    L/mlp_norm/scale pre_feedforward_layernorm.weight, L/mlp_post_norm/scale
    post_feedforward_layernorm.weight
    final_norm/scale [D]           model.norm.weight
    head/kernel [D, V] (untied)    lm_head.weight (T)

q/k rotation convention: HF's "rotate half": a head's dimension j pairs with j + head_dim/2
(not the adjacent pairs of Meta's original code, torchtitan and MaxText, which permute q and k
on import). Keeping HF's order means an HF checkpoint loads with transposes only.

Scan (``scan_layers``): the blocks' params are one stack (``sharding.STACKED``) walked by
``jax.lax.scan``; each layer's slice is cast (under FSDP gathered) inside the loop
(``sharding.Layers``). Unscanned, block ``i`` is ``layers_i``, another checkpoint layout.
Remat: ``mptrain.models.remat``, per block.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from absl import logging

from mptrain import errors
from mptrain.models import attention as attention_lib
from mptrain.models import layers, lm_loss
from mptrain.models import remat as remat_lib
from mptrain.models.decoder import blocks, grouped, moe, rope
from mptrain.models.decoder.layouts import check_mesh
from mptrain.models.decoder.model import Llama
from mptrain.models.record import Record
from mptrain.recipe import fp8 as fp8_lib

# The families whose HuggingFace folders this decoder reads and writes (`mptrain.hf`): each a
# setting of the parts of `blocks.BlockSpec`, and the names its folder gives them.
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "olmo2", "smollm3", "phi3")
FAMILIES += ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v3", "gpt_oss")  # experts (`moe`)
SLIDING, FULL = "sliding_attention", "full_attention"  # `layer_types`' values, transformers'


# The keys `create_model` reads under `config.model`, with their defaults: a small byte-level
# model. `head_dim` None: d_model / num_heads; `rope_scaling` None, or Llama 3's
# (factor, low_freq_factor, high_freq_factor, original_max_len), ("linear", factor), or
# ("longrope", short factors, long factors, original_max_len, attention_factor) (Phi-3's), or
# ("yarn", factor, original_max_len, beta_fast, beta_slow, attention_factor, truncate);
# `family`: the folder it exports as; `attn_bias`, `qk_norm`, `sliding_window` and Gemma's
# `norm_plus_one`, `post_norms`, `attn_softcap`, `mlp_act`: settings of a layer's parts
# (`blocks.BlockSpec`, built by `layer_specs`);
# `query_pre_attn_scalar` (None: head_dim) scales the scores by its -1/2 power.
# `layer_types` (None: every layer sliding where `sliding_window` is set, else full) names each
# layer's attention, SLIDING or FULL; `rope_local_theta` (None: rope_theta) is the RoPE base of
# the sliding layers, unscaled (Gemma 3's). `embed_scale`: embeddings times sqrt(d_model);
# `final_softcap`: the logits' soft-cap. OLMo 2's `pre_norms` False and `qk_norm_width` (the
# q and k norms over the whole projection); `nope_layers`: the layers without RoPE (SmolLM3's).
# `token_ids`: a folder's (pad, bos, eos) ids, which the model never reads and an export writes
# back to config.json. `partial_rotary_factor`: the part of each head that RoPE rotates (Phi's).
# `kv_lora_rank` (None: none) makes the attention DeepSeek's multi-head latent attention
# (`blocks.LatentSpec`), with `q_lora_rank` (None: q straight from the width), each head's q and
# k of `head_dim` whose last `qk_rope_head_dim` dimensions rotate, its v `v_head_dim`;
# `rope_interleave`: RoPE's pairs adjacent (DeepSeek's). `attn_sinks`: each head's learned
# logit in the softmax's denominator (gpt-oss's; the materialised attention only).
CONFIG_KEYS = {
    "vocab_size": 256,
    "d_model": 256,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "head_dim": None,
    "d_ff": 688,
    "max_len": 256,
    "rope_theta": 10000.0,
    "rope_scaling": None,
    "norm_eps": 1e-5,
    "tie_embeddings": False,
    "attention": "auto",
    "scan_layers": True,
    "remat": "none",
    "family": "llama",
    "attn_bias": "none",
    "qk_norm": False,
    "sliding_window": None,
    "layer_types": None,
    "rope_local_theta": None,
    "norm_plus_one": False,
    "post_norms": False,
    "query_pre_attn_scalar": None,
    "attn_softcap": None,
    "final_softcap": None,
    "mlp_act": "silu",
    "embed_scale": False,
    "pre_norms": True,
    "qk_norm_width": False,
    "nope_layers": None,
    "token_ids": None,
    "partial_rotary_factor": 1.0,
    "kv_lora_rank": None,
    "q_lora_rank": None,
    "qk_rope_head_dim": None,
    "v_head_dim": None,
    "rope_interleave": False,
    "attn_sinks": False,
    **moe.CONFIG_KEYS,
}


def settings(model_config: Any) -> dict[str, Any]:
    """The keys of `CONFIG_KEYS` as `model_config` sets them; a `ValueError` names a bad one."""
    keys = errors.settings(model_config, CONFIG_KEYS)
    for key in ("vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "d_ff"):
        errors.check_integer(f"model.{key}", keys[key], 1, errors.INT32_MAX)
    errors.check_integer("model.max_len", keys["max_len"], 1, errors.INT32_MAX)  # only a bound
    heads, kv = keys["num_heads"], keys["num_kv_heads"]
    if heads % kv:
        fits = [n for n in range(1, heads + 1) if heads % n == 0]
        raise ValueError(
            f"model.num_kv_heads={kv}: must divide model.num_heads={heads} (each kv head serves "
            f"an equal group of query heads), e.g. {', '.join(map(str, fits))}"
        )
    if keys["head_dim"] is None:
        if keys["d_model"] % heads:
            raise ValueError(
                f"model.num_heads={heads}: does not divide model.d_model={keys['d_model']}; "
                "set model.head_dim, or a head count that divides the width"
            )
        keys["head_dim"] = keys["d_model"] // heads
    head_dim = errors.check_integer("model.head_dim", keys["head_dim"], 2, 2**16)
    if head_dim % 2:
        raise ValueError(
            f"model.head_dim={head_dim}: RoPE rotates pairs of dimensions; use an even size"
        )
    errors.check_number("model.rope_theta", keys["rope_theta"], 1.0, open_low=True)
    errors.check_number("model.norm_eps", keys["norm_eps"], 0.0, 1.0, open_low=True)
    keys["rope_scaling"] = rope.scaling(keys["rope_scaling"])
    bools = ("tie_embeddings", "scan_layers", "qk_norm", "norm_plus_one", "post_norms")
    for key in (*bools, "pre_norms", "qk_norm_width", "attn_sinks"):
        if not isinstance(keys[key], bool):
            raise ValueError(f"model.{key}={keys[key]!r}: must be True or False")
    errors.check_choice("model.family", keys["family"], FAMILIES)
    errors.check_choice("model.attn_bias", keys["attn_bias"], blocks.ATTN_BIASES)
    if not isinstance(keys["embed_scale"], bool):
        raise ValueError(f"model.embed_scale={keys['embed_scale']!r}: must be True or False")
    errors.check_choice("model.mlp_act", keys["mlp_act"], blocks.MLP_ACTS)
    if keys["sliding_window"] is not None:
        errors.check_integer("model.sliding_window", keys["sliding_window"], 1, errors.INT32_MAX)
    factor = keys["partial_rotary_factor"]
    factor = errors.check_number("model.partial_rotary_factor", factor, 0.0, 2.0, open_low=True)
    if factor > 1 or int(keys["head_dim"] * factor) < 2:
        raise ValueError(
            f"model.partial_rotary_factor={factor}: the part of a head's {keys['head_dim']} "
            "dimensions RoPE rotates, at most 1 and at least 2 dimensions"
        )
    keys["partial_rotary_factor"] = factor
    scaling, rotary = keys["rope_scaling"], int(keys["head_dim"] * factor) // 2 * 2
    if scaling is not None and scaling[0] == "longrope" and len(scaling[1]) != rotary // 2:
        raise ValueError(
            f"model.rope_scaling: {len(scaling[1])} longrope factors for the {rotary // 2} "
            "frequencies of the rotated part of a head"
        )
    for key in ("rope_local_theta", "query_pre_attn_scalar", "attn_softcap", "final_softcap"):
        if keys[key] is not None:
            keys[key] = errors.check_number(f"model.{key}", keys[key], 0.0, open_low=True)
    _check_latent(keys)
    keys["layer_types"] = layer_types(keys)
    keys["nope_layers"] = nope_layers(keys["nope_layers"], keys["num_layers"])
    moe.check(keys)
    return keys


def create_model(
    model_config: Any,
    compute_dtype: layers.Dtype = jnp.float32,
    fp8: Any = None,
    backend: attention_lib.Backend | None = None,
    loss: Any = None,
    host_memory: bool = True,
    lora: Any = None,
) -> Llama:
    """Builds a ``Llama`` from ``config.model`` (``CONFIG_KEYS``; host-side, no params). A bad
    value is a ``ConfigError`` naming its key. ``backend``: what the step is compiled for, which
    ``attention="auto"`` decides by; ``host_memory``: whether its devices have pinned host
    memory (the ``*_offloaded`` remat policies need it); ``loss``: ``config.loss``
    (``chunk_tokens``, ``z_loss``); ``fp8``: the projections' matmuls in fp8; ``lora``: a
    ``lora.Spec``, adapters on the projections it names (`mptrain.models.lora`)."""
    with errors.config_errors():
        keys = settings(model_config)
        choice = attention_lib.choose_attention(
            keys["attention"],
            dtype=compute_dtype,
            head_dim=keys["head_dim"],
            backend=backend,
            length=keys["max_len"],
            softcap=keys["attn_softcap"],
            sinks=keys["attn_sinks"],
        )
        platform = backend.platform if backend else jax.default_backend()
        keys["remat"] = remat_lib.check(keys["remat"], host_memory, platform)
        chunk, z_loss = (None, 0.0) if loss is None else lm_loss.settings(loss)
    logging.info("mptrain: attention: %s", choice)
    machine = backend or attention_lib.local_backend()  # the experts' matmuls: by the chip
    kernel = "xla"  # a dense model's: never run
    if keys["num_experts"]:
        widths = {"model.d_model": keys["d_model"], "model.expert_d_ff": keys["expert_d_ff"]}
        kernel = grouped.kernel_for(keys["expert_matmul"], machine, compute_dtype, widths)
    keys["expert_kernel"] = (kernel, machine.sms)
    return Llama(
        vocab_size=keys["vocab_size"],
        num_layers=keys["num_layers"],
        specs=layer_specs(keys),
        embed_scale=keys["embed_scale"],
        final_softcap=keys["final_softcap"],
        aux_loss_coef=keys["router_aux_loss_coef"] if keys["num_experts"] else 0.0,
        max_len=keys["max_len"],
        dtype=compute_dtype,
        tie_embeddings=keys["tie_embeddings"],
        implementation=choice.implementation,
        scan_layers=keys["scan_layers"],
        remat=keys["remat"],
        loss_chunk=chunk,
        z_loss=z_loss,
        fp8=fp8_lib.on(fp8, platform),
        lora=lora,
    )


def _check_latent(keys: dict) -> None:
    """Multi-head latent attention's keys (`kv_lora_rank` and the sizes it needs), checked."""
    if not isinstance(keys["rope_interleave"], bool):
        raise ValueError(
            f"model.rope_interleave={keys['rope_interleave']!r}: must be True or False"
        )
    if keys["kv_lora_rank"] is None:
        for key in ("q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if keys[key] is not None:
                raise ValueError(f"model.{key}={keys[key]!r}: multi-head latent attention's, "
                                 "and model.kv_lora_rank is None")  # fmt: skip
        return
    errors.check_integer("model.kv_lora_rank", keys["kv_lora_rank"], 1, errors.INT32_MAX)
    if keys["q_lora_rank"] is not None:
        errors.check_integer("model.q_lora_rank", keys["q_lora_rank"], 1, errors.INT32_MAX)
    head = keys["head_dim"]
    for key in ("qk_rope_head_dim", "v_head_dim"):
        if keys[key] is None:
            raise ValueError(f"model.{key}: None, and model.kv_lora_rank asks for it")
        errors.check_integer(f"model.{key}", keys[key], 1, head)
    if keys["qk_rope_head_dim"] % 2:
        raise ValueError(f"model.qk_rope_head_dim={keys['qk_rope_head_dim']}: RoPE rotates pairs")
    if keys["num_kv_heads"] != keys["num_heads"] or keys["partial_rotary_factor"] != 1:
        raise ValueError(
            f"model.kv_lora_rank={keys['kv_lora_rank']}: latent attention gives every head its "
            "own k and v (model.num_kv_heads = model.num_heads) and rotates "
            "model.qk_rope_head_dim of each (model.partial_rotary_factor = 1)"
        )


# --------------------------------------------------------------- each layer's spec


def nope_layers(value: Any, layers: int) -> tuple[int, ...] | None:
    """`model.nope_layers` checked: None, or the layers (numbers from 0) that take no RoPE."""
    if value is None or value == ():
        return None
    if isinstance(value, str) or not isinstance(value, tuple | list):
        raise ValueError(f"model.nope_layers={value!r}: None, or a tuple of layer numbers")
    for layer in value:
        errors.check_integer("model.nope_layers[...]", layer, 0, layers - 1)
    return tuple(sorted(set(value)))


def layer_types(keys: dict) -> tuple[str, ...] | None:
    """`model.layer_types` checked: None, or one of SLIDING, FULL a layer (a tuple); a sliding
    layer needs `model.sliding_window`."""
    kinds, n = keys["layer_types"], keys["num_layers"]
    if kinds is None:
        return None
    if isinstance(kinds, str) or not isinstance(kinds, tuple | list) or len(kinds) != n:
        raise ValueError(
            f"model.layer_types={kinds!r}: None, or one of {SLIDING!r}, {FULL!r} for each of "
            f"the {n} layers"
        )
    bad = next((k for k in kinds if k not in (SLIDING, FULL)), None)
    if bad is not None:
        raise ValueError(f"model.layer_types: {bad!r} is not {SLIDING!r} or {FULL!r}")
    if SLIDING in kinds and keys["sliding_window"] is None:
        raise ValueError(
            f"model.layer_types has {SLIDING!r} layers but model.sliding_window is None"
        )
    return tuple(kinds)


def layer_specs(keys: dict[str, Any]) -> tuple[blocks.BlockSpec, ...]:
    """Each layer's `BlockSpec` for the checked settings `keys` (`settings`): its sizes, its
    attention (a sliding or a full layer's window and RoPE base, `layer_types`; none for a
    NoPE layer), its norms, and its feed-forward (experts, but in `dense_layers`)."""
    scaling = keys["rope_scaling"]
    long = scaling is not None and scaling[0] == "longrope"
    # partial RoPE: the first int(head_dim * factor) dimensions of a head rotate, as transformers
    rotary = int(keys["head_dim"] * keys["partial_rotary_factor"]) // 2 * 2
    latent = None
    if keys["kv_lora_rank"] is not None:  # DeepSeek's: the last qk_rope_head_dim rotate
        rotary = keys["qk_rope_head_dim"]
        latent = blocks.LatentSpec(
            keys["kv_lora_rank"], keys["q_lora_rank"], rotary, keys["v_head_dim"]
        )
    frequencies = lambda theta, scaling: tuple(
        float(f) for f in rope.rope_frequencies(rotary, theta, scaling)
    )
    scalar = keys["query_pre_attn_scalar"]
    shape = blocks.Shape(keys["d_model"], keys["num_heads"], keys["num_kv_heads"], keys["head_dim"])
    qk_norm = ("width" if keys["qk_norm_width"] else "head") if keys["qk_norm"] else None
    attention = blocks.AttentionSpec(
        bias=keys["attn_bias"],
        qk_norm=qk_norm,
        scale=None if scalar is None else float(scalar) ** -0.5,
        softcap=keys["attn_softcap"],
        window=keys["sliding_window"],
        inv_freq=frequencies(keys["rope_theta"], keys["rope_scaling"]),
        longrope=rope.longrope(rotary, keys["rope_theta"], scaling) if long else None,
        rope_scale=rope.attention_scale(scaling),
        interleaved=keys["rope_interleave"],
        latent=latent,
        sinks=keys["attn_sinks"],
    )
    norms = blocks.NormSpec(
        float(keys["norm_eps"]), keys["norm_plus_one"], keys["pre_norms"], keys["post_norms"]
    )
    local, full = attention, attention
    if keys["layer_types"] is not None:
        if keys["rope_local_theta"] is not None:
            local_freq = frequencies(keys["rope_local_theta"], None)
            local = dataclasses.replace(
                attention, inv_freq=local_freq, longrope=None, rope_scale=1.0
            )
        full = dataclasses.replace(attention, window=None)
    kinds = keys["layer_types"] or [SLIDING] * keys["num_layers"]
    nope, dense = set(keys["nope_layers"] or ()), set(keys["dense_layers"] or ())
    mlp, experts = blocks.MlpSpec(keys["d_ff"], keys["mlp_act"]), None
    if keys["num_experts"]:
        experts = blocks.MoeSpec(
            keys["num_experts"], keys["experts_per_token"], keys["expert_d_ff"],
            keys["norm_topk_prob"], keys["router_fp32"], keys["expert_kernel"],
            keys["shared_expert_d_ff"], keys["shared_expert_gate"],
            moe.Routing(keys["router_scoring"], keys["router_bias"], keys["router_groups"],
                        keys["router_groups_per_token"], float(keys["routed_scale"]),
                        keys["router_logit_bias"]),
            keys["expert_bias"],
            None if keys["swiglu_limit"] is None
            else (float(keys["swiglu_limit"]), float(keys["swiglu_alpha"])),
        )  # fmt: skip
    return tuple(
        blocks.BlockSpec(
            shape,
            dataclasses.replace(a, inv_freq=()) if i in nope else a,
            norms,
            experts if experts is not None and i not in dense else mlp,
        )
        for i, a in enumerate(local if kind == SLIDING else full for kind in kinds)
    )


# What the decoder can do. fp8's defaults follow the recipes that train a Llama in fp8 today:
# current scaling (torchtitan, Megatron), the first and last blocks in bf16 (NVIDIA's
# Megatron-Bridge Llama 3 recipes), and no fp8 for matmuls too thin to gain (torchao's filter,
# whose rowwise rule drops an output of 1,024 or fewer: Llama 3 8B's and 70B's k and v).
RECORD = Record(
    name="llama",
    language_model=True,
    adapters=True,
    fp8={"scaling": "current", "bf16_layers": 1, "min_size": 1024},
    mesh=frozenset({"expert", "context", "tensor"}),
    decodes=True,
    hf=True,
    check_mesh=check_mesh,
)
