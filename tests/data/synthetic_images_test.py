"""The synthetic image source: the zoo's tiny image configs train offline, without TensorFlow;
batches are a pure function of (seed, i), shaped as the tfds pipeline's, and learnable; a bad key
exits 2 naming it."""

import json
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from helpers import ROOT, fake_cpu_env, load_config, needs_tfds, run_cli

import mptrain
from mptrain import config as config_lib
from mptrain.data import synthetic_images
from mptrain.train import trainer as trainer_lib

IMAGE_CONFIGS = {"mnist_cnn": ("mnist", (28, 28, 1)), "cifar10_resnet": ("cifar10", (32, 32, 3))}

# Runs `python -m mptrain.main` in-process with TensorFlow and TensorFlow Datasets hidden, as if
# not installed (etils still probes for tensorflow with find_spec: it finds nothing), first on
# the full config (which needs them: exit 2), then on the tiny one; prints what it saw as JSON.
_WITHOUT_TENSORFLOW = textwrap.dedent(
    """
    import importlib.machinery, json, sys, time

    class HideTensorFlow(importlib.machinery.PathFinder):
        @classmethod
        def find_spec(cls, name, path=None, target=None):
            if name.partition(".")[0] in ("tensorflow", "tensorflow_datasets"):
                return None
            return super().find_spec(name, path, target)

    sys.meta_path[:] = [
        HideTensorFlow if f is importlib.machinery.PathFinder else f for f in sys.meta_path
    ]
    from mptrain import main

    def cli(*args):
        try:
            return main.main(["mptrain", *args])
        except SystemExit as e:
            return e.code

    config, workdir = sys.argv[1:]
    full = cli(f"--config={config}", f"--workdir={workdir}-full")
    started = time.perf_counter()
    tiny = cli(f"--config={config}:tiny", f"--workdir={workdir}")
    seconds = time.perf_counter() - started
    loaded = sorted(m for m in sys.modules if m.partition(".")[0].startswith("tensorflow"))
    print(json.dumps({"full": full, "tiny": tiny, "seconds": seconds, "loaded": loaded}))
    """
)


@pytest.mark.slow  # CLI runs: make test keeps the images' shapes and the ResNet's two steps
@pytest.mark.parametrize("name", IMAGE_CONFIGS)
def test_tiny_image_configs_train_from_the_cli_without_tensorflow(name, tmp_path):
    config, workdir = ROOT / "configs" / f"{name}.py", tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TENSORFLOW, str(config), str(workdir)],
        cwd=ROOT,
        env=fake_cpu_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    # The hiding works: the full config reads TFDS, which cannot be imported here.
    assert seen["full"] == 2 and "pip install 'mptrain[tfds]'" in done.stderr
    assert seen["tiny"] == 0, done.stderr[-3000:]
    assert seen["loaded"] == []  # "tensorflow_datasets" not in sys.modules, nor tensorflow
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir()) == ["4"]
    history = [json.loads(line) for line in (workdir / "history.jsonl").read_text().splitlines()]
    assert any("eval_loss" in record for record in history)


def _source(seed=0, batch_size=8, **keys):
    config = load_config("cifar10_resnet", seed=seed, batch_size=batch_size)
    config_lib.override(config, {f"data.{k}": v for k, v in keys.items()})
    return synthetic_images.create_sources(config)


def test_batches_are_a_pure_function_of_seed_and_index():
    train, evaluation = _source()
    first = train.get_batch(5)
    fresh, _ = _source()  # a new object, asked out of order
    fresh.get_batch(9)
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(fresh.get_batch(5)[key], first[key])
        np.testing.assert_array_equal(train.get_batch(5)[key], first[key])
    assert not np.array_equal(_source(seed=1)[0].get_batch(5)["inputs"], first["inputs"])
    assert not np.array_equal(train.get_batch(4)["inputs"], first["inputs"])
    # one process's rows are those rows of the whole batch
    rows = train.get_batch(5, rows=slice(2, 5))
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(rows[key], first[key][2:5])
    # evaluation: one held-out stream, the same for every seed, not the training one
    other_eval = _source(seed=1)[1]
    np.testing.assert_array_equal(
        other_eval.get_batch(0)["inputs"], evaluation.get_batch(0)["inputs"]
    )
    assert not np.array_equal(evaluation.get_batch(0)["inputs"], train.get_batch(0)["inputs"])


