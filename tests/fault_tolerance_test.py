"""Bad input and failures: every one ends in one clear line, an exit code, and nothing lost."""

import errno
import fcntl
import glob
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import (
    ROOT,
    TINY,
    TraceCountingTrainer,
    assert_trees_bytes_equal,
    plain_orbax_state,
    run_cli,
    tiny_config,
)

import mptrain
from mptrain import checkpoint, errors
from mptrain import main as main_lib
from mptrain import trainer as trainer_lib


@pytest.mark.parametrize(
    "override, named",
    [
        ("--config.optimizer.learning_rate=0", "optimizer.learning_rate"),
        ("--config.optimizer.learning_rate=nan", "optimizer.learning_rate"),
        ("--config.num_train_steps=0", "num_train_steps"),
        ("--config.checkpoint_every_steps=-1", "checkpoint_every_steps"),
        ("--config.precision=bf17-mixed", "bf17-mixed"),
        ("--config.loss_scale.growth_factor=1.0", "loss_scale.growth_factor"),
        ("--config.loss_scale.backoff_factor=1.5", "loss_scale.backoff_factor"),
        ("--config.loss_scale.kind=dinamic", "loss_scale.kind"),
        ("--config.optimizer.name=adam", "optimizer.name"),
        ("--config.batch_size=abc", "batch_size"),
        ("--config.no_such_key=1", "no_such_key"),
        ("--config.trainer=nowhere:Trainer", "config.trainer"),
    ],
)
def test_bad_config_exits_2_naming_the_key_and_writes_nothing(override, named, tmp_path, capsys):
    workdir = tmp_path / "run"
    code, err = run_cli(workdir, override, capsys=capsys)
    assert code == 2
    assert named in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert not workdir.exists()


def test_missing_config_file(tmp_path, capsys):
    try:
        main_lib.main(["mptrain", "--config=configs/nope.py", f"--workdir={tmp_path}"])
    except SystemExit as e:
        assert e.code == 2
    assert "configs/nope.py" in capsys.readouterr().err


def test_runaway_non_finite_steps_exit_3_with_a_diagnostic(tmp_path, capsys):
    # fp16 with a static scale of 1e30: every backward pass overflows, nothing can recover.
    code, err = run_cli(
        tmp_path,
        "--config.precision=fp16-mixed",
        "--config.loss_scale.kind=static",
        "--config.loss_scale.init_scale=1e30",
        "--config.max_consecutive_skips=4",
        capsys=capsys,
    )
    assert code == 3
    assert "4 non-finite steps in a row" in err and "loss scale 1e+30" in err
    step = checkpoint.Checkpointer(tmp_path / "checkpoints").latest_step()
    assert step in (4, 5)  # seen at the log step 4, read after step 5 was dispatched
    state = plain_orbax_state(tmp_path, step)  # the last good state: the untouched init
    assert int(state["skipped_steps"]) == step
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state["params"]))


def test_a_dynamic_scale_stuck_at_its_minimum_exits_3(tmp_path, capsys):
    code, err = run_cli(
        tmp_path,
        "--config.precision=fp16-mixed",
        "--config.loss_scale.init_scale=1e30",
        "--config.loss_scale.min_scale=1e30",
        "--config.loss_scale.max_scale=1e31",
        capsys=capsys,
    )
    assert code == 3 and "stuck at its minimum" in err


class _SigtermAt(trainer_lib.Trainer):
    """Sends itself SIGTERM at a chosen moment: during eval, or after a step."""

    moment = "step"

    def evaluate(self, *args, **kwargs):
        if self.moment == "eval":
            os.kill(os.getpid(), signal.SIGTERM)
        return super().evaluate(*args, **kwargs)

    def build_hooks(self, run):
        def kill_at_3(step):
            if self.moment == "step" and step == 3:
                os.kill(os.getpid(), signal.SIGTERM)

        return [*super().build_hooks(run), kill_at_3]


@pytest.mark.parametrize("moment, stopped_at", [("step", 3), ("eval", 4)])
def test_sigterm_checkpoints_then_resume_is_exact(moment, stopped_at, tmp_path):
    trainer = _SigtermAt(tiny_config(), tmp_path)
    trainer.moment = moment
    with pytest.raises(errors.Preempted) as info:
        trainer.train_and_evaluate()
    assert info.value.exit_code == 75 and info.value.step == stopped_at
    assert checkpoint.Checkpointer(tmp_path / "checkpoints").latest_step() == stopped_at
    mptrain.run(tiny_config(), tmp_path)
    straight = mptrain.run(tiny_config(), tmp_path / "straight")
    assert_trees_bytes_equal(
        plain_orbax_state(tmp_path, 8), plain_orbax_state(tmp_path / "straight", 8)
    )
    assert int(straight.step) == 8


