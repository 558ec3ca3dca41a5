"""The zoo's configs end to end: tiny variants train on mock TFDS data, the fp16 ResNet keeps its
batch statistics in fp32 through training, resuming and skipped steps, and missing data exits 2.
"""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
import tensorflow_datasets as tfds
from conftest import ROOT, load_config
from jax.experimental.compilation_cache import compilation_cache

import mptrain
from mptrain import trainer as trainer_lib

CONFIGS = ["default", "mnist_cnn", "cifar10_resnet", "lm_bf16", "lm_fp16"]


def tiny_config(name, **overrides):
    return load_config(name, **overrides)


def resnet_config(**overrides):
    # A constant schedule: the programs of a 2-step and a 4-step run are then the same.
    return tiny_config("cifar10_resnet", **{"optimizer.schedule": "constant", **overrides})


def plain_orbax_state(workdir, step):
    return ocp.PyTreeCheckpointer().restore(Path(workdir) / "checkpoints" / str(step) / "state")


def assert_trees_bytes_equal(a, b):
    la, lb = jax.tree_util.tree_flatten_with_path(a)[0], jax.tree_util.tree_flatten_with_path(b)[0]
    assert [p for p, _ in la] == [p for p, _ in lb]
    for (path, x), (_, y) in zip(la, lb, strict=True):
        x, y = np.asarray(x), np.asarray(y)
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes(), jax.tree_util.keystr(path)


@pytest.fixture(scope="module", autouse=True)
def persistent_compilation_cache(tmp_path_factory):
    """The ResNet runs here compile the same programs; compile them once (test speed only)."""
    keys = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    saved = {key: getattr(jax.config, key) for key in keys}
    jax.config.update(keys[0], str(tmp_path_factory.mktemp("jax_cache")))
    jax.config.update(keys[1], 0.0)
    jax.config.update(keys[2], 0)
    compilation_cache.reset_cache()
    yield
    for key, value in saved.items():
        jax.config.update(key, value)
    compilation_cache.reset_cache()


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_has_a_tiny_variant_and_a_documented_command(name):
    path = ROOT / "configs" / f"{name}.py"
    module = runpy.run_path(str(path))
    assert f"--config=configs/{name}.py" in module["__doc__"]
    assert "Expected" in module["__doc__"]
    full, tiny = module["get_config"](None), module["get_config"]("tiny")
    mptrain.config.validate(full)
    mptrain.config.validate(tiny)
    assert tiny.num_train_steps < full.num_train_steps and tiny.batch_size <= 8
    with pytest.raises(ValueError, match="tiny"):
        module["get_config"]("huge")


def test_lm_configs_differ_only_in_precision_and_loss_scale():
    bf16, fp16 = tiny_config("lm_bf16"), tiny_config("lm_fp16")
    assert (bf16.precision, fp16.precision) == ("bf16-mixed", "fp16-mixed")
    assert fp16.loss_scale.kind == "dynamic"
    full = runpy.run_path(str(ROOT / "configs" / "lm_fp16.py"))["get_config"](None)
    assert full.model.d_model > tiny_config("default").model.d_model


def test_mnist_cnn_tiny_trains_on_mock_data(tmp_path):
    with tfds.testing.mock_data(num_examples=64):
        state = mptrain.run(tiny_config("mnist_cnn"), tmp_path)
    assert int(state.step) == 4 and int(state.skipped_steps) == 0  # every update applied
    params = jax.tree.leaves(state.params)
    assert all(p.dtype == np.float32 and np.all(np.isfinite(p)) for p in params)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4"]


class RecordingTrainer(trainer_lib.Trainer):
    """Remembers which training batches it fetched, to tell a resumed run from a fresh one."""

    def build_datasets(self):
        train, evaluation = super().build_datasets()
        self.fetched = []
        get_batch = train.get_batch

        def recording_get_batch(index):
            self.fetched.append(index)
            return get_batch(index)

        train.get_batch = recording_get_batch
        return train, evaluation


def test_cifar10_resnet_tiny_fp16_keeps_fp32_batch_stats_and_resumes_them(tmp_path):
    # One test, not a shared fixture: pytest-xdist would build a module fixture once per worker.
    with tfds.testing.mock_data(num_examples=64):
        straight = mptrain.run(resnet_config(), tmp_path / "straight")
        mptrain.run(resnet_config(num_train_steps=2), tmp_path / "resumed")
        resumed = RecordingTrainer(resnet_config(), tmp_path / "resumed")
        state = resumed.train_and_evaluate()

    assert int(straight.step) == 4
    assert str(straight.policy) == "params=float32,compute=float16,output=float32"
    assert isinstance(straight.loss_scale, mptrain.DynamicLossScale)
    stats = jax.device_get(straight.model_state["batch_stats"])
    assert jax.tree.leaves(stats) and all(s.dtype == np.float32 for s in jax.tree.leaves(stats))
    assert np.any(stats["stem_bn"]["mean"] != 0)  # updated from the zeros of init

    # Training resumed at step 2: batch 1 was never fetched (init samples batch 0's shapes).
    assert 1 not in resumed.fetched and {2, 3} <= set(resumed.fetched)
    assert_trees_bytes_equal(jax.device_get(state.model_state["batch_stats"]), stats)
    assert_trees_bytes_equal(
        plain_orbax_state(tmp_path / "resumed", 4), plain_orbax_state(tmp_path / "straight", 4)
    )


def test_a_skipped_fp16_step_leaves_the_batch_stats_untouched(tmp_path):
    trainer = trainer_lib.Trainer(resnet_config(), tmp_path)
    with tfds.testing.mock_data(num_examples=64):
        trainer.train_source, trainer.eval_source = trainer.build_datasets()
    state = trainer.init_state()
    train_step = jax.jit(mptrain.make_train_step(trainer.loss_fn))
    state, _ = train_step(state, trainer.train_source.get_batch(0))
    bad = trainer.train_source.get_batch(1)
    bad["inputs"][0, 0, 0, 0] = np.nan
    after, metrics = train_step(state, bad)
    assert not bool(metrics["grads_finite"])
    assert int(after.skipped_steps) == int(state.skipped_steps) + 1
    assert float(after.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2
    assert_trees_bytes_equal(jax.device_get(after.model_state), jax.device_get(state.model_state))
    assert_trees_bytes_equal(jax.device_get(after.params), jax.device_get(state.params))


def test_missing_dataset_exits_2_with_how_to_prepare_it(tmp_path):
    data_dir = tmp_path / "tfds"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "mptrain.main",
            "--config=configs/mnist_cnn.py:tiny",
            f"--workdir={tmp_path / 'run'}",
            f"--config.data.data_dir={data_dir}",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("mptrain: error:")]
    assert len(error) == 1, result.stderr[-2000:]
    assert "'mnist'" in error[0] and f"tfds build mnist --data_dir={data_dir}" in error[0]
    assert "Traceback" not in result.stderr
    assert not data_dir.exists()
