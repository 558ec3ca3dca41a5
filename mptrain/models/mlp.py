"""A multilayer perceptron classifier: the smallest model of the zoo.

Mixed precision: params arrive already cast to the compute dtype ``dtype`` (but those
``keep_fp32`` keeps); every ``nn.Dense`` runs in it (``layers.run_in``). The one fp32 island is
the logits (``layers.logits_f32``): they leave the model as fp32, so the softmax and the loss
never run in 16 bits.

``model_config`` keys: ``hidden`` (width, default 256), ``num_layers`` (hidden layers, default
2), ``num_classes`` (default 10).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain import errors
from mptrain.models import layers
from mptrain.models.record import Record
from mptrain.parallel import axes as axes_lib


class MLP(nn.Module):
    """``float[B, ...]`` -> ``float32[B, num_classes]`` logits; inputs are flattened first."""

    hidden: int = 256
    num_layers: int = 2
    num_classes: int = 10
    dtype: layers.Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        del train  # no dropout or batch statistics
        x = x.reshape(x.shape[0], -1)
        for i in range(self.num_layers):
            inits = layers.dense_inits((axes_lib.EMBED, axes_lib.MLP))
            dense = nn.Dense(self.hidden, dtype=None, name=f"dense_{i}", **inits)
            x = nn.relu(layers.run_in(self.dtype, dense, x))
        return layers.logits_f32(x, self.num_classes, self.dtype)


# The keys `create_model` reads under `config.model`, with their defaults.
CONFIG_KEYS = {"hidden": 256, "num_layers": 2, "num_classes": 10}


def create_model(model_config: Any, compute_dtype: layers.Dtype = jnp.float32) -> MLP:
    """Host-side: an `MLP` from the keys in the module doc; a bad value is a `ConfigError`
    naming its key."""
    keys = errors.settings(model_config, CONFIG_KEYS)
    with errors.config_errors():
        errors.check_integer("model.hidden", keys["hidden"], 1)
        errors.check_integer("model.num_layers", keys["num_layers"], 0)
        errors.check_integer("model.num_classes", keys["num_classes"], 1)
    return MLP(**keys, dtype=compute_dtype)


RECORD = Record(name="mlp")  # a classifier: data and fsdp meshes, fp32 or 16-bit compute
