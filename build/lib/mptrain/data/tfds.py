"""Image classification from TensorFlow Datasets (MNIST, CIFAR-10, ...), held in host memory.

Each split is read once with tfds into uint8 numpy arrays; batches are then cut from memory, so
batch ``i`` is a pure function of ``(seed, i)`` and a resumed run needs only its step number.
Meant for datasets that fit in RAM (MNIST: 55 MB, CIFAR-10: 180 MB as uint8).

``config.data`` keys:
  name:        ``"tfds"`` (this module).
  dataset:     a TFDS name, optionally with a version, e.g. ``"mnist"``, ``"cifar10:3.0.2"``.
  train_split: the split to train on (default ``"train"``; TFDS slicing like ``"train[:90%]"``
               works).
  eval_split:  the split to evaluate on (default ``"test"``).
  data_dir:    where the prepared dataset lives; ``None`` means TFDS's default
               (``$TFDS_DATA_DIR``, else ``~/tensorflow_datasets``). Declare it in a config
               file as ``config_dict.placeholder(str)``: a plain ``None`` field cannot be
               overridden with ``--config.data.data_dir=DIR``.
  augment:     ``True`` for random 4-pixel-padded crops plus horizontal flips on the training
               batches (the usual CIFAR augmentation; default ``False``).
(`CONFIG_KEYS` holds these keys, bar ``name``, with their defaults.)

Needs the extra ``pip install 'mptrain[tfds]'`` (TensorFlow and TensorFlow Datasets): this
is the only module of mptrain that imports them, so other data train without TensorFlow.

Nothing is downloaded: training machines are often offline, and a surprise multi-gigabyte fetch
is worse than a clear error. Prepare a dataset once with ``tfds build <dataset> --data_dir=DIR``;
a missing dataset raises `mptrain.config.ConfigError` (exit code 2 from the CLI) saying so.

Images become ``float32`` as ``(pixel / 255 - mean) / std`` per channel, with the constants of
`NORMALIZATION`; other datasets get the statistics of their first training images (see
`normalization`).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np

from mptrain import errors

# Per-channel mean and standard deviation of each dataset's training split, on the [0, 1] pixel
# scale. (The CIFAR-10 std often quoted as (0.2023, 0.1994, 0.2010) is not the per-channel std
# of the training pixels; these are.)
NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
}
CROP_PADDING = 4  # pixels of zero padding around an image before a random crop (augment=True)
NORMALIZATION_SAMPLE = 10_000  # training images measured for datasets not in NORMALIZATION
# Examples per chunk while reading a split. (Not batch_size=-1: it needs a second full copy while
# converting, and under tfds.testing.mock_data it aborts the process.)
_READ_BATCH = 4096


CONFIG_KEYS = {
    "dataset": None,
    "train_split": "train",
    "eval_split": "test",
    "data_dir": None,
    "augment": False,
}


def check_config(config: Any) -> None:
    """What `config.validate` calls: the keys' types, checked without TensorFlow (reading a
    split takes seconds; `create_sources` does it, before the workdir is touched, and turns a
    missing extra, an unknown dataset or an unprepared split into a `ConfigError`)."""
    keys = errors.settings(config.data, CONFIG_KEYS)
    if not isinstance(keys["dataset"], str) or not keys["dataset"].strip():
        raise ValueError(
            f"data.dataset={keys['dataset']!r}: name a TensorFlow Datasets dataset, e.g. 'mnist'"
        )
    for key in ("train_split", "eval_split", "data_dir"):  # data_dir: None is TFDS's default
        value = keys[key]
        if (value is not None or key != "data_dir") and not (isinstance(value, str) and value):
            raise ValueError(f"data.{key}={value!r}: must be a non-empty string")
    if not isinstance(keys["augment"], bool):
        raise ValueError(f"data.augment={keys['augment']!r}: must be True or False")


def _base_name(dataset: str) -> str:
    """``"cifar10/plain:3.0.2"`` -> ``"cifar10"``."""
    return dataset.split(":")[0].split("/")[0]


def _not_prepared(dataset: str, split: str, data_dir: str | None, location: str) -> str:
    name = _base_name(dataset)
    if data_dir:
        how = f"`tfds build {name} --data_dir={data_dir}`"
    else:
        how = (
            f"`tfds build {name}` (into TFDS's default directory), or "
            f"`tfds build {name} --data_dir=DIR` and --config.data.data_dir=DIR"
        )
    return (
        f"config.data.dataset={dataset!r}: split {split!r} is not prepared in {location} "
        f"(mptrain never downloads). Prepare it once, on a machine with internet access: {how}; "
        "or point --config.data.data_dir at a directory that already holds it"
    )


def import_tfds():
    """`tensorflow_datasets`, imported on first use, with TensorFlow kept off the accelerators.

    These are the only TensorFlow imports of mptrain, and they come with the extra
    `mptrain[tfds]`; without it the tfds source is a config error, raised before anything
    touches the workdir.
    """
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # before TensorFlow loads: INFO is noise
    try:
        import tensorflow as tf
    except ImportError as e:
        raise _needs_the_extra(e) from None
    # TensorFlow is here only to read the data; left alone it would grab the accelerators'
    # memory that JAX needs. (It refuses once earlier TensorFlow use in this process has set up
    # its devices; nothing can be done then, so that is no error here.)
    for kind in ("GPU", "TPU"):
        with contextlib.suppress(RuntimeError, ValueError):
            tf.config.set_visible_devices([], kind)
    try:
        import tensorflow_datasets as tfds
    except ImportError as e:
        raise _needs_the_extra(e) from None
    return tfds


def _needs_the_extra(error: ImportError) -> errors.ConfigError:
    cause = (str(error).splitlines() or [type(error).__name__])[0]
    return errors.ConfigError(
        f"config.data.name='tfds' needs TensorFlow Datasets, which cannot be imported here "
        f"({cause}); install it with: pip install 'mptrain[tfds]'"
    )


def load_split(dataset: str, split: str, data_dir: str | None = None) -> dict[str, np.ndarray]:
    """Host-side: one split as ``{"image": uint8[N, H, W, C], "label": int32[N]}``, in file order.

    Raises `ConfigError` when the dataset name is unknown or the data are not prepared; the
    check costs a fraction of a second and writes nothing (no download, no directories).
    """
    tfds = import_tfds()

    try:
        builder = tfds.builder(dataset, data_dir=data_dir)
    except tfds.core.DatasetNotFoundError:
        raise errors.ConfigError(
            f"config.data.dataset={dataset!r}: not a TensorFlow Datasets name; see "
            "https://www.tensorflow.org/datasets/catalog/overview"
        ) from None
    try:
        ds = builder.as_dataset(split=split, batch_size=_READ_BATCH, shuffle_files=False)
    except AssertionError:  # how tfds says "not prepared" when download is off
        raise errors.ConfigError(
            _not_prepared(dataset, split, data_dir, builder.data_dir)
        ) from None
    except (ValueError, KeyError) as e:  # an unknown split, or a malformed slice
        raise errors.ConfigError(f"config.data: split {split!r} of {dataset!r}: {e}") from None
    images, labels = [], []
    for chunk in tfds.as_numpy(ds):
        missing = {"image", "label"} - set(chunk)
        if missing:
            raise errors.ConfigError(
                f"config.data.dataset={dataset!r}: examples have {sorted(chunk)}, not the "
                "'image' and 'label' features an image classification source needs"
            )
        images.append(np.asarray(chunk["image"], np.uint8))
        labels.append(np.asarray(chunk["label"], np.int32))
    if not images:
        raise errors.ConfigError(f"config.data: split {split!r} of {dataset!r} is empty")
    return {"image": np.concatenate(images), "label": np.concatenate(labels)}


def normalization(dataset: str, train_images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel ``(mean, std)`` on the [0, 1] scale.

    From `NORMALIZATION` for the datasets it lists; otherwise measured on the first
    `NORMALIZATION_SAMPLE` training images (deterministic, and cheap for any size of split).
    """
    known = NORMALIZATION.get(_base_name(dataset))
    if known is not None:
        mean, std = known
        return np.asarray(mean, np.float32), np.asarray(std, np.float32)
    sample = train_images[:NORMALIZATION_SAMPLE]
    pixels = sample.reshape(-1, sample.shape[-1]).astype(np.float64) / 255.0
    return pixels.mean(0).astype(np.float32), np.maximum(pixels.std(0), 1e-3).astype(np.float32)


