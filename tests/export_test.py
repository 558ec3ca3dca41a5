"""`python -m mptrain.export`: a run's params in the dtype they serve in, restorable with plain
orbax, and bad usage that writes nothing."""

import errno
import json
import os
import shutil
import subprocess
import threading
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from absl import logging
from helpers import (
    assert_trees_bytes_equal,
    plain_orbax_state,
    run_cli,
    run_cli_process,
    stderr_lines,
)

from mptrain import errors, export
from mptrain.train import checkpoint, standalone


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("run")
    assert (
        run_cli(workdir, "--config.num_train_steps=4", "--config.checkpoint_every_steps=2")[0] == 0
    )
    return workdir


def _flat(tree, prefix=""):
    if isinstance(tree, dict):
        out = {}
        for key, value in tree.items():
            out |= _flat(value, f"{prefix}/{key}" if prefix else key)
        return out
    return {prefix: tree}


def test_a_bf16_export_restores_with_plain_orbax_keeping_norms_in_fp32(finished_run, tmp_path):
    out = tmp_path / "bf16"
    export.export(finished_run, out, "bfloat16", keep_fp32=r"(^|/)ln_")
    exported = _flat(standalone.load_standalone(out))
    master = _flat(plain_orbax_state(finished_run, 4)["params"])
    assert set(exported) == set(master)
    norms = [path for path in exported if "/ln_" in f"/{path}"]
    assert norms  # the LM's LayerNorm scales and biases
    for path, value in exported.items():
        assert isinstance(value, np.ndarray)
        if path in norms:
            assert value.dtype == np.float32 and np.array_equal(value, master[path]), path
        else:
            assert value.dtype.name == "bfloat16", path
            assert value.tobytes() == master[path].astype(value.dtype).tobytes(), path
    sidecar = json.loads((out / "export.json").read_text())
    assert sidecar["source"]["step"] == 4 and sidecar["dtype"] == "bfloat16"
    assert sorted(sidecar["kept_fp32"]) == sorted(norms)
    assert sidecar["policy"] and sidecar["config"]["precision"] == "bf16-mixed"


def test_a_chosen_step_and_fp16(finished_run, tmp_path):
    sidecar = export.export(finished_run, tmp_path / "fp16", "float16", step=2)
    assert sidecar["source"]["step"] == 2
    leaves = _flat(standalone.load_standalone(tmp_path / "fp16"))
    assert {x.dtype.name for x in leaves.values()} == {"float16"}


@pytest.mark.parametrize(
    "args, says",
    [
        (["--dtype=int8"], "--dtype"),
        (["--step=3"], "--step=3"),
        (["--keep_fp32=(unclosed"], "--keep_fp32"),
        (["--workdir=/nonexistent/run"], "--workdir=/nonexistent/run"),
        (["--out={tmp}/file/x"], "--out={tmp}/file/x: {tmp}/file is a file, not a folder"),
    ],
)
def test_bad_usage_exits_2_with_one_line_and_writes_nothing(finished_run, tmp_path, args, says):
    out = tmp_path / "out"
    (tmp_path / "file").write_text("")
    args, says = [a.format(tmp=tmp_path) for a in args], says.format(tmp=tmp_path)
    argv = [f"--workdir={finished_run}", f"--out={out}", *args]
    result = run_cli_process(*argv, module="mptrain.export")
    assert result.returncode == 2, result.stderr
    lines = stderr_lines(result.stderr)
    assert len(lines) == 1 and says in lines[0] and "Traceback" not in result.stderr
    assert not out.exists() and not list(tmp_path.glob(".*"))


@pytest.fixture
def export_cli(capfd):
    """`python -m mptrain.export ARGS` in this process: (exit code, stderr). The export turns
    absl's verbosity down to warnings; it is put back after the test."""
    verbosity = logging.get_verbosity()

    def run(*args):
        capfd.readouterr()
        code = export.main(list(args))
        return code, capfd.readouterr().err

    yield run
    logging.set_verbosity(verbosity)


def _one_line(err: str, *named: str) -> str:
    lines = stderr_lines(err)
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    assert all(name in lines[0] for name in named), (lines[0], named)
    return lines[0]


@pytest.mark.parametrize(
    "text, says",
    [
        ('{"seed": 0, "model": {"na', "line 1 column 23"),  # cut short
        ("", "Expecting value"),
        ("[1, 2, 3]", "a JSON list, not an object"),
        ('{"seed": 0}', "num_train_steps: missing"),  # an object, but no config
    ],
)
def test_a_corrupt_config_json_is_exit_2_naming_it(finished_run, tmp_path, export_cli, text, says):
    workdir = Path(shutil.copytree(finished_run, tmp_path / "run"))
    (workdir / "config.json").write_text(text)
    code, err = export_cli(f"--workdir={workdir}", f"--out={tmp_path / 'out'}")
    assert code == 2
    _one_line(err, f"{workdir / 'config.json'}", says)
    assert not (tmp_path / "out").exists()


