"""`mptrain.plan` on the accelerators it compiles for: the run's own train step, compiled here
for an H100 (or a TPU) that is not here, read, and held to what that chip would run.

Marked `plan`: they need the extra `mptrain[plan]` (the CUDA compiler plugin, cuDNN, libtpu),
which `make test-plan` installs before running them (`make test` leaves them out). Each plan
is compiled once per session.
"""

import functools
import json
import math
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import FIXTURE, ROOT, fake_cpu_env, hub_cache, load_config, run_cli_process

from mptrain import plan as plan_lib
from mptrain import target
from mptrain.models import attention
from mptrain.plan import memory as plan_memory
from mptrain.train import trainer

# the suite's persistent compilation cache cannot load back a program compiled without its
# device: JAX warns and compiles it again
pytestmark = [
    pytest.mark.plan,
    pytest.mark.filterwarnings("ignore:Error reading persistent compilation cache entry"),
]
GiB = 2**30
# the tests that read `planned("llama3", "8b", 8)` run in one xdist worker: one compile of it
ON_8_H100S = pytest.mark.xdist_group("llama3 8b on 8 h100s")


@functools.cache
def planned(name: str, arg: str | None = None, devices: int | None = None, tgt="h100", **keys):
    """The plan of `configs/<name>.py[:arg]` with `keys` set ("a__b" for `a.b`), cached."""
    overrides = {key.replace("__", "."): value for key, value in keys.items()}
    return plan_lib.plan(load_config(name, arg, **overrides), tgt, devices)


def gpt2s_failures(result, layers_: int = 12) -> list[str]:
    """The checks of acceptance 1 that `result` (a gpt2s bf16-mixed plan on an H100) fails."""
    flops = result.matmul_flops
    sixteen = sum(v for k, v in flops.items() if k in ("bfloat16", "float16"))
    checks = {
        "scatters": not [h for h in result.hazards if "scatter" in h["op"]],
        "cudnn forward in every layer": result.attention["forward_calls"] == layers_,
        "cudnn backward in every layer": result.attention["backward_calls"] == layers_,
        "no [B,H,L,L] buffer": result.attention["buffers"] == 0,
        ">= 99% 16-bit matmul FLOPs": sixteen >= 0.99 * sum(flops.values()),
        "temporaries <= 7 GiB": result.memory["temporaries"] <= 7 * GiB,
        "fits": result.fits and result.verdict().startswith("fits"),
    }
    return [name for name, ok in checks.items() if not ok]


def test_gpt2s_bf16_on_an_h100_is_the_fast_step():
    result = planned("lm_gpt2s")
    assert gpt2s_failures(result) == [], str(result)
    assert result.attention["implementation"].startswith("cuDNN fused flash attention")
    assert "fits" in str(result) and "NOT a measurement" in str(result)
    data = json.loads(result.to_json())
    assert data["fits"] and data["memory"]["temporaries"] == result.memory["temporaries"]


def test_materialized_attention_turns_the_buffer_and_memory_checks_red():
    failed = gpt2s_failures(planned("lm_gpt2s", model__attention="materialized"))
    assert "no [B,H,L,L] buffer" in failed and "temporaries <= 7 GiB" in failed
    assert "cudnn forward in every layer" in failed


# mptrain's own embedding no longer scatters (its gradient is a one-hot matmul); the scatter
# these two tests need the plan to find comes from a test Trainer that gathers plainly.
SCATTERING = "scatter_trainer:GatherTrainer"


def test_a_16_bit_scatter_turns_the_scatter_check_red():
    """A plain gather of rows from a large table cast to bf16 (`keep_fp32=""`): its gradient is
    a bf16 scatter-add on the GPU. `make test-plan` compiles with XLA's deterministic kernels
    (a default run's), which sort the updates first."""
    result = planned("lm_gpt2s", "tiny", model__vocab_size=8192, keep_fp32="", trainer=SCATTERING)
    assert "scatters" in gpt2s_failures(result, layers_=2)
    (scatter,) = [h for h in result.hazards if "scatter" in h["op"]]
    assert scatter["op"] == "scatter-add" and scatter["dtype"] == "bfloat16"
    assert scatter["kind"] == "deterministic" and "scatter_trainer.py" in scatter["where"]


