"""Writes HuggingFace folders made by transformers itself (Llamas; with `--families`, the other
families the decoder reads), for `mptrain.hf`'s tests, beside them, and for timing its loader.
mptrain never imports torch or transformers: run this in a venv of its own (the CPU is enough;
plain PyPI, no extra index), from the repository's root:

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install transformers torch safetensors numpy
    /tmp/hfvenv/bin/python tests/hf/make_fixture.py                  # tests/hf/fixture
    /tmp/hfvenv/bin/python tests/hf/make_fixture.py --families       # tests/hf/families
    /tmp/hfvenv/bin/python tests/hf/make_fixture.py --size=1b --out=/tmp/llama1b

`--size=tiny` (the default) writes the committed fixture, well under 1 MB:

  * `tests/hf/fixture/`: a random `LlamaForCausalLM` with grouped-query attention (4 query
    heads over 2 kv heads of 16 dims, on a width of 48, so head_dim is not width / heads),
    2 layers, a vocabulary of 300, untied embeddings, rope_theta 500,000 and Llama 3's
    rope scaling (factor 8, low/high frequency factors 1 and 4) over an original context of
    16 positions, so the reference's 48 positions reach three times past it. Its config.json
    is in transformers 4.x's form (`rope_theta`, `rope_scaling`), the form Hub checkpoints of
    Llama 3.x carry; the script checks that transformers loads that form to the same logits.
  * `tests/hf/fixture/tied/`: the same shapes with tied embeddings and plain RoPE
    (rope_theta 50,000, no scaling), its config.json as transformers 5.x writes it
    (`rope_parameters`).

Each holds `model.safetensors` (fp32) and `reference.npz`: `ids` (int32 [2, 48], fixed) and
`logits` (float32 [2, 48, 300]) as transformers computes them in eval mode with
attn_implementation="eager". The weights are not HF's default init (normal, std 0.02): with
that, attention scores are near zero and a wrong RoPE barely moves the logits. Here the
projections and embedding rows are normal with variance 1 / width in, norm scales uniform in
[0.5, 1.5], so scores are of order one and every mistake shows.

`--size=1b` writes a random Llama with Llama 3.2 1B's shapes (1.24 B params, tied, vocab
128,256) in bf16, sharded in 1 GB files with an index, to `--out` (not committed): the folder
`scripts/hf_load_bench.py` times `mptrain.hf.load_params` on.

Each also holds `generate.npz`: transformers' greedy `generate` from three prompts cut from
`ids` (5, 12 and 9 tokens), 32 new tokens each (`--generate` writes only these).

`--check=DIR` loads a folder (one `mptrain.hf.save` or `mptrain.export --format=hf` wrote, say)
with transformers and prints the largest difference of its logits from a reference.npz's
(`--reference`, default the fixture's): that transformers reads what mptrain writes
(`scripts/hf_export_check.py` runs it so on a run's export).

    /tmp/hfvenv/bin/python tests/hf/make_fixture.py --check=/tmp/exported
"""

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

HERE = Path(__file__).resolve().parent  # tests/hf: the fixtures' folder
SHAPES = {  # the tiny fixture's
    "vocab_size": 300,
    "hidden_size": 48,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
}
LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
LLAMA_3_2_1B = {
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": True,
}
IDS_SHAPE = (2, 48)


def _config(shapes: dict, theta: float, scaling: dict | None, **kwargs) -> LlamaConfig:
    rope = {"rope_type": "default"} if scaling is None else dict(scaling)
    return LlamaConfig(**shapes, rope_parameters={**rope, "rope_theta": theta}, **kwargs)


@torch.no_grad()
def _randomise(model: Any, generator: torch.Generator) -> None:
    """Weights that make scores and logits of order one (the module doc says why)."""
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # q_norm and k_norm too
            p.copy_(0.5 + torch.rand(p.shape, generator=generator))
        elif p.ndim == 1:  # a bias: large enough to move every score
            p.copy_(0.5 * torch.randn(p.shape, generator=generator))
        else:  # a torch Linear's [out, in]; the embedding's rows of norm ~1 (a tied head too)
            p.copy_(torch.randn(p.shape, generator=generator) / p.shape[-1] ** 0.5)


