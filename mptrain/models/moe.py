"""A mixture-of-experts MLP (Qwen3-MoE's and Mixtral's): a router picks `top_k` of `num_experts`
SwiGLU experts for each token, their outputs summed with the router's weights.

Where the precision goes (MaxText's `float32_weight_sum`, Megatron-LM's `--moe-router-dtype`):

  * the router: its matmul in fp32 (the tokens and the router's kernel in fp32, `HIGHEST`),
    its softmax, the top-k and the renormalisation of the chosen weights (`norm_topk_prob`;
    Mixtral always) in fp32. In 16 bits the logits of two experts a few ulps apart become equal
    or swap, and the token goes to another expert (serving engines report it at near-ties:
    tests/models/moe_test.py counts such tokens). `router_fp32=False` runs the router's matmul
    in the compute dtype (what a 16-bit `F.linear` gives), to show the difference;
  * the experts: grouped matmuls (`jax.lax.ragged_dot`) over the token copies sorted by
    expert, in the compute dtype with fp32 accumulation, no token dropped (no capacity);
  * the weighted sum of a token's `top_k` expert outputs in fp32, cast to the compute dtype
    once (transformers rounds the weights to the model's dtype and sums in it).

What XLA makes of `ragged_dot` (jax 0.10.2, `scripts/moe_compiled.py`, one Qwen3-30B-A3B layer's
forward at 8,192 tokens, compiled here for chips that are not): a TPU v5e runs each of the
three as one grouped-matmul kernel (Mosaic's `ragged-dot`), 1.94 GiB of temporaries; an H100 as
a dense matmul of every token copy against every expert's kernel (`[65,536, 262,144]` by
`[262,144, 768]`: 128 times the routed FLOPs, 32.2 GiB of temporaries). On a GPU the experts
need another path before this layer is fit to train there.

The layer returns its output and the router's fp32 logits `[tokens, num_experts]`, which the
load-balancing loss reads (`load_balancing_loss`, transformers' `load_balancing_loss_func`:
`num_experts * sum_e f_e P_e` over every layer's tokens, `f_e` the share of top-k picks that go
to expert `e`, `P_e` its mean router probability), in fp32.

Params (`[in, out]` as flax keeps them; a HuggingFace folder's per-expert `[out, in]` weights
are transposed and stacked): `router` `[D, E]`, `gate` and `up` `[E, D, F]`, `down` `[E, F, D]`.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from mptrain.models import layers


def route(
    tokens: jax.Array, kernel: jax.Array, top_k: int, normalise: bool, fp32: bool = True
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`(logits, weights, experts)` for `tokens [T, D]` and the router's `kernel [D, E]`:
    fp32 logits `[T, E]`, the fp32 weights `[T, top_k]` of the experts `int32 [T, top_k]` the
    softmax ranks first (renormalised to sum to 1 where `normalise`). `fp32=False`: the
    matmul in `tokens`' dtype, its logits rounded to it (the softmax still in fp32)."""
    if fp32:
        logits = jnp.dot(
            tokens.astype(jnp.float32),
            kernel.astype(jnp.float32),
            precision=jax.lax.Precision.HIGHEST,
        )
    else:
        logits = jnp.dot(tokens, kernel.astype(tokens.dtype)).astype(jnp.float32)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if normalise:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return logits, weights, experts.astype(jnp.int32)


def load_balancing_loss(logits: jax.Array, top_k: int) -> jax.Array:
    """transformers' auxiliary loss on every MoE layer's router logits (`[..., T, E]`, all
    layers' tokens together): `E * sum_e f_e P_e`, in fp32."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)
    experts = logits.shape[-1]
    probs = jax.nn.softmax(logits, axis=-1)
    _, picked = jax.lax.top_k(probs, top_k)
    counts = jnp.sum(jax.nn.one_hot(picked, experts, dtype=jnp.float32), axis=(0, 1))
    rows = logits.shape[0]
    return experts * jnp.sum((counts / rows) * (jnp.sum(probs, axis=0) / rows))


def experts_mlp(
    tokens: jax.Array, experts: jax.Array, weights: jax.Array, gate, up, down
) -> jax.Array:
    """`[T, D]`: each token's `top_k` SwiGLU experts (`gate`, `up` `[E, D, F]`, `down`
    `[E, F, D]`, in `tokens`' dtype) summed with its fp32 `weights`. The `T x top_k` copies
    of the tokens are sorted by expert, so each expert's are one group of a grouped matmul."""
    count, top_k = experts.shape
    flat = experts.reshape(-1)
    order = jnp.argsort(flat, stable=True)  # copy j of the sorted list: token order[j] // k
    sizes = jnp.bincount(flat, length=gate.shape[0]).astype(jnp.int32)
    copies = jnp.take(tokens, order // top_k, axis=0)
    matmul = lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    h = nn.silu(matmul(copies, gate).astype(tokens.dtype))
    h = h * matmul(copies, up).astype(tokens.dtype)
    out = matmul(h, down)  # fp32 [T * k, D], sorted
    back = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    out = jnp.take(out, back, axis=0).reshape(count, top_k, -1)
    return jnp.einsum("tkd,tk->td", out, weights.astype(jnp.float32))


class MoE(nn.Module):
    """The mixture-of-experts MLP (the module doc): `x [B, L, D] -> (y [B, L, D], fp32 router
    logits [B * L, num_experts])`."""

    num_experts: int
    top_k: int
    d_ff: int  # each expert's hidden width (`moe_intermediate_size`)
    normalise: bool  # `norm_topk_prob` (Mixtral: always)
    dtype: layers.Dtype
    router_fp32: bool = True

    @nn.compact
    def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
        batch, length, width = x.shape
        init = nn.initializers.lecun_normal()
        experts_init = nn.initializers.lecun_normal(in_axis=-2, out_axis=-1, batch_axis=(0,))
        router = self.param("router", init, (width, self.num_experts))
        shapes = {
            "gate": (self.num_experts, width, self.d_ff),
            "up": (self.num_experts, width, self.d_ff),
            "down": (self.num_experts, self.d_ff, width),
        }
        kernels = {k: self.param(k, experts_init, s).astype(self.dtype) for k, s in shapes.items()}
        tokens = x.reshape(-1, width).astype(self.dtype)
        logits, weights, picked = route(
            tokens, router, self.top_k, self.normalise, self.router_fp32
        )
        y = experts_mlp(tokens, picked, weights, kernels["gate"], kernels["up"], kernels["down"])
        return y.astype(self.dtype).reshape(batch, length, width), logits