def test_without_deterministic_kernels_a_bf16_scatter_is_a_16_bit_hazard():
    done = _plan_cli(
        f"--config={ROOT / 'configs' / 'lm_gpt2s.py'}:tiny",
        "--target=h100",
        "--config.model.vocab_size=8192",
        "--config.keep_fp32=",
        "--config.deterministic=False",
        f"--config.trainer={SCATTERING}",
        tests_importable=True,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.search(
        r"16-bit +scatter-add +bfloat16 +x1 +tests/train/scatter_trainer.py", done.stdout
    )
    assert "runs with 16-bit atomics on GPUs" in done.stdout
    assert "compiled without XLA's deterministic GPU kernels" in done.stdout


def test_gpt2s_fp32_reports_materialized_attention_fp32_flops_and_no_false_hazard():
    result = planned("lm_gpt2s", precision="fp32")
    assert result.attention["implementation"] == "materialized"
    assert result.attention["buffers"] > 0
    # every dot of the compiled program at HIGHEST: true float32, not TensorFloat-32
    assert set(result.matmul_flops) == {"float32_highest"}
    assert result.hazards == [] and result.offenders == []
    assert result.floor["mfu_dtype"] == "float32_highest"
    highest = target.targets()["h100"].roofline["float32_highest"]
    assert result.floor["peaks"]["float32_highest"] == result.floor["mfu_peak"] == highest


@pytest.mark.parametrize("tgt", ["h100", "v5e"])
def test_fp32_runs_every_matmul_at_highest_on_the_target_and_default_asks_for_less(tgt):
    """Read on the compiled program of each kind of chip: JAX's default runs these dots in
    TensorFloat-32 on the H100 and as one bfloat16 pass on a TPU, whose compiler casts the
    operands of most of them to bfloat16 in the program itself."""
    strict = planned("lm_gpt2s", "tiny", tgt=tgt, precision="fp32").matmul_flops
    assert set(strict) == {"float32_highest"}
    reduced = planned("lm_gpt2s", "tiny", tgt=tgt, precision="fp32", matmul_precision="default")
    assert set(reduced.matmul_flops) == ({"float32"} if tgt == "h100" else {"float32", "bfloat16"})
    assert sum(reduced.matmul_flops.values()) == sum(strict.values())


def test_fp8_matmuls_run_with_e4m3_and_e5m2_operands_on_the_h100():
    result = planned("lm_gpt2s", precision="fp8-mixed")
    flops = result.matmul_flops
    assert flops["float8_e4m3fn"] > 0 and flops["float8_e5m2"] > 0
    fp8 = flops["float8_e4m3fn"] + flops["float8_e5m2"]
    assert fp8 > 0.85 * sum(flops.values())  # attention and MLP projections: the bulk
    assert result.fp8_kernels and all(n > 0 for n in result.fp8_kernels.values())
    assert any(note.startswith("fp8 matmuls:") for note in result.notes)


def test_fsdp_over_4_h100s_reduces_gradients_in_fp32_and_gathers_bf16():
    result = planned("lm_gpt2s", devices=4, mesh__data=1, mesh__fsdp=4)
    assert result.devices == 4
    assert result.mesh == {"data": 1, "fsdp": 4, "expert": 1, "context": 1, "tensor": 1}
    collectives = result.collectives
    assert set(collectives["reduce-scatter"]) == {"f32"}
    assert set(collectives.get("all-reduce", {"f32": 0})) == {"f32"}
    gathered = collectives["all-gather"]
    assert gathered["bf16"] > 0.99 * sum(gathered.values())
    # what is gathered in f32 is a param the casting rule keeps fp32 (LayerNorms here)
    kept = result.kept_fp32
    assert kept and all("ln" in p or "embedding" in p for p in kept)
    ln_floats = sum(2 * 768 for p in kept if "ln" in p and p.endswith("scale"))
    assert gathered.get("f32", 0) == 4 * ln_floats
    assert not [h for h in result.hazards if h["kind"] == "16-bit"]
    sites = [where for found in result.collective_sites.values() for where in found]
    # the recipe's reductions; and the loss's count of tokens, summed over the devices (the
    # mean is every device's: `layers.masked_mean`), a scalar
    ours = ("mptrain/parallel/sharding.py:", "mptrain/models/layers.py:")
    assert all(where.startswith(ours) for where in sites), sites


def test_the_attention_choice_follows_the_compile_target_not_the_host():
    config = load_config("lm_gpt2s", "tiny")
    on_this_cpu = trainer.Trainer(config, "/nonexistent")
    on_an_h100 = trainer.Trainer(
        config, "/nonexistent", devices=target.targets()["h100"].devices(1)
    )
    assert attention.backend_of(on_this_cpu.mesh.devices.flat).platform == "cpu"
    assert on_this_cpu.model.attention == "materialized"
    assert on_an_h100.model.attention == "cudnn"
    assert on_an_h100.mesh.devices.flat[0].platform == "gpu"


def test_the_program_flops_match_the_traced_step_on_gpu_and_tpu():
    """The FLOPs read off the compiled GPU and TPU programs (dots; the TPU's convolutions,
    dilations and all) are those of the step JAX traces (the precision report's count)."""
    import jax.numpy as jnp
    import numpy as np

    from mptrain.inspect import audit

    config = load_config("lm_gpt2s", "tiny", **{"model.attention": "materialized"})
    here = trainer.Trainer(config, "/nonexistent")
    sample = {k: np.zeros((1, 64), np.int32) for k in ("inputs", "targets")}
    state = here.init_state(sample)
    jitted, make_totals, _ = here.make_run_step(state, sample)
    batch = {k: jnp.zeros((8, 64), jnp.int32) for k in sample}
    report = audit.precision_report(jitted, state, batch, make_totals())
    expected = sum(report.matmul_flops.values())
    for tgt in ("h100", "v5e"):
        result = planned("lm_gpt2s", "tiny", tgt=tgt, model__attention="materialized")
        assert sum(result.matmul_flops.values()) == pytest.approx(expected, rel=1e-6), tgt


def test_a_v5e_plan_compiles_and_reports_the_tpu_rules():
    result = planned("lm_gpt2s", "tiny", tgt="v5e-4", mesh__data=4)
    assert result.devices == 4 and result.target == "v5e"
    assert result.attention["implementation"] == "materialized"
    assert result.fits and result.capacity == 16 * GiB


# ---- the command line


def _plan_cli(*args, tests_importable=False):
    return run_cli_process(*args, module="mptrain.plan", timeout=600, tests=tests_importable)


def test_a_config_that_cannot_fit_exits_4_naming_the_largest_buffers(tmp_path):
    done = _plan_cli(
        # the test-sized model at a batch no H100 holds: the same verdict, a program that
        # compiles in seconds (gpt2s at 64 times its batch took 41 s of make test-plan)
        f"--config={ROOT / 'configs' / 'lm_gpt2s.py'}:tiny",
        "--target=h100",
        "--config.batch_size=1048576",
        f"--json={tmp_path / 'plan.json'}",
    )
    assert done.returncode == plan_lib.EXIT_DOES_NOT_FIT, done.stderr[-2000:]
    first, second = done.stdout.splitlines()[:2]
    assert first.startswith("does not fit: needs ") and "of 59.3; largest buffers: " in first
    assert "transformer_lm.py:" in first
    assert second.startswith("to make it fit: --fit searches the memory knobs"), second
    assert "mesh.fsdp" not in second  # one device: no data axis to split the state over
    data = json.loads((tmp_path / "plan.json").read_text())
    assert not data["fits"] and data["memory"]["total"] > data["capacity"]


def test_a_hub_id_whose_cache_holds_only_its_config_json_plans(tmp_path, monkeypatch):
    """A plan reads a model's config.json, no weights and no data: `configs/hf.py:ORG/NAME`
    plans, offline, from a Hub cache that holds that one file."""
    hub_cache(tmp_path / "hub", "mptrain-tests/tiny", FIXTURE, names=("config.json",))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    config = f"--config={ROOT / 'configs' / 'hf.py'}:mptrain-tests/tiny"
    done = _plan_cli(config, "--target=h100", "--config.batch_size=2", "--config.data.seq_len=32")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("plan: bf16-mixed on 1 x NVIDIA H100"), done.stdout[:500]
    # the tokenizer is not fetched for a plan, and the plan says what that leaves unchecked
    assert "data.tokenizer='mptrain-tests/tiny' is not in the Hub's cache" in done.stderr


def test_a_plan_that_does_not_fit_on_a_data_axis_names_the_split_that_would():
    """Sweep 2026-12-06: Qwen3-8B on data 8 read "does not fit: needs 141.8 GiB of 59.3" and
    named neither --fit nor mesh.fsdp, which make it fit."""
    plan = object.__new__(plan_lib.Plan)
    plan.mesh = {"data": 8, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    assert plan.ways_to_fit().endswith(
        "the data axis keeps the whole state on each of its 8 devices: "
        "--config.mesh.data=1 --config.mesh.fsdp=8 splits it over them"
    )


def test_the_gpt2s_plan_exits_0_and_prints_the_report():
    done = _plan_cli(f"--config={ROOT / 'configs' / 'lm_gpt2s.py'}", "--target=h100")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "fits, " in done.stdout and "cuDNN fused flash attention" in done.stdout
    assert "compiled with XLA's deterministic GPU kernels" in done.stdout


def test_the_8b_with_adapters_fits_a_24_gb_card_and_its_8_bit_base_takes_under_10_gib():
    """configs/llama3.py:8b_lora and 8b_qlora (issue 46) on one RTX 4090: rank-16 adapters on
    every projection, batch 2 of 2,048, each block's input offloaded to the host. torchtune's
    LoRA (adapters and moments in bf16) on that card: 16.2 GiB, 3,083 tokens/s; its QLoRA (NF4):
    7.4 GiB, 2,413 tokens/s. mptrain keeps the adapters and their moments in fp32 (0.3 GiB
    more than bf16 ones)."""
    lora, qlora = (
        planned("llama3", "8b_lora", tgt="rtx4090"),
        planned("llama3", "8b_qlora", tgt="rtx4090"),
    )
    print(f"8b_lora {lora.memory}; 8b_qlora {qlora.memory}")
    assert lora.fits and qlora.fits
    assert lora.memory["total"] <= 16.6 * GiB and qlora.memory["total"] <= 10 * GiB
    assert lora.state_bytes_per_param == pytest.approx(12.0)  # fp32 adapters, fp32 moments
    assert lora.frozen_bytes_per_param == pytest.approx(2.0, abs=1e-3)  # a bf16 base
    assert qlora.frozen_bytes_per_param < 1.1  # 1 byte + a 4-byte scale per 256, but the norms
    assert lora.memory["host"] == 32 * 2 * 2048 * 4096 * 2  # each block's bf16 input
    for plan, measured in ((lora, 3083), (qlora, 2413)):  # a floor is never slower than a step
        assert 2 * 2048 / plan.floor["floor_s"] > measured
    # in torchtune's precision (adapters and moments in bf16) mptrain's step needs no more
    keys = {"precision": "bf16-pure", "optimizer__mu_dtype": "bfloat16"}
    as_torchtune = planned(
        "llama3", "8b_lora", tgt="rtx4090", **keys, optimizer__nu_dtype="bfloat16"
    )
    assert as_torchtune.memory["total"] <= 16.2 * GiB


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["--target=h101"],
            "--target='h101': unknown; known targets: a100, b200, h100, h200, rtx4090",
        ),
        (["--target=h100", "--devices=12"], "--devices=12: a h100 plan takes 1, 2, 3"),
        (["--target=h100", "--config.model.num_heads=5"], "config.model.num_heads=5"),
        ([], "--target is required; known targets: a100"),
    ],
)
def test_bad_targets_and_configs_exit_2_with_one_line(args, message):
    done = _plan_cli(f"--config={ROOT / 'configs' / 'lm_gpt2s.py'}:tiny", *args)
    assert done.returncode == 2, done.stdout
    assert message in done.stderr
    assert "Traceback" not in done.stderr


