"""The TFDS image source: determinism in (seed, step), epochs, normalisation, missing data.

TFDS data never come from the network here: the in-memory source is tested on synthetic arrays,
and the loading path under `tfds.testing.mock_data`.
"""

import ml_collections
import numpy as np
import pytest
from helpers import needs_tfds

from mptrain import config as config_lib
from mptrain.data import tfds as tfds_data


def _numbered(n, shape=(4, 4, 1)):
    """n images whose pixels all equal the image's index (n <= 256)."""
    images = np.broadcast_to(np.arange(n, dtype=np.uint8)[:, None, None, None], (n, *shape))
    return np.ascontiguousarray(images), np.arange(n) % 10


def _source(n=24, batch_size=8, seed=0, **kwargs):
    images, labels = _numbered(n)
    return tfds_data.ImageSource(images, labels, batch_size, seed, **kwargs)


def _ids(batch):
    return batch["inputs"][:, 0, 0, 0].round().astype(int)  # mean 0, std 1/255: x = pixel


def _config(dataset, data_dir=None, **data):
    return ml_collections.ConfigDict(
        {
            "seed": 0,
            "batch_size": 8,
            "data": {"name": "tfds", "dataset": dataset, "data_dir": data_dir, **data},
        }
    )


def test_batches_are_a_pure_function_of_seed_and_index():
    first = _source().get_batch(5)
    fresh = _source()  # asked out of order, on a new object
    for key in ("inputs", "targets"):
        np.testing.assert_array_equal(fresh.get_batch(5)[key], first[key])
    assert not np.array_equal(_source(seed=1).get_batch(5)["inputs"], first["inputs"])
    assert not np.array_equal(_source().get_batch(4)["inputs"], first["inputs"])


def test_each_epoch_visits_every_example_once():
    source = _source(n=20, batch_size=8, std=1 / 255)
    ids = np.concatenate([_ids(source.get_batch(i)) for i in range(5)])  # 40 = two epochs
    epoch0, epoch1 = ids[:20], ids[20:]
    assert sorted(epoch0) == list(range(20)) and sorted(epoch1) == list(range(20))
    assert not np.array_equal(epoch0, epoch1)  # reshuffled
    assert not np.array_equal(epoch0, np.arange(20))
    np.testing.assert_array_equal(source.get_batch(3)["targets"], ids[24:32] % 10)


def test_eval_source_is_in_order_and_wraps():
    source = _source(n=20, batch_size=8, std=1 / 255, shuffle=False)
    assert source.num_batches == 3
    np.testing.assert_array_equal(_ids(source.get_batch(0)), np.arange(8))
    np.testing.assert_array_equal(_ids(source.get_batch(2)), [16, 17, 18, 19, 0, 1, 2, 3])


def test_images_are_normalised_per_channel_in_float32():
    mean, std = np.array([0.2, 0.4, 0.6]), np.array([0.1, 0.2, 0.3])
    images = np.broadcast_to((mean * 255).astype(np.uint8), (4, 2, 2, 3))
    batch = tfds_data.ImageSource(images, np.zeros(4), 4, mean=mean, std=std).get_batch(0)
    assert batch["inputs"].dtype == np.float32 and batch["targets"].dtype == np.int32
    expected = (np.floor(mean * 255) / 255 - mean) / std
    np.testing.assert_allclose(batch["inputs"][0, 0, 0], expected, atol=1e-5)


def test_known_and_computed_normalisation():
    mean, std = tfds_data.normalization("cifar10:3.0.2", np.zeros((1, 1, 1, 3), np.uint8))
    np.testing.assert_allclose(mean, [0.4914, 0.4822, 0.4465])
    images = np.random.default_rng(0).integers(0, 256, (50, 4, 4, 2)).astype(np.uint8)
    mean, std = tfds_data.normalization("my_dataset", images)
    np.testing.assert_allclose(mean, images.reshape(-1, 2).mean(0) / 255, rtol=1e-5)
    np.testing.assert_allclose(std, images.reshape(-1, 2).std(0) / 255, rtol=1e-5)


def test_augmentation_crops_the_padded_image_and_flips_it():
    images = np.random.default_rng(0).integers(0, 256, (16, 8, 8, 3)).astype(np.uint8)
    source = tfds_data.ImageSource(images, np.zeros(16), 16, std=1 / 255, augment=True)
    batch = source.get_batch(0)
    np.testing.assert_array_equal(batch["inputs"], source.get_batch(0)["inputs"])
    p = tfds_data.CROP_PADDING
    flips = 0
    for image, index in zip(batch["inputs"].round(), source.indices(0), strict=True):
        padded = np.pad(images[index], ((p, p), (p, p), (0, 0))).astype(np.float32)
        windows = [
            (flip, padded[y : y + 8, x : x + 8][:, ::-1] if flip else padded[y : y + 8, x : x + 8])
            for y in range(2 * p + 1)
            for x in range(2 * p + 1)
            for flip in (False, True)
        ]
        matches = [flip for flip, window in windows if np.array_equal(window, image)]
        assert matches, "not a crop of the padded image"
        flips += matches[0]
    assert 0 < flips < 16
    plain = tfds_data.ImageSource(images, np.zeros(16), 16, std=1 / 255).get_batch(0)
    assert not np.array_equal(plain["inputs"], batch["inputs"])


@needs_tfds
@pytest.mark.parametrize(("dataset", "shape"), [("mnist", (28, 28, 1)), ("cifar10", (32, 32, 3))])
def test_create_sources_under_mock_data(dataset, shape, tmp_path):
    import tensorflow_datasets as tfds

    with tfds.testing.mock_data(num_examples=64):
        train, evaluation = tfds_data.create_sources(_config(dataset, str(tmp_path)))
    assert len(train) == len(evaluation) == 64
    for source in (train, evaluation):
        batch = source.get_batch(3)
        assert batch["inputs"].shape == (8, *shape) and batch["inputs"].dtype == np.float32
        assert batch["targets"].shape == (8,) and batch["targets"].dtype == np.int32
        assert batch["targets"].min() >= 0 and batch["targets"].max() < 10
    assert abs(float(np.mean(train.get_batch(0)["inputs"]))) < 3  # normalised, not 0..255


@needs_tfds
def test_missing_data_says_how_to_prepare_it_and_writes_nothing(tmp_path):
    data_dir = tmp_path / "absent"
    with pytest.raises(config_lib.ConfigError) as error:
        tfds_data.create_sources(_config("mnist", str(data_dir)))
    message = str(error.value)
    assert "'mnist'" in message and f"tfds build mnist --data_dir={data_dir}" in message
    assert "config.data.data_dir" in message
    assert not data_dir.exists()


@needs_tfds
def test_unknown_dataset_and_missing_name_are_config_errors(tmp_path):
    with pytest.raises(config_lib.ConfigError, match="'mnistt': not a TensorFlow Datasets name"):
        tfds_data.create_sources(_config("mnistt", str(tmp_path)))
    with pytest.raises(config_lib.ConfigError, match="config.data.dataset"):
        tfds_data.create_sources(_config(None, str(tmp_path)))