def test_an_export_reads_a_workdir_without_writing_or_deleting_there(finished_run, tmp_path):
    # A save in progress, as a run holding the workdir would have it: the export must neither
    # mistake it for a leftover nor export it.
    workdir = Path(shutil.copytree(finished_run, tmp_path / "run"))
    shutil.copytree(
        workdir / "checkpoints" / "4", workdir / "checkpoints" / f"6{checkpoint.TMP_SUFFIX}"
    )
    before = {p: p.read_bytes() if p.is_file() else None for p in sorted(workdir.rglob("*"))}
    sidecar = export.export(workdir, tmp_path / "out")
    assert sidecar["source"]["step"] == 4
    after = {p: p.read_bytes() if p.is_file() else None for p in sorted(workdir.rglob("*"))}
    assert after == before


@pytest.fixture
def unwritable(request, tmp_path):
    """A folder the export cannot be written into: on a read-only tmpfs, or a tmpfs of 64 KiB
    (where this process may mount one, as root can), or without write permission (where the
    process is not root, which writes anywhere). Its test chooses which: `request.param`."""
    folder = tmp_path / "locked"
    folder.mkdir()
    if request.param != "permission denied":
        options = "ro,size=64k" if request.param == "read-only filesystem" else "size=64k"
        mount = ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)]
        if shutil.which("mount") is None or subprocess.run(mount, capture_output=True).returncode:
            pytest.skip("cannot mount a filesystem here (needs root)")
        yield folder, request.param
        subprocess.run(["umount", str(folder)], check=True)
    else:
        if os.geteuid() == 0:
            pytest.skip("root writes into a folder whatever its permissions")
        folder.chmod(0o555)
        yield folder, request.param
        folder.chmod(0o755)


@pytest.mark.parametrize(
    "unwritable",
    [  # variants: make test keeps permission denied
        pytest.param("read-only filesystem", marks=pytest.mark.slow),
        pytest.param("disk full", marks=pytest.mark.slow),
        "permission denied",
    ],
    indirect=True,
)
def test_an_out_that_cannot_be_written_is_exit_1_naming_it(finished_run, unwritable):
    folder, says = unwritable
    out = folder / "export"
    result = run_cli_process(f"--workdir={finished_run}", f"--out={out}", module="mptrain.export")
    assert result.returncode == 1, result.stderr[-3000:]
    _one_line(result.stderr, str(out), says)
    assert not list(folder.iterdir())  # nothing half-written left there


def test_an_export_gets_the_modes_the_umask_gives(finished_run, tmp_path):
    previous = os.umask(0o022)
    try:
        export.export(finished_run, tmp_path / "out")
    finally:
        os.umask(previous)
    made = [tmp_path / "out", *(tmp_path / "out").rglob("*")]
    assert {p.stat().st_mode & 0o777 for p in made if p.is_dir()} == {0o755}
    assert {p.stat().st_mode & 0o777 for p in made if p.is_file()} == {0o644}


# ---- --format=hf -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama_run(tmp_path_factory):
    """A fine-tune of a copy of the HF fixture on text its own tokenizer.json encodes: the
    init_from tests' (the same compiled programs), ending at step 20."""
    from helpers import FIXTURE, STEPS, hf_flag, make_text, make_tokenizer, overrides

    base = tmp_path_factory.mktemp("llama")
    folder = Path(shutil.copytree(FIXTURE, base / "llama"))
    text = make_text(base / "notes")
    make_tokenizer(folder, [p.read_text() for p in sorted((base / "notes").iterdir())])
    flags = overrides(text, base / "cache", steps=STEPS)
    assert run_cli(base / "run", *flags, config=hf_flag(folder))[0] == 0
    return base / "run", folder


def test_an_hf_export_loads_with_mptrain_hf_bit_identical_in_fp32(llama_run, tmp_path):
    from mptrain import hf

    workdir, folder = llama_run
    sidecar = export.export(workdir, tmp_path / "fp32", "float32", format="hf")
    assert sidecar["format"] == "hf" and sidecar["source"]["step"] == 20
    model, params = hf.load(tmp_path / "fp32", scan_layers=True)
    assert model == hf.read_config(folder)
    master = plain_orbax_state(workdir, 20)["params"]
    assert_trees_bytes_equal(params, master)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # the run's, copied in
        assert (tmp_path / "fp32" / name).read_bytes() == (folder / name).read_bytes()
    assert not (tmp_path / "fp32" / "special_tokens_map.json").exists()  # the run had none

    export.export(workdir, tmp_path / "bf16", format="hf")  # the default dtype, bfloat16
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" == _safetensors_dtype(tmp_path / "bf16")
    _, params = hf.load(tmp_path / "bf16", scan_layers=True)
    rounded = jax.tree.map(lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32), master)
    assert_trees_bytes_equal(params, rounded)