def test_gpt2s_on_a_v5e_chip_runs_the_pallas_flash_kernel_in_every_layer():
    result = planned("lm_gpt2s", tgt="v5e-1")
    att = result.attention
    assert att["implementation"].startswith("Pallas TPU flash attention"), att
    assert att["forward_calls"] == 12 and att["backward_calls"] == 24  # dq and dk/dv kernels
    assert att["buffers"] == 0 and result.memory["temporaries"] <= 5 * GiB, result.memory
    assert set(result.matmul_flops) == {"bfloat16"} and result.fits


@ON_8_H100S
def test_llama3_8b_fits_8_h100s_with_cudnn_attention_per_layer_gathers_and_no_fp32_logits():
    # configs/llama3.py:8b as planned: FSDP 8, 2 sequences of 8,192 a device, bf16-mixed with
    # fp32 master params and moments, remat "minimal", the loss in chunks
    result = planned("llama3", "8b", 8)
    assert result.memory["total"] <= 72 * GiB, result.memory
    assert result.involuntary == []  # no resharding by whole-tensor gathers (jax#21562)
    # above the 75% JAX takes (59.3 GiB): the config's memory_fraction=0.85 gives it room
    assert result.fits and result.share["why"] == "config.memory_fraction=0.85", result.verdict()
    over = plan_lib.plan(load_config("llama3", "8b", memory_fraction=0.7), "h100", 8)
    assert re.search(r"memory_fraction=0\.[89]\d would give it that", over.verdict())
    assert result.compile_seconds < 300
    att = result.attention
    assert att["implementation"].startswith("cuDNN") and att["buffers"] == 0, att
    assert att["forward_calls"] >= 32 and att["backward_calls"] >= 32, att
    assert result.hazards == []  # no scatter: the embedding's gradient is a matmul
    assert set(result.matmul_flops) == {"bfloat16"}
    gathers, scatters = result.collectives["all-gather"], result.collectives["reduce-scatter"]
    assert set(scatters) == {"f32"} and gathers["bf16"] > 10 * gathers["f32"]
    # the kernels' gathers and reduce-scatters come from inside the loop over layers
    assert any("sharding.py" in site for site in result.collective_sites["all-gather"])
    # no [tokens, vocab] fp32 array: 2 x 8192 x 128,256 floats is 8.4 GB
    logits = 2 * 8192 * 128_256
    big = [b for b in result.largest if b["array"].startswith("f32[") and "128256" in b["array"]]
    assert all(math.prod(map(int, re.findall(r"\d+", b["array"][3:]))) < logits for b in big), big


