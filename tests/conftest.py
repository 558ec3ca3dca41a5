"""Shared test helpers. Tests run on CPU with fake devices (see the Makefile's XLA_FLAGS)."""

import os
import re
import runpy
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp

import mptrain
from mptrain import config as config_lib
from mptrain import main as main_lib

ROOT = Path(__file__).resolve().parents[1]
TINY = f"--config={ROOT / 'configs' / 'default.py'}:tiny"

# Dozens of tests (and the CLI processes they start) compile the same tiny programs: one
# persistent compilation cache for the session, its xdist workers and their subprocesses. It
# stores XLA's executables keyed by program, flags and devices, so no test sees other numbers.
_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": str(Path(tempfile.gettempdir()) / "mptrain-tests-jax-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
for _key, _value in _CACHE.items():
    os.environ.setdefault(_key, _value)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def load_config(name: str, arg: str | None = "tiny", **overrides):
    """`configs/<name>.py:get_config(arg)` with dotted-key overrides, like --config.a.b=v."""
    config = runpy.run_path(str(ROOT / "configs" / f"{name}.py"))["get_config"](arg)
    return config_lib.override(config, overrides)


def tiny_config(**overrides):
    """The tiny default with a constant schedule, so its horizon is not `num_train_steps`
    (a 4-step run resumed to 8 then trains exactly as an 8-step run)."""
    return load_config("default", **{"optimizer.schedule": "constant", **overrides})


def assert_trees_bytes_equal(a, b):
    """The same leaf paths, and every leaf bit-identical in dtype, shape and bytes."""
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        name = jax.tree_util.keystr(path)
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.tobytes() == y.tobytes(), name


def plain_orbax_state(workdir, step):
    """The `state` item read back with plain orbax (no mptrain): nested dicts of numpy arrays."""
    path = (Path(workdir) / "checkpoints" / str(step) / "state").resolve()
    ckptr = ocp.PyTreeCheckpointer()
    tree = ckptr.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = ckptr.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
    assert all(isinstance(x, np.ndarray) for x in jax.tree.leaves(state))
    return state


def run_cli(workdir, *overrides, capsys=None, config=TINY):
    """`python -m mptrain.main` in-process: (exit code, stderr)."""
    argv = ["mptrain", config, f"--workdir={workdir}", *overrides]
    try:
        code = main_lib.main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err if capsys else ""
    return code, err


def run_cli_process(*args, devices: int = 1, timeout: int = 300, module: str = "mptrain.main"):
    """`python -m mptrain.main ARGS` (or another `module`) in a fresh process from the
    repository root (so that `examples` is importable), with `devices` fake CPU devices."""
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    command = [sys.executable, "-m", module, *args]
    return subprocess.run(
        command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def start_processes(workdir, *overrides, processes=2, devices=2, config=TINY):
    """Starts one job of `processes` CLI processes on localhost, `devices` fake CPU devices
    each, coordinated by `jax.distributed` (gloo collectives); `tests/` is importable, so
    `--config.trainer=multihost_helpers:...` works. Returns the `Popen`s (stderr piped)."""
    with socket.socket() as s:  # a free port for the coordinator
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "mptrain.main", config, f"--workdir={workdir}", *overrides]
    command += [
        f"--config.distributed.coordinator_address=localhost:{port}",
        f"--config.distributed.num_processes={processes}",
    ]
    return [
        subprocess.Popen(
            [*command, f"--config.distributed.process_id={i}"],
            cwd=ROOT,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(processes)
    ]


def wait_for_processes(procs, timeout=300):
    """`[(exit code, stderr)]` of the processes, once all have ended."""
    errs = [proc.communicate(timeout=timeout)[1] for proc in procs]  # drains the pipes
    return [(proc.returncode, err) for proc, err in zip(procs, errs, strict=True)]


class TraceCountingTrainer(mptrain.Trainer):
    """Counts how often the train step is traced; each trace is a compilation."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.train_step_traces = 0

    def make_train_step(self):
        train_step = super().make_train_step()

        def counted(*args):
            self.train_step_traces += 1  # runs only while tracing
            return train_step(*args)

        return counted


_DOT = re.compile(r"stablehlo\.(dot_general|convolution)\b.*:\s*\((tensor<[^)]*)\)\s*->\s*(\S+)")
_TYPE = re.compile(r"tensor<(?:[0-9?]+x)*([a-z]+[0-9]*)>")


def matmul_dtypes(lowered_text: str) -> list[tuple[tuple[str, ...], str]]:
    """(operand dtypes, result dtype) of every dot_general/convolution in a lowered program."""
    found = []
    for line in lowered_text.splitlines():
        match = _DOT.search(line)
        if match:
            operands = tuple(_TYPE.findall(match.group(2)))
            (result,) = _TYPE.findall(match.group(3))
            found.append((operands, result))
    return found