def _logits(folder: Path, ids: np.ndarray, dtype: Any = torch.float32) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=dtype, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.from_numpy(ids).long()).logits.float().numpy()


def _as_transformers_4(folder: Path) -> None:
    """Rewrites config.json in transformers 4.x's form: `rope_theta` at the top, the scaling
    (or null) as `rope_scaling`, the dtype as `torch_dtype` too, and no `layer_types` (a Qwen2
    window then comes of `use_sliding_window` and `max_window_layers`)."""
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("layer_types", None)
    rope = dict(config.pop("rope_parameters"))
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = None if rope.get("rope_type") == "default" else rope
    config["torch_dtype"] = config.get("dtype", "float32")
    path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def write_tiny(out: Path, *, tied: bool, theta: float, scaling: dict | None, v4: bool) -> None:
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(1234 + tied)
    config = _config(SHAPES, theta, scaling, tie_word_embeddings=tied)
    model = LlamaForCausalLM(config).to(torch.float32)
    _randomise(model, generator)
    for buffer_name, buffer in model.named_buffers():  # DeepSeek's routing bias: enough to
        if buffer_name.endswith("e_score_correction_bias"):
            buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))  # choose others
    if out.exists():
        for path in out.iterdir():  # keep the tied variant's subfolder
            if path.is_file():
                path.unlink()
    model.save_pretrained(out, safe_serialization=True)
    ids = np.random.default_rng(5 + tied).integers(0, SHAPES["vocab_size"], IDS_SHAPE, np.int32)
    logits = _logits(out, ids)
    if v4:
        _as_transformers_4(out)
        again = _logits(out, ids)  # transformers reads the 4.x form to the same model
        assert np.array_equal(again, logits), np.abs(again - logits).max()
    np.savez(out / "reference.npz", ids=ids, logits=logits.astype(np.float32))
    print(f"{out}: logits max |value| {np.abs(logits).max():.3f}")


# Prompts for `--generate`: (row of reference.npz's ids, start, length), three lengths.
PROMPTS = ((0, 0, 5), (1, 3, 12), (0, 20, 9))
NEW_TOKENS = 32


def write_generated(folder: Path) -> None:
    """`generate.npz` beside reference.npz: transformers' greedy `generate` (fp32, eager
    attention, its own KV cache), one prompt at a time, NEW_TOKENS tokens each, never stopping
    early: `prompts` (int32 [3, longest], right-padded with 0), `lengths` and `tokens` (int32
    [3, NEW_TOKENS]): what mptrain.generate's batched decoder must give token for token."""
    from transformers import GenerationConfig

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    ids = np.load(folder / "reference.npz")["ids"]
    prompts = [ids[row, start : start + n] for row, start, n in PROMPTS]
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
        eos_token_id=None, pad_token_id=0, bos_token_id=None,
    )  # fmt: skip
    tokens = []
    with torch.no_grad():
        for prompt in prompts:
            out = model.generate(torch.from_numpy(prompt[None]).long(), generation_config=config)
            tokens.append(out[0, len(prompt) :].numpy().astype(np.int32))
    padded = np.zeros((len(prompts), max(len(p) for p in prompts)), np.int32)
    for i, p in enumerate(prompts):
        padded[i, : len(p)] = p
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    np.savez(folder / "generate.npz", prompts=padded, lengths=lengths, tokens=np.stack(tokens))
    print(f"{folder}: generated {NEW_TOKENS} tokens for prompts of {lengths.tolist()} tokens")