@ON_8_H100S
def test_the_8b_in_fp8_runs_the_matmuls_its_rules_select_as_fp8_gemms_and_the_head_in_bf16():
    """configs/llama3.py:8b under fp8-mixed on 8 H100s, the Llama's fp8 defaults (issue 47):
    blocks 1..30 in fp8 (the first and last in bf16), in each q, o, gate, up and down (k and v,
    1,024 outputs, fall under the size filter), each as 3 GEMMs (forward, two gradients)."""
    result, bf16 = planned("llama3", "8b", 8, precision="fp8-mixed"), planned("llama3", "8b", 8)
    print(f"fp8 {result.memory} floor {result.floor}; bf16 {bf16.memory} floor {bf16.floor}")
    assert result.fits, result.verdict()
    assert sum(result.fp8_kernels.values()) == 30 * 5 * 3, result.fp8_kernels
    tokens, d, ff, vocab = 2 * 8192, 4096, 14_336, 128_256
    selected = 2 * tokens * (2 * d * d + 3 * d * ff)  # q, o; gate, up, down: forward
    fp8_flops = sum(v for k, v in result.matmul_flops.items() if k.startswith("float8"))
    assert fp8_flops == pytest.approx(30 * 3 * selected, rel=1e-9), result.matmul_flops
    # the rest in bf16: the head's (forward, two gradients) among it, k and v, blocks 0 and 31
    assert result.matmul_flops["bfloat16"] > 3 * 2 * tokens * d * vocab
    assert set(result.matmul_flops) == {"bfloat16", "float8_e4m3fn", "float8_e5m2"}
    floor = result.floor
    assert floor["peaks"]["float8_e4m3fn"] == pytest.approx(
        2 * floor["peaks"]["bfloat16"], rel=1e-3
    )
    # fp8 shortens the compute side; priced at bf16's peak, the same step is back near bf16's
    assert 1.2 < floor["without_fp8_s"] / floor["floor_s"] < 2
    assert floor["without_fp8_s"] == pytest.approx(bf16.floor["floor_s"], rel=0.05)


