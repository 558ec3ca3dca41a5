"""Synthetic image classification: batches shaped like MNIST's or CIFAR-10's, made from numbers.

Offline and instant: no download, no TensorFlow, no files. The zoo's image configs train on it
in their `:tiny` variants (`configs/mnist_cnn.py:tiny`, `configs/cifar10_resnet.py:tiny`); their
full configs read the real datasets with `mptrain.data.tfds`.

Batches are what `mptrain.data.tfds` gives for a dataset of that shape: ``{"inputs":
float32[B, H, W, C], "targets": int32[B]}``, the inputs roughly normalised (mean 0, standard
deviation 1 per pixel), the targets in ``[0, num_classes)``. An example of class ``k`` is
``signal * prototype[k] + sqrt(1 - signal**2) * noise``: the prototype is a fixed blocky pattern
(a 4 x 4 grid of random colours, scaled up to H x W, so it survives convolutions and pooling),
the noise is Gaussian per pixel. The prototypes are the same for every seed (they are "the
dataset"); the seed draws the examples, so a model can learn them and its loss falls.

``config.data`` keys (`CONFIG_KEYS` holds them, bar ``name``, with their defaults):
  name:        ``"synthetic_images"`` (this module).
  image_shape: ``(height, width, channels)``: ``(28, 28, 1)`` is MNIST's, ``(32, 32, 3)``
               CIFAR-10's.
  num_classes: the labels drawn, ``0 .. num_classes - 1``; at most the model's
               ``model.num_classes`` where it has one.
  signal:      in ``(0, 1]``: how much of each pixel's variance is the class's prototype (1:
               no noise at all).

Training batch ``i`` draws its labels and noise from ``default_rng([seed, 0, i])``: a pure
function of ``(seed, i)``, so a resumed run needs only its step number. The eval source is one
fixed held-out stream, ``default_rng([0, 1, i])``, the same for every seed (as a test split is).
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from mptrain import errors

CONFIG_KEYS = {"image_shape": (28, 28, 1), "num_classes": 10, "signal": 0.8}
GRID = 4  # each prototype is a GRID x GRID pattern of random colours, scaled up to H x W
_PROTOTYPES = 2**31 - 1  # the first entropy word of the prototypes' generator
TRAIN, EVAL = 0, 1  # the second entropy word of a batch's generator


def prototype(label: int, image_shape: tuple[int, int, int]) -> np.ndarray:
    """The fixed ``float32[H, W, C]`` pattern of class ``label``: unit variance per pixel."""
    h, w, c = image_shape
    cells = np.random.default_rng([_PROTOTYPES, int(label)]).standard_normal((GRID, GRID, c))
    rows, cols = np.arange(h) * GRID // h, np.arange(w) * GRID // w
    return cells[rows[:, None], cols[None, :]].astype(np.float32)


def _checked(
    image_shape: Any, num_classes: Any, signal: Any, *, prefix: str = ""
) -> tuple[tuple[int, int, int], int, float]:
    """``(image_shape, num_classes, signal)`` checked; a bad one is a `ValueError` naming it as
    ``prefix + key`` (``data.num_classes=1: ...`` with ``prefix="data."``)."""
    shape = errors.check_integers(f"{prefix}image_shape", image_shape, 1)
    if len(shape) != 3:
        raise ValueError(
            f"{prefix}image_shape={image_shape!r}: must be (height, width, channels), e.g. "
            "(28, 28, 1) or (32, 32, 3)"
        )
    num_classes = errors.check_integer(f"{prefix}num_classes", num_classes, 2)
    checked_signal = errors.check_number(f"{prefix}signal", signal, 0.0, open_low=True)
    if checked_signal > 1.0:
        raise ValueError(f"{prefix}signal={signal!r}: must be > 0 and <= 1")
    return shape, num_classes, checked_signal  # type: ignore[return-value]


class SyntheticImageSource:
    """Batches ``{"inputs": float32[B, H, W, C], "targets": int32[B]}`` (see the module doc).

    Batch ``index`` draws from ``default_rng([seed, stream, index])``; `EVAL` sources are made
    with seed 0, so that every run is evaluated on the same examples.
    """

    def __init__(
        self,
        image_shape: Any,
        num_classes: int,
        batch_size: int,
        seed: int = 0,
        *,
        signal: float = CONFIG_KEYS["signal"],
        stream: int = TRAIN,
    ):
        self.image_shape, self.num_classes, self.signal = _checked(image_shape, num_classes, signal)
        self.batch_size = errors.check_integer("batch_size", batch_size, 1)
        self.seed = errors.check_integer("seed", seed, 0)
        self.stream = stream
        self._noise = float(np.sqrt(1.0 - self.signal**2))

    @functools.cached_property
    def _means(self) -> np.ndarray:
        """``float32[num_classes, H, W, C]``: each class's ``signal * prototype``, built when the
        first batch is asked for (so that `check_config` builds a source without them)."""
        classes = [prototype(k, self.image_shape) for k in range(self.num_classes)]
        return self.signal * np.stack(classes)

    def get_batch(self, index: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Batch number ``index``, deterministic in ``(seed, index)``; only its ``rows`` (each
        process of a multi-process run builds only its own; drawn whole, then cut, so a row is
        the same whoever builds it)."""
        if isinstance(index, bool) or not isinstance(index, int | np.integer) or index < 0:
            raise ValueError(f"batch index must be a non-negative int, got {index!r}")
        rng = np.random.default_rng([self.seed, self.stream, int(index)])
        labels = rng.integers(0, self.num_classes, size=self.batch_size).astype(np.int32)
        noise = rng.standard_normal((self.batch_size, *self.image_shape), dtype=np.float32)
        labels, noise = labels[rows], noise[rows]
        inputs = (self._means[labels] + np.float32(self._noise) * noise).astype(np.float32)
        return {"inputs": inputs, "targets": labels}

    def __repr__(self) -> str:
        return (
            f"SyntheticImageSource(image_shape={self.image_shape}, "
            f"num_classes={self.num_classes}, batch_size={self.batch_size}, seed={self.seed}, "
            f"signal={self.signal:g}, stream={'eval' if self.stream == EVAL else 'train'})"
        )


