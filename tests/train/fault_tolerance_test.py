"""Bad input and failures: every one ends in one clear line, an exit code, and nothing lost."""

import errno
import fcntl
import glob
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    ROOT,
    TINY,
    TraceCountingTrainer,
    assert_trees_bytes_equal,
    checkpoint_steps_on_disk,
    fake_cpu_env,
    plain_orbax_state,
    run_cli,
    run_cli_process,
    start_processes,
    tiny_config,
    wait_for_processes,
)

import mptrain
from mptrain import errors
from mptrain import main as main_lib
from mptrain.recipe import loss_scale as loss_scale_lib
from mptrain.train import checkpoint, loop
from mptrain.train import trainer as trainer_lib


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
    # no step was ever finite: no "last finite loss nan", and the advice fits a static scale
    assert "no step of this run was finite" in err and "nan" not in err
    assert "config.loss_scale.init_scale" in err and "learning rate is not the cause" in err
    step = checkpoint.Checkpointer(tmp_path / "checkpoints").latest_step()
    assert step in (4, 5)  # seen at the log step 4, read after step 5 was dispatched
    state = plain_orbax_state(tmp_path, step)  # the last good state: the untouched init
    assert int(state["skipped_steps"]) == step
    assert all(np.isfinite(x).all() for x in jax.tree.leaves(state["params"]))


@pytest.mark.slow  # a variant: make test keeps exit 3 for runaway non-finite steps
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
    # a loss-scale overflow: the advice is the scale's floor, not the learning rate
    assert "lower config.loss_scale.min_scale" in err and "lower the learning rate" not in err
    assert "no step of this run was finite" in err and "nan" not in err


def _diagnostic(scaler, skips, scale, last=2.5, step=100, max_skips=25):
    values = {
        "consecutive_skips": skips,
        "loss_scale": scale,
        "last_finite_loss": last,
        "skipped_steps": skips,
    }
    return loop.nonfinite_diagnostic(step, values, scaler, max_skips)


def test_the_exit_3_diagnostic_says_what_is_true_of_each_case():
    dynamic = loss_scale_lib.DynamicLossScale(scale=2.0**15, min_scale=1.0)
    assert _diagnostic(dynamic, 0, 2.0**15) is None
    assert _diagnostic(dynamic, 3, 2.0**12) is None  # still backing off, within the budget
    # backed off to a minimum of 1 and still overflowing: the gradients themselves
    stuck = _diagnostic(dynamic, 3, 1.0)
    assert "stuck at its minimum 1" in stuck and "last finite loss 2.5" in stuck
    assert "not finite even at a loss scale of 1" in stuck and "lower the learning rate" in stuck
    # out of skips while the scale still falls: its budget, not the learning rate
    falling = _diagnostic(dynamic, 25, 2.0**-10 * 2.0**15)
    assert "still backing off" in falling and "config.max_consecutive_skips" in falling
    # no loss scale: divergence after finite steps; or never finite from step 0 (the init)
    none = loss_scale_lib.NoOpLossScale()
    diverged = _diagnostic(none, 25, 1.0)
    assert "last finite loss 2.5" in diverged and "lower the learning rate" in diverged
    never = _diagnostic(none, 25, 1.0, last=float("nan"), step=25)
    assert "no step of this run was finite" in never and "nan" not in never
    assert "learning rate is not the cause" in never and "initialization" in never
    # a resumed run none of whose steps was finite: the params were trained, the rate may be it
    resumed = _diagnostic(none, 25, 1.0, last=float("nan"), step=125)
    assert "no step of this run was finite" in resumed and "lower the learning rate" in resumed


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


@pytest.mark.parametrize(
    "moment, stopped_at",
    # during eval, a second moment of the same stop: make test keeps the stop after a step
    [("step", 3), pytest.param("eval", 4, marks=pytest.mark.slow)],
)
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


# The command-line runs below: `_start_cli(workdir)` trains "forever" (until a signal);
# `_start_cli(workdir, *FINITE)` is the command that `finished_cli_run` ran without a stop.
LAST = 120
FINITE = (
    f"--config.num_train_steps={LAST}",
    "--config.optimizer.schedule=constant",
    "--config.checkpoint_every_steps=10",
    "--config.log_every_steps=5",
    "--config.eval_every_steps=40",
)
FOREVER = ("--config.num_train_steps=100000", "--config.checkpoint_every_steps=20")
RESUME = "run the same command again to resume"