def test_mxfp8_on_a_b200_runs_the_selected_matmuls_as_cudnns_block_scaled_gemms():
    """fp8.scaling="mxfp8" (blocks of 32 with their own scales) on 8 B200s: XLA compiles each
    selected matmul, forward and both gradients, to `__cudnn$blockScaledDot`, e4m3 operands."""
    result = planned("llama3", "8b", 8, tgt="b200", precision="fp8-mixed", fp8__scaling="mxfp8")
    print(f"b200 mxfp8 {result.memory} {result.fp8_kernels} floor {result.floor}")
    assert result.fits, result.verdict()
    assert result.fp8_kernels == {"__cudnn$blockScaledDot": 30 * 5 * 3}, result.fp8_kernels
    tokens, d, ff = 2 * 8192, 4096, 14_336
    selected = 30 * 3 * 2 * tokens * (2 * d * d + 3 * d * ff)
    assert result.matmul_flops["float8_e4m3fn"] == pytest.approx(selected, rel=1e-9)
    assert set(result.matmul_flops) == {"bfloat16", "float8_e4m3fn"}  # gradients e4m3 too
    assert result.floor["peaks"]["float8_e4m3fn"] == 4500e12


@ON_8_H100S
def test_the_8b_on_packed_sft_rows_fits_with_cudnns_packed_layout_and_the_same_floor():
    """configs/llama3.py:8b_sft (issue 44): packed rows of 8,192 keep their examples apart in
    cuDNN's packed layout (the rows' segment lengths and offsets, no [B, H, L, L] buffer, no
    fp32 one of [L, L]), fit as the unpacked 8B does, and price attention as the causal row it
    is at most: the same FLOPs as the unpacked plan (red when PADDING_CAUSAL counts full)."""
    packed, unpacked = planned("llama3", "8b_sft", 8), planned("llama3", "8b", 8)
    assert packed.fits and packed.verdict().startswith("fits"), packed.verdict()
    att = packed.attention
    assert att["implementation"].startswith("cuDNN") and att["buffers"] == 0, att
    assert "the packed rows' layout" in att["implementation"], att
    assert "packed" not in unpacked.attention["implementation"]
    assert att["forward_calls"] >= 32 and att["backward_calls"] >= 32, att
    squares = [b for b in packed.largest if "8192,8192" in b["array"]]
    assert not squares, squares
    assert packed.matmul_flops == pytest.approx(unpacked.matmul_flops, rel=1e-6)
    assert packed.memory["temporaries"] <= unpacked.memory["temporaries"] + GiB
    print(f"8b_sft {packed.memory} vs 8b {unpacked.memory}; flops {packed.matmul_flops}")


