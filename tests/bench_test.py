"""scripts/bench.py: its hand-written side trains the same model as mptrain, its model FLOPs are
what the audit counts in the traced program, its MFU takes the right peak, and it reports."""

import json
import runpy
import types

import jax
import numpy as np
import pytest
from helpers import ROOT

import mptrain
from mptrain import data as data_lib
from mptrain.inspect import audit
from mptrain.train import trainer as trainer_lib

bench = runpy.run_path(str(ROOT / "scripts" / "bench.py"))
report = bench["report"]  # scripts/bench_report.py


@pytest.mark.slow  # scripts/bench.py's runs: each side compiles its own steps
@pytest.mark.parametrize(
    "model, case",
    [
        ("lm", "fp32"),
        ("lm", "bf16-mixed"),
        ("lm", "fp16-mixed+dyn"),
        ("resnet", "bf16-mixed+dyn"),
        ("resnet", "bf16-pure"),
    ],
)
def test_the_hand_written_side_trains_the_same_model(model, case, tmp_path):
    """A ratio against the hand-written loop means something only if both sides do the same
    work: from the same init and batches, three steps land on the same params (bf16-pure
    rounds stochastically with other random bits on each side: within one bf16 ulp)."""
    config = bench["load_config"](model, case, "tiny")
    with bench["mptrain_sides"](config, tmp_path) as (_, bare, info, train):
        step, fresh, _ = bench["make_hand"](config, train)
        state = fresh()
        bare(range(3))
        for i in range(3):
            state, _ = step(state, jax.device_put(train.get_batch(i)))
        ours = jax.device_get(info["run"].state.params)
    theirs = jax.device_get(state["params"])
    tolerance = (
        {"rtol": 1e-2, "atol": 1e-2} if case == "bf16-pure" else {"rtol": 2e-3, "atol": 1e-5}
    )
    paths = []
    for (path, a), b in zip(jax.tree.leaves_with_path(ours), jax.tree.leaves(theirs), strict=True):
        assert a.dtype == b.dtype, path
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        np.testing.assert_allclose(a, b, err_msg=jax.tree_util.keystr(path), **tolerance)
        paths.append(path)
    assert len(paths) > 4


def traced_reports(config, tmp_path, sources):
    """The audit's precision reports of `config`'s traced forward pass (the loss, as bench.py
    traces it) and of its traced train step."""
    trainer = trainer_lib.Trainer(config, tmp_path)
    batch = sources(config)[0].get_batch(0)
    state = trainer.init_state(batch)
    forward = audit.precision_report(
        trainer.loss_fn, state.params, state.model_state, batch, jax.random.key(0), policy="fp32"
    )
    return forward, audit.precision_report(mptrain.make_train_step(trainer.loss_fn), state, batch)


@pytest.mark.slow  # scripts/bench.py traces each LM's step anew
@pytest.mark.parametrize("name, case", [("default", "fp32"), ("lm_gpt2s", "fp16-mixed+dyn")])
def test_lm_flops_from_the_config_are_what_the_traced_program_computes(name, case, tmp_path):
    """The LM's model FLOPs, written out from the config, against the dots JAX traces: exactly
    3x those of the forward pass, and exactly those of the step plus the one gradient the step
    does not take, the embedding's with respect to its one-hot input (2*V*d a token). Exact,
    as the model materialises the whole T x T attention scores the formula counts, masked half
    included. Two shapes, so that no wrong term can hide behind a coincidence of sizes."""
    config = bench["load_config"]("lm", case, "tiny", str(ROOT / "configs" / f"{name}.py"))
    if "attention" in config.model:  # a fused attention kernel is one call: no dots to count
        config.model.attention = "materialized"
    forward, step = map(
        report.traced_flops, traced_reports(config, tmp_path, data_lib.create_sources)
    )
    tokens, m = config.batch_size * config.data.seq_len, config.model
    flops = report.lm_flops(config)
    assert flops == 3 * forward
    assert flops == step + tokens * 2 * m.get("vocab_size", 256) * m.d_model
    source = report.model_flops(config, forward=None)[1]
    assert "config" in source


