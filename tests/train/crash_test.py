"""kill -9, or Ctrl-C, at random moments, again and again: the run still ends exactly where it
should.

Slow (each trial starts a fresh process): `make test-slow` runs them; `make test` skips them.
"""

import random
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import (
    ROOT,
    assert_trees_bytes_equal,
    checkpoint_steps_on_disk,
    fake_cpu_env,
    plain_orbax_state,
)

# Each kill or Ctrl-C costs a process start (about 6 s on a 2-core machine): eight kills and six
# Ctrl-Cs land in steps and in saves alike (one every 3 steps); twenty and ten (2026-12-06: 52 s
# and 82 s of make test-slow) found no other moment.
TRIALS = 8
CTRL_C_TRIALS = 6
# The interrupted runs' length, far past where the kills leave them (2026-12-06: default.py
# checkpointed step 42 by its 20th kill, llama3.py step 9 by its 6th), so each kill interrupts.
STEPS = 400
# The interrupted run then resumes to a few steps past its newest checkpoint, and the straight
# run trains to that step: with a constant learning rate and no warmup, a run's steps do not
# depend on num_train_steps, which a resume may move (to no less than its checkpoint's step).
PAST_THE_LAST_CHECKPOINT = 5


def _command(workdir, steps=STEPS, checkpoint_every=3, config="default.py"):
    return [
        sys.executable,
        "-m",
        "mptrain.main",
        f"--config={ROOT / 'configs' / config}:tiny",
        f"--workdir={workdir}",
        f"--config.num_train_steps={steps}",
        "--config.optimizer.schedule=constant",
        "--config.optimizer.warmup_steps=0",
        f"--config.checkpoint_every_steps={checkpoint_every}",  # often: kills land in saves
        "--config.log_every_steps=5",
        "--config.eval_every_steps=50",
        "--config.eval_steps=2",
    ]


def _env():
    # conftest's persistent compilation cache is in os.environ: later starts skip compiling
    return fake_cpu_env(1)


def _end(workdir) -> int:
    """The step to finish at: a few past `workdir`'s newest checkpoint, which must exist (else
    no kill or Ctrl-C has left anything to resume from)."""
    newest = max(checkpoint_steps_on_disk(workdir), default=0)
    assert newest > 0, "no checkpoint on disk after the interruptions"
    return newest + PAST_THE_LAST_CHECKPOINT


@pytest.mark.slow
@pytest.mark.parametrize(
    ("config", "trials"),
    # llama3.py:tiny: scanned layers, remat "full", the chunked loss
    [("default.py", TRIALS), ("llama3.py", 6)],
)
def test_kill_9_at_random_moments_then_resume_matches_an_uninterrupted_run(
    tmp_path, config, trials
):
    rng = random.Random(0)
    crashed, env = tmp_path / "crashed", _env()
    command = lambda workdir, steps=STEPS: _command(workdir, steps, config=config)
    kills = 0
    while kills < trials:
        proc = subprocess.Popen(command(crashed), cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        started = lambda: list(crashed.glob("events.out.tfevents.*"))  # the writer is up
        while not started() and proc.poll() is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(rng.uniform(0.0, 2.5))
        if proc.poll() is not None:
            assert proc.returncode == 0
            break  # finished before this kill: nothing left to interrupt
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        kills += 1
    assert kills >= trials, f"the run finished after only {kills} kills; raise STEPS"
    end = _end(crashed)
    final = subprocess.run(command(crashed, end), cwd=ROOT, env=env, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-3000:]

    straight = tmp_path / "straight"
    done = subprocess.run(command(straight, end), cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trees_bytes_equal(plain_orbax_state(straight, end), plain_orbax_state(crashed, end))
    print(f"kill -9 ({config}): {kills} kills, then resumed to step {end}")


# Each Ctrl-C lands a random number of steps (0 to 9) into a run, at a random moment of a step
# or of a save (one every 3 steps), so a trial moves the run on by 5 steps on average on any
# machine (the moment within a step or a save is what varies; the straight run to the end
# trains the total): the trials stay well short of STORM_STEPS (then the run resumes to `_end`).
STORM_STEPS = 800


def _wait_for_training(workdir, proc, runs_before: int) -> None:
    """Until this process's event file appears: its writer is made last thing before the loop."""
    deadline = time.monotonic() + 120
    while len(list(workdir.glob("events.out.tfevents.*"))) <= runs_before:
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.02)


@pytest.mark.slow
def test_ctrl_c_at_random_moments_then_resume_matches_an_uninterrupted_run(tmp_path):
    rng = random.Random(1)
    stopped, env = tmp_path / "stopped", _env()
    command = _command(stopped, STORM_STEPS)
    lines = []  # the line each Ctrl-C ended a run with
    while len(lines) < CTRL_C_TRIALS:
        runs_before = len(list(stopped.glob("events.out.tfevents.*")))
        start = max(checkpoint_steps_on_disk(stopped), default=0)
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
        _wait_for_training(stopped, proc, runs_before)
        target = start + rng.randint(0, 9)
        while max(checkpoint_steps_on_disk(stopped), default=0) < target and proc.poll() is None:
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.15))  # somewhere in a step or a save
        assert proc.poll() is None, "the run finished: raise STORM_STEPS"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 75 and "Traceback" not in err, err[-3000:]
        lines.append(err.strip().splitlines()[-1])
        assert "run the same command again to resume" in lines[-1]
        assert not list((stopped / "checkpoints").glob("*tmp*"))  # no save left half-done
    steps = [int(m.group(1)) for m in map(re.compile(r"at step (\d+);").search, lines) if m]
    assert len(steps) >= CTRL_C_TRIALS // 2, lines  # most landed in the loop, not in the start-up
    end = _end(stopped)
    resume = _command(stopped, end)
    final = subprocess.run(resume, cwd=ROOT, env=env, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-3000:]

    # The uninterrupted run saves only at its end: saving changes nothing of the training.
    straight = tmp_path / "straight"
    once = _command(straight, end, checkpoint_every=end)
    done = subprocess.run(once, cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trees_bytes_equal(plain_orbax_state(straight, end), plain_orbax_state(stopped, end))
    print(
        f"Ctrl-C storm: stopped at steps {steps}; {len(lines) - len(steps)} while starting up; "
        f"resumed to step {end}"
    )