def build_sources(config: Any, *, batch_size: int | None = None):
    """``(train, eval)`` sources of a full mptrain config; a bad key is a `ValueError` naming
    it (``data.num_classes=1: ...``)."""
    shape, num_classes, signal = _checked(
        **errors.settings(config.data, CONFIG_KEYS), prefix="data."
    )
    batch_size = config.batch_size if batch_size is None else batch_size
    common = {"image_shape": shape, "num_classes": num_classes, "signal": signal}
    train = SyntheticImageSource(**common, batch_size=batch_size, seed=config.seed)
    model_classes = getattr(getattr(config, "model", None), "num_classes", None)
    if isinstance(model_classes, int) and train.num_classes > model_classes:
        raise ValueError(
            f"data.num_classes={train.num_classes}: more classes than the model has logits "
            f"(model.num_classes={model_classes})"
        )
    evaluation = SyntheticImageSource(**common, batch_size=batch_size, seed=0, stream=EVAL)
    return train, evaluation


def check_config(config: Any) -> dict[str, Any]:
    """What `config.validate` calls: the sources built as `create_sources` builds them (nothing
    is drawn until a batch is asked for), then the abstract shapes of one example,
    ``{"inputs": float32[1, H, W, C], "targets": int32[1]}``, for the model to be tried on."""
    import jax

    train, _ = build_sources(config, batch_size=1)
    return {
        "inputs": jax.ShapeDtypeStruct((1, *train.image_shape), np.float32),
        "targets": jax.ShapeDtypeStruct((1,), np.int32),
    }


def create_sources(config: Any) -> tuple[SyntheticImageSource, SyntheticImageSource]:
    """Host-side: the ``(train, eval)`` sources for a full mptrain config (keys in the module
    doc); a bad key is an `errors.ConfigError` naming it."""
    with errors.config_errors():
        return build_sources(config)