def _start_cli(workdir, *overrides):
    cmd = [sys.executable, "-m", "mptrain.main", TINY, f"--workdir={workdir}"]
    cmd += list(overrides or FOREVER)
    return subprocess.Popen(cmd, cwd=ROOT, env=fake_cpu_env(1), stderr=subprocess.PIPE, text=True)


def _signal(proc, signum=signal.SIGTERM):
    sent = time.monotonic()
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, time.monotonic() - sent, err


def _wait_for(condition, proc, seconds=180, every=0.1):
    deadline = time.monotonic() + seconds
    while not condition():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(every)


def _leftovers(workdir) -> list[str]:
    return [n for n in os.listdir(Path(workdir) / "checkpoints") if not n.isdigit()]


def _stopped_at(err: str) -> int:
    """The step of the one line a stop by signal ends with: `mptrain: preempted (...) at step
    N; checkpoint written, run the same command again to resume`."""
    lines = err.strip().splitlines()
    assert "Traceback" not in err and [line for line in lines if RESUME in line] == lines[-1:]
    return int(re.search(r"at step (\d+);", lines[-1]).group(1))


@pytest.fixture(scope="module")
def finished_cli_run(tmp_path_factory):
    """The FINITE command's workdir, run without interruption."""
    workdir = tmp_path_factory.mktemp("uninterrupted")
    done = run_cli_process(TINY, f"--workdir={workdir}", *FINITE)
    assert done.returncode == 0, done.stderr[-3000:]
    return workdir


def _resumes_to_the_same_state(workdir, finished, *overrides):
    done = run_cli_process(TINY, f"--workdir={workdir}", *(overrides or FINITE))
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trees_bytes_equal(plain_orbax_state(finished, LAST), plain_orbax_state(workdir, LAST))


@pytest.mark.slow  # a CLI process: make test keeps SIGTERM at a step, in this process
def test_sigterm_to_the_cli_exits_75_within_seconds(tmp_path):
    # While starting up (restoring, compiling): nothing to save, so it exits at once.
    proc = _start_cli(tmp_path)
    _wait_for(lambda: (tmp_path / "config.json").exists(), proc)
    code, took, err = _signal(proc)
    assert code == 75 and took < 10, err[-2000:]
    assert RESUME in err and "Traceback" not in err
    # In the middle of training: it finishes the step, checkpoints it, and exits.
    proc = _start_cli(tmp_path)
    _wait_for(lambda: (tmp_path / "checkpoints" / "20").exists(), proc)
    code, took, err = _signal(proc)
    assert code == 75 and took < 10, err[-2000:]
    assert _stopped_at(err) == max(checkpoint_steps_on_disk(tmp_path)) > 20
    assert "SIGTERM received; checkpointing" in err and "preempted (SIGTERM) at" in err


@pytest.mark.slow  # a CLI process: make test keeps SIGTERM at a step, resumed exactly
def test_ctrl_c_mid_run_checkpoints_the_steps_done_and_resume_is_exact(tmp_path, finished_cli_run):
    proc = _start_cli(tmp_path, *FINITE)
    _wait_for(lambda: 10 in checkpoint_steps_on_disk(tmp_path), proc, every=0.01)
    code, took, err = _signal(proc, signal.SIGINT)
    assert code == 75 and took < 10, err[-2000:]
    step = _stopped_at(err)
    assert 10 <= step < LAST and checkpoint_steps_on_disk(tmp_path)[-1] == step
    assert "SIGINT received; checkpointing" in err and "preempted (SIGINT) at" in err
    assert not _leftovers(tmp_path)
    _resumes_to_the_same_state(tmp_path, finished_cli_run)


