"""The second sweep of bad input (issue 27): what a demanding user tries, and what each gets.

One test per rule family, parametrized over its cases: choices read in any case, numbers with an
upper bound that follows from what they mean, modules that fail to import, workdirs of the
wrong shape, settings without effect, and a run's record that resumes like its state.
"""

import json
import os
import signal
import time

import pytest
from conftest import tiny_config

from mptrain import checkpoint, errors, models, trainer
from mptrain import config as config_lib


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.attention", "AUTO"),
        ("model.attention", " Materialized "),
        ("model.name", "Transformer_LM"),
        ("data.name", "TEXT"),
        ("precision", "BF16-Mixed"),
        ("loss_scale.kind", "Dynamic"),
        ("optimizer.name", "AdamW"),
        ("optimizer.schedule", "Cosine"),
        ("param_rounding", "Nearest"),
    ],
)
def test_every_choice_is_read_in_any_case(key, value, tmp_path):
    config = tiny_config(**{key: value})
    config_lib.validate(config)
    built = trainer.Trainer(config, tmp_path)
    built.build_datasets()
    assert models.loss_unit(config) == "nats/byte"


class _SigtermMidEval(trainer.Trainer):
    """Sends itself SIGTERM as the third batch of an evaluation is taken."""

    def evaluate(self, state, source=None, eval_step=None):
        self.calls = 0

        def counting(state, batch):
            self.calls += 1
            if self.calls == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return eval_step(state, batch)

        return super().evaluate(state, source, counting)


def test_a_stop_signal_during_a_long_evaluation_stops_within_a_batch(tmp_path):
    config = tiny_config(eval_steps=100_000, eval_every_steps=4, num_train_steps=8)
    stopping = _SigtermMidEval(config, tmp_path)
    started = time.monotonic()
    with pytest.raises(errors.Preempted) as info:
        stopping.train_and_evaluate()
    assert info.value.step == 4 and stopping.calls == 3  # the signal came as batch 3 was taken
    assert time.monotonic() - started < 120
    assert checkpoint.Checkpointer(tmp_path / "checkpoints").latest_step() == 4
    rows = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert not [row for row in rows if "eval_loss" in row]  # the partial evaluation is dropped
