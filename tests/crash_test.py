"""kill -9 at random moments, again and again: the run still ends exactly where it should.

Slow (each trial starts a fresh process): `make test-slow` runs it; `make test` skips it.
"""

import os
import random
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, assert_trees_bytes_equal, plain_orbax_state

TRIALS = 20
STEPS = 400


def _command(workdir):
    return [
        sys.executable,
        "-m",
        "mptrain.main",
        f"--config={ROOT / 'configs' / 'default.py'}:tiny",
        f"--workdir={workdir}",
        f"--config.num_train_steps={STEPS}",
        "--config.optimizer.schedule=constant",
        "--config.checkpoint_every_steps=3",  # saves are frequent, so kills land inside them
        "--config.log_every_steps=5",
        "--config.eval_every_steps=50",
    ]


def _env():
    # conftest's persistent compilation cache is in os.environ: later starts skip compiling
    return dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")


@pytest.mark.slow
def test_kill_9_at_random_moments_then_resume_matches_an_uninterrupted_run(tmp_path):
    rng = random.Random(0)
    crashed, env = tmp_path / "crashed", _env()
    kills = 0
    while kills < TRIALS:
        proc = subprocess.Popen(_command(crashed), cwd=ROOT, env=env, stderr=subprocess.DEVNULL)
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
    assert kills >= TRIALS, f"the run finished after only {kills} kills; raise STEPS"
    final = subprocess.run(_command(crashed), cwd=ROOT, env=env, capture_output=True, text=True)
    assert final.returncode == 0, final.stderr[-3000:]

    straight = tmp_path / "straight"
    done = subprocess.run(_command(straight), cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_trees_bytes_equal(plain_orbax_state(straight, STEPS), plain_orbax_state(crashed, STEPS))