def resnet_forward_flops(config) -> tuple[int, int]:
    """`(forward FLOPs of an image, those of its stem)` of `models/resnet.py` on 32 x 32 x 3
    images, from its architecture: 3x3 convolutions, "SAME" padding, stride 2 entering each
    stage after the first, a 1x1 projection where the shape changes, a dense head."""
    m, size, channels = config.model, 32, 3
    stem = 2 * size * size * 9 * channels * m.width
    total, channels = stem, m.width
    for stage, blocks in enumerate(m.stage_sizes):
        features = m.width * 2**stage
        for block in range(blocks):
            stride = 2 if stage > 0 and block == 0 else 1
            out = size // stride
            total += 2 * out * out * 9 * (channels + features) * features  # conv1, conv2
            if stride != 1 or channels != features:
                total += 2 * out * out * channels * features
            size, channels = out, features
    return total + 2 * channels * m.num_classes, stem


@pytest.mark.slow  # scripts/bench.py traces the ResNet's programs anew
def test_resnet_flops_are_three_traced_forward_passes_of_its_shapes(tmp_path):
    """Other models' FLOPs are 3x the audit's count of the traced forward pass; for the ResNet
    that is 3x its convolutions and head written out. (The traced step itself is no measure:
    the audit counts a strided convolution's input gradient at its dilated size, zeros
    included; it is at least the step the shapes give, never less.)"""
    config = bench["load_config"]("resnet", "bf16-mixed", "tiny")
    forward, step = traced_reports(config, tmp_path, bench["sources"])
    flops, source = report.model_flops(config, lambda: forward)
    step = report.traced_flops(step)
    per_image, stem = resnet_forward_flops(config)
    assert flops == 3 * per_image * config.batch_size and "forward" in source
    assert step >= (3 * per_image - stem) * config.batch_size  # no input gradient at the stem


H100, TPU = "NVIDIA H100 80GB HBM3", "TPU v5 lite"


@pytest.mark.parametrize(
    "kind, dtype, peak",
    [
        (H100, "bfloat16", 989),
        (H100, "float16", 989),
        (H100, "float32", 495),  # TF32, as JAX runs an fp32 matmul by default
        (H100, "float32-highest", 67),
        ("NVIDIA H100 PCIe", "bfloat16", 756),
        ("NVIDIA H200", "bfloat16", 989),
        ("NVIDIA A100-SXM4-40GB", "float32", 156),
        ("NVIDIA A100 80GB PCIe", "bfloat16", 312),
        (TPU, "bfloat16", 197),
        (TPU, "float32", 197),  # one bf16 pass
        (TPU, "float32-highest", 32.8),  # six
        (TPU, "float16", None),  # no fp16 units
        ("TPU v5", "bfloat16", 459),
        ("TPU v4", "bfloat16", 275),
        ("NVIDIA H100 NVL", "bfloat16", None),  # other clocks: no MFU rather than a wrong one
        ("cpu", "float32", None),
    ],
)
def test_the_peak_is_the_device_s_dense_rate_for_the_dtype(kind, dtype, peak):
    assert report.peak_tflops(kind, dtype)[0] == peak


@pytest.mark.parametrize(
    "preset, matmuls, dtype, peak",
    [
        ("bf16-mixed", "auto", "bfloat16", 989),
        ("bf16-pure", "auto", "bfloat16", 989),
        ("fp16-mixed", "auto", "float16", 989),
        ("fp32", "auto", "float32-highest", 67),  # the fp32 preset is strict fp32
        ("fp32", "default", "float32", 495),  # TF32, as JAX runs an fp32 matmul by default
        ("bf16-mixed", "highest", "bfloat16", 989),  # 16-bit operands: one pass anyway
    ],
)
def test_mfu_takes_the_peak_of_the_row_s_matmul_dtype(preset, matmuls, dtype, peak):
    config = bench["load_config"]("lm", "fp32", "tiny")
    config.precision, config.matmul_precision = preset, matmuls
    chips = [types.SimpleNamespace(device_kind=H100)] * 2
    row = report.flop_figures(config, flops=peak * 1e9, step_ms=4.0, devices=chips)
    assert (row["peak_dtype"], row["peak_tflop_per_s"]) == (dtype, 2 * peak)
    assert row["model_tflop_per_s"] == pytest.approx(peak / 4)
    assert row["mfu"] == pytest.approx(1 / 8)  # a quarter of one chip's peak, over two chips
    cpu = report.flop_figures(config, 1e9, 4.0, [types.SimpleNamespace(device_kind="cpu")])
    assert cpu["mfu"] is None and cpu["peak_tflop_per_s"] is None


