"""The roofline floor against steps that ran (issue 43): a floor is the least time a chip's
peaks allow, so a step measured on that chip, model, batch and sequence cannot be faster. Each
row compiles the step for its target (marked `plan`, run by `make test-plan`); counting the
stacked buffers of a scanned model whole, as the floor's memory side once did, fails the
torchtitan row (2,712 ms)."""

import pytest
from helpers import load_config

from mptrain import plan as plan_lib

pytestmark = [
    pytest.mark.plan,
    pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry"),
]
FIT_8B = {"batch_size": 8, "data.seq_len": 4096, "model.remat": "full"}
FIT_8B |= {"optimizer.mu_dtype": "q8", "optimizer.nu_dtype": "q8"}
FIT_8B |= {"precision": "bf16-pure", "param_rounding": "stochastic"}
# MaxText's Llama 2 7B on 8 H100s (src/maxtext/configs/gpu/a3/llama_2_7b/README.md, 1vm.sh):
# FSDP 8, 4 x 4096 tokens a GPU, cuDNN flash attention, remat minimal_with_context. MaxText
# ran it unscanned; planned here scanned, which compiles in 11 s instead of 58: the floor is
# compute's either way (745 ms scanned, 754 ms unscanned on 2026-12-06), and the unscanned
# floor is the gpt2s rows'
LLAMA2_7B = {"model.vocab_size": 32_000, "model.num_kv_heads": 32, "model.d_ff": 11_008}
LLAMA2_7B |= {"model.rope_theta": 10_000.0, "model.rope_scaling": None}
LLAMA2_7B |= {"model.remat": "minimal_with_context", "batch_size": 32, "data.seq_len": 4096}
# ... at 492 TFLOP/s a chip as MaxText counts them; its count is at least 6 x 6.74e9 params x
# 16,384 tokens = 663 TFLOP a step, so a step took at least 663 / 492 = 1.35 s
MAXTEXT_7B_S = 6 * 6.74e9 * 16_384 / 492e12
MEASURED = {
    "llama 2 7b on 8 h100 (maxtext)": ("llama3", "8b", LLAMA2_7B, "h100", 8, MAXTEXT_7B_S),
    # torchtitan's Llama 3.1 8B on 8 H100s, FSDP 8, 2 x 8192 tokens a GPU, selective
    # activation checkpointing, torch.compile: 6,667 tokens/s/GPU (benchmarks/
    # llama3_h100_202412_torchtitan.md at 9dec370a): 16,384 / 6,667 = 2.457 s a step
    "8b on 8 h100 (torchtitan)": ("llama3", "8b", {}, "h100", 8, 16_384 / 6_667),
    # mptrain's own on one H200, 2026-11-27 (docs/measured/h200-2026-11-27.jsonl): part b, the
    # 1b at batch 8 x 8192, 1.3235 s a step; part c, the 8B with --fit's overrides for one
    # H100, 3.0193 s; part a2, lm_gpt2s bf16-mixed, 25.87 ms
    "1b on 1 h200 (mptrain)": ("llama3", "1b", {}, "h200", 1, 1.3235),
    "8b fit on 1 h200 (mptrain)": ("llama3", "8b", FIT_8B, "h200", 1, 3.0193),
    "gpt2s on 1 h200 (mptrain)": ("lm_gpt2s", None, {}, "h200", 1, 0.02587),
}


@pytest.mark.parametrize("case", sorted(MEASURED))
def test_no_floor_is_slower_than_a_measured_step(case):
    name, arg, overrides, target, devices, measured_s = MEASURED[case]
    config = load_config(name, arg, **{"mesh.fsdp": devices, **overrides})
    floor = plan_lib.plan(config, target, devices).floor
    assert floor["floor_s"] <= measured_s, (case, floor)