@pytest.mark.slow  # a variant: make test keeps SIGTERM at a step and a signal at start-up
def test_ctrl_c_during_a_save_lets_it_finish_then_stops(tmp_path, finished_cli_run):
    # Saves every 2 steps take about half of the run; the test catches one in flight by its
    # folder (orbax writes `<step>.orbax-checkpoint-tmp` and renames it when complete).
    every_2 = (*FINITE, "--config.checkpoint_every_steps=2")
    proc = _start_cli(tmp_path, *every_2)
    _wait_for(lambda: 2 in checkpoint_steps_on_disk(tmp_path), proc, every=0.005)
    in_flight = []
    while not in_flight:
        assert proc.poll() is None
        in_flight = [n for n in os.listdir(tmp_path / "checkpoints") if "tmp" in n]
    saving = int(in_flight[0].split(".")[0])
    code, _, err = _signal(proc, signal.SIGINT)
    assert code == 75, err[-2000:]
    # the save in flight was completed (a signal at its very end, or a test process that the
    # 2-core machine put aside for a while, lets more steps run)
    assert _stopped_at(err) >= saving and saving in checkpoint_steps_on_disk(tmp_path)
    assert not _leftovers(tmp_path)
    int(plain_orbax_state(tmp_path, saving)["step"])  # complete: plain orbax reads it
    _resumes_to_the_same_state(tmp_path, finished_cli_run, *every_2)


def _in_signal_masks(pid: int, signum: int, *masks: str) -> bool:
    """Whether `signum` is in any of process `pid`'s signal `masks` (Linux's /proc status:
    SigCgt, the signals it has handlers for; SigPnd and ShdPnd, those sent, not yet delivered)."""
    status = Path(f"/proc/{pid}/status").read_text()
    found = re.findall(rf"^(?:{'|'.join(masks)}):\s*([0-9a-f]+)$", status, re.MULTILINE)
    return any(int(mask, 16) >> (signum - 1) & 1 for mask in found)


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
@pytest.mark.parametrize(
    "name, moment",
    [("SIGINT", "handlers installed"), ("SIGTERM", "handlers installed"), ("SIGINT", "compiling")],
)
def test_a_signal_while_starting_up_exits_75_at_once_with_one_line(name, moment, tmp_path):
    # "handlers installed": as soon as the process catches SIGTERM (Python alone catches only
    # SIGINT), that is before validation, the dataset build and the workdir; "compiling":
    # config.json is written right before the steps compile.
    workdir = tmp_path / "run"
    proc = _start_cli(workdir)
    if moment == "compiling":
        _wait_for(lambda: (workdir / "config.json").exists(), proc, every=0.01)
    else:
        _wait_for(lambda: _in_signal_masks(proc.pid, signal.SIGTERM, "SigCgt"), proc, every=0.002)
    code, took, err = _signal(proc, signal.Signals[name])
    assert code == 75 and took < 10, err[-3000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == (
        f"mptrain: preempted ({name}) while starting up; nothing new to save, {RESUME}"
    )
    if moment == "handlers installed":
        assert not workdir.exists()  # it stopped before touching anything


@pytest.mark.slow  # a variant: make test keeps SIGTERM at a step and a signal at start-up
@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads Linux's /proc")
def test_a_second_ctrl_c_exits_at_once_with_130_and_the_run_still_resumes(
    tmp_path, finished_cli_run
):
    # The second Ctrl-C must land while the first one's checkpoint is being written: so the
    # first comes at a step with no checkpoint yet (15 to 19: they are written every 10), and
    # the second as soon as the kernel has delivered the first (two SIGINTs still pending
    # would merge into one).
    log = tmp_path / "stderr.txt"
    cmd = [sys.executable, "-m", "mptrain.main", TINY, f"--workdir={tmp_path}", *FINITE]
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=fake_cpu_env(1), stderr=stderr, text=True)
    _wait_for(lambda: "] [15] " in log.read_text(), proc, every=0.005)
    proc.send_signal(signal.SIGINT)  # the first starts a checkpoint of the steps done ...
    while _in_signal_masks(proc.pid, signal.SIGINT, "SigPnd", "ShdPnd"):
        time.sleep(0.0002)
    sent = time.monotonic()
    proc.send_signal(signal.SIGINT)  # ... which the second does not wait for
    code, took, err = proc.wait(timeout=120), time.monotonic() - sent, log.read_text()
    assert code == 130 and took < 5, err[-3000:]
    assert "Traceback" not in err
    # the last line but the log records a writer thread may still flush (`I1124 ...] [20] ...`)
    last = [line for line in err.strip().splitlines() if not re.match(r"[IWE]\d{4} ", line)][-1]
    assert last.startswith("mptrain: SIGINT again: stopped at once"), err[-3000:]
    _resumes_to_the_same_state(tmp_path, finished_cli_run)


