"""The zoo's configs end to end: tiny variants train (the image ones on synthetic images, and on
mock TFDS data when told `data.name="tfds"`), the fp16 ResNet keeps its batch statistics in fp32
through training, resuming and skipped steps, and missing data exits 2.
"""

import logging
import os
import runpy

import jax
import numpy as np
import pytest
from helpers import (
    ROOT,
    assert_trees_bytes_equal,
    load_config,
    needs_tfds,
    plain_orbax_state,
    run_cli,
    run_cli_process,
)

import mptrain
from mptrain.train import trainer as trainer_lib

CONFIGS = [
    *("default", "mnist_cnn", "cifar10_resnet", "lm_bf16", "lm_fp16", "lm_gpt2s", "lm_1b"),
    "llama3",
]


# What a tiny image config needs to read its TFDS dataset instead of synthetic images (the
# tiny variants train on `synthetic_images`; the tests under `tfds.testing.mock_data` say "tfds").
TFDS_DATA = {
    "mnist_cnn": {"data.name": "tfds", "data.dataset": "mnist", "data.augment": False},
    "cifar10_resnet": {"data.name": "tfds", "data.dataset": "cifar10", "data.augment": True},
}


def resnet_config(**overrides):
    # A constant schedule: the programs of a 2-step and a 4-step run are then the same.
    overrides = {**TFDS_DATA["cifar10_resnet"], "optimizer.schedule": "constant", **overrides}
    return load_config("cifar10_resnet", **overrides)


@pytest.mark.parametrize("name", CONFIGS)
def test_every_config_has_a_tiny_variant_and_a_documented_command(name):
    path = ROOT / "configs" / f"{name}.py"
    module = runpy.run_path(str(path))
    assert f"--config=configs/{name}.py" in module["__doc__"]
    assert "Expected" in module["__doc__"]
    full, tiny = module["get_config"](None), module["get_config"]("tiny")
    if name == "llama3":  # 8B params: planned for H100s, and too big for this machine's memory
        with pytest.raises(mptrain.errors.ConfigError, match="python -m mptrain.plan"):
            mptrain.config.validate(full)
    else:
        mptrain.config.validate(full)
    mptrain.config.validate(tiny)
    assert tiny.num_train_steps < full.num_train_steps and tiny.batch_size <= 8
    with pytest.raises(ValueError, match="tiny"):
        module["get_config"]("huge")


TWO_STEP_RUNS = {
    # `default.py:tiny` runs as `lm_bf16.py:tiny` below; here it runs under fp16 without loss
    # scaling, which must draw the warning at start.
    "default": (
        ["--config.precision=fp16-mixed", "--config.loss_scale.kind=none"],
        "float16 compute without loss scaling",
    ),
    "lm_bf16": ([], "warming up over 1 instead"),  # warmup_steps=2 does not fit in 2 steps
    "lm_fp16": ([], "warming up over 1 instead"),
    "lm_gpt2s": ([], None),  # no warmup, as the PyTorch peer it is measured against
    "lm_1b": (["--config.precision=fp8-mixed"], None),  # the fp8 benchmark, in fp8
    "llama3": ([], "warming up over 1 instead"),  # scanned, remat full, the loss chunked
    "mnist_cnn": ([], None),  # synthetic images: no TFDS, no TensorFlow
    "cifar10_resnet": ([], None),
    "custom_trainer": ([], None),
}


# make test keeps the default LM's two steps; the other configs compile programs of their own
# and run in make test-slow. lm_gpt2s and lm_1b are transformer_lm at other sizes (compiled in
# make test-plan for an H100): their two CPU steps take 10 s each on a fresh machine.
@pytest.mark.parametrize(
    "name",
    [n if n == "default" else pytest.param(n, marks=pytest.mark.slow) for n in TWO_STEP_RUNS],
)
def test_two_steps_of_every_tiny_config_run(name, tmp_path, caplog):
    overrides, logged = TWO_STEP_RUNS[name]
    path = ROOT / "examples" / "custom_trainer" / "config.py"
    path = path if name == "custom_trainer" else ROOT / "configs" / f"{name}.py"
    caplog.set_level(logging.INFO)
    code, err = run_cli(
        tmp_path, "--config.num_train_steps=2", *overrides, config=f"--config={path}:tiny"
    )
    assert code == 0, err
    assert int(plain_orbax_state(tmp_path, 2)["step"]) == 2
    if logged:
        assert logged in caplog.text


def test_lm_configs_differ_only_in_precision_and_loss_scale():
    bf16, fp16 = load_config("lm_bf16"), load_config("lm_fp16")
    assert (bf16.precision, fp16.precision) == ("bf16-mixed", "fp16-mixed")
    assert fp16.loss_scale.kind == "dynamic"
    full = runpy.run_path(str(ROOT / "configs" / "lm_fp16.py"))["get_config"](None)
    assert full.model.d_model > load_config("default").model.d_model


@pytest.mark.slow  # programs no other test compiles; make test keeps the default LM's two steps
@needs_tfds
def test_mnist_cnn_tiny_trains_on_mock_data(tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=64):
        state = mptrain.run(load_config("mnist_cnn", **TFDS_DATA["mnist_cnn"]), tmp_path)
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


@pytest.mark.slow  # make test keeps fp16 batch statistics through a skipped step
@needs_tfds
def test_cifar10_resnet_tiny_fp16_keeps_fp32_batch_stats_and_resumes_them(tmp_path):
    import tensorflow_datasets as tfds

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


@needs_tfds
def test_a_skipped_fp16_step_leaves_the_batch_stats_untouched(tmp_path):
    import tensorflow_datasets as tfds

    trainer = trainer_lib.Trainer(resnet_config(), tmp_path)
    with tfds.testing.mock_data(num_examples=64):
        source, _ = trainer.build_datasets()
    state = trainer.init_state(source.get_batch(0))
    train_step = jax.jit(mptrain.make_train_step(trainer.loss_fn))
    state, _ = train_step(state, source.get_batch(0))
    bad = source.get_batch(1)
    bad["inputs"][0, 0, 0, 0] = np.nan
    after, metrics = train_step(state, bad)
    assert not bool(metrics["grads_finite"])
    assert int(after.skipped_steps) == int(state.skipped_steps) + 1
    assert float(after.loss_scale.loss_scale) == float(state.loss_scale.loss_scale) / 2
    assert_trees_bytes_equal(jax.device_get(after.model_state), jax.device_get(state.model_state))
    assert_trees_bytes_equal(jax.device_get(after.params), jax.device_get(state.params))


@needs_tfds
def test_missing_dataset_exits_2_with_how_to_prepare_it(tmp_path):
    data_dir = tmp_path / "tfds"
    result = run_cli_process(
        "--config=configs/mnist_cnn.py",  # the full config reads MNIST (its tiny one does not)
        f"--workdir={tmp_path / 'run'}",
        f"--config.data.data_dir={data_dir}",
    )
    assert result.returncode == 2, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("mptrain: error:")]
    assert len(error) == 1, result.stderr[-2000:]
    assert "'mnist'" in error[0] and f"tfds build mnist --data_dir={data_dir}" in error[0]
    assert "Traceback" not in result.stderr
    assert not data_dir.exists()
