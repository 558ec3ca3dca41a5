"""The edges of a run's record that a sweep of new-user commands found short (issue 36, point 5):
each ends as the docs promise. A loss scale that float32 cannot hold is a config error; the
summary's TensorBoard command survives a path with spaces; a finished workdir that cannot be
written is refused with exit 2 and its `.lock` untouched; `keep_fp32='.*'` does what
docs/precision.md says of it; the exit-3 message names the checkpoint it wrote; `matmul_precision`
under 16-bit compute says at start-up that it has no effect; a run refused at resume leaves the
lock file as it was."""

import errno
import inspect
import os
import shlex
import types

import jax
import numpy as np
import pytest
from helpers import checkpoint_steps_on_disk, run_cli, stderr_lines, tiny_config

import mptrain
from mptrain import config as config_lib
from mptrain import errors, unused
from mptrain.inspect import audit
from mptrain.models import layers
from mptrain.record import curves, log_totals


@pytest.mark.parametrize(
    "key, value",
    [("init_scale", 1e39), ("max_scale", 1e39), ("min_scale", 4e38)],
)
def test_a_loss_scale_float32_cannot_hold_is_a_config_error(key, value):
    config = tiny_config(**{"loss_scale.kind": "static", f"loss_scale.{key}": value})
    with pytest.raises(errors.ConfigError, match=rf"loss_scale\.{key}=.*inf in float32"):
        config_lib.validate(config)


def test_the_largest_float32_loss_scale_is_valid():
    largest = float(np.finfo(np.float32).max)
    config_lib.validate(
        tiny_config(**{"loss_scale.kind": "static", "loss_scale.init_scale": largest})
    )


def test_a_static_loss_scale_of_1e39_exits_2_before_the_workdir_is_touched(tmp_path, capsys):
    code, err = run_cli(
        tmp_path / "run",
        "--config.loss_scale.kind=static",
        "--config.loss_scale.init_scale=1e39",
        capsys=capsys,
    )
    assert code == 2 and "inf in float32" in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()


def test_the_summary_quotes_a_workdir_with_spaces(tmp_path):
    workdir = tmp_path / "my runs" / "it's here"
    state = types.SimpleNamespace(step=3, skipped_steps=0)
    text = curves.summary(workdir, state, None, 1.0, types.SimpleNamespace(precision="fp32"))
    (line,) = [line for line in text.splitlines() if "tensorboard" in line]
    assert shlex.split(line) == ["tensorboard", "--logdir", str(workdir)]


def _read_only(monkeypatch, folder):
    """Creating a file under `folder` fails as on a read-only filesystem (tests run as root,
    whom a folder's mode does not stop); writing files already there still works."""
    real = os.open

    def refuse(path, flags, *args, **kwargs):
        if str(path).startswith(str(folder)) and flags & os.O_CREAT and not os.path.exists(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)


def test_a_finished_workdir_that_cannot_be_written_exits_2_and_keeps_its_lock(
    tmp_path, monkeypatch, capsys
):
    assert run_cli(tmp_path, "--config.num_train_steps=2", capsys=capsys)[0] == 0
    lock = (tmp_path / ".lock").read_text()
    before = sorted(os.listdir(tmp_path))
    _read_only(monkeypatch, tmp_path)
    code, err = run_cli(tmp_path, "--config.num_train_steps=2", capsys=capsys)
    monkeypatch.undo()
    assert code == 2, err
    (line,) = [line for line in stderr_lines(err) if line.startswith("mptrain")]
    assert "not writable" in line and str(tmp_path) in line
    assert (tmp_path / ".lock").read_text() == lock  # not the refusing process's id
    assert sorted(os.listdir(tmp_path)) == before


def test_a_run_refused_at_resume_leaves_the_lock_naming_the_run_before(tmp_path, capsys):
    assert run_cli(tmp_path, "--config.num_train_steps=2", capsys=capsys)[0] == 0
    (tmp_path / ".lock").write_text("pid 1 on the-host-before\n")
    # Another model cannot resume the checkpoint: refused once the lock is held.
    code, err = run_cli(
        tmp_path, "--config.num_train_steps=4", "--config.model.num_layers=3", capsys=capsys
    )
    assert code == 2, err
    assert (tmp_path / ".lock").read_text() == "pid 1 on the-host-before\n"


