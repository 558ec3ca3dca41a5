"""The Trainer end to end on the tiny default config: resume, determinism, presets, metrics."""

import logging
import os

import jax
import numpy as np
import pytest
from helpers import (
    TraceCountingTrainer,
    assert_trees_bytes_equal,
    event_tags,
    needs_devices,
    plain_orbax_state,
    run_cli,
    run_cli_process,
    tiny_config,
)

import mptrain
from mptrain import config as config_lib
from mptrain.train import trainer as trainer_lib


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("straight")
    trainer = TraceCountingTrainer(tiny_config(), workdir)
    with jax.transfer_guard("disallow"):  # only log/eval/checkpoint sections may read values
        state = trainer.train_and_evaluate()
    return workdir, trainer, state


def test_compiles_once_and_never_syncs_between_log_steps(straight_run):
    _, trainer, state = straight_run
    assert trainer.train_step_traces == 1
    assert int(state.step) == 8


def test_resume_is_byte_identical(straight_run, tmp_path):
    workdir_a = straight_run[0]
    mptrain.run(tiny_config(num_train_steps=4), tmp_path)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]
    resumed = TraceCountingTrainer(tiny_config(), tmp_path)
    resumed.train_and_evaluate()
    assert resumed.train_step_traces == 1
    assert_trees_bytes_equal(plain_orbax_state(workdir_a, 8), plain_orbax_state(tmp_path, 8))


def test_same_seed_same_state_other_seed_different(straight_run, tmp_path):
    again = mptrain.run(tiny_config(), tmp_path / "again")
    # Every byte of the state (params, moments, loss scale, counters), not only the params.
    assert_trees_bytes_equal(jax.device_get(straight_run[2]), jax.device_get(again))
    other = mptrain.run(tiny_config(seed=1), tmp_path / "other")
    differs = [
        not np.array_equal(x, y)
        for x, y in zip(jax.tree.leaves(again.params), jax.tree.leaves(other.params), strict=True)
    ]
    assert all(differs)


def test_workdir_layout(straight_run):
    workdir = straight_run[0]
    assert (workdir / "config.json").is_file()
    assert "matmul FLOPs" in (workdir / "precision_report.txt").read_text()
    assert sorted(os.listdir(workdir / "checkpoints")) == ["4", "8"]  # every 4 and the last
    assert {"state", "meta"} <= set(os.listdir(workdir / "checkpoints" / "8"))


def test_tensorboard_events_hold_the_training_signals(straight_run):
    tags = event_tags(straight_run[0])
    wanted = {"loss", "eval_loss", "loss_scale", "skipped_steps", "grad_norm", "learning_rate"}
    assert wanted | {"steps_per_sec"} <= tags


@pytest.mark.parametrize(
    "preset",
    [  # make test keeps bf16-mixed, the default; the other presets' CLI runs in make test-slow
        pytest.param("fp32", marks=pytest.mark.slow),
        "bf16-mixed",
        pytest.param("fp16-mixed", marks=pytest.mark.slow),
        pytest.param("bf16-pure", marks=pytest.mark.slow),
    ],
)
def test_every_preset_runs_the_tiny_default_from_the_cli(preset, tmp_path):
    # 2 steps, as other tests of the tiny default run: one compiled step for them all
    code, _ = run_cli(tmp_path, f"--config.precision={preset}", "--config.num_train_steps=2")
    assert code == 0
    state = plain_orbax_state(tmp_path, 2)
    assert int(state["step"]) == 2
    kernel = jax.tree.leaves(state["params"])[0]
    assert kernel.dtype == (np.dtype("bfloat16") if preset == "bf16-pure" else np.float32)


def test_the_start_up_lines_and_the_report_name_the_casting_rule(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    mptrain.run(tiny_config(num_train_steps=3), tmp_path)  # the other tiny runs' step
    assert "casting rule keep_fp32=" in caplog.text
    assert "8 params in fp32 for compute (Embed_0/embedding, " in caplog.text
    assert "(matmul precision default)" in caplog.text  # "auto" under bf16 compute
    report = (tmp_path / "precision_report.txt").read_text()
    assert "casting rule: keep_fp32=" in report and "Embed_0/embedding" in report
    assert "precision default" in report


def test_cli_exit_codes_in_a_subprocess(tmp_path):
    bad = run_cli_process(
        "--config=configs/default.py:tiny",
        f"--workdir={tmp_path}",
        "--config.optimizer.learning_rate=0",
    )
    assert bad.returncode == 2
    assert "optimizer.learning_rate" in bad.stderr and "Traceback" not in bad.stderr
    assert not any(tmp_path.iterdir())  # nothing written


@needs_devices(4)
def test_data_parallel_and_fsdp_mesh_gives_the_same_result(straight_run, tmp_path):
    trainer = trainer_lib.Trainer(tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2}), tmp_path)
    state = trainer.train_and_evaluate()
    kernel = max(jax.tree.leaves(state.params), key=lambda x: x.size)
    assert len(kernel.sharding.device_set) == 4
    assert "fsdp" in str(kernel.sharding.spec)
    for x, y in zip(
        jax.tree.leaves(jax.device_get(straight_run[2].params)),
        jax.tree.leaves(jax.device_get(state.params)),
        strict=True,
    ):
        # bf16 sums in another order: rare elements differ by a few bf16 ulps after 8 steps
        assert np.mean(np.abs(x - y)) < 1e-4 and np.max(np.abs(x - y)) < 2e-2


