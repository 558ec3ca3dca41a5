"""ResNet-18 for CIFAR-sized images (32x32): 3x3 stem, no max pool, four stages of basic blocks.

Mixed precision: params arrive already cast to the compute dtype ``dtype``; every convolution
and the head run in it. The fp32 islands:

  * BatchNorm, whole (``layers.batch_norm_f32``): the batch mean and variance (a 16-bit sum of
    squares over a batch of activations overflows fp16 and loses bits in bf16), the running
    averages kept in the ``batch_stats`` collection (the trainer's ``model_state``, created and
    stored as fp32), and the normalisation itself. Only its output is cast back to ``dtype``, so
    the next convolution still gets 16-bit operands instead of being silently promoted to fp32;
  * the global average pool, a mean over the spatial positions;
  * the logits, which leave the model as fp32 (``layers.logits_f32``).

``model_config`` keys: ``stage_sizes`` (basic blocks per stage, default ``(2, 2, 2, 2)``, i.e.
ResNet-18), ``width`` (channels of the first stage, doubled at each later one, default 64),
``num_classes`` (default 10), ``bn_momentum`` (running-average decay, default 0.9).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain import errors
from mptrain.models import layers
from mptrain.models.record import Record
from mptrain.parallel import axes as axes_lib

_conv_init = layers.kernel_init_as_matrix(nn.initializers.he_normal())  # He et al., 2015 (fan-in)
# a conv's kernel `[height, width, in, out]`: the channels in as the width FSDP splits
CONV = {"kernel_init": axes_lib.declare(_conv_init, (None, None, axes_lib.EMBED, axes_lib.MLP))}


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a residual connection (projected when the shape changes)."""

    features: int
    strides: int = 1
    dtype: layers.Dtype = jnp.float32
    bn_momentum: float = 0.9

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool) -> jax.Array:
        conv = functools.partial(nn.Conv, use_bias=False, dtype=None, **CONV)
        norm = functools.partial(
            layers.batch_norm_f32, train=train, dtype=self.dtype, momentum=self.bn_momentum
        )
        y = layers.run_in(self.dtype, conv(self.features, (3, 3), self.strides, name="conv1"), x)
        y = nn.relu(norm(y, name="bn1"))
        y = layers.run_in(self.dtype, conv(self.features, (3, 3), name="conv2"), y)
        # Zero-initialised scale: each block starts as the identity (Goyal et al., 2017).
        y = norm(y, name="bn2", scale_init=nn.initializers.zeros)
        if x.shape != y.shape:
            proj = conv(self.features, (1, 1), self.strides, name="proj_conv")
            x = layers.run_in(self.dtype, proj, x)
            x = norm(x, name="proj_bn")
        return nn.relu(x + y)


class ResNet(nn.Module):
    """``float[B, H, W, C]`` images -> ``float32[B, num_classes]`` logits."""

    stage_sizes: Sequence[int] = (2, 2, 2, 2)
    width: int = 64
    num_classes: int = 10
    dtype: layers.Dtype = jnp.float32
    bn_momentum: float = 0.9

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        if x.ndim != 4:
            raise ValueError(f"images must be [batch, height, width, channels], got {x.shape}")
        stem = nn.Conv(self.width, (3, 3), use_bias=False, dtype=None, name="stem_conv", **CONV)
        x = layers.run_in(self.dtype, stem, x)
        x = layers.batch_norm_f32(
            x, train=train, dtype=self.dtype, momentum=self.bn_momentum, name="stem_bn"
        )
        x = nn.relu(x)
        for stage, num_blocks in enumerate(self.stage_sizes):
            for block in range(num_blocks):
                x = BasicBlock(
                    self.width * 2**stage,
                    strides=2 if stage > 0 and block == 0 else 1,
                    dtype=self.dtype,
                    bn_momentum=self.bn_momentum,
                    name=f"stage{stage}_block{block}",
                )(x, train=train)
        x = jnp.mean(x.astype(jnp.float32), axis=(1, 2)).astype(self.dtype)  # pooled in fp32
        return layers.logits_f32(x, self.num_classes, self.dtype)


# The keys `create_model` reads under `config.model`, with their defaults: ResNet-18.
CONFIG_KEYS = {"stage_sizes": (2, 2, 2, 2), "width": 64, "num_classes": 10, "bn_momentum": 0.9}


def create_model(model_config: Any, compute_dtype: layers.Dtype = jnp.float32) -> ResNet:
    """Host-side: a `ResNet` from the keys in the module doc; a bad value is a `ConfigError`
    naming its key."""
    keys = errors.settings(model_config, CONFIG_KEYS)
    with errors.config_errors():
        stage_sizes = errors.check_integers("model.stage_sizes", keys["stage_sizes"], 1)
        errors.check_integer("model.width", keys["width"], 1)
        errors.check_integer("model.num_classes", keys["num_classes"], 1)
        errors.check_number("model.bn_momentum", keys["bn_momentum"], 0.0, 1.0)
    return ResNet(
        stage_sizes=stage_sizes,
        width=keys["width"],
        num_classes=keys["num_classes"],
        dtype=compute_dtype,
        bn_momentum=keys["bn_momentum"],
    )


RECORD = Record(name="resnet")  # a classifier: data and fsdp meshes, fp32 or 16-bit compute