def test_the_70b_full_fine_tune_fits_one_node_of_8_h100s_as_shipped():
    """configs/llama3.py:70b_node (issue 57): fsdp 2 x context 4, bf16-pure and q8 moments;
    it fits the 0.93 share (69.5 GiB of 73.6 planned on 2026-12-06), each sequence's attention
    in cuDNN's calls (two a chunk: `context_attention`), no [B, H, L, L] buffer, the keys and
    values gathered over the context axis and the weights over fsdp x context."""
    result = planned("llama3", "70b_node")
    assert result.mesh == {"data": 1, "fsdp": 2, "expert": 1, "context": 4, "tensor": 1}
    assert result.fits and result.memory["total"] <= 73 * GiB, result.verdict()
    assert result.involuntary == []  # no resharding by whole-tensor gathers (jax#21562)
    assert result.state_bytes_per_param < 4.1
    att = result.attention
    assert att["implementation"].startswith("cuDNN") and att["buffers"] == 0, att
    assert att["forward_calls"] >= 4 * 80 and att["backward_calls"] >= 4 * 80, att
    assert set(result.axis_bytes) == {"context", "fsdp x context"}, result.axis_bytes
    assert result.axis_bytes["fsdp x context"] > 10 * result.axis_bytes["context"]
    assert result.hazards == [] and set(result.collectives["reduce-scatter"]) == {"f32"}


