"""Mixtures of experts at their published shapes, for `mptrain.plan` (a real run of one reads its
folder: `configs/hf.py:DIR`), with the recipe of `configs/llama3.py:8b` (bf16-mixed, AdamW,
sequences of 8,192, the layers scanned, remat `minimal`):

    python -m mptrain.plan --config=configs/moe.py:qwen3_30b_a3b --target=h100 --devices=8
    python -m mptrain.plan --config=configs/moe.py:qwen3_30b_a3b_lora --target=h100 --devices=8
    python -m mptrain.plan --config=configs/moe.py:mixtral_8x7b_lora --target=h100 --devices=8
    python -m mptrain.plan --config=configs/moe.py:moonlight_16b_a3b --target=h100 --devices=8
    python -m mptrain.plan --config=configs/moe.py:gpt_oss_20b --target=h100 --devices=8

Arguments:
- `qwen3_30b_a3b`: Qwen3-30B-A3B's full fine-tune (30.5B params, 3.3B active: width 2,048,
  48 layers of 32 heads over 4 kv heads of 128 with q and k norms, each layer 128 experts of
  768 with 8 a token renormalised, vocabulary 151,936, RoPE theta 1,000,000), on 8 H100s:
  fsdp 2 x expert 4 (each device 32 of a layer's experts), a global batch of 8 x 8,192; the
  moments in bf16 and remat `full`, which `--fit` finds (fp32 moments plan 84.6 GiB).
- `qwen3_30b_a3b_lora`: the same with rank-16 adapters (alpha 32) on the attention's
  projections over a frozen bf16 base, on fsdp 8 (its floor is 0.62 of fsdp 2 x expert 4's:
  the experts' frozen weights gathered move fewer bytes than the group's tokens).
- `mixtral_8x7b_lora`: Mixtral 8x7B (46.7B params, 12.9B active: width 4,096, 32 layers of 32
  heads over 8 kv heads, each layer 8 experts of 14,336 with 2 a token, vocabulary 32,000) with
  rank-16 adapters on the attention's projections over a frozen bf16 base, on 8 H100s: fsdp 8.
- `moonlight_16b_a3b`: Moonlight-16B-A3B (DeepSeek-V3's architecture, 16.0B params: width 2,048,
  27 layers of latent attention over 16 heads, kv rank 512, no q rank, the first layer dense,
  then 64 experts of 1,408 with 6 a token by sigmoid scores and the fixed bias, two shared,
  vocabulary 163,840; its shapes as slime's and Megatron-Bridge's Moonlight scripts give them),
  on fsdp 8.
- `gpt_oss_20b`: gpt-oss-20b (20.9B params: width 2,880, 24 layers of 64 heads over 8 kv heads
  of 64 with sinks, sliding (128) and full in turn, 32 experts of 2,880 with 4 a token,
  vocabulary 201,088, YaRN factor 32 over 4,096), 16 x 4,096 tokens a step on fsdp 8, cuDNN's
  attention taking its sinks as one more key a head.
The plans' figures are in docs/mixture-of-experts.md.
"""

import math
import os
import runpy

ARGS = ("qwen3_30b_a3b", "qwen3_30b_a3b_lora", "mixtral_8x7b_lora", "moonlight_16b_a3b")
ARGS += ("gpt_oss_20b",)


def _model(c, **keys) -> None:
    c.model.rope_scaling = None
    c.model.rope_theta = 1_000_000.0
    c.model.router_aux_loss_coef = 0.001
    for key, value in keys.items():
        setattr(c.model, key, value)


def get_config(arg: str | None = None):
    if arg not in ARGS:
        raise ValueError(f"unknown config argument {arg!r}; valid: {', '.join(ARGS)}")
    llama3 = runpy.run_path(os.path.join(os.path.dirname(__file__), "llama3.py"))
    c = llama3["get_config"]("8b")
    if arg == "moonlight_16b_a3b":  # DeepSeek-V3's architecture
        _model(
            c, family="deepseek_v3", vocab_size=163_840, d_model=2048, num_layers=27,
            num_heads=16, num_kv_heads=16, head_dim=192, d_ff=11_264, norm_eps=1e-5,
            max_len=8192, rope_theta=50_000.0, kv_lora_rank=512, qk_rope_head_dim=64,
            v_head_dim=128, rope_interleave=True, num_experts=64, experts_per_token=6,
            expert_d_ff=1408, shared_expert_d_ff=2816, dense_layers=(0,), norm_topk_prob=True,
            router_scoring="sigmoid", router_bias=True, routed_scale=2.446,
            router_aux_loss_coef=0.0,
        )  # fmt: skip
        c.batch_size = 8
        c.mesh.data, c.mesh.fsdp, c.mesh.expert = 1, 8, 1
        return c
    if arg == "gpt_oss_20b":
        _model(
            c, family="gpt_oss", vocab_size=201_088, d_model=2880, num_layers=24, num_heads=64,
            num_kv_heads=8, head_dim=64, d_ff=2880, norm_eps=1e-5, max_len=131_072,
            rope_theta=150_000.0, rope_scaling=("yarn", 32.0, 4096, 32.0, 1.0,
                                                0.1 * math.log(32.0) + 1, False),
            attn_bias="all", attn_sinks=True, sliding_window=128,
            layer_types=("sliding_attention", "full_attention") * 12, num_experts=32,
            experts_per_token=4, expert_d_ff=2880, norm_topk_prob=True, router_logit_bias=True,
            expert_bias=True, swiglu_limit=7.0, router_aux_loss_coef=0.9,
        )  # fmt: skip
        # 16 x 4,096 tokens a step on fsdp 8 (cuDNN's attention, the sinks one more key a head);
        # it plans 69.4 GiB: a memory fraction of 0.9 of the H100's 79.1
        c.data.seq_len, c.batch_size = 4096, 16
        c.mesh.data, c.mesh.fsdp, c.mesh.expert = 1, 8, 1
        c.memory_fraction = 0.9
        return c
    if arg.startswith("qwen3_30b_a3b"):
        _model(
            c, family="qwen3_moe", vocab_size=151_936, d_model=2048, num_layers=48,
            num_heads=32, num_kv_heads=4, head_dim=128, d_ff=6144, qk_norm=True,
            norm_eps=1e-6, max_len=40_960, num_experts=128, experts_per_token=8,
            expert_d_ff=768, norm_topk_prob=True,
        )  # fmt: skip
        c.batch_size = 8
        c.mesh.data, c.mesh.fsdp, c.mesh.expert = 1, 2, 4
        if arg == "qwen3_30b_a3b":  # what `--fit` finds: 12 bytes of state a param do not fit
            c.optimizer.mu_dtype = c.optimizer.nu_dtype = "bfloat16"
            c.model.remat = "full"
    else:
        _model(
            c, family="mixtral", vocab_size=32_000, d_model=4096, num_layers=32, num_heads=32,
            num_kv_heads=8, d_ff=14_336, max_len=32_768, num_experts=8, experts_per_token=2,
            expert_d_ff=14_336, norm_topk_prob=True,
        )  # fmt: skip
        c.batch_size = 8
    if arg.endswith("_lora"):  # no expert weights to train: fsdp 8 moves less than experts
        c.lora.rank, c.lora.alpha, c.lora.base_dtype = 16, 32.0, "compute"
        c.mesh.data, c.mesh.fsdp, c.mesh.expert = 1, 8, 1
    return c
