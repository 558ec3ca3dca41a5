"""Background checkpoints (`config.checkpoint_async`, issue 36 point 3): training goes on while
orbax writes, no checkpoint is read before it is complete, and a failed background write stops
the run with one line and the last complete checkpoint intact. The kill -9 and Ctrl-C storms
with async saves are `make test-slow`'s (crash_test.py, fault_tolerance_test.py here)."""

import asyncio
import errno
import json
import os
import threading
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from helpers import assert_trees_bytes_equal, plain_orbax_state, run_cli, stderr_lines

# orbax is imported here only to hold or fail a save's writes, as a slow or full disk would.
from orbax.checkpoint._src.serialization import serialization

from mptrain import errors
from mptrain.train import checkpoint

_FINALIZE = ocp.path.atomicity.AtomicRenameTemporaryPath.finalize


def _hold_finalize(monkeypatch, step: int, until) -> dict:
    """Holds the save of checkpoint `step` before its rename (every file written, the folder
    still a temporary one) until `until()` holds or 20 s pass; returns what it saw."""
    seen = {"held": False, "released": None}

    async def finalize(self):
        if Path(self.get_final()).name == str(step):
            seen["held"] = True
            deadline = time.monotonic() + 20
            while not until() and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            seen["released"] = bool(until())
        await _FINALIZE(self)

    monkeypatch.setattr(ocp.path.atomicity.AtomicRenameTemporaryPath, "finalize", finalize)
    return seen


def test_steps_run_while_a_save_is_written_and_the_save_holds_the_state_it_was_given(
    tmp_path, monkeypatch
):
    go = threading.Event()
    seen = _hold_finalize(monkeypatch, 1, go.is_set)
    step = jax.jit(lambda s: jax.tree.map(lambda x: x * 1.5 + 1.0, s), donate_argnums=0)
    state = step({"w": jnp.arange(4096.0), "b": jnp.ones((64, 64), jnp.bfloat16)})
    saved = jax.device_get(state)
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, state, {})
    for _ in range(5):  # the state is donated: its buffers are reused while the save goes on
        state = step(state)
        jax.block_until_ready(state)
        assert ckpt.in_flight() == 1
        ckpt.check()  # nothing failed: no wait, no error
    assert not (tmp_path / "1").exists()  # not a checkpoint yet: still a temporary folder
    assert checkpoint.Checkpointer(tmp_path, read_only=True).all_steps() == []
    go.set()
    ckpt.wait()
    assert seen == {"held": True, "released": True} and ckpt.in_flight() is None
    restored, meta = ckpt.restore(jax.eval_shape(lambda: saved))
    assert meta["step"] == 1
    assert_trees_bytes_equal(restored, saved)
    ckpt.close()


def test_a_read_waits_for_the_save_in_flight(tmp_path, monkeypatch):
    go = threading.Event()
    _hold_finalize(monkeypatch, 1, go.is_set)
    state = {"w": jnp.arange(16.0)}
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, state, {})
    threading.Timer(0.5, go.set).start()
    started = time.monotonic()
    restored, meta = ckpt.restore(jax.eval_shape(lambda: state))  # blocks until step 1 is whole
    assert time.monotonic() - started >= 0.4 and meta["step"] == 1
    assert_trees_bytes_equal(restored, state)
    ckpt.close()


def _fail_writes(monkeypatch, step: int) -> None:
    """The array writes of checkpoint `step` fail as tensorstore fails on a full disk."""
    real = serialization.async_serialize_from_host

    async def write(value, tspec, *args, **kwargs):
        base = tspec["kvstore"]["base"]["path"]
        if f"/{step}{checkpoint.TMP_SUFFIX}/" in base:
            await asyncio.sleep(0.2)  # the run is past the save when it fails
            raise ValueError(
                f'RESOURCE_EXHAUSTED: Error writing in OCDBT database at local file "{base}": '
                f"{os.strerror(errno.ENOSPC)} [os_error_code='{errno.ENOSPC}']"
            )
        return await real(value, tspec, *args, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", write)


def test_check_raises_a_failed_background_write_once_it_is_over(tmp_path, monkeypatch):
    state = {"w": jnp.arange(64.0)}
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=True)
    ckpt.save(1, state, {})
    ckpt.wait()
    _fail_writes(monkeypatch, 2)
    ckpt.save(2, state, {})  # returns: the write fails in the background
    ckpt.check()  # still in flight: no error yet, no wait
    deadline = time.monotonic() + 10
    with pytest.raises(errors.StorageError) as info:
        while time.monotonic() < deadline:
            ckpt.check()
            time.sleep(0.05)
    message = str(info.value)
    assert "\n" not in message and f"{tmp_path}/2" in message and "disk full" in message
    assert "steps [1]" in message
    ckpt.close()  # told once
    monkeypatch.undo()
    with checkpoint.Checkpointer(tmp_path) as reopened:
        assert reopened.all_steps() == [1]
        assert_trees_bytes_equal(reopened.restore(jax.eval_shape(lambda: state))[0], state)