def test_a_stop_signal_after_the_command_finished_exits_with_its_code_and_no_traceback():
    # JAX's exit hooks run after the last line; a Ctrl-C there once printed a KeyboardInterrupt.
    script = (
        "import os, signal, time\n"
        "from mptrain import runtime\n"
        "runtime.catch_stop_signals()\n"
        "runtime.end_with_on_stop_signals(75)\n"
        "os.kill(os.getpid(), signal.SIGINT)\n"
        "time.sleep(30)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stderr) == (75, "")


_FORKED_WORKER = """
import multiprocessing, os, signal, time
from mptrain import runtime
runtime.catch_stop_signals()
runtime.PreemptionFlag().__enter__()  # as in the loop: a stop signal checkpoints, then exits 75
worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(3,))
worker.start()
os.killpg(0, signal.SIGINT)  # Ctrl-C: to the whole process group, the worker too
time.sleep(0.5)
print("still running after one Ctrl-C", flush=True)
"""


@pytest.mark.slow  # a variant: make test keeps SIGTERM at a step and a signal at start-up
def test_a_forked_worker_does_not_turn_one_ctrl_c_into_two():
    # A child forked without exec inherits the wakeup fd: unless it is reset there, its own
    # SIGINT reaches the parent's watcher as a second Ctrl-C (exit 130 at once).
    cmd = [sys.executable, "-c", _FORKED_WORKER]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, start_new_session=True)
    assert done.returncode == 0 and "still running" in done.stdout, done.stderr[-2000:]


@pytest.mark.slow
@pytest.mark.xdist_group("multihost")
def test_ctrl_c_to_one_of_two_processes_stops_both_at_one_step(tmp_path):
    # JAX's preemption notifier owns SIGTERM there; a SIGINT is passed on to it, so both
    # processes agree on the step, checkpoint it and exit 75.
    mesh = ("--config.mesh.data=2", "--config.mesh.fsdp=2", "--config.precision=fp32")
    procs = start_processes(tmp_path, *mesh, *FOREVER)
    deadline = time.monotonic() + 300
    while 20 not in checkpoint_steps_on_disk(tmp_path):
        assert all(p.poll() is None for p in procs) and time.monotonic() < deadline
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGINT)
    results = wait_for_processes(procs)
    assert [code for code, _ in results] == [75, 75], "\n".join(e[-3000:] for _, e in results)
    (step,) = {_stopped_at(err) for _, err in results}
    assert step > 20 and checkpoint_steps_on_disk(tmp_path)[-1] == step


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
    manager = checkpoint.ocp.CheckpointManager  # the write under the Checkpointer's save
    real_save = manager.save

    def save(self, step, *args, **kw):
        if step == 8:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_save(self, step, *args, **kw)

    monkeypatch.setattr(manager, "save", save)
    code, err = run_cli(tmp_path, capsys=capsys)
    assert code == 1 and "No space left on device" in err and "step 8" in err
    monkeypatch.undo()
    restored = plain_orbax_state(tmp_path, 4)  # the older checkpoint is intact
    assert int(restored["step"]) == 4


@pytest.mark.slow  # a refused resume: make test keeps workdir_test's (exit 2, nothing touched)
def test_resuming_with_another_model_or_precision_is_refused(tmp_path, capsys):
    assert run_cli(tmp_path, "--config.num_train_steps=4", capsys=capsys)[0] == 0
    code, err = run_cli(tmp_path, "--config.model.d_model=48", capsys=capsys)
    assert code == 2 and "config.model.d_model=48: " in err  # the key, not a list of shapes
    assert "was trained with model.d_model=32" in err
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


@pytest.mark.slow  # a variant: make test keeps an exact resume (trainer_test)
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