def test_a_float32_row_says_which_precision_its_matmuls_ran_at():
    rows = [
        {"case": "fp32", "peak_dtype": "float32-highest", "matmul_precision": "highest"},
        {"case": "fp32", "peak_dtype": "float32", "matmul_precision": "default"},
        {"case": "bf16-mixed", "peak_dtype": "bfloat16", "matmul_precision": "default"},
    ]
    labels = [report.case_label(row) for row in rows]
    assert labels == ["fp32@highest", "fp32@default", "bf16-mixed"]


def test_an_lm_of_over_a_tflop_a_step_runs_tiny_on_a_cpu_unless_full():
    gpt2s, default = (str(ROOT / "configs" / f"{n}.py") for n in ("lm_gpt2s", "default"))
    assert bench["resolve_size"]("lm", "small", gpt2s) == "tiny"  # what --size=auto is on a CPU
    assert bench["resolve_size"]("lm", "small", default) == "full"
    assert bench["resolve_size"]("lm", "full", gpt2s) == "full"
    assert bench["resolve_size"]("resnet", "small") == "small"
    assert report.lm_flops(runpy.run_path(gpt2s)["get_config"](None)) > 10e12


@pytest.mark.slow  # scripts/bench.py end to end; make test keeps its MFU and peak tables
def test_bench_writes_its_table_and_json(tmp_path, capsys):
    out = tmp_path / "bench.json"
    bench["main"](
        [
            "--models=lm,resnet",
            "--cases=bf16-mixed",
            "--size=tiny",
            "--blocks=1",
            "--block_steps=2",
            f"--out={out}",
        ]
    )
    result = json.loads(out.read_text())
    assert "git_commit" in result and result["device"].startswith("cpu")
    assert result["jax_version"] == jax.__version__ and result["date"][:2] == "20"
    assert result["device_kind"] == jax.devices()[0].device_kind and "xla_flags" in result
    assert [(r["model"], r["case"], r["size"]) for r in result["rows"]] == [
        ("lm", "bf16-mixed", "tiny"),
        ("resnet", "bf16-mixed", "tiny"),
    ]
    for row in result["rows"]:
        assert row["loop_ms"] > 0 and row["hand_ms"] > 0 and row["compile_s"] > 0
        expected = {"lm": 12.0, "resnet": 8.0}[row["model"]]  # adamw; sgd with momentum
        assert row["bytes_per_param"] == row["hand_bytes_per_param"] == expected
        assert row["memory"]["temp_mib"] > 0 and len(row["blocks_ms"]) == 1
        assert row["model_gflop_per_step"] > 0 and row["xla_gflop_per_step"] > 0
        assert row["model_tflop_per_s"] == pytest.approx(
            row["model_gflop_per_step"] / row["loop_ms"]
        )
        assert row["peak_dtype"] == "bfloat16" and row["matmul_precision"] == "default"
        assert row["mfu"] is None and row["device_peak_mib"] is None  # a CPU has neither
    config = bench["load_config"]("lm", "bf16-mixed", "tiny")
    assert result["rows"][0]["model_gflop_per_step"] == report.lm_flops(config) / 1e9
    assert "tokens_per_s" in result["rows"][0] and "images_per_s" in result["rows"][1]
    table = capsys.readouterr().out
    assert "loop/hand" in table and "resnet bf16-mixed" in table and "MFU" in table
    assert f"jax {jax.__version__}, {result['date']}" in table


@pytest.mark.slow  # two tiny Llama runs, each compiling its steps
def test_the_fp8_llama_table_trains_each_variant_and_names_its_fp8_matmuls(tmp_path, capsys):
    """scripts/fp8_llama_tiny.py (issue 47), a few steps: a row per variant with its eval loss
    and the matmuls it ran in fp8."""
    script = runpy.run_path(str(ROOT / "scripts" / "fp8_llama_tiny.py"))
    out = tmp_path / "fp8.json"
    args = ["--seeds=0", "--steps=3", "--variants=bf16-mixed,fp8-all", f"--out={out}"]
    result = script["main"](args)
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    bf16, fp8 = result["rows"]
    assert bf16["fp8_matmuls"] == "" and fp8["fp8_matmuls"].endswith("(14 matmuls)")
    assert fp8["ratio_to_first"] == pytest.approx(fp8["mean"] / bf16["mean"])
    assert "fp8-all" in capsys.readouterr().out