def test_keep_fp32_everything_leaves_attention_and_the_one_hot_lookup_in_bf16(tmp_path):
    """docs/precision.md: `keep_fp32='.*'` under bf16-mixed runs the kernels' and the head's
    matmuls in fp32; attention's matmuls of activations (its scores through `einsum_f32_out`)
    and their gradients, and the one-hot embedding lookup stay bf16: 31% of the tiny LM's FLOPs."""
    trainer = mptrain.Trainer(tiny_config(keep_fp32=".*"), tmp_path)
    config = trainer.config
    tokens = np.random.default_rng(0).integers(0, 256, (config.batch_size, 33)).astype(np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    state = trainer.init_state(batch)
    source = types.SimpleNamespace(get_batch=lambda index: batch)
    args = (state, trainer.device_batch(source, 0), log_totals.LogTotals.zeros())
    report = audit.precision_report(jax.jit(trainer.make_train_step()), *args)
    bf16 = {where for (where, dtype) in report.matmuls if dtype == "bfloat16"}
    einsum_f32_out = f"layers.py:{_line(layers.einsum_f32_out.fun, 'return jnp.einsum(')}"
    lookup = f"layers.py:{_line(layers.embed, 'return jax.nn.one_hot(ids, vocab')}"
    assert {where.rpartition("/")[2] for where in bf16 if "attention.py" not in where} == {
        einsum_f32_out,
        lookup,
    }
    assert any("attention.py" in where for where in bf16)
    assert round(100 * report.compute_fraction) == 31


def _line(fn, text: str) -> int:
    """The line of `fn`'s source file that holds `text`."""
    lines, first = inspect.getsourcelines(fn)
    (index,) = [i for i, line in enumerate(lines) if text in line]
    return first + index


def test_matmul_precision_under_16_bit_compute_says_it_has_no_effect():
    config = tiny_config(matmul_precision="highest")
    lines = [line for line in unused.settings(config) if "matmul_precision" in line]
    assert len(lines) == 1 and "no effect" in lines[0] and "bfloat16" in lines[0]
    kept = tiny_config(matmul_precision="highest", keep_fp32=".*")  # kept kernels: it acts
    assert not [line for line in unused.settings(kept) if "matmul_precision" in line]


@pytest.mark.slow  # a variant: fault_tolerance_test keeps the exit 3 diagnostic
def test_the_exit_3_message_names_the_checkpoint_it_wrote(tmp_path, capsys):
    code, err = run_cli(
        tmp_path,
        "--config.precision=fp16-mixed",
        "--config.loss_scale.kind=static",
        "--config.loss_scale.init_scale=3e38",
        "--config.max_consecutive_skips=3",
        "--config.log_every_steps=1",
        "--config.num_train_steps=20",
        capsys=capsys,
    )
    assert code == 3, err
    saved = max(checkpoint_steps_on_disk(tmp_path))
    (line,) = [line for line in stderr_lines(err) if line.startswith("mptrain")]
    assert f"checkpoint of step {saved}" in line, line


@pytest.mark.parametrize("redraw_s", [60.0, 0.0])
def test_the_picture_is_redrawn_at_most_once_a_minute_and_at_the_end(
    redraw_s, tmp_path, monkeypatch, capsys
):
    """A redraw costs the loop up to a second of host time: evaluations every step of a short
    run redraw nothing until the end, unless a minute has passed since the last picture."""
    drawn, draw = [], curves.draw
    monkeypatch.setattr(curves, "draw", lambda *a, **k: drawn.append(1) or draw(*a, **k))
    monkeypatch.setattr(curves, "REDRAW_S", redraw_s)
    # 2 steps: the step other tests of the tiny default compile
    code, _ = run_cli(tmp_path, "--config.num_train_steps=2", "--config.eval_every_steps=1")
    assert code == 0 and (tmp_path / curves.PICTURE).exists()
    assert len(drawn) == (1 if redraw_s else 2 + 1)  # two evaluations, then the end
