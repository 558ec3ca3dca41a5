"""A byte-level, decoder-only transformer language model with fp32 islands.

Mixed-precision contract: the framework passes parameters already cast to the compute dtype
(``dtype``; e.g. bf16) while fp32 master copies live in the train state. Inside the model:

  * every matmul (QKV, attention scores, attention-weighted values, output projection, MLP,
    logits) takes ``dtype`` operands. Each ``nn.Dense`` is built with ``dtype=self.dtype``, which
    makes flax cast its input and kernel to that dtype, and every fp32 island ends with an explicit
    cast back, so an fp32 tensor never silently promotes the next matmul to fp32;
  * the fp32 islands are the LayerNorm statistics, the attention softmax, and the logits: the
    attention scores and the logits use ``dtype`` operands with fp32 results
    (``preferred_element_type``), so they never round to 16 bits before the softmax / the loss.

``param_dtype`` is left at flax's default (fp32), so ``model.init`` creates fp32 master params.
"""

from __future__ import annotations

import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

Dtype = Any

# The logits matmul: 16-bit operands, fp32 accumulation and fp32 result.
_dot_general_f32_out = functools.partial(jax.lax.dot_general, preferred_element_type=jnp.float32)


def _layer_norm(x: jax.Array, dtype: Dtype, name: str) -> jax.Array:
    """LayerNorm computed in fp32 (mean, variance, rsqrt), result cast back to ``dtype``."""
    return nn.LayerNorm(dtype=jnp.float32, name=name)(x).astype(dtype)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; softmax in fp32, everything else in ``dtype``."""

    num_heads: int
    dtype: Dtype = jnp.float32
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        batch, length, d_model = x.shape
        if d_model % self.num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={self.num_heads}")
        head_dim = d_model // self.num_heads
        qkv = nn.Dense(3 * d_model, dtype=self.dtype, name="qkv")(x)
        qkv = qkv.reshape(batch, length, 3, self.num_heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each [B, L, H, D]
        q = q * jnp.asarray(head_dim**-0.5, self.dtype)
        # Scores: 16-bit operands, fp32 result that goes straight into the fp32 softmax.
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, preferred_element_type=jnp.float32)
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)  # end of the fp32 island
        probs = nn.Dropout(self.dropout_rate)(probs, deterministic=not train)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return nn.Dense(d_model, dtype=self.dtype, name="out")(out.reshape(batch, length, d_model))


class MLP(nn.Module):
    """Two-layer feed-forward block with GELU."""

    d_ff: int
    dtype: Dtype = jnp.float32
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        d_model = x.shape[-1]
        h = nn.gelu(nn.Dense(self.d_ff, dtype=self.dtype, name="fc_in")(x))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=not train)
        return nn.Dense(d_model, dtype=self.dtype, name="fc_out")(h)


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    num_heads: int
    d_ff: int
    dtype: Dtype = jnp.float32
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        drop = nn.Dropout(self.dropout_rate)
        h = _layer_norm(x, self.dtype, "ln_attn")
        h = CausalSelfAttention(self.num_heads, self.dtype, self.dropout_rate, name="attn")(
            h, train=train
        )
        x = x + drop(h, deterministic=not train)
        h = _layer_norm(x, self.dtype, "ln_mlp")
        h = MLP(self.d_ff, self.dtype, self.dropout_rate, name="mlp")(h, train=train)
        return x + drop(h, deterministic=not train)


class TransformerLM(nn.Module):
    """Decoder-only LM: ``int32[B, L]`` tokens -> ``float32[B, L, vocab_size]`` logits.

    ``dtype`` is the compute dtype; params are created in fp32 (flax's ``param_dtype``
    default). Positions are learned, up to ``max_len``. Dropout needs a ``"dropout"`` rng when
    called with ``train=True`` and ``dropout_rate > 0``.
    """

    vocab_size: int = 256
    d_model: int = 256
    num_layers: int = 4
    num_heads: int = 4
    d_ff: int = 1024
    max_len: int = 256
    dtype: Dtype = jnp.float32
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, tokens: jax.Array, *, train: bool = False) -> jax.Array:
        if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(
                f"tokens must be an integer [batch, length] array, got {tokens.dtype}"
                f"{list(tokens.shape)}"
            )
        length = tokens.shape[1]
        if length > self.max_len:
            raise ValueError(f"sequence length {length} exceeds max_len={self.max_len}")
        init = nn.initializers.normal(stddev=0.02)
        x = nn.Embed(self.vocab_size, self.d_model, dtype=self.dtype, embedding_init=init)(tokens)
        positions = self.param("pos_embedding", init, (self.max_len, self.d_model))
        x = x + positions[:length].astype(self.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        for i in range(self.num_layers):
            x = Block(self.num_heads, self.d_ff, self.dtype, self.dropout_rate, name=f"block_{i}")(
                x, train=train
            )
        x = _layer_norm(x, self.dtype, "ln_final")
        # Logits: 16-bit operands, fp32 accumulation and result; the loss never sees bf16 logits.
        logits = nn.Dense(
            self.vocab_size, dtype=self.dtype, dot_general=_dot_general_f32_out, name="head"
        )(x)
        return logits.astype(jnp.float32)  # already fp32; the bias add keeps it so


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats (per byte for a byte-level model), in fp32."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    return jnp.mean(losses)


def bits_per_byte(loss_nats: float) -> float:
    """Converts a per-byte loss in nats to bits."""
    return float(loss_nats) / float(np.log(2.0))


def create_model(model_config: Any, compute_dtype: Dtype = jnp.float32) -> TransformerLM:
    """Builds a ``TransformerLM`` from a config with the keys below (host-side, no params).

    ``model_config`` keys: ``d_model, num_layers, num_heads, d_ff, max_len`` and optionally
    ``vocab_size`` (default 256: bytes) and ``dropout_rate`` (default 0.0).
    """
    return TransformerLM(
        vocab_size=getattr(model_config, "vocab_size", 256),
        d_model=model_config.d_model,
        num_layers=model_config.num_layers,
        num_heads=model_config.num_heads,
        d_ff=model_config.d_ff,
        max_len=model_config.max_len,
        dtype=compute_dtype,
        dropout_rate=getattr(model_config, "dropout_rate", 0.0),
    )