@pytest.mark.parametrize(
    "setting, platform, expected",
    [
        (None, "gpu", True),
        (None, "tpu", True),
        (None, "cpu", False),
        (True, "cpu", True),
        (False, "gpu", False),
    ],
)
def test_checkpoint_async_is_on_by_default_on_accelerators(setting, platform, expected):
    assert checkpoint.use_async(setting, platform) is expected


def _async_runs(monkeypatch) -> tuple[str, ...]:
    """The trainer's checkpointer saves in the background, as `--config.checkpoint_async=True`
    (returned, for the command line) asks on any platform."""
    real = checkpoint.Checkpointer

    def background(*args, **kwargs):
        return real(*args, **{**kwargs, "async_save": True})

    monkeypatch.setattr(checkpoint, "Checkpointer", background)
    return ("--config.checkpoint_async=True",)


def _history_steps(workdir) -> list[int]:
    path = Path(workdir) / "history.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if line.endswith("}")]


_RUN = ("--config.num_train_steps=8", "--config.log_every_steps=1", "--config.eval_every_steps=8")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """An 8-step run saving in the foreground: the bytes every other run must end with."""
    workdir = tmp_path_factory.mktemp("straight")
    code, err = run_cli(workdir, *_RUN, "--config.checkpoint_every_steps=4")
    assert code == 0, err
    return workdir


def test_a_run_trains_on_while_its_checkpoint_is_written(tmp_path, monkeypatch, capsys, straight):
    flags = _async_runs(monkeypatch)
    # Checkpoint 4 is held unfinished until the run has logged step 7: a run that waited for
    # its save would never get there, and the hold would end unmet after 20 s.
    seen = _hold_finalize(monkeypatch, 4, lambda: max(_history_steps(tmp_path), default=0) >= 7)
    code, err = run_cli(tmp_path, *_RUN, *flags, "--config.checkpoint_every_steps=4", capsys=capsys)
    assert code == 0, err
    assert seen == {"held": True, "released": True}
    assert_trees_bytes_equal(plain_orbax_state(tmp_path, 8), plain_orbax_state(straight, 8))
    assert_trees_bytes_equal(plain_orbax_state(tmp_path, 4), plain_orbax_state(straight, 4))


def test_a_failed_background_write_stops_the_run_in_one_line(
    tmp_path, monkeypatch, capsys, straight
):
    flags = _async_runs(monkeypatch)
    _fail_writes(monkeypatch, 4)
    code, err = run_cli(tmp_path, *_RUN, *flags, "--config.checkpoint_every_steps=2", capsys=capsys)
    assert code == 1, err
    (line,) = [line for line in stderr_lines(err) if line.startswith("mptrain")]
    assert f"{tmp_path}/checkpoints/4" in line and "disk full" in line and "steps [2]" in line
    assert "Traceback" not in err
    steps = sorted(int(n) for n in os.listdir(tmp_path / "checkpoints") if n.isdigit())
    assert 4 not in steps and 2 in steps
    assert int(plain_orbax_state(tmp_path, 2)["step"]) == 2  # the last complete one, intact
    monkeypatch.undo()
    assert run_cli(tmp_path, *_RUN, "--config.checkpoint_every_steps=4", capsys=capsys)[0] == 0
    assert_trees_bytes_equal(plain_orbax_state(tmp_path, 8), plain_orbax_state(straight, 8))
