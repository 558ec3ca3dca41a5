"""The suite's set-up, which every test and every process a test starts shares. `make test`
runs on CPU with 8 fake devices (the Makefile's XLA_FLAGS); `make test-gpu` runs the same suite on
a GPU machine. The helpers that tests import live in `tests/helpers.py`; a folder's own fixtures
live in its conftest.py.
"""

import json
import os
import shutil
import tempfile
from pathlib import Path

# `make test-plan` adds the extra mptrain[plan]: JAX's CUDA plugin and libtpu beside its CPU
# backend. Where no NVIDIA driver is, JAX would try them first at every start and print their
# errors (which the tests that read stderr would see): there the suite, and every process it
# starts, runs on the CPU, as it would without the extra.
if not (Path("/proc/driver/nvidia").exists() or shutil.which("nvidia-smi")):
    os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax
import pytest

from mptrain import config as config_lib
from mptrain import runtime

# Threads enough in XLA's CPU pool for this process's 8 fake devices (`runtime.set_cpu_threads`,
# which every run's start-up calls): JAX makes its CPU client below, before any run starts.
runtime.set_cpu_threads()

# Dozens of tests (and the CLI processes they start) compile the same tiny programs: one
# persistent compilation cache for the session, its xdist workers and their subprocesses. It
# stores XLA's executables keyed by program, flags and devices, so no test sees other numbers.
_CACHE = {
    "JAX_COMPILATION_CACHE_DIR": str(Path(tempfile.gettempdir()) / "mptrain-tests-jax-cache"),
    "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
    "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0",
}
# Tokenized text's cache (mptrain.data.tokenize) in the session's temp folder, never ~/.cache.
_CACHE["MPTRAIN_CACHE"] = str(Path(tempfile.gettempdir()) / "mptrain-tests-cache")
for _key, _value in _CACHE.items():
    os.environ.setdefault(_key, _value)
jax.config.update("jax_compilation_cache_dir", os.environ["JAX_COMPILATION_CACHE_DIR"])
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
# A GPU runs fp32 matmuls in TF32 (10 mantissa bits) by default. The tests compare the recipe's
# numbers with references and with each other, not the hardware's shortcuts: full fp32 there.
if jax.default_backend() != "cpu":
    jax.config.update("jax_default_matmul_precision", "highest")


_BASE_CONFIG = config_lib.base_config


def _on_one_device():
    config = _BASE_CONFIG()
    config.mesh.data = 1
    return config


@pytest.fixture(scope="session", autouse=True)
def one_device_by_default():
    """In this process, a config trains on one device unless its test sets a mesh: `make test`
    gives the process 8 fake CPU devices for the tests that build meshes, and the default mesh
    (every device) would shard every in-process run 8 ways. The default itself is tested in
    fresh processes with exact device counts, and by tests marked `default_mesh`. Session-wide,
    so that module fixtures get it too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config_lib, "base_config", _on_one_device)
        yield


@pytest.fixture(autouse=True)
def _default_mesh_when_marked(request, monkeypatch):
    if request.node.get_closest_marker("default_mesh"):
        monkeypatch.setattr(config_lib, "base_config", _BASE_CONFIG)


# ---- where the suite's time goes: MPTRAIN_TEST_COMPILES=<file> ------------------------------
# One JSON line a test: its seconds, the programs this process compiled during it (XLA backend
# compiles, their seconds) and the files it added to the persistent compilation cache (this
# process's and its subprocesses'; with xdist's workers sharing the folder, run with -p no:xdist
# for exact counts). A file over 20 KB is a train or eval step, a model's init or an eager
# random draw (each shape its own program).
_COMPILE_LOG = os.environ.get("MPTRAIN_TEST_COMPILES")
if _COMPILE_LOG:
    import time

    _compiles: list[float] = []
    jax.monitoring.register_event_duration_secs_listener(
        lambda event, secs, **_: (
            _compiles.append(secs)
            if event == "/jax/core/compile/backend_compile_duration"
            else None
        )
    )

    def _cache_files() -> dict[str, int]:
        with os.scandir(os.environ["JAX_COMPILATION_CACHE_DIR"]) as it:
            return {e.name: e.stat().st_size for e in it}

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item, nextitem):
        before, start = _cache_files(), time.perf_counter()
        _compiles.clear()
        yield
        new = {name: size for name, size in _cache_files().items() if name not in before}
        added = list(new.values())
        line = {
            "test": item.nodeid,
            "seconds": round(time.perf_counter() - start, 2),
            "compiles": len(_compiles),
            "compile_seconds": round(sum(_compiles), 2),
            "cache_files": len(added),
            "cache_files_over_20kb": sum(size > 20_000 for size in added),
            # their programs' names: jit_train_step, or jit__normal for an eager random draw
            "over_20kb": sorted(n.split("-", 1)[0] for n, size in new.items() if size > 20_000),
        }
        with open(_COMPILE_LOG, "a") as f:
            f.write(json.dumps(line) + "\n")