def _start_cli(workdir):
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    cmd = [sys.executable, "-m", "mptrain.main", TINY, f"--workdir={workdir}"]
    cmd += ["--config.num_train_steps=100000", "--config.checkpoint_every_steps=20"]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)


def _sigterm(proc):
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, time.monotonic() - sent, err


def _wait_for(condition, proc, seconds=180):
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)


def test_sigterm_to_the_cli_exits_75_within_seconds(tmp_path):
    # While starting up (restoring, compiling): nothing to save, so it exits at once.
    proc = _start_cli(tmp_path)
    _wait_for(lambda: (tmp_path / "config.json").exists(), proc)
    code, took, err = _sigterm(proc)
    assert code == 75 and took < 10, err[-2000:]
    assert "run the same command again to resume" in err
    # In the middle of training: it finishes the step, checkpoints it, and exits.
    proc = _start_cli(tmp_path)
    steps = lambda: checkpoint.Checkpointer(tmp_path / "checkpoints").all_steps()
    _wait_for(lambda: (tmp_path / "checkpoints" / "20").exists(), proc)
    code, took, err = _sigterm(proc)
    assert code == 75 and took < 10, err[-2000:]
    assert max(steps()) > 20


def test_a_second_run_on_the_same_workdir_is_refused(tmp_path, capsys):
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("pid 12345 on elsewhere\n")
        held.flush()
        code, err = run_cli(tmp_path, capsys=capsys)
    assert code == 2 and "in use by another run" in err and "pid 12345" in err
    assert not (tmp_path / "checkpoints").exists()


def test_unwritable_workdir_is_a_clear_error(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, err = run_cli(blocker / "run", capsys=capsys)
    assert code == 2 and "not writable" in err and "Traceback" not in err


def test_disk_full_keeps_older_checkpoints(tmp_path, monkeypatch, capsys):
    real_save = checkpoint.Checkpointer.save

    def save(self, step, state, meta, **kw):
        if step == 8:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, step, state, meta, **kw)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save)
    code, err = run_cli(tmp_path, capsys=capsys)
    assert code == 1 and "No space left on device" in err and "step 8" in err
    monkeypatch.undo()
    restored = plain_orbax_state(tmp_path, 4)  # the older checkpoint is intact
    assert int(restored["step"]) == 4


def test_resuming_with_another_model_or_precision_is_refused(tmp_path, capsys):
    assert run_cli(tmp_path, "--config.num_train_steps=4", capsys=capsys)[0] == 0
    code, err = run_cli(tmp_path, "--config.model.d_model=48", capsys=capsys)
    assert code == 2 and "params" in err and "float32[48" in err
    code, err = run_cli(tmp_path, "--config.precision=fp32", capsys=capsys)
    assert code == 2 and "compute=bfloat16" in err and "compute=float32" in err
    # a new learning rate is fine, and is logged
    code, _ = run_cli(tmp_path, "--config.optimizer.learning_rate=0.001", capsys=capsys)
    assert code == 0


def _flip_a_byte_in_the_largest_data_file(step_dir: Path):
    files = [Path(p) for p in glob.glob(str(step_dir / "state" / "**" / "d" / "*"), recursive=True)]
    target = max(files, key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF  # mid-file: inside compressed array data, no orbax checksum
    target.write_bytes(bytes(data))


def test_corrupt_newest_checkpoint_falls_back_and_finishes_identically(tmp_path):
    straight = tmp_path / "straight"
    mptrain.run(tiny_config(), straight)
    damaged = tmp_path / "damaged"
    mptrain.run(tiny_config(), damaged)
    _flip_a_byte_in_the_largest_data_file(damaged / "checkpoints" / "8")
    trainer = TraceCountingTrainer(tiny_config(), damaged)
    state = trainer.train_and_evaluate()
    assert trainer.train_step_traces == 1  # it really trained again, from step 4
    assert int(state.step) == 8
    assert_trees_bytes_equal(plain_orbax_state(straight, 8), plain_orbax_state(damaged, 8))
