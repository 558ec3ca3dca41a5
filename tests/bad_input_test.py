"""The second sweep of bad input (issue 27): what a demanding user tries, and what each gets.

One test per rule family, parametrized over its cases: choices read in any case, numbers with an
upper bound that follows from what they mean, modules that fail to import, workdirs of the
wrong shape, settings without effect, and a run's record that resumes like its state.
"""

import errno
import json
import logging
import os
import signal
import time

import jax
import pytest
from helpers import ROOT, run_cli, tiny_config

import mptrain
from mptrain import config as config_lib
from mptrain import errors, export, files, models, runtime, unused
from mptrain.record import curves
from mptrain.train import checkpoint, trainer


@pytest.mark.parametrize(
    "key, value",
    [
        ("model.attention", "AUTO"),
        ("model.attention", " Materialized "),
        ("model.name", "Transformer_LM"),
        ("data.name", "TEXT"),
        ("precision", "BF16-Mixed"),
        ("loss_scale.kind", "Dynamic"),
        ("optimizer.name", "AdamW"),
        ("optimizer.schedule", "Cosine"),
        ("param_rounding", "Nearest"),
        ("matmul_precision", "Highest"),
    ],
)
def test_every_choice_is_read_in_any_case(key, value, tmp_path):
    config = tiny_config(**{key: value})
    config_lib.validate(config)
    built = trainer.Trainer(config, tmp_path)
    built.build_datasets()
    assert models.loss_unit(config) == "nats/byte"


class _SigtermMidEval(trainer.Trainer):
    """Sends itself SIGTERM as the third batch of an evaluation is taken."""

    def evaluate(self, state, source=None, eval_step=None):
        self.calls = 0

        def counting(state, batch):
            self.calls += 1
            if self.calls == 3:
                os.kill(os.getpid(), signal.SIGTERM)
            return eval_step(state, batch)

        return super().evaluate(state, source, counting)


@pytest.mark.slow  # a variant: make test keeps SIGTERM after a step
def test_a_stop_signal_during_a_long_evaluation_stops_within_a_batch(tmp_path):
    config = tiny_config(eval_steps=100_000, eval_every_steps=4, num_train_steps=8)
    stopping = _SigtermMidEval(config, tmp_path)
    started = time.monotonic()
    with pytest.raises(errors.Preempted) as info:
        stopping.train_and_evaluate()
    assert info.value.step == 4 and stopping.calls == 3  # the signal came as batch 3 was taken
    assert time.monotonic() - started < 120
    assert checkpoint.Checkpointer(tmp_path / "checkpoints").latest_step() == 4
    rows = [json.loads(line) for line in (tmp_path / "history.jsonl").read_text().splitlines()]
    assert not [row for row in rows if "eval_loss" in row]  # the partial evaluation is dropped


BROKEN = {
    "badsyntax.py": "def f(:\n    pass\n",
    "raises.py": 'raise RuntimeError("no GPU here")\n',
}


@pytest.mark.parametrize(
    "trainer_spec, says",
    [
        (
            "badsyntax:T",
            "cannot import badsyntax: SyntaxError: invalid syntax (badsyntax.py, line 1)",
        ),
        ("raises:T", "cannot import raises: RuntimeError: no GPU here"),
        ("nosuch_module:T", "cannot import nosuch_module: ModuleNotFoundError: No module named"),
    ],
)
def test_a_trainer_module_that_fails_to_import_is_one_line(
    trainer_spec, says, tmp_path, monkeypatch, capsys
):
    for name, text in BROKEN.items():
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    code, err = run_cli(tmp_path / "run", f"--config.trainer={trainer_spec}", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"config.trainer='{trainer_spec}': {says}" in err
    assert not (tmp_path / "run").exists()


CONFIG_FILES = {
    "raises_at_import": ('raise ValueError("bad thing")\n', "line 1: ValueError: bad thing"),
    "key_error": (
        "def get_config(arg=None):\n    return {}['missing']\n",
        "line 2: KeyError: 'missing'",
    ),
    "attribute_error": (
        "from mptrain import config\n"
        "def get_config(arg=None):\n    return config.base_config().lrr\n",
        "line 3: AttributeError: 'lrr'",
    ),
}


@pytest.mark.parametrize("name", list(CONFIG_FILES))
def test_a_config_file_that_raises_names_the_exception_and_its_line(name, tmp_path, capsys):
    text, says = CONFIG_FILES[name]
    path = tmp_path / f"{name}.py"
    path.write_text(text)
    code, err = run_cli(tmp_path / "run", capsys=capsys, config=f"--config={path}")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--config={path}: {says}" in err


def test_two_config_files_are_refused_not_silently_the_last(tmp_path, capsys):
    code, err = run_cli(
        tmp_path / "run", f"--config={ROOT / 'configs' / 'default.py'}", capsys=capsys
    )
    assert code == 2 and "--config given 2 times" in err and not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "key, meant",
    [("optimizer.lr", "optimizer.learning_rate"), ("optimizer.warmup", "optimizer.warmup_steps")],
)
def test_an_abbreviated_key_suggests_the_key_it_abbreviates(key, meant, tmp_path, capsys):
    code, err = run_cli(tmp_path / "run", f"--config.{key}=1", capsys=capsys)
    assert code == 2 and f"did you mean '{meant}'?" in err, err