@pytest.mark.parametrize("name", IMAGE_CONFIGS)
def test_batches_are_shaped_as_the_tfds_pipelines(name):
    config = load_config(name)
    assert config.data.name == "synthetic_images"
    _, shape = IMAGE_CONFIGS[name]
    config_lib.validate(config)
    example = synthetic_images.check_config(config)  # what validate tries the model on
    assert example["inputs"].shape == (1, *shape) and example["inputs"].dtype == np.float32
    assert example["targets"].shape == (1,) and example["targets"].dtype == np.int32
    train, evaluation = synthetic_images.create_sources(config)
    for source in (train, evaluation):
        batch = source.get_batch(3)
        assert sorted(batch) == ["inputs", "targets"]
        assert batch["inputs"].shape == (8, *shape) and batch["inputs"].dtype == np.float32
        assert batch["targets"].shape == (8,) and batch["targets"].dtype == np.int32
    many = np.concatenate([train.get_batch(i)["targets"] for i in range(40)])
    assert set(many.tolist()) == set(range(10))  # every class, labels 0 .. 9
    pixels = np.concatenate([train.get_batch(i)["inputs"] for i in range(8)])
    assert abs(pixels.mean()) < 0.3 and 0.7 < pixels.std() < 1.3  # normalised, as tfds's are


@needs_tfds
@pytest.mark.parametrize("name", IMAGE_CONFIGS)
def test_the_same_keys_dtypes_and_shapes_as_tfds_under_mock_data(name, tmp_path):
    import tensorflow_datasets as tfds

    from mptrain.data import tfds as tfds_data

    dataset, _ = IMAGE_CONFIGS[name]
    real = load_config(name, **{"data.name": "tfds", "data.dataset": dataset})
    with tfds.testing.mock_data(num_examples=16):
        want = tfds_data.create_sources(real)[0].get_batch(0)
    got = synthetic_images.create_sources(load_config(name))[0].get_batch(0)
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == {
        k: (v.dtype, v.shape) for k, v in want.items()
    }


@pytest.mark.slow  # 24 steps of training; make test keeps the batches' shapes and purity
def test_the_classes_are_learnable(tmp_path):
    # The tiny CNN, 24 steps at a higher learning rate: well above chance on held-out batches.
    config = load_config(
        "mnist_cnn",
        **{
            "num_train_steps": 24,
            "eval_every_steps": 24,
            "checkpoint_every_steps": 24,
            "eval_steps": 16,
            "optimizer.learning_rate": 1e-2,
        },
    )
    trainer = trainer_lib.Trainer(config, tmp_path / "init")
    before = trainer.evaluate(trainer.init_state())
    after = trainer.evaluate(mptrain.run(config, tmp_path / "run"))
    assert after["eval_loss"] < before["eval_loss"] - 0.5, (before, after)
    assert after["eval_accuracy"] > 0.35, (before, after)  # chance: 0.1


@pytest.mark.parametrize(
    "override, named",
    [
        ("--config.data.image_shape=(28, 28)", "config.data.image_shape=(28, 28): must be"),
        ("--config.data.image_shape=(28, 0, 1)", "config.data.image_shape=(28, 0, 1): must be"),
        ("--config.data.num_classes=1", "config.data.num_classes=1: must be an integer >= 2"),
        ("--config.data.num_classes=12", "config.data.num_classes=12: more classes than"),
        ("--config.data.signal=0.0", "config.data.signal=0.0: must be > 0"),
        ("--config.data.signal=1.5", "config.data.signal=1.5: must be > 0 and <= 1"),
    ],
)
def test_a_bad_synthetic_key_exits_2_naming_it(override, named, tmp_path, capsys):
    workdir = tmp_path / "run"
    config = f"--config={ROOT / 'configs' / 'mnist_cnn.py'}:tiny"
    code, err = run_cli(workdir, override, capsys=capsys, config=config)
    assert code == 2, err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert named in err, err
    assert not workdir.exists()