class ImageSource:
    """Batches ``{"inputs": float32[B, H, W, C], "targets": int32[B]}`` from in-memory arrays.

    ``shuffle=True`` (training): examples are visited epoch by epoch, each epoch in the order of
    a permutation drawn from ``default_rng([seed, 0, epoch])``, so every example is seen once
    per epoch and batch ``i`` depends only on ``(seed, i)``. Augmentation, when on, draws from
    ``default_rng([seed, 1, i])``.

    ``shuffle=False`` (evaluation): batch ``i`` holds examples ``i * B ... i * B + B - 1`` in
    order, wrapping around at the end of the split so that every batch is full.
    """

    def __init__(
        self,
        images: np.ndarray,
        labels: np.ndarray,
        batch_size: int,
        seed: int = 0,
        *,
        mean: Any = 0.0,
        std: Any = 1.0,
        shuffle: bool = True,
        augment: bool = False,
    ):
        images, labels = np.asarray(images), np.asarray(labels)
        if images.ndim != 4 or len(images) != len(labels) or not len(images):
            raise ValueError(
                f"want images [N, H, W, C] and labels [N] with N > 0, got {images.shape} "
                f"and {labels.shape}"
            )
        if not isinstance(batch_size, int | np.integer) or batch_size <= 0:
            raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
        self.images, self.labels = images, labels.astype(np.int32)
        self.batch_size, self.seed = int(batch_size), int(seed)
        self.shuffle, self.augment = bool(shuffle), bool(augment)
        # Folding 1/255 into the affine map: x = pixel * scale + shift.
        std = np.asarray(std, np.float32)
        self._scale = (1.0 / (255.0 * std)).astype(np.float32)
        self._shift = (-np.asarray(mean, np.float32) / std).astype(np.float32)
        self._permutations: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def num_batches(self) -> int:
        """Batches that cover the split once (the last one wraps around)."""
        return -(-len(self) // self.batch_size)

    def _permutation(self, epoch: int) -> np.ndarray:
        perm = self._permutations.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, 0, epoch]).permutation(len(self))
            if len(self._permutations) >= 2:  # a batch spans at most two epochs (B <= N)
                self._permutations.pop(min(self._permutations))
            self._permutations[epoch] = perm
        return perm

    def indices(self, index: int) -> np.ndarray:
        """Example indices of batch ``index``."""
        if not isinstance(index, int | np.integer) or index < 0:
            raise ValueError(f"batch index must be a non-negative int, got {index!r}")
        positions = int(index) * self.batch_size + np.arange(self.batch_size)
        if not self.shuffle:
            return positions % len(self)
        epochs, offsets = np.divmod(positions, len(self))
        out = np.empty(self.batch_size, np.int64)
        for epoch in np.unique(epochs):
            where = epochs == epoch
            out[where] = self._permutation(int(epoch))[offsets[where]]
        return out

    def _crop_and_flip(self, images: np.ndarray, index: int, rows: slice) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1, int(index)])
        b, h, w, _ = images.shape
        p = CROP_PADDING
        padded = np.pad(images, ((0, 0), (p, p), (p, p), (0, 0)))
        # drawn for the whole batch, then cut: a row is augmented alike whoever builds it
        dy, dx = rng.integers(0, 2 * p + 1, size=(2, self.batch_size))[:, rows]
        flip = (rng.random(self.batch_size) < 0.5)[rows]
        cols = dx[:, None] + np.where(flip[:, None], np.arange(w)[::-1], np.arange(w))
        rows = dy[:, None] + np.arange(h)
        return padded[np.arange(b)[:, None, None], rows[:, :, None], cols[:, None, :]]

    def get_batch(self, index: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Batch number ``index``, deterministic in ``(seed, index)``; only its ``rows`` (each
        process of a multi-process run builds only its own)."""
        idx = self.indices(index)[rows]
        images = self.images[idx]
        if self.augment:
            images = self._crop_and_flip(images, index, rows)
        inputs = images.astype(np.float32) * self._scale + self._shift
        return {"inputs": inputs, "targets": self.labels[idx]}

    def __repr__(self) -> str:
        return (
            f"ImageSource(examples={len(self)}, shape={self.images.shape[1:]}, "
            f"batch_size={self.batch_size}, seed={self.seed}, shuffle={self.shuffle}, "
            f"augment={self.augment})"
        )


def create_sources(config: Any) -> tuple[ImageSource, ImageSource]:
    """Host-side: ``(train, eval)`` sources for a full mptrain config (keys in the module doc).

    Both splits are read here, before anything compiles, so a missing dataset fails at once.
    """
    import_tfds()  # a missing extra first: it is the reason whatever else is set
    with errors.config_errors():
        check_config(config)
    keys = errors.settings(config.data, CONFIG_KEYS)
    dataset, data_dir = keys["dataset"], keys["data_dir"]
    train = load_split(dataset, keys["train_split"], data_dir)
    evaluation = load_split(dataset, keys["eval_split"], data_dir)
    mean, std = normalization(dataset, train["image"])
    common = {"mean": mean, "std": std, "seed": config.seed}
    return (
        ImageSource(
            train["image"],
            train["label"],
            config.batch_size,
            augment=keys["augment"],
            **common,
        ),
        ImageSource(
            evaluation["image"], evaluation["label"], config.batch_size, shuffle=False, **common
        ),
    )