@pytest.mark.parametrize(
    "args, says",
    [
        (["--workdir=w", "--out=o", "--step=abc"], "argument --step: invalid int value: 'abc'"),
        (["--workdir=w"], "the following arguments are required: --out"),
        (["--workdir=w", "--out=o", "--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_export_flag_errors_are_one_line(args, says, capsys):
    with pytest.raises(SystemExit) as info:
        export.main(args)
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"mptrain.export: error: {says}")


@pytest.mark.slow  # a variant: make test keeps a refused resume compiling nothing
def test_a_refused_resume_gives_one_advice_in_clean_sentences(tmp_path, capsys):
    assert run_cli(tmp_path, "--config.num_train_steps=2", capsys=capsys)[0] == 0
    code, err = run_cli(tmp_path, "--config.model.d_model=64", capsys=capsys)
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("mptrain: error: config.model.d_model=64: "), err
    assert (
        "was trained with model.d_model=" in line and "Resume with --config.model.d_model=" in line
    )
    assert ".." not in line and line.count("workdir to start a new run") == 1
    assert "new setup" not in line


def test_a_refused_resume_compiles_nothing(tmp_path, capsys):
    """The newest checkpoint's config is checked before any state is built: a resume of
    another model is one line in seconds, with no program compiled first."""
    assert run_cli(tmp_path, "--config.num_train_steps=2", capsys=capsys)[0] == 0
    compiled = []

    def listen(event, seconds, **kwargs):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        code, err = run_cli(tmp_path, "--config.model.d_model=64", capsys=capsys)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    assert code == 2 and "config.model.d_model=64: " in err.strip().splitlines()[-1], err
    assert not compiled


@pytest.mark.parametrize(
    "key, value, says",
    [
        ("seed", 2**70, "must be at most 4,294,967,295: JAX's random keys take 32 bits"),
        ("seed", 2**32, "(2**32 would be seed 0 again)"),
        ("batch_size", 10**12, "a call's batches take 232.8 TiB on this host"),
        ("num_train_steps", 2**63, "must be at most 2,147,483,647: the device counts it"),
        ("eval_steps", 2**64, "must be at most 2,147,483,647"),
        ("optimizer.warmup_steps", 10**30, "must be at most 2,147,483,647"),
        ("optimizer.q8_block_size", 2**40, "must be at most 1,048,576"),
        ("fp8.history", 10**12, "must be at most 65,536"),
        ("fp8.margin", 100, "must be at most 14"),
        ("data.prefetch", 10**6, "must be at most 64"),
        ("loss_scale.growth_interval", 2**32, "must be at most 2,147,483,647"),
        ("model.d_model", 2**20, "params take 16.0 TiB as fp32 master weights alone"),
    ],
)
def test_every_integer_has_an_upper_bound_checked_before_the_workdir(
    key, value, says, tmp_path, capsys
):
    code, err = run_cli(tmp_path / "run", f"--config.{key}={value}", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    named = "model.name='transformer_lm': its " if key == "model.d_model" else f"{key}={value}: "
    assert f"config.{named}" in err and says in err, err
    assert not (tmp_path / "run").exists()  # not even its .lock


@pytest.mark.parametrize(
    "name, make",
    [
        ("checkpoints", "file"),
        ("numerics", "file"),
        ("config.json", "folder"),
        ("history.jsonl", "folder"),
        ("curves.png", "folder"),
        ("precision_report.txt", "folder"),
    ],
)
def test_a_workdir_path_of_the_wrong_kind_stops_the_run_before_it_compiles(
    name, make, tmp_path, capsys
):
    path = tmp_path / "run" / name
    path.parent.mkdir()
    path.mkdir() if make == "folder" else path.write_text("mine")
    started = time.monotonic()
    code, err = run_cli(tmp_path / "run", capsys=capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"{path} is " in err and "use another --workdir" in err
    assert time.monotonic() - started < 30 and not (tmp_path / "run" / ".lock").exists()


@pytest.mark.parametrize("url", ["s3://bucket/run", "gs://bucket/run", "hdfs://host/run"])
def test_a_url_for_a_workdir_or_an_export_is_refused_not_written_to_a_local_folder(
    url, tmp_path, capsys, monkeypatch
):
    """A URL mptrain does not read or write (a run's or an export's: any but s3:// and gs://,
    `bucket_workdir_test`; a Trainer's own: any) is one line, exit 2, and no folder named after
    its scheme appears where the command ran."""
    monkeypatch.chdir(tmp_path)
    if url.startswith("hdfs"):
        code, err = run_cli(url, capsys=capsys)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert f"--workdir={url}: a hdfs:// URL" in err and "s3://BUCKET/PATH" in err, err
        for args in (["--workdir=" + url, "--out=o"], ["--workdir=w", "--out=" + url]):
            assert export.main(args) == 2
            err = capsys.readouterr().err
            assert len(err.strip().splitlines()) == 1 and "URL" in err, err
    with pytest.raises(errors.ConfigError, match="a s3:// URL|a gs:// URL|a hdfs:// URL"):
        trainer.Trainer(tiny_config(), url)
    assert list(tmp_path.iterdir()) == []


class _FullDisk:
    """A file object whose writes find the disk full."""

    def __init__(self, handle):
        self._handle = handle

    def write(self, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    def __getattr__(self, name):
        return getattr(self._handle, name)


def test_a_disk_full_at_start_is_exit_1_in_one_line(tmp_path, capsys, monkeypatch):
    real_open = open
    monkeypatch.setattr(
        runtime, "open", lambda *a, **k: _FullDisk(real_open(*a, **k)), raising=False
    )
    code, err = run_cli(tmp_path / "run", capsys=capsys)
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert f"could not write {tmp_path / 'run' / '.lock'}: disk full" in err


@pytest.mark.slow  # a variant: make test keeps a record's storage failure named in one line
def test_a_record_that_cannot_be_written_stops_after_a_checkpoint(tmp_path, capsys, monkeypatch):
    real_append = curves.append

    def append(workdir, step, values):
        if step >= 6:
            raise errors.StorageError(f"could not write {workdir}/history.jsonl: permission denied")
        real_append(workdir, step, values)

    monkeypatch.setattr(curves, "append", append)
    code, err = run_cli(tmp_path / "run", "--config.log_every_steps=2", capsys=capsys)
    assert code == 1 and err.strip().splitlines()[-1].endswith("history.jsonl: permission denied")
    assert "Traceback" not in err
    saved = checkpoint.Checkpointer(tmp_path / "run" / "checkpoints").latest_step()
    assert saved is not None and saved >= 6  # the steps done are kept


def test_a_storage_failure_writing_a_record_is_named_in_one_line():
    denied = r"could not write h.jsonl: permission denied"
    with pytest.raises(errors.StorageError, match=denied), files.writing("h.jsonl"):
        raise PermissionError(errno.EACCES, "Permission denied")
    with pytest.raises(KeyError), files.writing("h.jsonl"):  # not the disk's: unchanged
        raise KeyError("x")


@pytest.mark.parametrize(
    "overrides, warned",
    [
        ({"fp8.history": 512}, "fp8.history=512: no effect, precision='bf16-mixed' has no fp8"),
        ({"fp8.scaling": "current"}, "fp8.scaling='current': no effect"),
        ({"optimizer.momentum": 0.5}, "optimizer.momentum=0.5: no effect, optimizer.name='adamw'"),
        ({"optimizer.nesterov": True}, "optimizer.nesterov=True: no effect"),
        (
            {"optimizer.name": "sgd", "optimizer.b2": 0.95, "optimizer.nu_dtype": None},
            "optimizer.b2=0.95: no effect, optimizer.name='sgd': adamw's setting",
        ),
        (
            {"optimizer.q8_block_size": 128},
            "optimizer.q8_block_size=128: no effect, neither moment",
        ),
        (
            {"optimizer.moment_rounding": "nearest"},
            "optimizer.moment_rounding='nearest': no effect, it rounds moments stored in bfloat16",
        ),
        ({"precision": "fp32", "keep_fp32": "embedding"}, "keep_fp32='embedding': no effect"),
        ({"loss_scale.growth_interval": 10}, "loss_scale.growth_interval=10: no effect"),
        (
            {"optimizer.warmup_steps": 10**6},
            "optimizer.warmup_steps=1000000: not shorter than the run's 8 updates; warming up "
            "over 4",
        ),
        (
            {"optimizer.accumulation_steps": 3},
            "optimizer.accumulation_steps=3: num_train_steps=8 leaves its last 2 micro-batches",
        ),
        (  # issue 42, sweep case E01: a trace after the last step traced nothing, silently
            {"profile.start_step": 20, "profile.num_steps": 3},
            "profile.start_step=20: after the run's last step (num_train_steps=8); no step is "
            "traced",
        ),
        (
            {"profile.start_step": 7, "profile.num_steps": 3},
            "profile.num_steps=3: the run ends at step 8; steps 7-8 are traced",
        ),
    ],
)
def test_every_setting_without_effect_is_told_at_start(overrides, warned):
    config = config_lib.override(tiny_config(), overrides)
    config_lib.validate(config)
    found = unused.settings(config)
    assert [line for line in found if line.startswith(warned)], found
    assert unused.settings(tiny_config()) == []


@pytest.mark.slow  # a variant: make test keeps the other settings told at start
def test_more_eval_steps_than_the_eval_split_holds_are_told(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    mptrain.run(tiny_config(num_train_steps=2, eval_steps=500), tmp_path)
    assert "eval_steps=500: the eval split holds" in caplog.text
    assert "an evaluation repeats them" in caplog.text


@pytest.mark.slow  # two runs of their own: make test keeps the default rule's matmuls
def test_the_casting_rule_does_what_it_says(tmp_path):
    """keep_fp32='.*' under bf16-mixed hands every param to the model in fp32, and every layer
    of the zoo then runs its matmul in fp32: the report says so, and the run is not the
    default rule's."""
    every = mptrain.run(tiny_config(num_train_steps=2, keep_fp32=".*"), tmp_path / "every")
    default = mptrain.run(tiny_config(num_train_steps=2), tmp_path / "default")
    report = (tmp_path / "every" / "precision_report.txt").read_text()
    assert "of the matmul FLOPs run in bfloat16" in report  # the <95% warning
    assert "float32" in report.split("matmul FLOPs:")[1].splitlines()[1]  # fp32 leads
    kernel = lambda state: state.params["block_0"]["mlp"]["fc_in"]["kernel"]
    assert not (kernel(every) == kernel(default)).all()


def test_the_host_batch_check_is_for_a_run_here_not_for_a_plan(monkeypatch):
    """The batch must fit the host that builds it: this one for a run, not for `mptrain.plan`
    (which passes the target's devices), whose error would send the reader to itself."""
    from mptrain import runtime

    monkeypatch.setattr(runtime, "host_memory", lambda: 1024)
    config = tiny_config()
    with pytest.raises(errors.ConfigError, match="a call's batches take"):
        config_lib.validate(config)
    config_lib.validate(config, devices=jax.devices())
