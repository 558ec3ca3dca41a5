"""`python -m mptrain.export`: a run's params in the dtype they serve in, restorable with plain
orbax, and bad usage that writes nothing."""

import json

import numpy as np
import pytest
from conftest import plain_orbax_state, run_cli, run_cli_process

from mptrain import checkpoint, export


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    assert (
        run_cli(workdir, "--config.num_train_steps=4", "--config.checkpoint_every_steps=2")[0] == 0
    )
    return workdir


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out |= _flat(value, f"{prefix}/{key}" if prefix else key)
        return out
    return {prefix: tree}


def test_a_bf16_export_restores_with_plain_orbax_keeping_norms_in_fp32(finished_run, tmp_path):
    out = tmp_path / "bf16"
    export.export(finished_run, out, "bfloat16", keep_fp32=r"(^|/)ln_")
    exported = _flat(checkpoint.load_standalone(out))
    master = _flat(plain_orbax_state(finished_run, 4)["params"])
    assert set(exported) == set(master)
    norms = [path for path in exported if "/ln_" in f"/{path}"]
    assert norms  # the LM's LayerNorm scales and biases
    for path, value in exported.items():
        assert isinstance(value, np.ndarray)
        if path in norms:
            assert value.dtype == np.float32 and np.array_equal(value, master[path]), path
        else:
            assert value.dtype.name == "bfloat16", path
            assert value.tobytes() == master[path].astype(value.dtype).tobytes(), path
    sidecar = json.loads((out / "export.json").read_text())
    assert sidecar["source"]["step"] == 4 and sidecar["dtype"] == "bfloat16"
    assert sorted(sidecar["kept_fp32"]) == sorted(norms)
    assert sidecar["policy"] and sidecar["config"]["precision"] == "bf16-mixed"


def test_a_chosen_step_and_fp16(finished_run, tmp_path):
    sidecar = export.export(finished_run, tmp_path / "fp16", "float16", step=2)
    assert sidecar["source"]["step"] == 2
    leaves = _flat(checkpoint.load_standalone(tmp_path / "fp16"))
    assert {x.dtype.name for x in leaves.values()} == {"float16"}


@pytest.mark.parametrize(
    "args, says",
    [
        (["--dtype=int8"], "--dtype"),
        (["--step=3"], "--step=3"),
        (["--keep_fp32=(unclosed"], "--keep_fp32"),
        (["--workdir=/nonexistent/run"], "--workdir=/nonexistent/run"),
    ],
)
def test_bad_usage_exits_2_with_one_line_and_writes_nothing(finished_run, tmp_path, args, says):
    out = tmp_path / "out"
    argv = [f"--workdir={finished_run}", f"--out={out}", *args]
    result = run_cli_process(*argv, module="mptrain.export")
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.stderr
    assert not out.exists() and not list(tmp_path.glob(".export-*"))