def test_a_split_sequence_runs_the_tpu_kernel_with_its_offsets_on_a_v5e():
    """The tiny Llama on a v5e-4, context 4: the splash kernel in every layer (a branch per
    chunk, `splash.split_attention`), no [B, H, L, L] buffer."""
    result = planned(
        "llama3", "tiny", tgt="v5e-4", mesh__data=1, mesh__context=4, model__attention="auto",
        precision="bf16-mixed", data__seq_len=1024, model__max_len=1024,
    )  # fmt: skip
    att = result.attention
    assert att["implementation"].startswith("Pallas TPU flash attention"), att
    assert att["buffers"] == 0 and att["forward_calls"] >= 2, att
    assert "context" in result.axis_bytes, result.axis_bytes


# ---- the command line's edge cases: one line, exit 2, no traceback, before anything compiles

GPT2S_TINY = f"--config={ROOT / 'configs' / 'lm_gpt2s.py'}:tiny"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target=h100", "--devices=0"], "--devices=0: a plan is for 1 device or more"),
        (["--target=h100", "--devices=-4"], "--devices=-4: a plan is for 1 device or more"),
        (["--target=v5e-0"], "--target='v5e-0': the chip count after '-' must be a whole number"),
        (["--target=v5e-3"], "--devices=3: a v5e plan takes 1, 4, 8"),
        (["--target=v5e-\u00b2"], "the chip count after '-' must be a whole number of at least 1"),
        (["--target=v5e-8", "--devices=4"], "--target=v5e-8 names 8 devices and --devices=4"),
        (["--target=h100", "--json="], "--json= is empty: give the path of a file to write"),
        (["--target=h100", "--json={tmp}"], "a folder; give the path of a file in it"),
        (["--target=h100", "--json={tmp}/file/plan.json"], "/file is a file, not a folder"),
    ],
)
def test_the_command_line_refuses_bad_counts_and_json_paths_with_one_line(tmp_path, args, message):
    (tmp_path / "file").write_text("not a folder")
    done = _plan_cli(GPT2S_TINY, *(a.replace("{tmp}", str(tmp_path)) for a in args))
    assert done.returncode == 2, (done.stdout, done.stderr[-2000:])
    ours = [line for line in done.stderr.splitlines() if line.startswith("mptrain: error: ")]
    assert len(ours) == 1 and message in ours[0], done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing written


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write in any folder")
def test_a_json_path_in_a_folder_this_user_cannot_write_is_refused_before_the_compile(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    done = _plan_cli(GPT2S_TINY, "--target=h100", f"--json={locked}/plan.json")
    assert done.returncode == 2 and f"cannot write in {locked}" in done.stderr
    assert "Traceback" not in done.stderr


def test_ctrl_c_during_the_compile_ends_at_once_with_one_line_and_130():
    command = [sys.executable, "-m", "mptrain.plan", f"--config={ROOT / 'configs/llama3.py'}:8b"]
    command += ["--target=h100", "--devices=1", "--config.batch_size=8"]
    command += [
        "--config.data.seq_len=4096",
        "--config.mesh.fsdp=1",
        "--config.model.scan_layers=False",
    ]
    env = fake_cpu_env(1) | {"JAX_PLATFORMS": "cpu"}
    process = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    # Ctrl-C once JAX has started its backends (the CUDA plugin's fourth start-up line: main has
    # parsed the flags and built the config), then 2 s into the trace of 32 unrolled layers and
    # its compile (10-20 s here), not after a fixed wait that a quick machine spends finishing.
    seen = []
    for line in process.stderr:
        seen.append(line)
        if sum("cudart_stub" in x for x in seen) >= 4 or "gpu_hlo_schedule" in line:
            break
    time.sleep(2)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=30)
    err = "".join(seen) + err
    assert process.returncode == 130, err[-2000:]
    ours = [line for line in err.splitlines() if line.startswith("mptrain: ")]
    assert ours == ["mptrain: error: interrupted (Ctrl-C); nothing was written"], err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err and out == ""


# ---- the plan's honesty