# The other families, each with the switches that set it apart from the Llama turned on:
# Mistral's and Qwen2's sliding window (16 keys, a third of the 48 positions of the reference),
# Qwen2's q, k, v biases, Qwen3's q and k norms and tied embeddings. config.json in each form:
# Qwen2's and Gemma 2's as Hub checkpoints carry it (transformers 4.x), the others as 5.x writes
# it. Gemma 2: three layers (sliding, full, sliding: a period of two and one layer over), soft-caps
# of 2 on the scores and 3 on the logits (its defaults of 50 and 30 would barely touch scores and
# logits of this size), query_pre_attn_scalar 24 where head_dim is 16. Gemma 3: four layers of a
# pattern of three (sliding, sliding, full, sliding), the global layers' RoPE base 50,000 with
# linear scaling by 2, the sliding layers' 10,000 unscaled. OLMo 2: norms after the attention
# and the MLP only, q and k norms over the whole projection. SmolLM3: three layers, the middle one
# without RoPE (an interval of 2) and with the window (transformers slides its NoPE layers).
# Phi-3: q, k, v and gate, up fused, half of each head rotated, a window of 16.
GEMMA_ROPE = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 50_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
FAMILIES = {
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 16}, False),
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 0},
        True,
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"tie_word_embeddings": True}, False),
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {
            "num_hidden_layers": 3,
            "sliding_window": 16,
            "attn_logit_softcapping": 2.0,
            "final_logit_softcapping": 3.0,
            "query_pre_attn_scalar": 24,
        },
        True,
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {
            "num_hidden_layers": 4,
            "sliding_window": 16,
            "sliding_window_pattern": 3,
            "query_pre_attn_scalar": 24,
            "rope_parameters": GEMMA_ROPE,
        },
        False,
    ),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 1, "eos_token_id": 2}, True),
    "smollm3": (
        "SmolLM3Config",
        "SmolLM3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "no_rope_layer_interval": 2,
            "use_sliding_window": True,
            "sliding_window": 16,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        False,
    ),
    "phi3": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "sliding_window": 16,
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 50_000.0,
                "partial_rotary_factor": 0.5,
            },
        },
        False,
    ),
    # Mixtures of experts: Qwen3-MoE's three layers, the middle one dense (mlp_only_layers), 8
    # experts of 16, top 2 renormalised; Mixtral's 4 experts of 32, top 2, a window of 16, its
    # config.json in 4.x's form. Each with a load-balancing weight that shows in the loss.
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
            "router_aux_loss_coef": 0.01,
        },
        False,
    ),
    # Qwen2-MoE: Qwen2's biases, Qwen3-MoE's routing (here not renormalised, its default), a
    # shared expert of 32 beside 8 routed ones of 16, its output times its sigmoid gate
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        {
            "num_hidden_layers": 3,
            "num_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "shared_expert_intermediate_size": 32,
            "mlp_only_layers": [1],
            "router_aux_loss_coef": 0.01,
        },
        False,
    ),
    "mixtral": (
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "intermediate_size": 32,
            "sliding_window": 16,
            "router_aux_loss_coef": 0.01,
        },
        True,
    ),
    # DeepSeek-V3: latent attention (q through a rank of 24, k and v from one of 16, heads of
    # 12 + 8 rotated dimensions in interleaved pairs, v of 10), YaRN with mscale and
    # mscale_all_dim apart (both the cos/sin factor and the scores' scale show); the first of
    # three layers dense, then 8 experts of 16 in 4 groups, a token's 2 from its 2 best groups,
    # sigmoid scores with a random correction bias, weights renormalised and times 2.5, two
    # shared experts
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        {
            "num_hidden_layers": 3,
            "num_key_value_heads": 4,
            "head_dim": 8,  # transformers' RoPE reads it: qk_rope_head_dim, as its config sets
            "kv_lora_rank": 16,
            "q_lora_rank": 24,
            "qk_nope_head_dim": 12,
            "qk_rope_head_dim": 8,
            "v_head_dim": 10,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 2,
            "n_group": 4,
            "topk_group": 2,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 50_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "mscale": 1.0,
                "mscale_all_dim": 0.707,
            },
        },
        False,
    ),
    # gpt-oss: sinks, q, k, v, o biases, sliding (16) and full layers in turn, YaRN as gpt-oss
    # has it (truncate false); 8 experts of 16, top 2, the router and the experts biased, the
    # SwiGLU clamped at 1 (gpt-oss's 7 would barely bite at these sizes)
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "intermediate_size": 16,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
            "swiglu_limit": 1.0,
            "router_aux_loss_coef": 0.01,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 50_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "truncate": False,
            },
        },
        False,
    ),
    # gpt-oss as its checkpoints ship: the experts in MXFP4 (`_as_mxfp4`, by the format's
    # definition; transformers dequantises them on a CPU), a width of 64 and experts of 32 (the
    # blocks of 32 run along each expert's input)
    "gpt_oss-mxfp4": (
        "GptOssConfig",
        "GptOssForCausalLM",
        {
            "hidden_size": 64,
            "intermediate_size": 32,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
            "swiglu_limit": 1.0,
            "router_aux_loss_coef": 0.01,
        },
        False,
    ),
    # Qwen3 taken past its context by YaRN, as its model card does (factor 4): an original
    # context of 16 positions, the reference's 48 past it; the attention factor 0.1 ln 4 + 1.
    # Tied as the Qwen3 fixture is: the same params, the programs that read them shared
    "qwen3-yarn": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {
                "rope_type": "yarn",
                "rope_theta": 50_000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        },
        False,
    ),
    # Phi-4-mini's RoPE on the tiny shapes: longrope over an original context of 44 (the
    # reference's 48 positions use the long factors; decoding 32 tokens after prompts of 12 at
    # most stays within 44, on the short ones), three quarters of each head rotated
    "phi3-longrope": (
        "Phi3Config",
        "Phi3ForCausalLM",
        {
            "hidden_size": 64,  # transformers checks the factors against width / heads
            "pad_token_id": 0,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "original_max_position_embeddings": 44,
            "rope_parameters": {
                "rope_type": "longrope",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0 + 0.1 * i for i in range(6)],
                "long_factor": [1.5 + 2.0 * i for i in range(6)],
                "original_max_position_embeddings": 44,
            },
        },
        False,
    ),
}


