"""examples/custom_trainer: a Trainer subclass for a model outside the zoo, run from the CLI."""

import runpy

import pytest
from helpers import ROOT, plain_orbax_state, run_cli_process

from mptrain.train import launch
from mptrain.train import trainer as trainer_lib


def test_the_config_names_a_trainer_subclass():
    config = runpy.run_path(str(ROOT / "examples" / "custom_trainer" / "config.py"))["get_config"]()
    cls = launch.import_trainer(config.trainer)
    assert issubclass(cls, trainer_lib.Trainer) and cls is not trainer_lib.Trainer
    assert cls.loss_fn is not trainer_lib.Trainer.loss_fn


@pytest.mark.slow  # a CLI run: custom_trainer_test keeps a Trainer subclass in this process
def test_runs_from_the_command_line(tmp_path):
    result = run_cli_process(
        "--config=examples/custom_trainer/config.py:tiny", f"--workdir={tmp_path}"
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval_mae" in result.stderr  # the example's own aux metric was evaluated and logged
    state = plain_orbax_state(tmp_path, 4)
    assert int(state["step"]) == 4
    assert "GRUCell_0" in state["params"]  # the example's own model was trained