def test_layer_norm_outputs_as_wide_as_the_sequence_are_not_attention_scores():
    # the tiny config at d_model = seq_len = 32: [B, L, D] activations are [.., 32, 32]
    fused = planned("lm_gpt2s", "tiny", data__seq_len=32)
    assert fused.attention["implementation"].startswith("cuDNN fused flash attention")
    assert fused.attention["buffers"] == 0, fused.attention
    materialized = planned("lm_gpt2s", "tiny", data__seq_len=32, model__attention="materialized")
    att = materialized.attention
    assert att["implementation"] == "materialized" and att["buffers"] > 0
    # the scores' matmul: `layers.einsum_f32_out`'s einsum, wherever it sits in the file
    source = (ROOT / "mptrain/models/layers.py").read_text().splitlines()
    line = 1 + next(i for i, t in enumerate(source) if "preferred_element_type=jnp.float32)" in t)
    assert all(
        site.startswith(("mptrain/models/attention.py", f"mptrain/models/layers.py:{line}"))
        for site in att["buffer_sites"]
    ), att


def test_xla_rematerialisation_is_reported_with_memory_before_and_the_recomputed_flops():
    result = planned("lm_gpt2s", batch_size=512)
    remat = result.xla_remat
    assert remat["before"] > 150 * GiB > remat["after"], remat
    assert 0.05 < remat["recompute_share"] < 0.5 and remat["recompute_flops"] > 10e12, remat
    text = str(result)
    assert "XLA's own rematerialisation: " in text and "TFLOP recomputed a step" in text
    assert "memory_fraction unset" in text
    assert result.capacity == int(0.75 * target.targets()["h100"].memory_bytes)


def test_the_plan_takes_the_memory_share_the_run_is_given(monkeypatch):
    h100 = target.targets()["h100"]
    given = load_config("lm_gpt2s", memory_fraction=0.85)
    monkeypatch.delenv(plan_memory.MEM_FRACTION, raising=False)
    assert plan_memory.share(h100, given)["fraction"] == 0.85  # the config's, as the run's
    monkeypatch.setenv(plan_memory.MEM_FRACTION, "0.9")
    assert plan_memory.share(h100)["fraction"] == 0.9
    assert plan_memory.share(h100, given)["fraction"] == 0.9  # the user's own variable wins
    monkeypatch.setenv(plan_memory.MEM_FRACTION, "1.5")
    with pytest.raises(plan_lib.errors.ConfigError, match="XLA_PYTHON_CLIENT_MEM_FRACTION='1.5'"):
        plan_memory.share(h100)
    assert plan_memory.share(target.targets()["v5e"])["fraction"] == 1.0


def test_fsdp_over_8_h100s_prices_its_collectives_over_nvlink_and_names_the_bound():
    result = planned("lm_1b", None, 8, mesh__data=1, mesh__fsdp=8)
    floor = result.floor
    sent = floor["network"]["NVLink"]["bytes"]
    gathered = sum(result.collectives["all-gather"].values())
    scattered = sum(result.collectives["reduce-scatter"].values())
    assert sent == pytest.approx(7 / 8 * (gathered + scattered), rel=0.01)
    assert floor["collectives_s"] == pytest.approx(sent / 450e9)
    assert floor["floor_s"] == max(floor["compute_s"], floor["memory_s"], floor["collectives_s"])
    assert floor["bound"] in ("compute", "memory", "collectives") and floor["collectives_s"] > 0.01
    assert re.search(
        r"collectives +[\d.]+ GB sent by each device over NVLink at 450 GB/s", str(result)
    )


def test_fsdp_across_nodes_prices_the_network_and_is_bound_by_it():
    result = planned("llama3", "8b", 64, mesh__fsdp=64, batch_size=64, data__seq_len=2048)
    floor = result.floor
    assert set(floor["network"]) == {"network"} and floor["bound"] == "collectives"
    assert floor["collectives_s"] > 3 * floor["memory_s"], floor


def test_devices_the_mesh_leaves_out_are_said_to_sit_idle():
    """Sweep 2026-12-06, P11: 70b_node (a mesh of 8) on --devices=16 planned "8 x NVIDIA
    H100" without a word of the 8 others."""
    planned = plan_lib.plan(load_config("llama3", "tiny", **{"mesh.data": 1}), "h100", 4)
    first = str(planned).splitlines()[0]
    assert planned.idle == 3 and "; 3 of the 4 devices asked for sit idle" in first, first