def test_a_run_whose_tokenizer_is_gone_still_exports_its_weights(llama_run, tmp_path, caplog):
    """Issue 42, sweep case C17: the weights are the run's, the tokenizer only travels with
    them; without it the export warns and writes the weights (the config check refused)."""
    from mptrain import hf

    workdir = Path(shutil.copytree(llama_run[0], tmp_path / "run"))
    config = json.loads((workdir / "config.json").read_text())
    config["data"]["tokenizer"] = str(tmp_path / "gone")
    (workdir / "config.json").write_text(json.dumps(config))
    with caplog.at_level(logging.WARNING):
        export.export(workdir, tmp_path / "out", "float32", format="hf")
    assert any("is gone: none copied" in m for m in caplog.messages), caplog.messages
    assert not (tmp_path / "out" / "tokenizer.json").exists()
    _, params = hf.load(tmp_path / "out", scan_layers=True)
    assert_trees_bytes_equal(params, plain_orbax_state(workdir, 20)["params"])


def _trained_on(llama_run, tmp_path, **mesh) -> Path:
    """A copy of `llama_run` whose config.json says it trained on `mesh` (a checkpoint is the
    same arrays whatever mesh wrote it)."""
    workdir = Path(shutil.copytree(llama_run[0], tmp_path / "run"))
    config = json.loads((workdir / "config.json").read_text())
    config["mesh"] |= mesh
    (workdir / "config.json").write_text(json.dumps(config))
    return workdir


def test_a_run_trained_on_context_and_tensor_axes_is_read_onto_one_device(llama_run, tmp_path):
    """Sweep 2026-12-06, X25 and X27: the run is read onto one device whatever axes it trained
    on (the export once kept the context, tensor and expert axes, and was refused where fewer
    devices were than they take: make test-slow runs it in a process of one device)."""
    from mptrain import hf

    workdir = _trained_on(llama_run, tmp_path, data=1, fsdp=2, context=2, tensor=2)
    config, _ = export.read_run(workdir)
    assert {axis: config.mesh[axis] for axis in config.mesh} == dict.fromkeys(config.mesh, 1)
    export.export(workdir, tmp_path / "out", "float32", format="hf")
    _, params = hf.load(tmp_path / "out", scan_layers=True)
    assert_trees_bytes_equal(params, plain_orbax_state(workdir, 20)["params"])


@pytest.mark.slow  # processes of one device: their own programs
def test_a_run_trained_on_a_context_mesh_exports_and_answers_in_a_process_of_one_device(
    llama_run, tmp_path
):
    """Sweep 2026-12-06, X27 and X28: `python -m mptrain.export` and `python -m mptrain.generate
    --workdir` where one device is, of a run of fsdp 2 x context 4."""
    from mptrain import hf

    workdir = _trained_on(llama_run, tmp_path, data=1, fsdp=2, context=4)
    done = run_cli_process(
        f"--workdir={workdir}", f"--out={tmp_path / 'out'}", "--format=hf", "--dtype=float32",
        module="mptrain.export",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    _, params = hf.load(tmp_path / "out", scan_layers=True)
    assert_trees_bytes_equal(params, plain_orbax_state(workdir, 20)["params"])
    done = run_cli_process(
        f"--workdir={workdir}", "--prompt=def ", "--max_new_tokens=4", module="mptrain.generate",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[0] def " in done.stdout and "1 answers from" in done.stderr, done.stderr[-2000:]


@pytest.mark.parametrize(
    "args, says",
    [
        (["--format=hf"], "--format=hf: the run in"),
        (["--format=safetensors"], "--format='safetensors'"),
        (["--format=hf", "--keep_fp32=norm"], "--keep_fp32='norm'"),
    ],
)
def test_an_hf_export_it_cannot_make_is_one_line_exit_2(
    finished_run, tmp_path, export_cli, args, says
):
    code, err = export_cli(f"--workdir={finished_run}", f"--out={tmp_path / 'out'}", *args)
    assert code == 2
    _one_line(err, says)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".*"))


