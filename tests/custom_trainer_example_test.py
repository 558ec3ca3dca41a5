"""examples/custom_trainer: a Trainer subclass for a model outside the zoo, run from the CLI."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import orbax.checkpoint as ocp

from mptrain import trainer as trainer_lib

ROOT = Path(__file__).resolve().parents[1]


def test_the_config_names_a_trainer_subclass():
    config = runpy.run_path(str(ROOT / "examples" / "custom_trainer" / "config.py"))["get_config"]()
    cls = trainer_lib.import_trainer(config.trainer)
    assert issubclass(cls, trainer_lib.Trainer) and cls is not trainer_lib.Trainer
    assert cls.loss_fn is not trainer_lib.Trainer.loss_fn


def test_runs_from_the_command_line(tmp_path):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mptrain.main",
            "--config=examples/custom_trainer/config.py:tiny",
            f"--workdir={tmp_path}",
        ],
        cwd=ROOT,  # `examples` is importable from the repository root
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval_mae" in result.stderr  # the example's own aux metric was evaluated and logged
    state = ocp.PyTreeCheckpointer().restore(tmp_path / "checkpoints" / "4" / "state")
    assert int(state["step"]) == 4
    assert "GRUCell_0" in state["params"]  # the example's own model was trained
