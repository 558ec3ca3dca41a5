"""A workdir has one owner. Readers never write or delete there; what an interrupted or failed
write leaves behind never blocks the next run, which ends byte-identical to an uninterrupted
one; a failed save, a corrupt file or a config that cannot continue a run is one line and an
exit code; new files get the modes the umask gives."""

import asyncio
import errno
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
import pytest
from helpers import ROOT, TINY, assert_trees_bytes_equal, plain_orbax_state, run_cli

# orbax is imported here only to make its writes fail, or wait, where a full disk or a slow
# filesystem would: at the layer that hands array data to tensorstore and at the final rename.
from orbax.checkpoint._src.path import async_path
from orbax.checkpoint._src.serialization import serialization

from mptrain import errors, export, files
from mptrain.record import curves
from mptrain.train import checkpoint, standalone

# orbax abandons its other writes when one fails; their "exception ignored" reports are noise.
pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The tiny default trained to step 8 without a stop: what every resume must end as."""
    workdir = tmp_path_factory.mktemp("straight")
    assert run_cli(workdir)[0] == 0
    return workdir


def _copy(workdir, tmp_path) -> Path:
    return Path(shutil.copytree(workdir, tmp_path / "run"))


def _snapshot(workdir, skip_contents=()) -> dict[str, tuple]:
    """Every file and folder under `workdir` with its mode and a hash of its bytes (only the
    name for those starting with one of `skip_contents`), leaving out the run lock, which every
    run, even a refused one, stamps with its pid."""
    found = {}
    for path in sorted(Path(workdir).rglob("*")):
        name = str(path.relative_to(workdir))
        if name == ".lock":
            continue
        data = b"" if path.is_dir() or path.name.startswith(skip_contents) else path.read_bytes()
        found[name] = (path.stat().st_mode, hashlib.sha256(data).hexdigest())
    return found


def _one_error_line(err: str, *named: str) -> str:
    """The one line of `err` that is not an INFO or WARNING log line; it names each of `named`
    (so no traceback, and no error logged by a library beside it)."""
    assert "Traceback" not in err, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip() and not line.startswith(("I", "W"))]
    assert len(lines) == 1, "\n".join(lines)[-3000:]
    assert all(name in lines[0] for name in named), (lines[0], named)
    return lines[0]


# --------------------------------------------------------------- readers leave the workdir alone

_PAUSED_RUN = """
import sys
sys.path[:0] = [{tests!r}, {tests!r} + "/.."]
import workdir_test
workdir_test.pause_save({step}, {signals!r})
from mptrain import main
sys.exit(main.main(["mptrain", *sys.argv[1:]]))
"""


def pause_save(step: int, signals: str) -> None:
    """Holds this process's save of checkpoint `step` just before its final rename (every file
    written, the folder still `<step>.orbax-checkpoint-tmp`): touches `signals/paused`, then
    waits for `signals/go`. A save in progress, for as long as a test looks at it."""
    real = ocp.path.atomicity.AtomicRenameTemporaryPath.finalize
    signals = Path(signals)

    async def finalize(self):
        final = Path(self.get_final())
        if final.name == str(step) and final.parent.name == "checkpoints":
            (signals / "paused").touch()
            while not (signals / "go").exists():
                await asyncio.sleep(0.05)
        await real(self)

    ocp.path.atomicity.AtomicRenameTemporaryPath.finalize = finalize


@pytest.mark.slow  # a run and an export at once; make test keeps the export's own tests
def test_an_export_while_the_run_saves_leaves_the_save_alone(tmp_path, straight):
    workdir, signals = tmp_path / "run", tmp_path / "signals"
    signals.mkdir()
    code = _PAUSED_RUN.format(tests=str(ROOT / "tests" / "train"), step=8, signals=str(signals))
    with open(tmp_path / "stderr", "w") as err:
        run = subprocess.Popen(
            [sys.executable, "-c", code, TINY, f"--workdir={workdir}", "--config.mesh.data=1"],
            cwd=ROOT,
            env=dict(os.environ),  # this process's devices, and one of them, as `straight` had
            stderr=err,
        )
    try:
        deadline = time.monotonic() + 300
        while not (signals / "paused").exists():
            assert run.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)
        assert (workdir / "checkpoints" / f"8{checkpoint.TMP_SUFFIX}").is_dir()
        # The run may flush its event file any time; everything else stands still while it waits.
        before = _snapshot(workdir, skip_contents=("events.out.tfevents",))
        sidecar = export.export(workdir, tmp_path / "export")
        assert sidecar["source"]["step"] == 4  # the newest finished checkpoint
        assert _snapshot(workdir, skip_contents=("events.out.tfevents",)) == before
    finally:
        (signals / "go").touch()
        run.wait(timeout=300)
    assert run.returncode == 0, (tmp_path / "stderr").read_text()[-3000:]
    assert_trees_bytes_equal(plain_orbax_state(workdir, 8), plain_orbax_state(straight, 8))


# --------------------------------------------------------------- a failed save is one line

_TENSORSTORE_STATUS = {errno.ENOSPC: "RESOURCE_EXHAUSTED", errno.EROFS: "FAILED_PRECONDITION"}


def _fail_array_writes(monkeypatch, step: int, code: int, kind=ValueError) -> None:
    """Makes the writes of checkpoint `step`'s array data fail the way tensorstore fails (a
    ValueError naming the file, with the errno in its text), as a full disk made it fail here
    on a 700 KiB tmpfs."""
    real = serialization.async_serialize_from_host

    async def write(value, tspec, *args, **kwargs):
        base = tspec["kvstore"]["base"]["path"]
        if f"/{step}{checkpoint.TMP_SUFFIX}/" in base:
            status, leaf = _TENSORSTORE_STATUS.get(code, "UNKNOWN"), tspec["kvstore"]["path"]
            raise kind(
                f'{status}: Error writing "{leaf}" in OCDBT database at local file "{base}": '
                f'Failed writing: "{base}d/0123": '
                f"Failed to write 58237 bytes to file 14: {os.strerror(code)} "
                f"[os_error_code='{code}']"
            )
        return await real(value, tspec, *args, **kwargs)

    monkeypatch.setattr(serialization, "async_serialize_from_host", write)


def _fail_commit_file(monkeypatch, step: int, code: int) -> None:
    """Makes the commit marker of checkpoint `step`, orbax's last file before the rename, fail
    to be written with an OSError, as a filesystem gone read-only or a lost permission would."""
    real = async_path.write_text

    async def write_text(path, text, *args, **kwargs):
        if f"/{step}{checkpoint.TMP_SUFFIX}" in str(path):
            raise OSError(code, os.strerror(code), str(path))
        return await real(path, text, *args, **kwargs)

    monkeypatch.setattr(async_path, "write_text", write_text)


def test_a_full_disk_under_the_array_data_is_one_line_then_the_resume_is_exact(
    tmp_path, straight, monkeypatch, capfd
):
    _fail_array_writes(monkeypatch, 8, errno.ENOSPC)
    code, err = run_cli(tmp_path, capsys=capfd)
    assert code == 1
    _one_error_line(err, f"{tmp_path}/checkpoints/8", "disk full", "steps [4]")
    assert int(plain_orbax_state(tmp_path, 4)["step"]) == 4  # the older checkpoint is intact
    monkeypatch.undo()
    assert run_cli(tmp_path, capsys=capfd)[0] == 0
    assert not list((tmp_path / "checkpoints").glob(f"*{checkpoint.TMP_SUFFIX}"))
    assert_trees_bytes_equal(plain_orbax_state(tmp_path, 8), plain_orbax_state(straight, 8))


@pytest.mark.parametrize(
    "fail, code, says",
    [
        ("array data (ValueError)", errno.ENOSPC, "disk full"),
        ("array data (RuntimeError)", errno.EROFS, "read-only filesystem"),
        ("commit file (OSError)", errno.EACCES, "permission denied"),
    ],
)
@pytest.mark.parametrize("surfaces_at", ["save", "wait", "the next save", "close"])
def test_every_storage_failure_of_a_save_is_one_storage_error(
    tmp_path, monkeypatch, caplog, fail, code, says, surfaces_at
):
    state = {"w": jnp.arange(256.0)}
    ckpt = checkpoint.Checkpointer(tmp_path, async_save=surfaces_at != "save")
    ckpt.save(1, state, {})
    ckpt.wait()
    if fail.startswith("array data"):
        _fail_array_writes(monkeypatch, 2, code, ValueError if "Value" in fail else RuntimeError)
    else:
        _fail_commit_file(monkeypatch, 2, code)
    with caplog.at_level(logging.INFO), pytest.raises(errors.StorageError) as info:
        ckpt.save(2, state, {})  # an async save fails later, in its own threads
        {"wait": ckpt.wait, "the next save": lambda: ckpt.save(3, state, {})}.get(
            surfaces_at, ckpt.close
        )()
    message = str(info.value)
    assert "\n" not in message and f"{tmp_path}/2" in message, message
    assert says in message and "steps [1]" in message, message
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no orbax tracebacks
    monkeypatch.undo()
    ckpt.close()  # the failure is not raised twice
    with checkpoint.Checkpointer(tmp_path) as reopened:
        restored, meta = reopened.restore(jax.eval_shape(lambda: state))
    assert meta["step"] == 1
    assert_trees_bytes_equal(restored, state)


def test_the_write_tasks_of_a_failed_save_log_nothing_after_its_one_line(
    tmp_path, monkeypatch, caplog
):
    """Sweep 2026-12-06, F01: after the one line, asyncio logged "Task exception was never
    retrieved" with orbax's traceback for each other write of the save that failed (seen in 1
    run of 3 on a 2.4 MB tmpfs). Once a save has failed, such records of a storage failure go;
    any other unretrieved exception is still logged."""
    _fail_array_writes(monkeypatch, 1, errno.ENOSPC)
    with checkpoint.Checkpointer(tmp_path) as ckpt, pytest.raises(errors.StorageError):
        ckpt.save(1, {"w": jnp.arange(256.0)}, {})
    full = ValueError(  # as tensorstore words it (the whole of F01's is in the sweep)
        'RESOURCE_EXHAUSTED: Error writing "w/0.0" in OCDBT database at local file "d/": '
        "Failed to write 58237 bytes to file 14: No space left on device [os_error_code='28']"
    )
    asyncio_log = logging.getLogger("asyncio")
    with caplog.at_level(logging.ERROR, logger="asyncio"):
        for message, error in (
            ("Task exception was never retrieved", full),
            ("Future exception was never retrieved", full),
            ("Task exception was never retrieved", RuntimeError("a bug")),
        ):
            asyncio_log.error("%s\nfuture: <Task>", message, exc_info=(type(error), error, None))
    kept = [r.exc_info[1] for r in caplog.records if r.name == "asyncio"]
    assert [str(e) for e in kept] == ["a bug"], kept


def test_a_full_disk_at_the_first_checkpoint_says_there_is_no_older_one(tmp_path, monkeypatch):
    """Sweep 2026-12-06: it read "the older ones are intact (steps [])"."""
    _fail_array_writes(monkeypatch, 1, errno.ENOSPC)
    with checkpoint.Checkpointer(tmp_path) as ckpt, pytest.raises(errors.StorageError) as info:
        ckpt.save(1, {"w": jnp.arange(256.0)}, {})
    assert str(info.value).endswith("disk full (No space left on device); there is no older one")


@pytest.mark.parametrize("error", [TimeoutError("barrier timed out"), ConnectionResetError()])
def test_a_timeout_or_a_lost_connection_is_no_storage_failure(error):
    # An OSError, but not the disk's: it must surface as itself, not as "could not write".
    assert files.storage_error(error, "the checkpoint of step 2") is None
    assert files.storage_error(OSError(errno.ENOSPC, "full"), "x") is not None


def test_a_storage_error_inside_a_job_is_told_as_the_job(tmp_path, monkeypatch):
    """The export's sidecar is written with `files.write_json`, which names its own (staging)
    file; the export's handler tells the reader which export failed and why."""

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(files, "_write_text", full)
    out = tmp_path / "exports" / "e"
    with pytest.raises(errors.StorageError) as info, export._written(out) as staging:
        standalone.save_params(staging, {"w": jnp.zeros(2, jnp.float32)})
        files.write_json(staging / "export.json", {"step": 1})
    assert str(info.value).startswith(f"could not write the export at {out}: disk full")
    assert not out.exists() and os.listdir(out.parent) == []