@needs_devices(3)
def test_batch_that_does_not_divide_over_the_mesh_is_a_config_error(tmp_path):
    config = tiny_config(**{"mesh.data": 3, "batch_size": 8})
    with pytest.raises(mptrain.config.ConfigError, match="batch_size=8"):
        mptrain.run(config, tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "precision, rounding",
    [("bf16-mixed", "nearest"), pytest.param("bf16-pure", "stochastic", marks=pytest.mark.slow)],
)  # the second variant (the other policy's init and eval programs) in make test-slow
def test_init_state_and_evaluate_work_on_their_own(precision, rounding, tmp_path):
    trainer = trainer_lib.Trainer(tiny_config(precision=precision), tmp_path / "run")
    state = trainer.init_state()
    assert int(state.step) == 0 and state.param_rounding == rounding  # "auto" resolved
    values = trainer.evaluate(state)
    assert set(values) == {"eval_loss", "eval_accuracy"}
    assert 5.0 < values["eval_loss"] < 7.0  # an untrained byte model: about ln 256 = 5.55
    assert not (tmp_path / "run").exists()  # neither touched the workdir


@needs_devices(4)
def test_init_state_is_created_in_its_shardings(tmp_path):
    trainer = trainer_lib.Trainer(tiny_config(**{"mesh.data": 2, "mesh.fsdp": 2}), tmp_path)
    state = trainer.init_state()
    kernel = max(jax.tree.leaves(state.params), key=lambda x: x.size)
    assert "fsdp" in str(kernel.sharding.spec) and len(kernel.sharding.device_set) == 4
    # each device holds half of the kernel
    assert {s.data.size for s in kernel.addressable_shards} == {kernel.size // 2}


def test_a_run_ends_with_a_summary_and_leaves_its_picture(tmp_path, capsys):
    from mptrain.record import curves

    # 2 steps, then 8: the steps other tests of the tiny default compile
    assert run_cli(tmp_path, "--config.num_train_steps=2", "--config.eval_every_steps=3")[0] == 0
    out = capsys.readouterr().out
    assert "mptrain: done: 2 steps" in out and "bits/byte" in out
    assert f"tensorboard --logdir {tmp_path}" in out and str(tmp_path / "curves.png") in out
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a resumed run appends to the history; a step written twice keeps its later value
    assert run_cli(tmp_path, "--config.num_train_steps=8", "--config.eval_every_steps=3")[0] == 0
    series = curves.load(tmp_path)
    assert series["eval_loss"][0] == [2, 3, 6, 8] and series["loss"][0][-1] == 8


def test_a_run_builds_each_of_its_parts_once(tmp_path, monkeypatch, caplog):
    """`mptrain.run`: validation builds the policy, the mesh, the optimizer and the model, and
    the Trainer runs with what it built (`config.Resolved`): each is built once, and the
    attention's choice is logged once."""
    import collections

    from mptrain import optim
    from mptrain.models import transformer_lm
    from mptrain.parallel import layout

    counts = collections.Counter()

    def counted(module, name):
        real = getattr(module, name)

        def counting(*args, **kwargs):
            counts[name] += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counting)

    for module, name in [(transformer_lm, "create_model"), (optim, "make_optimizer"),
                         (layout, "create_mesh"), (config_lib, "policy_of")]:  # fmt: skip
        counted(module, name)
    caplog.set_level(logging.INFO)
    mptrain.run(tiny_config(num_train_steps=3), tmp_path)  # the other tiny runs' step
    assert counts == {"create_model": 1, "make_optimizer": 1, "create_mesh": 1, "policy_of": 1}
    assert caplog.text.count("mptrain: attention:") == 1
