"""A run's record resumes like its state: after a stop and a resume, or a crash that leaves
records past the newest checkpoint, history.jsonl and TensorBoard hold what a run that never
stopped holds, entry for entry (issue 27)."""

import json
import os
import shutil
import signal

import pytest
from helpers import tiny_config

import mptrain
from mptrain import errors
from mptrain.record import throughput
from mptrain.train import trainer as trainer_lib

# a log interval (5 steps) that a checkpoint (every 3) and a stop (at step 3 or 7) cut
KEYS = {
    "num_train_steps": 12,
    "log_every_steps": 5,
    "checkpoint_every_steps": 3,
    "eval_every_steps": 6,
    "optimizer.schedule": "constant",
}


def _history(workdir) -> list[dict]:
    """The history's rows without the speed (`throughput.KEYS`: timings differ run to run)."""
    rows = [json.loads(line) for line in (workdir / "history.jsonl").read_text().splitlines()]
    return [{k: v for k, v in row.items() if k not in throughput.KEYS} for row in rows]


def _tensorboard(workdir, tag: str) -> list[tuple[int, float]]:
    """`(step, value)` of `tag` as TensorBoard's server shows the workdir: one run, every file
    in order, the events a restarted session's START makes stale dropped."""
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.util import tensor_util

    events = plugin_event_accumulator.EventAccumulator(str(workdir), size_guidance={"tensors": 0})
    events.Reload()
    return [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in events.Tensors(tag)]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    mptrain.run(tiny_config(**KEYS), workdir)
    return workdir


class _StopAt(trainer_lib.Trainer):
    """Sends itself SIGTERM after step `at`, inside a log interval."""

    at = 7

    def build_hooks(self, run):
        def stop(step):
            if step == self.at:
                os.kill(os.getpid(), signal.SIGTERM)

        return [*super().build_hooks(run), stop]


@pytest.mark.parametrize("at", [3, pytest.param(7, marks=pytest.mark.slow)])  # a variant
def test_a_stop_inside_a_log_interval_logs_what_the_straight_run_logs(at, straight, tmp_path):
    stopped = _StopAt(tiny_config(**KEYS), tmp_path)
    stopped.at = at
    with pytest.raises(errors.Preempted):
        stopped.train_and_evaluate()
    mptrain.run(tiny_config(**KEYS), tmp_path)
    assert _history(tmp_path) == _history(straight)  # the losses at 5 and 10 among them
    assert _tensorboard(tmp_path, "loss") == _tensorboard(straight, "loss")


def test_records_past_the_newest_checkpoint_are_dropped_before_a_resume(straight, tmp_path):
    """A kill -9 after step 12's records but before checkpoint 12 is complete: the newest
    checkpoint is 9, and the history and event files hold steps 10 to 12 already."""
    crashed = tmp_path / "crashed"
    shutil.copytree(straight, crashed)
    shutil.rmtree(crashed / "checkpoints" / "12")
    assert [row["step"] for row in _history(crashed)].count(12) == 2  # loss and eval_loss
    mptrain.run(tiny_config(**KEYS), crashed)
    assert _history(crashed) == _history(straight)
    for tag in ("loss", "eval_loss"):
        assert _tensorboard(crashed, tag) == _tensorboard(straight, tag)


class _Crash(BaseException):
    """Stands for a kill -9: nothing of mptrain's catches it."""


class _CrashAfterSaving(trainer_lib.Trainer):
    def build_hooks(self, run):
        def crash(step):
            if step == 6:  # after step 6's checkpoint, before the next call reads its log
                raise _Crash

        return [*super().build_hooks(run), crash]


@pytest.mark.slow  # a variant: make test keeps the records dropped past a checkpoint
def test_a_log_step_checkpointed_has_its_line_written_first(tmp_path):
    keys = {**KEYS, "num_train_steps": 9, "log_every_steps": 3, "checkpoint_every_steps": 3}
    mptrain.run(tiny_config(**keys), tmp_path / "straight")
    with pytest.raises(_Crash):
        _CrashAfterSaving(tiny_config(**keys), tmp_path / "crashed").train_and_evaluate()
    assert 6 in [row["step"] for row in _history(tmp_path / "crashed")]
    mptrain.run(tiny_config(**keys), tmp_path / "crashed")
    assert _history(tmp_path / "crashed") == _history(tmp_path / "straight")