def write_family(out: Path, name: str) -> None:
    import transformers

    config_class, model_class, switches, v4 = FAMILIES[name]
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(4321)
    rope = {"rope_type": "default", "rope_theta": 50_000.0}
    settings = {**SHAPES, "rope_parameters": rope, **switches}
    config = getattr(transformers, config_class)(**settings)
    model = getattr(transformers, model_class)(config).to(torch.float32)
    _randomise(model, generator)
    for buffer_name, buffer in model.named_buffers():  # DeepSeek's routing bias: enough to
        if buffer_name.endswith("e_score_correction_bias"):
            buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))  # choose others
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    if name.endswith("-mxfp4"):
        _as_mxfp4(out)
    ids = np.random.default_rng(7).integers(0, SHAPES["vocab_size"], IDS_SHAPE, np.int32)
    logits = _logits(out, ids)
    if v4:
        _as_transformers_4(out)
        again = _logits(out, ids)
        assert np.array_equal(again, logits), np.abs(again - logits).max()
    # transformers' own error in bf16 (weights and activations), of the largest |logit|: the
    # band mptrain's bf16-mixed is held to where it is wider than the Llama's
    bf16 = np.abs(_logits(out, ids, torch.bfloat16) - logits).max() / np.abs(logits).max()
    extra = {}
    if name in ("qwen3_moe", "mixtral", "qwen2_moe", "gpt_oss", "gpt_oss-mxfp4"):  # aux loss
        with torch.no_grad():
            routed = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            aux = routed(torch.from_numpy(ids).long(), output_router_logits=True).aux_loss
        extra["aux_loss"] = np.float32(aux.item())
    np.savez(out / "reference.npz", ids=ids, logits=logits.astype(np.float32), bf16_error=bf16,
             **extra)  # fmt: skip
    write_generated(out)
    print(f"{out}: {model_class}, logits max |value| {np.abs(logits).max():.3f}")


FP4 = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)


