"""scripts/gpu_check.py cannot rot between the rare sessions that have a GPU: its `--dry-run`
runs every part at test sizes on this CPU, each in its own process, and each part writes its
result line. In `make test-plan` (two minutes of compiles that `make test` need not repeat)."""

import json
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.plan

PARTS = ("k", "m", "p", "r", "a", "torch", "d", "b", "e", "s", "l", "c", "f", "a2")


def test_the_dry_run_runs_every_part_and_writes_a_line_each(tmp_path):
    """The tiny Llama's plans first (`--make-plans --dry-run`), which parts b and s read; then
    every part in one process (`--together`: the second test runs a process a part)."""
    out, plans = tmp_path / "out", tmp_path / "plans"
    script = [sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run", f"--plans={plans}"]
    proc = subprocess.run([*script, "--make-plans=h100"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.count("written") == 2, proc.stdout + proc.stderr
    argv = [*script, f"--out={out}", "--together"]  # one process: one JAX start-up
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert not [r for r in records if "error" in r], records
    assert {r["part"] for r in records} == set(PARTS)
    by = {}
    for r in records:  # the first line of each part
        by.setdefault(r["part"], r)
    assert by["a"]["bf16_ms"] > 0 and by["a"]["fp32_ms"] > 0
    assert by["torch"]["skipped"] == "dry run"
    for part in ("b", "c", "l"):  # the record's speed and the compiled step's own memory
        assert by[part]["tokens_per_s"] > 0 and by[part]["compiled_gib"] > 0, by[part]
    assert "jit_train_step" in by["e"]["table"] and "top kernels" in by["e"]["table"]
    assert by["f"]["loop_over_bare"] > 0 and by["f"]["bare_over_hand"] > 0
    assert by["d"]["fp8_ms"] > 0
    assert max(by["m"]["errors"].values()) < 1e-2 and by["m"]["kernel_ms"] > 0  # stand-ins
    assert by["m"]["within"] and 0 < max(by["m"]["errors_vs_fp32"].values()) < 1e-2
    kernels = {r["case"]: r for r in records if r["part"] == "k"}  # every case within bounds
    assert len(kernels) == 5 and all(r["within"] for r in kernels.values()), kernels
    assert max(kernels["split over 4, jnp kernel"]["errors"].values()) < 1e-5
    assert set(kernels["sinks, window 16"]["errors"]) == {"out", "dq", "dk", "dv", "dsinks"}
    packed = [r for r in records if r["part"] == "p"]
    assert packed[0]["within"] and packed[0]["fp32_vs_alone"] < 1e-5, packed[0]
    # scripts/bench_sft.py's rows: packing fills a row (deterministic), one example a row
    # leaves most of it padding; the timed ratio of 2 steps is a smoke run, not a measurement
    shares = packed[1]["packed_real_share"], packed[1]["unpacked_real_share"]
    assert shares[0] > 0.85 > 0.5 > shares[1] and shares[0] / shares[1] > 2, packed[1]
    assert packed[1]["overrides"] == {"batch_size": 8, "data.seq_len": 256}, packed[1]
    assert by["r"]["precision"] == "bf16-mixed" and by["r"]["update"]["max"] < 0.1, by["r"]
    assert by["s"]["ms_per_token"] > 0 and by["s"]["tokens"] == 16, by["s"]
    assert by["s"]["plan_ms_floor"] > 0 and by["s"]["over_floor"] > 0, by["s"]  # the plans read
    assert by["b"]["plan_gib"] > 0 and by["b"]["plan_floor_ms"] > 0, by["b"]
    assert by["l"]["tokens_per_s"] > 0 and by["l"]["compiled_gib"] > 0, by["l"]
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["dry_run"] and len(summary["results"]) == len(records)
    assert "part" in proc.stdout and "results in" in proc.stdout  # the table at the end


@pytest.mark.parametrize("together", [False, True])
def test_a_part_that_fails_is_a_line_and_the_rest_still_run(tmp_path, together):
    """A part that breaks (here e, with no trace to read) leaves an error line with its log's
    tail; the parts after it run; the exit code says one failed. In their own processes, as on
    the GPU, and all in one (`--together`)."""
    out = tmp_path / "out"
    argv = [sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run", f"--out={out}"]
    argv += ["--parts=e,torch", *(["--together"] if together else [])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout
    records = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [r["part"] for r in records] == ["e", "torch"]
    tail = records[0]["log_tail"]  # a process's exit, or the traceback's last line
    assert records[0]["error"] == (tail[-1] if together else "exit 1"), records[0]
    assert "no trace" in "\n".join(tail)
