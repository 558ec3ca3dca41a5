"""Ctrl-C ends `python -m mptrain.plan` at once from its first milliseconds (issue 42, sweep
cases D22, D22b, D22c), not only once jax has loaded: `import mptrain.plan` loads no jax, so its
watcher is up before the half second of imports. The import needs no accelerator compiler; the
Ctrl-C test does (`plan` marker: without the plugin the command refuses the target at once)."""

import signal
import subprocess
import sys
import time

import pytest
from helpers import ROOT, fake_cpu_env


def test_importing_the_plan_package_loads_no_jax():
    probe = "import sys, mptrain.plan; print(sorted(m for m in sys.modules if m.startswith('jax')))"
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout == "[]\n", done.stderr[-2000:]


def _ignoring_ctrl_c():  # as a shell's background job starts: SIGINT ignored until set
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.mark.plan  # without the compiler plugin the command ends (exit 2) before 0.3 s
def test_ctrl_c_a_third_of_a_second_after_start_ends_the_fit_with_one_line_and_130():
    command = [sys.executable, "-m", "mptrain.plan", f"--config={ROOT / 'configs/default.py'}:tiny"]
    process = subprocess.Popen(
        [*command, "--target=h100", "--fit"],
        cwd=ROOT,
        env=fake_cpu_env(1) | {"JAX_PLATFORMS": "cpu"},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_ignoring_ctrl_c,
    )
    time.sleep(0.3)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate(timeout=120)
    assert process.returncode == 130, err[-2000:]
    ours = [line for line in err.splitlines() if line.startswith("mptrain: ")]
    assert ours == ["mptrain: error: interrupted (Ctrl-C); nothing was written"], err[-2000:]
    assert "Traceback" not in err and out == ""