@pytest.mark.parametrize(
    "unwritable",
    [  # a variant: make test keeps a full disk and permission denied
        pytest.param("read-only filesystem", marks=pytest.mark.slow),
        "disk full",
        "permission denied",
    ],
    indirect=True,
)
def test_an_hf_export_that_cannot_be_written_is_exit_1_naming_it(llama_run, unwritable, export_cli):
    folder, says = unwritable
    code, err = export_cli(f"--workdir={llama_run[0]}", f"--out={folder / 'hf'}", "--format=hf")
    assert code == 1
    _one_line(err, str(folder / "hf"), says)
    assert not list(folder.iterdir())  # nothing half-written left there


def _safetensors_dtype(folder) -> str:
    """The one dtype of the tensors in `folder`/model.safetensors, as a numpy name."""
    from safetensors import safe_open

    with safe_open(folder / "model.safetensors", "numpy") as f:
        names = {f.get_slice(name).get_dtype() for name in f.keys()}  # noqa: SIM118
    assert len(names) == 1, names
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}[names.pop()]


def test_a_failed_write_inside_hf_save_is_told_as_the_exports(
    llama_run, tmp_path, monkeypatch, export_cli
):
    from mptrain import errors, hf

    def full(path, *args, **kwargs):  # hf_io's line for an OSError, naming its file
        raise errors.StorageError(
            f"{path}/config.json: could not write: [Errno 28] No space left on device: "
            f"'{path}/.config.json.partial'"
        )

    monkeypatch.setattr(hf, "save", full)
    code, err = export_cli(f"--workdir={llama_run[0]}", f"--out={tmp_path / 'hf'}", "--format=hf")
    assert code == 1
    line = _one_line(err, f"could not write the export at {tmp_path / 'hf'}: disk full")
    assert ".export-" not in line and not list(tmp_path.iterdir())


def test_the_staging_folders_that_killed_exports_to_out_left_are_removed_first(tmp_path, caplog):
    """An HF export killed part-way (kill -9, a lost node) leaves its staging folder, gigabytes
    for a real model (issue 42, sweep cases C21, C22): the next export to that --out removes
    it. A live process's, another host's and another --out's are left alone."""
    import socket
    import sys

    host, out = socket.gethostname(), tmp_path / "hf"
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        killed = tmp_path / f".hf.export-{host}-{dead.pid}"
        kept = [f".hf.export-{host}-{live.pid}", f".hf.export-elsewhere-{dead.pid}"]
        kept += [f".other.export-{host}-{dead.pid}"]
        for name in [killed.name, *kept]:
            (tmp_path / name).mkdir()
            (tmp_path / name / ".model.safetensors.partial").write_bytes(bytes(64))
        with caplog.at_level(logging.WARNING, logger="absl"):
            staging = export._staging(out)
    finally:
        live.kill()
        live.wait()
    assert staging == tmp_path / f".hf.export-{host}-{os.getpid()}" and not staging.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(kept)
    assert [r.getMessage() for r in caplog.records] == [
        f"mptrain.export: removed {killed}, left by an export that was killed"
    ]


def test_a_failed_export_outwaits_the_writes_that_go_on_after_its_failure(tmp_path):
    """orbax raises a save's first failed write while tensorstore's others go on and make their
    folders anew (CI, stop 77: a disk-full export left `params.orbax-checkpoint-tmp/` behind):
    one landing 0.3 s after the failure must not outlive the export."""

    def late_write(folder: Path) -> None:
        time.sleep(0.3)
        (folder / "params.orbax-checkpoint-tmp" / "ocdbt.process_0").mkdir(parents=True)

    out = tmp_path / "out"
    with pytest.raises(errors.StorageError, match="disk full"), export._written(out) as staging:
        threading.Thread(target=late_write, args=(staging,)).start()
        raise OSError(errno.ENOSPC, "No space left on device")
    time.sleep(0.5)
    assert not list(tmp_path.iterdir())


def test_a_failed_exports_unawaited_writes_print_nothing_more(tmp_path, caplog):
    """The other writes of a failed orbax save fail in tasks orbax never awaits; asyncio prints
    each at exit ("Task exception was never retrieved", a traceback: CI, 2026-12-06, 7 lines
    where the export says one). A failed export leaves only its own line."""
    import asyncio
    import gc

    async def write():
        raise OSError(errno.ENOSPC, "No space left on device")

    loop = asyncio.new_event_loop()
    with pytest.raises(errors.StorageError), export._written(tmp_path / "out"):
        task = loop.create_task(write())  # orbax holds its tasks until the save ends
        loop.run_until_complete(asyncio.sleep(0.01))  # the write fails, its task unawaited
        raise OSError(errno.ENOSPC, "No space left on device")
    loop.close()
    del task
    gc.collect()  # the task goes: asyncio would report it now
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
