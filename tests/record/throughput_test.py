"""Speed in the record (issue 36, point 1): step time, tokens/s, MFU from analytic FLOPs."""

import logging
import types

import pytest
from helpers import event_series, run_cli

from mptrain.record import curves, throughput

H100 = types.SimpleNamespace(device_kind="NVIDIA H100 80GB HBM3")


def test_device_kinds_find_their_spec_and_a_cpu_none():
    kinds = {
        "NVIDIA H100 80GB HBM3": "h100",
        "NVIDIA A100-SXM4-80GB": "a100",
        "TPU v5 lite": "v5e",
        "TPU v5p": "v5p",
        "TPU v4": "v4",
    }
    for kind, name in kinds.items():
        assert throughput.chip_of(types.SimpleNamespace(device_kind=kind)).name == name, kind
    assert throughput.chip_of(types.SimpleNamespace(device_kind="cpu")) is None


def test_lm_flops_count_matmul_params_and_half_the_attention_scores():
    params = {
        "Embed_0": {"embedding": types.SimpleNamespace(size=256 * 32)},  # gathered: not counted
        "pos_embedding": types.SimpleNamespace(size=32 * 32),  # added: not counted
        "block_0": {"attn": {"qkv": types.SimpleNamespace(size=32 * 96)}},
        "head": {"kernel": types.SimpleNamespace(size=32 * 256)},
    }
    model = types.SimpleNamespace(vocab_size=256, d_model=32, num_layers=1, num_heads=2)
    per_token = throughput.lm_flops_per_token(params, model, seq_len=32)
    # 6 x (3072 + 8192) matmul params + 6 x 1 layer x 32 wide x 32 positions (causal: half of 12)
    assert per_token == 6 * (32 * 96 + 32 * 256) + 6 * 1 * 32 * 32


def test_mfu_of_an_h100_from_known_figures():
    # a 7B-class step: 6.7e9 matmul params, 4 x 2048 tokens a step on 8 H100s in bf16, 0.5 s
    chip = throughput.chip_of(H100)
    peak = chip.peak("bfloat16")
    assert peak == 989.4e12
    flops_per_step = 6 * 6.7e9 * 4 * 2048 * 8  # each device's 4 sequences of 2048 tokens
    got = throughput.mfu(flops_per_step, 0.5, 8, peak)
    assert got == pytest.approx(6 * 6.7e9 * 4 * 2048 / 0.5 / 989.4e12)
    assert got == pytest.approx(0.6657, abs=1e-4)  # 66.6% of the bf16 peak


def test_the_meter_leaves_out_time_spent_outside_train_steps(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(throughput.time, "monotonic", lambda: now[0])
    clock = throughput.Clock()
    meter = throughput.Meter(clock, 0, ("tokens", 1000), 2, 4e12, 989.4e12)
    now[0] += 3.0  # 10 steps in 3 s of which 1 s is an evaluation
    with clock.section("eval"):
        now[0] += 1.0
        with clock.section("checkpoints"):  # inside the evaluation: counted once
            now[0] += 0.5
    values = meter.values(10)
    assert values["step_time_s"] == pytest.approx(0.3)
    assert values["tokens_per_s"] == pytest.approx(1000 / 0.3)
    assert values["tokens_per_s_per_device"] == pytest.approx(1000 / 0.3 / 2)
    assert values["steps_per_sec"] == pytest.approx(10 / 4.5)
    assert values["mfu"] == pytest.approx(4e12 / 0.3 / 2 / 989.4e12)
    assert clock.spent == pytest.approx({"eval": 1.0, "checkpoints": 0.5})
    assert clock.goodput() == pytest.approx(3.0 / 4.5)


def test_packed_rows_count_their_real_tokens_only_in_tokens_per_s_and_mfu(monkeypatch, caplog):
    """A source that counts real tokens (`data.sft`'s packed rows): tokens/s and MFU are of
    those, not of the rows' padding, and the progress line says "real tokens/s"."""
    now = [100.0]
    monkeypatch.setattr(throughput.time, "monotonic", lambda: now[0])
    asked = []

    def count(start, stop):  # 600 real tokens in each 1,000-token batch
        asked.append((start, stop))
        return 600 * (stop - start)

    meter = throughput.Meter(throughput.Clock(), 0, ("tokens", 1000), 2, 4e12, 989.4e12, 10, count)
    now[0] += 3.0
    caplog.set_level(logging.INFO)
    values = meter.values(10)
    assert asked == [(0, 10)]  # batches 0 .. 9 made steps 1 .. 10
    assert values["tokens_per_s"] == pytest.approx(600 / 0.3)
    assert values["mfu"] == pytest.approx(0.6 * 4e12 / 0.3 / 2 / 989.4e12)
    assert "2000 real tokens/s" in caplog.text


def test_a_tiny_run_records_its_speed_and_goodput(tmp_path, capsys):
    code, _ = run_cli(tmp_path, "--config.num_train_steps=4")
    assert code == 0
    out = capsys.readouterr().out
    for tag in ("step_time_s", "tokens_per_s", "tokens_per_s_per_device", "steps_per_sec"):
        series = event_series(tmp_path, tag)
        assert sorted(series) == [2, 4], tag
        assert all(v > 0 for v in series.values()), (tag, series)
    tokens = event_series(tmp_path, "tokens_per_s")[4]
    step_time = event_series(tmp_path, "step_time_s")[4]
    assert tokens * step_time == pytest.approx(8 * 32, rel=1e-3)  # batch 8 x 32 tokens
    assert not event_series(tmp_path, "mfu")  # a CPU has no peak in mptrain/targets/
    (goodput,) = event_series(tmp_path, "goodput").values()
    assert 0 < goodput < 1
    assert "goodput" in out and "set-up and compiles" in out


def test_the_history_keeps_the_speed():
    assert set(throughput.KEYS) <= set(curves.KEYS)


def test_the_progress_line_shows_the_speed():
    import io

    from mptrain.record import metrics

    line = metrics.ProgressLine(10, io.StringIO()).update(
        5, {"loss": 2.0, "tokens_per_s": 12345.6, "mfu": 0.4123}
    )
    assert "12,346 tok/s" in line and "MFU 41.2%" in line


def test_a_bf16_lm_on_an_h100_gets_mfu_against_the_bf16_peak(monkeypatch):
    import jax.numpy as jnp
    from helpers import tiny_config

    from mptrain import config as config_lib

    config = tiny_config()  # the tiny LM: width 32, 1 layer, 2 heads, batch 8 x 32 tokens
    params = {"Embed_0": {"embedding": jnp.zeros((256, 32))}, "w": jnp.zeros((32, 100))}
    state = types.SimpleNamespace(params=params, policy=config_lib.policy_of(config))
    h100 = throughput.chip_of(H100)
    monkeypatch.setattr(throughput, "chip_of", lambda device: h100)
    now = [0.0]
    monkeypatch.setattr(throughput.time, "monotonic", lambda: now[0])
    meter = throughput.create_meter(config, state, 0, throughput.Clock())
    now[0] += 2.0  # 4 steps of 0.5 s
    values = meter.values(4)
    flops = (6 * 3200 + 6 * 1 * 32 * 32) * 8 * 32  # per token (the table is not a matmul) x tokens
    assert values["tflops_per_device"] == pytest.approx(flops / 0.5 / 1e12)
    assert values["mfu"] == pytest.approx(flops / 0.5 / 989.4e12)  # bf16-mixed: bf16's peak