# --------------------------------------------------------------- a corrupt meta is skipped


def _corrupt_meta(directory: Path, step: int, how: str) -> None:
    path = directory / str(step) / checkpoint.META_ITEM / "metadata"
    meta = json.loads(path.read_text())
    text = {
        "cut short": path.read_text()[: len(path.read_text()) // 2],
        "not an object": "[1, 2]",
        "no step": json.dumps({k: v for k, v in meta.items() if k != "step"}),
        "another step": json.dumps({**meta, "step": step + 5}),
        "config not an object": json.dumps({**meta, "config": "bf16"}),
        "policy not a string": json.dumps({**meta, "policy": 3}),
    }[how]
    path.write_text(text)


_HOW = ["cut short", "not an object", "no step", "another step", "config not an object"]


@pytest.mark.parametrize("how", [*_HOW, "policy not a string"])
def test_a_corrupt_meta_is_skipped_naming_its_file(tmp_path, caplog, how):
    state, config = {"w": jnp.arange(16.0)}, {"model": {"width": 4}, "num_train_steps": 9}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        for step in (1, 2):
            ckpt.save(step, state, {"config": config, "policy": "bf16"})
    _corrupt_meta(tmp_path, 2, how)
    with checkpoint.Checkpointer(tmp_path) as ckpt, caplog.at_level(logging.WARNING):
        _, step, _ = checkpoint.resume(ckpt, state, "bf16", config)
    assert step == 1
    (warning,) = [r.getMessage() for r in caplog.records if "Skipping" in r.getMessage()]
    assert f"{tmp_path}/2/meta" in warning
    _corrupt_meta(tmp_path, 1, how)
    with checkpoint.Checkpointer(tmp_path) as ckpt, pytest.raises(errors.WorkdirError) as info:
        checkpoint.resume(ckpt, state, "bf16", config)
    assert f"{tmp_path}/1/meta" in str(info.value) and f"{tmp_path}/2/meta" in str(info.value)


@pytest.mark.parametrize("which", ["the newest", "every"])
def test_a_run_past_corrupt_metas(tmp_path, straight, capfd, which):
    workdir = _copy(straight, tmp_path)
    for step in (8, 4) if which == "every" else (8,):
        _corrupt_meta(workdir / "checkpoints", step, "no step")
    before = _snapshot(workdir)
    code, err = run_cli(workdir, capsys=capfd)
    if which == "every":  # unusable: exit 2, as for corrupt arrays, and nothing touched
        assert code == 2
        _one_error_line(err, f"{workdir}/checkpoints/8/meta", f"{workdir}/checkpoints/4/meta")
        assert _snapshot(workdir) == before
    else:  # back to step 4, and on to the same step 8
        assert code == 0, err[-3000:]
        assert_trees_bytes_equal(plain_orbax_state(workdir, 8), plain_orbax_state(straight, 8))


# --------------------------------------------------------------- leftovers never block


def test_leftovers_of_interrupted_json_writes_never_block(tmp_path, straight, capfd):
    # A run stopped after its step-4 checkpoint, in the middle of writes of its own: JSON files,
    # and the checkpoint of a step that is never saved again (a run resumes at whole intervals).
    workdir = _copy(straight, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / "8")
    numerics, checkpoints = workdir / "numerics", workdir / "checkpoints"
    leftovers = [numerics / ".7.json.k3j4_h5g.tmp", workdir / ".config.json.ab12cd34.tmp"]
    for path in leftovers:
        path.parent.mkdir(exist_ok=True)
        path.write_text('{"step": 7, "lay')
    leftovers.append(checkpoints / f"6{checkpoint.TMP_SUFFIX}")
    shutil.copytree(checkpoints / "4", leftovers[-1])
    history = workdir / "history.jsonl"
    history.write_text(history.read_text() + '{"step": 9, "lo')  # cut short, no newline
    # a changed key that leaves the step's program alone, seen in the config.json rewritten
    code, err = run_cli(workdir, "--config.max_checkpoints_to_keep=7", capsys=capfd)
    assert code == 0, err[-3000:]
    assert not any(path.exists() for path in leftovers)
    assert json.loads((workdir / "config.json").read_text())["max_checkpoints_to_keep"] == 7
    loss_steps, _ = curves.load(workdir)["loss"]
    assert loss_steps == [2, 4, 6, 8]  # the lines after the cut-short one were all read
    assert_trees_bytes_equal(plain_orbax_state(workdir, 8), plain_orbax_state(straight, 8))


# --------------------------------------------------------------- modes follow the umask


@pytest.fixture
def umask():
    """The process's umask at 022 for the test (which may set another), then as it was."""
    previous = os.umask(0o022)
    yield
    os.umask(previous)


def _mode(path) -> int:
    return Path(path).stat().st_mode & 0o777


@pytest.mark.parametrize("mask", [0o022, 0o027, 0o077])
def test_write_json_gives_what_the_umask_gives(tmp_path, umask, mask):
    os.umask(mask)
    files.write_json(tmp_path / "deep" / "x.json", {"a": 1})
    assert _mode(tmp_path / "deep" / "x.json") == 0o666 & ~mask
    assert _mode(tmp_path / "deep") == 0o777 & ~mask


@pytest.mark.slow  # a variant: make test keeps an export's modes under the umask
def test_a_runs_json_files_follow_the_umask(tmp_path, umask, capfd):
    # fp16 with a huge loss scale: both steps overflow, so both get a numerics table.
    overrides = ["--config.precision=fp16-mixed", "--config.numerics.per_layer=True"]
    overrides += ["--config.loss_scale.init_scale=1e9", "--config.loss_scale.max_scale=1e10"]
    code, err = run_cli(tmp_path, *overrides, "--config.num_train_steps=2", capsys=capfd)
    assert code == 0, err[-3000:]
    tables = sorted((tmp_path / "numerics").glob("*.json"))
    assert [p.name for p in tables] == ["0.json", "1.json"]
    assert {_mode(p) for p in [tmp_path / "config.json", *tables]} == {0o644}
    assert _mode(tmp_path / "numerics") == 0o755


# --------------------------------------------------------------- a resume that cannot continue


@pytest.mark.parametrize(
    "override, named",
    [
        ("--config.model.num_heads=4", ["config.model.num_heads=4", "model.num_heads=2"]),
        ("--config.model.dropout_rate=0.1", ["config.model.dropout_rate=0.1", "=0.0"]),
        ("--config.num_train_steps=6", ["config.num_train_steps=6", "step 8"]),
    ],
)
def test_a_resume_that_cannot_continue_is_exit_2_and_touches_nothing(
    tmp_path, straight, capfd, override, named
):
    workdir = _copy(straight, tmp_path)
    before = _snapshot(workdir)
    code, err = run_cli(workdir, override, capsys=capfd)
    assert code == 2
    _one_error_line(err, *named, f"{workdir}/checkpoints/8")
    assert _snapshot(workdir) == before


@pytest.mark.slow  # a variant: make test keeps a resume that compares the model keys
def test_a_resume_with_other_intervals_or_learning_rate_goes_on(tmp_path, straight, capfd):
    workdir = _copy(straight, tmp_path)
    shutil.rmtree(workdir / "checkpoints" / "8")
    changes = ["--config.log_every_steps=4", "--config.optimizer.learning_rate=0.001"]
    code, err = run_cli(workdir, *changes, capsys=capfd)
    assert code == 0, err[-3000:]
    assert checkpoint.Checkpointer(workdir / "checkpoints", read_only=True).latest_step() == 8


def test_a_resume_of_a_finished_run_changes_no_checkpoint(tmp_path, straight, capfd):
    workdir = _copy(straight, tmp_path)
    before = _snapshot(workdir / "checkpoints")
    assert run_cli(workdir, capsys=capfd)[0] == 0
    assert _snapshot(workdir / "checkpoints") == before


def test_a_resume_compares_the_model_keys_both_configs_have(tmp_path):
    state, saved = {"w": jnp.arange(4.0)}, {"model": {"name": "lm", "width": 4}}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        ckpt.save(8, state, {"config": saved, "policy": "p"})
    # a key the checkpoint's mptrain did not have yet is no difference; a changed one is
    newer = {"model": {"name": "lm", "width": 4, "attention": "auto"}, "num_train_steps": 8}
    wider = {**newer, "model": {**newer["model"], "width": 5}}
    with checkpoint.Checkpointer(tmp_path) as ckpt:
        assert checkpoint.resume(ckpt, state, "p", newer)[1] == 8
        with pytest.raises(errors.ConfigError, match=r"config\.model\.width=5: .* model\.width=4"):
            checkpoint.resume(ckpt, state, "p", wider)
