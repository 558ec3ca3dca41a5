"""A byte-level transformer LM written in flax NNX, trained by the unchanged Trainer.

`build_model` returns an `nnx.Module`; the Trainer splits it into params (the fp32 master copy)
and other state, and rebuilds it from compute-dtype params inside the step, so precision
policies, loss scaling, skipped steps and checkpoints work as for linen models. The default
`loss_fn` and data (the embedded text corpus) are used as they are.
"""

import jax
import jax.numpy as jnp
from absl import logging
from flax import nnx

import mptrain
from mptrain.models import attention as attention_lib
from mptrain.models import layers


class Block(nnx.Module):
    """Pre-norm causal self-attention and MLP. The matmuls run in `dtype` (the policy's
    compute dtype, as for the linen zoo); LayerNorm statistics and the softmax statistics run
    in fp32. `attention` ("cudnn" | "materialized") picks the implementation in
    `mptrain.models.attention.causal_attention`, the one the linen transformer calls too."""

    def __init__(self, d_model, num_heads, d_ff, dtype, attention, *, rngs: nnx.Rngs):
        self.num_heads, self.attention = num_heads, attention
        linear = lambda i, o: nnx.Linear(i, o, dtype=dtype, rngs=rngs)
        self.ln_attn = nnx.LayerNorm(d_model, dtype=jnp.float32, rngs=rngs)
        self.qkv, self.out = linear(d_model, 3 * d_model), linear(d_model, d_model)
        self.ln_mlp = nnx.LayerNorm(d_model, dtype=jnp.float32, rngs=rngs)
        self.fc_in, self.fc_out = linear(d_model, d_ff), linear(d_ff, d_model)

    def __call__(self, x):
        dtype = x.dtype
        batch, length, _ = x.shape
        q, k, v = jnp.split(self.qkv(self.ln_attn(x).astype(dtype)), 3, axis=-1)
        heads = lambda t: t.reshape(batch, length, self.num_heads, -1)  # [B, L, H, D]
        attended = attention_lib.causal_attention(heads(q), heads(k), heads(v), self.attention)
        x = x + self.out(attended.reshape(x.shape))
        h = jax.nn.gelu(self.fc_in(self.ln_mlp(x).astype(dtype)))
        return x + self.fc_out(h)


class ByteLM(nnx.Module):
    """`int[B, T]` bytes -> `float32[B, T, 256]` logits of the next byte.

    `attention`: "auto" | "cudnn" | "materialized", resolved and logged here, once, by the
    zoo's rule (`mptrain.models.attention.choose_attention`): cuDNN's fused kernel where it can
    run."""

    def __init__(self, d_model, num_layers, num_heads, d_ff, max_len, dtype, attention, *, rngs):
        self.dtype = dtype
        choice = attention_lib.choose_attention(
            attention, dtype=dtype, head_dim=d_model // num_heads
        )
        logging.info("mptrain: attention: %s", choice)
        self.embed = nnx.Embed(256, d_model, dtype=dtype, rngs=rngs)
        self.pos = nnx.Param(0.02 * jax.random.normal(rngs.params(), (max_len, d_model)))
        self.blocks = nnx.List(
            [
                Block(d_model, num_heads, d_ff, dtype, choice.implementation, rngs=rngs)
                for _ in range(num_layers)
            ]
        )
        self.ln_final = nnx.LayerNorm(d_model, dtype=jnp.float32, rngs=rngs)
        self.head = nnx.Linear(d_model, 256, dtype=dtype, rngs=rngs)

    def __call__(self, tokens):
        # The lookup as a one-hot matmul: nnx.Embed's own gather would be differentiated into
        # a scatter-add, which a GPU runs with atomics (slow in bf16, never deterministic).
        x = layers.embed(self.embed.embedding[...], tokens, self.dtype)
        x = x + self.pos[: tokens.shape[1]].astype(x.dtype)
        for block in self.blocks:
            x = block(x)
        x = self.ln_final(x).astype(x.dtype)
        return self.head(x).astype(jnp.float32)  # the loss reads fp32 logits


class NNXTrainer(mptrain.Trainer):
    def build_model(self):  # host-side: an NNX module, built with the run's seed
        m, rngs = self.config.model, nnx.Rngs(self.config.seed)
        dims = (m.d_model, m.num_layers, m.num_heads, m.d_ff, m.max_len)
        attention = m.get("attention", "auto")  # configs without the key: "auto"
        return ByteLM(*dims, self.policy.compute_dtype, attention, rngs=rngs)
