"""A mixture of experts planned for GPUs that are not here (issue 59): the experts' FLOPs are the
routed ones, run by grouped kernels, where XLA's own `ragged_dot` is a dense matmul of every
token copy against every expert (docs/mixture-of-experts.md)."""

import pytest
from helpers import load_config

from mptrain import plan as plan_lib

pytestmark = [
    pytest.mark.plan,
    pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry"),
]
GiB = 2**30


def test_qwen3_30b_a3b_with_adapters_plans_its_routed_experts_on_8_h100s():
    """configs/moe.py:qwen3_30b_a3b_lora (128 experts of 768 a layer, 8 a token, 3.3B of 30.5B
    params active; rank-16 adapters on the attention over a frozen bf16 base), fsdp 8, 8 x
    8,192 tokens: it fits with room (23.7 GiB planned 2026-11-29), and its matmuls are within a
    quarter of the FLOPs of training every active param (the head's over 151,936 tokens
    beside), where XLA's dense `ragged_dot` on an H100 would make the experts' 16 times theirs
    (each copy against all 128 experts, not its 8)."""
    plan = plan_lib.plan(load_config("moe", "qwen3_30b_a3b_lora"), "h100", 8)
    print(f"qwen3_30b_a3b_lora {plan.memory} {plan.matmul_flops} {plan.floor}")
    assert plan.fits and plan.memory["total"] < 30 * GiB
    tokens = 8 * 8192 / 8  # a device's
    assert sum(plan.matmul_flops.values()) < 1.25 * 6 * 3.3e9 * tokens  # 165 TFLOP, 2026-11-29
    assert plan.matmul_flops["bfloat16"] > 0.99 * sum(plan.matmul_flops.values())
