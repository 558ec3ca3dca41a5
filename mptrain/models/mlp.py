"""A multilayer perceptron classifier: the smallest model of the zoo.

Mixed precision: params arrive already cast to the compute dtype ``dtype``; every ``nn.Dense`` is
built with ``dtype=self.dtype`` so its matmul runs in it. The one fp32 island is the logits:
they leave the model as fp32, so the softmax and the loss never run in 16 bits.

``model_config`` keys: ``hidden`` (width, default 256), ``num_layers`` (hidden layers, default
2), ``num_classes`` (default 10).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Dtype = Any


class MLP(nn.Module):
    """``float[B, ...]`` -> ``float32[B, num_classes]`` logits; inputs are flattened first."""

    hidden: int = 256
    num_layers: int = 2
    num_classes: int = 10
    dtype: Dtype = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        del train  # no dropout or batch statistics
        x = x.reshape(x.shape[0], -1)
        for i in range(self.num_layers):
            x = nn.relu(nn.Dense(self.hidden, dtype=self.dtype, name=f"dense_{i}")(x))
        logits = nn.Dense(self.num_classes, dtype=self.dtype, name="head")(x)
        # fp32 from here on. (The head's result itself is rounded to `dtype`: a bf16 x bf16 ->
        # f32 dot is not supported by every XLA backend.)
        return logits.astype(jnp.float32)


def create_model(model_config: Any, compute_dtype: Dtype = jnp.float32) -> MLP:
    """Host-side: an `MLP` from the keys in the module doc."""
    return MLP(
        hidden=getattr(model_config, "hidden", 256),
        num_layers=getattr(model_config, "num_layers", 2),
        num_classes=getattr(model_config, "num_classes", 10),
        dtype=compute_dtype,
    )