def _as_mxfp4(folder: Path) -> None:
    """Rewrites a gpt-oss folder's experts (`gate_up_proj`, `down_proj`, [experts, in, out]) as
    its published checkpoints store them, by the MXFP4 format's definition (OCP MX 1.0): for
    each expert's output row, blocks of 32 inputs share an e8m0 scale (`*_scales`, the exponent
    plus 127, the least that brings the block's largest |value| within 6), each value the
    nearest e2m1 (`FP4`) of value / scale, two to a byte, the first in the low nibble
    (`*_blocks`, [experts, out, in / 32, 16]); config.json gets its quantization_config."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(folder / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        w = np.swapaxes(tensors.pop(name).astype(np.float64), 1, 2)  # [E, out, in]
        blocks = w.reshape(*w.shape[:2], -1, 32)
        top = np.abs(blocks).max(-1, keepdims=True)
        exponent = np.ceil(np.log2(np.maximum(top, 1e-30) / 6.0)).astype(np.int32)
        scaled = blocks / np.exp2(exponent)
        index = np.abs(scaled[..., None] - FP4).argmin(-1).astype(np.uint8)  # nearest value
        tensors[f"{name}_blocks"] = index[..., 0::2] | (index[..., 1::2] << 4)
        tensors[f"{name}_scales"] = (exponent[..., 0] + 127).astype(np.uint8)
    save_file(tensors, str(folder / "model.safetensors"), {"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    not_converted = ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                     "model.embed_tokens", "lm_head"]  # fmt: skip
    config["quantization_config"] = {"quant_method": "mxfp4",
                                     "modules_to_not_convert": not_converted}  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def write_gemma3_multimodal(out: Path, text: Path) -> None:
    """A Gemma3ForConditionalGeneration around the Gemma 3 fixture's text model (its weights,
    a tiny random vision tower): `mptrain.hf` reads its text model, which must be that
    fixture's. `reference.npz`: the multimodal model's logits of the fixture's ids, no image."""
    from transformers import (
        AutoConfig,
        Gemma3Config,
        Gemma3ForConditionalGeneration,
        SiglipVisionConfig,
    )

    torch.manual_seed(0)
    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, image_size=8, patch_size=4)  # fmt: skip
    config = Gemma3Config(
        text_config=AutoConfig.from_pretrained(text).to_dict(), vision_config=vision.to_dict(),
        mm_tokens_per_image=4, image_token_index=299, boi_token_index=297, eoi_token_index=298,
    )  # fmt: skip
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    text_model = AutoModelForCausalLM.from_pretrained(text, dtype=torch.float32)
    model.model.language_model.load_state_dict(text_model.model.state_dict())
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True)
    ids = np.load(text / "reference.npz")["ids"]
    logits = _logits(out, ids)
    np.savez(out / "reference.npz", ids=ids, logits=logits.astype(np.float32))
    print(f"{out}: Gemma3ForConditionalGeneration, logits max |value| {np.abs(logits).max():.3f}")


def write_1b(out: Path) -> None:
    config = _config(LLAMA_3_2_1B, 500_000.0, {**LLAMA3_SCALING, "factor": 32.0})
    config.rope_parameters["original_max_position_embeddings"] = 8192
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: no fp32 copy of 1.2 B params
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(out, safe_serialization=True, max_shard_size="1GB")
    size = sum(p.stat().st_size for p in out.iterdir())
    count = sum(p.numel() for p in model.parameters())
    print(f"{out}: {count / 1e9:.3f} B params, {size / 1e9:.2f} GB on disk")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=("tiny", "1b"), default="tiny")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--check", type=Path, default=None)
    parser.add_argument("--reference", type=Path, default=HERE / "fixture/reference.npz")
    parser.add_argument(
        "--generate", action="store_true", help="only write the fixtures' generate.npz"
    )
    parser.add_argument(
        "--families", action="store_true", help="only write tests/hf/families/<family>/"
    )
    parser.add_argument("--only", default="", help="with --families: these, comma-separated")
    args = parser.parse_args()
    fixture = args.out or HERE / "fixture"
    if args.families:
        families = args.out or HERE / "families"
        for name in args.only.split(",") if args.only else FAMILIES:
            write_family(families / name, name)
        if not args.only:
            write_gemma3_multimodal(families / "gemma3-multimodal", families / "gemma3")
        return
    if args.generate:
        for folder in (fixture, fixture / "tied"):
            write_generated(folder)
        return
    if args.check is not None:
        reference = np.load(args.reference)
        logits = _logits(args.check, reference["ids"])
        scale = np.abs(reference["logits"]).max()
        error = np.abs(logits - reference["logits"]).max()
        print(f"{args.check}: logits differ by at most {error:.3g} ({error / scale:.3g} of max)")
        return
    if args.size == "1b":
        if args.out is None:
            parser.error("--size=1b needs --out (a folder outside the repository)")
        write_1b(args.out)
        return
    write_tiny(fixture, tied=False, theta=500_000.0, scaling=LLAMA3_SCALING, v4=True)
    write_tiny(fixture / "tied", tied=True, theta=50_000.0, scaling=None, v4=False)
    for folder in (fixture, fixture / "tied"):
        write_generated(folder)


if __name__ == "__main__":
    main()
