"""A byte-level, decoder-only transformer language model with fp32 islands.

Mixed-precision contract: the framework passes parameters already cast to the compute dtype
(``dtype``; e.g. bf16) while fp32 master copies live in the train state. Inside the model:

  * every matmul (QKV, attention scores, attention-weighted values, output projection, MLP,
    logits) takes ``dtype`` operands. Each ``nn.Dense`` is built with ``dtype=self.dtype``, which
    makes flax cast its input and kernel to that dtype, and every fp32 island ends with an explicit
    cast back, so an fp32 tensor never silently promotes the next matmul to fp32;
  * the fp32 islands are the LayerNorm statistics (``layers.layer_norm_f32``), the attention
    softmax, and the logits: the attention scores and the logits use ``dtype`` operands with fp32
    results (``layers.einsum_f32_out``, and ``layers.dot_general_f32_out`` in the head's
    ``nn.Dense``), so they never round to 16 bits before the softmax / the loss. Their custom
    gradient keeps the backward matmuls in ``dtype`` too (see ``layers``).

``param_dtype`` is left at flax's default (fp32), so ``model.init`` creates fp32 master params.

On CPU, XLA runs a bf16 x bf16 -> bf16 matmul as convert-to-fp32, fp32 matmul, convert back, so
bf16 compute is emulated there and costs about as much as fp32. (Giving every matmul, forward and
backward, fp32 accumulation would reach XLA:CPU's native bf16 kernels, but in jax 0.10.2 some of
the resulting backward matmuls fail at run time with "Unsupported element type for
DotThunk::Execute: BF16 x BF16 = F32"; so only the two forward matmuls above use it.)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mptrain.models import layers


def _dense(features: int, dtype: layers.Dtype, name: str, **kwargs: Any) -> nn.Dense:
    """A bias-free ``nn.Dense`` that casts its input and kernel to ``dtype`` before the matmul.

    No biases: with pre-LN blocks they add next to nothing (the LayerNorms have their own), and on
    XLA:CPU their gradients (column sums over batch x length) cost about a quarter of the step.
    """
    return nn.Dense(features, dtype=dtype, use_bias=False, name=name, **kwargs)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention; softmax in fp32, everything else in ``dtype``."""

    num_heads: int
    dtype: layers.Dtype = jnp.float32
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        batch, length, d_model = x.shape
        if d_model % self.num_heads:
            raise ValueError(f"d_model={d_model} is not divisible by num_heads={self.num_heads}")
        head_dim = d_model // self.num_heads
        qkv = _dense(3 * d_model, self.dtype, "qkv")(x)
        qkv = qkv.reshape(batch, length, 3, self.num_heads, head_dim)
        q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]  # each [B, L, H, D]
        q = q * jnp.asarray(head_dim**-0.5, self.dtype)
        # Scores: 16-bit operands, fp32 result that goes straight into the fp32 softmax.
        scores = layers.einsum_f32_out("bqhd,bkhd->bhqk", q, k)
        causal = jnp.tril(jnp.ones((length, length), dtype=bool))
        scores = jnp.where(causal, scores, jnp.finfo(jnp.float32).min)
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)  # end of the fp32 island
        probs = nn.Dropout(self.dropout_rate)(probs, deterministic=not train)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        return _dense(d_model, self.dtype, "out")(out.reshape(batch, length, d_model))


class MLP(nn.Module):
    """Two-layer feed-forward block with GELU."""

    d_ff: int
    dtype: layers.Dtype = jnp.float32
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        d_model = x.shape[-1]
        h = nn.gelu(_dense(self.d_ff, self.dtype, "fc_in")(x))
        h = nn.Dropout(self.dropout_rate)(h, deterministic=not train)
        return _dense(d_model, self.dtype, "fc_out")(h)


class Block(nn.Module):
    """Pre-LN transformer block: ``x + attn(ln(x))``, then ``x + mlp(ln(x))``."""

    num_heads: int
    d_ff: int
    dtype: layers.Dtype = jnp.float32
    dropout_rate: float = 0.0

    @nn.compact
    def __call__(self, x: jax.Array, *, train: bool = False) -> jax.Array:
        drop = nn.Dropout(self.dropout_rate)
        h = layers.layer_norm_f32(x, self.dtype, "ln_attn")
        h = CausalSelfAttention(self.num_heads, self.dtype, self.dropout_rate, name="attn")(
            h, train=train
        )
        x = x + drop(h, deterministic=not train)
        h = layers.layer_norm_f32(x, self.dtype, "ln_mlp")
        h = MLP(self.d_ff, self.dtype, self.dropout_rate, name="mlp")(h, train=train)
        return x + drop(h, deterministic=not train)


class TransformerLM(nn.Module):
    """Decoder-only LM: ``int32[B, L]`` tokens -> ``float32[B, L, vocab_size]`` logits.

    ``dtype`` is the compute dtype; params are created in fp32 (flax's ``param_dtype``
    default). Positions are learned, up to ``max_len``. Dropout needs a ``"dropout"`` rng when
    called with ``train=True`` and ``dropout_rate > 0``.
    """

    vocab_size: int = 256
    d_model: int = 128
    num_layers: int = 2
    num_heads: int = 2
    d_ff: int = 512
    max_len: int = 128
    dtype: layers.Dtype = jnp.float32
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
        # No nn.Embed: its gradient is a scatter-add (atomics on a GPU); see layers.embed.
        x = layers.Embed(self.vocab_size, self.d_model, self.dtype, init, name="Embed_0")(tokens)
        positions = self.param("pos_embedding", init, (self.max_len, self.d_model))
        x = x + positions[:length].astype(self.dtype)
        x = nn.Dropout(self.dropout_rate)(x, deterministic=not train)
        for i in range(self.num_layers):
            x = Block(self.num_heads, self.d_ff, self.dtype, self.dropout_rate, name=f"block_{i}")(
                x, train=train
            )
        x = layers.layer_norm_f32(x, self.dtype, "ln_final")
        # Logits: 16-bit operands, fp32 accumulation and result; the loss never sees bf16 logits.
        head = _dense(self.vocab_size, self.dtype, "head", dot_general=layers.dot_general_f32_out)
        logits = head(x)
        return logits.astype(jnp.float32)  # a no-op: the matmul already returns fp32


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy in nats (per byte for a byte-level model), in fp32."""
    return layers.cross_entropy(logits, targets)


def bits_per_byte(loss_nats: float) -> float:
    """Converts a per-byte loss in nats to bits."""
    return float(loss_nats) / float(np.log(2.0))


def create_model(model_config: Any, compute_dtype: layers.Dtype = jnp.float32) -> TransformerLM:
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
