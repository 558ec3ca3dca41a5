"""A small convolutional classifier for MNIST-sized images (28x28, one channel).

Two 3x3 convolutions with ReLU and 2x2 max pooling, then a hidden dense layer and the head; about
99% test accuracy on MNIST with the widths of `configs/mnist_cnn.py`.

Mixed precision: params arrive already cast to the compute dtype ``dtype`` (but those
``keep_fp32`` keeps); every convolution and dense layer runs in it (``layers.run_in``). Max
pooling does no arithmetic, so it is exact in any dtype; it is a reshape and a max, whose
gradient is a select,
rather than ``nn.max_pool``, whose gradient is a select-and-scatter (atomics on a GPU). The fp32
island is the logits (``layers.logits_f32``): they leave the model as fp32, so the softmax and
the loss never run in 16 bits.

``model_config`` keys: ``features`` (channels of each conv layer, default ``(32, 64)``),
``hidden`` (dense width, default 256), ``num_classes`` (default 10).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain import errors
from mptrain.models import layers
from mptrain.models.record import Record
from mptrain.parallel import axes as axes_lib

# flax's default (LeCun normal), drawn as a matrix: the same distribution, compiled much faster.
_conv_init = layers.kernel_init_as_matrix(nn.initializers.lecun_normal())


def max_pool_2x2(x: jax.Array) -> jax.Array:
    """2x2 max pooling with stride 2 (VALID: an odd last row or column is dropped)."""
    b, h, w, c = x.shape
    x = x[:, : h // 2 * 2, : w // 2 * 2]
    return x.reshape(b, h // 2, 2, w // 2, 2, c).max(axis=(2, 4))


class CNN(nn.Module):
    """``float[B, H, W, C]`` images -> ``float32[B, num_classes]`` logits."""

    features: Sequence[int] = (32, 64)
    hidden: int = 256
    num_classes: int = 10
    dtype: layers.Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        del train  # no dropout or batch statistics
        if x.ndim != 4:
            raise ValueError(f"images must be [batch, height, width, channels], got {x.shape}")
        for i, features in enumerate(self.features):
            inits = layers.dense_inits((None, None, axes_lib.EMBED, axes_lib.MLP), _conv_init)
            conv = nn.Conv(features, (3, 3), dtype=None, name=f"conv_{i}", **inits)
            x = layers.run_in(self.dtype, conv, x)
            x = max_pool_2x2(nn.relu(x))
        x = x.reshape(x.shape[0], -1)
        inits = layers.dense_inits((axes_lib.EMBED, axes_lib.MLP))
        dense = nn.Dense(self.hidden, dtype=None, name="dense", **inits)
        x = nn.relu(layers.run_in(self.dtype, dense, x))
        return layers.logits_f32(x, self.num_classes, self.dtype)


# The keys `create_model` reads under `config.model`, with their defaults.
CONFIG_KEYS = {"features": (32, 64), "hidden": 256, "num_classes": 10}


def create_model(model_config: Any, compute_dtype: layers.Dtype = jnp.float32) -> CNN:
    """Host-side: a `CNN` from the keys in the module doc; a bad value is a `ConfigError`
    naming its key."""
    keys = errors.settings(model_config, CONFIG_KEYS)
    with errors.config_errors():
        features = errors.check_integers("model.features", keys["features"], 1)
        errors.check_integer("model.hidden", keys["hidden"], 1)
        errors.check_integer("model.num_classes", keys["num_classes"], 1)
    return CNN(
        features=features,
        hidden=keys["hidden"],
        num_classes=keys["num_classes"],
        dtype=compute_dtype,
    )


RECORD = Record(name="cnn")  # a classifier: data and fsdp meshes, fp32 or 16-bit compute
