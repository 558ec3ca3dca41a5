"""scripts/gpu_check.py cannot rot between the rare sessions that have a GPU: its `--dry-run`
runs every part at test sizes on this CPU, each in its own process, and each part writes its
result line. In `make test-plan` (a minute of compiles that `make test` need not repeat)."""

import json
import subprocess
import sys

import pytest
from helpers import ROOT

pytestmark = pytest.mark.plan

PARTS = ("a", "m", "torch", "b", "e", "c", "f", "a2", "d")


def test_the_dry_run_runs_every_part_and_writes_a_line_each(tmp_path):
    out = tmp_path / "out"
    argv = [sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run", f"--out={out}"]
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
    for part in ("b", "c"):  # the record's speed and the compiled step's own memory
        assert by[part]["tokens_per_s"] > 0 and by[part]["compiled_gib"] > 0, by[part]
    assert "jit_train_step" in by["e"]["table"] and "top kernels" in by["e"]["table"]
    assert by["f"]["loop_over_bare"] > 0 and by["f"]["bare_over_hand"] > 0
    assert by["d"]["fp8_ms"] > 0
    assert max(by["m"]["errors"].values()) < 1e-2 and by["m"]["kernel_ms"] > 0  # stand-ins
    summary = json.loads((out / "gpu_check.json").read_text())
    assert summary["dry_run"] and len(summary["results"]) == len(records)
    assert "part" in proc.stdout and "results in" in proc.stdout  # the table at the end


def test_a_part_that_fails_is_a_line_and_the_rest_still_run(tmp_path):
    """A part that breaks (here e, with no trace to read) leaves an error line with its log's
    tail; the parts after it run; the exit code says one failed."""
    out = tmp_path / "out"
    argv = [sys.executable, str(ROOT / "scripts/gpu_check.py"), "--dry-run", f"--out={out}"]
    argv += ["--parts=e,torch"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 1, proc.stdout
    records = [json.loads(line) for line in (out / "gpu_check.jsonl").read_text().splitlines()]
    assert [r["part"] for r in records] == ["e", "torch"]
    assert records[0]["error"] == "exit 1" and "no trace" in "\n".join(records[0]["log_tail"])
