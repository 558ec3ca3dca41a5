"""The decoder's blocks (`mptrain.models.decoder`'s): RMSNorm, attention, the SwiGLU MLP, and
`Shape`, what a block needs to know: its sizes, and the switches by which the families the
decoder reads differ from the Llama (as settings, not copies of the model):

  * ``attn_bias``: ``"none"``, ``"qkv"`` (Qwen2: q, k, v with bias, o without) or ``"all"``
    (a Llama's or Qwen3's ``attention_bias``: the four projections);
  * ``qk_norm``: Qwen3's RMSNorm over each head's q and k (its own scale a head dimension),
    after the projection and before RoPE, in fp32 as every norm here; with ``qk_norm_width``
    OLMo 2's, over the whole projection (all heads) before it is split into heads;
  * ``window``: a sliding window (Mistral's ``sliding_window``; Qwen's, Gemma's on the layers
    ``layer_types`` names): a query sees itself and the ``window - 1`` keys before it, as
    transformers' ``sliding_window_overlay`` masks (``kv_idx > q_idx - window``). ``window`` and
    ``inv_freq`` (a RoPE base of its own, or none) may differ from layer to layer: the decoder
    takes a `Shape` a layer (`mptrain.models.decoder`'s ``layer_shapes``);
  * Gemma's: ``norm_plus_one`` (RMSNorm scales by ``1 + w``, ``w`` from 0, in fp32),
    ``post_norms`` (a norm after the attention and after the MLP too, four a block),
    ``pre_norms`` False (OLMo 2's block: norms after the attention and the MLP only),
    ``attn_scale`` (the scores' scale, ``query_pre_attn_scalar ** -0.5``, where it is not
    ``head_dim ** -0.5``), ``attn_softcap`` (``cap * tanh(s / cap)`` on the fp32 scores, before
    the mask) and ``mlp_act`` ``"gelu_tanh"`` (GELU's tanh form, in fp32, for SwiGLU's SiLU).

Every matmul takes compute-dtype operands; the fp32 islands are the llama module doc's.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from mptrain.models import attention as attention_lib
from mptrain.models import layers, splash
from mptrain.models import lora as lora_lib
from mptrain.models import remat as remat_lib
from mptrain.models.decoder import context_attention, moe
from mptrain.models.decoder.rope import apply_rope
from mptrain.parallel import axes as axes_lib
from mptrain.parallel import view
from mptrain.recipe import fp8 as fp8_lib

ATTN_BIASES = ("none", "qkv", "all")
MLP_ACTS = ("silu", "gelu_tanh")


class RMSNorm(nn.Module):
    """``x / rms(x) * scale`` (``* (1 + scale)``, ``scale`` from 0, with ``plus_one``: Gemma's),
    all of it in fp32, the result cast to ``dtype``."""

    eps: float
    dtype: layers.Dtype
    plus_one: bool = False
    names: tuple = (axes_lib.EMBED,)  # its scale's logical axes (`parallel.axes`)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        init = nn.initializers.zeros if self.plus_one else nn.initializers.ones
        init = axes_lib.declare(init, self.names, fp32=True)  # its role: kept in fp32
        scale = self.param("scale", init, (x.shape[-1],)).astype(jnp.float32)
        x32 = x.astype(jnp.float32)
        x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (x32 * (1.0 + scale if self.plus_one else scale)).astype(self.dtype)


# each projection's kernel `[in, out]` by its logical axes (`parallel.axes`): q, k, v and the
# MLP's gate and up from the width to heads or units, o and down back
PROJECTIONS = {
    "q": (axes_lib.EMBED, axes_lib.Q_HEADS),
    "k": (axes_lib.EMBED, axes_lib.KV_HEADS),
    "v": (axes_lib.EMBED, axes_lib.KV_HEADS),
    "o": (axes_lib.Q_HEADS, axes_lib.EMBED),
    "gate": (axes_lib.EMBED, axes_lib.MLP),
    "up": (axes_lib.EMBED, axes_lib.MLP),
    "down": (axes_lib.MLP, axes_lib.EMBED),
}


def dense(features: int, name: str, fp8: Any = None, lora: Any = None, bias: bool = False):
    """The projection `name` (`PROJECTIONS`): bias-free unless `bias`, its matmul in fp8 under
    a recipe (its scaling state in model_state, `mptrain.recipe.fp8`), with an adapter where
    `lora` says."""
    init = nn.initializers.normal(stddev=0.02)
    kwargs = {"use_bias": True} if bias else {}
    if fp8:
        kwargs["dot_general_cls"] = functools.partial(fp8_lib.DotGeneral, recipe=fp8)
    return lora_lib.dense(features, name, lora, init, names=PROJECTIONS[name], **kwargs)


@dataclasses.dataclass(frozen=True)
class Shape:
    """A block's sizes and switches (hashable: a static part of the module; the module doc)."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    d_ff: int
    norm_eps: float
    inv_freq: tuple[float, ...]  # RoPE's, `rope_frequencies`
    longrope: Any = None  # a `rope.LongRope`: Phi-3's long frequencies past a length
    attn_bias: str = "none"
    qk_norm: bool = False
    window: int | None = None
    norm_plus_one: bool = False
    pre_norms: bool = True
    post_norms: bool = False
    qk_norm_width: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    mlp_act: str = "silu"
    experts: int = 0  # a mixture of experts' MLP (`moe.MoE`) where not 0
    top_k: int = 0
    expert_d_ff: int = 0
    norm_topk: bool = True
    router_fp32: bool = True
    expert_kernel: tuple[str, int] = ("xla", 0)  # `grouped.matmul`'s kernel, the GPU's SMs

    def norm(self, dtype: layers.Dtype, name: str, names: tuple = (axes_lib.EMBED,)) -> RMSNorm:
        return RMSNorm(self.norm_eps, dtype, self.norm_plus_one, names, name=name)

    def part(self, ways: int) -> Shape:
        """One device's part of a tensor group of `ways` (`mptrain.parallel.tensor`): its heads,
        its key-value heads and its MLP units."""
        heads, kv, units = self.num_heads // ways, self.num_kv_heads // ways, self.d_ff // ways
        return dataclasses.replace(self, num_heads=heads, num_kv_heads=kv, d_ff=units)


class Attention(nn.Module):  # grouped-query, causal, with RoPE on q and k
    shape: Shape
    dtype: layers.Dtype
    implementation: str
    fp8: Any = None
    lora: Any = None  # a `lora.Spec`: adapters on the projections it names

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segments=None, cache=None) -> Any:
        s, (batch, length, _) = self.shape, x.shape
        bias = lambda name: s.attn_bias == "all" or (s.attn_bias == "qkv" and name != "o")
        run = lambda n, name, h: layers.run_in(
            self.dtype, dense(n, name, self.fp8, self.lora, bias(name)), h
        )

        # Three projections, each reshaped (a bitcast, no copy) to the [B, L, heads, Dh] the
        # attention kernel takes: no slices of a fused qkv output, no concatenated gradient.
        def project(n, name, tag):
            out = checkpoint_name(run(n * s.head_dim, name, x), tag)
            norm = s.qk_norm and name != "v"  # before RoPE: over each head, or all of them
            if norm and s.qk_norm_width:  # the projection's whole width: its heads' names
                out = s.norm(self.dtype, f"{name}_norm", PROJECTIONS[name][1:])(out)
            out = out.reshape(batch, length, n, s.head_dim)
            if norm and not s.qk_norm_width:  # a head's dimensions, never split
                out = s.norm(self.dtype, f"{name}_norm", (None,))(out)
            return out

        q = project(s.num_heads, "q", remat_lib.PROJECTIONS[0])
        k = project(s.num_kv_heads, "k", remat_lib.PROJECTIONS[1])
        v = project(s.num_kv_heads, "v", remat_lib.PROJECTIONS[2])
        if s.inv_freq:  # none: a layer without positions (NoPE)
            inv_freq = np.asarray(s.inv_freq, np.float32)
            rope = lambda t: apply_rope(t, positions, inv_freq, s.longrope)
            q, k = rope(q), rope(k)
        how = {"window": s.window, "scale": s.attn_scale, "softcap": s.attn_softcap}
        local = view.current() if cache is None else None  # the step's per-device layout
        split = local and local.sequence()
        if split is not None and self.implementation == "cudnn":  # `context_attention`
            index = jax.lax.axis_index(split.axis)
            kernel = context_attention.CUDNN
            out = context_attention.split_attention(
                q, k, v, index, split.size, split.gather, kernel, s.attn_scale
            )
        elif split is not None and self.implementation == "flash":  # `splash.split_attention`
            ids = None if segments is None else segments.ids
            index = jax.lax.axis_index(split.axis)
            out = splash.split_attention(q, k, v, index, split.size, split, ids, **how)
        elif cache is None:
            k, v, keys = _keys(k, v, positions, segments)
            out = attention_lib.causal_attention(q, k, v, self.implementation, **keys, **how)
        else:  # decoding (`KVCache`): [B, L] positions, each row's own
            cache = cache.write(k, v, positions)
            if length > 1:  # the prompt, from position 0: attention over its own keys
                out = attention_lib.causal_attention(q, k, v, self.implementation, **how)
            else:  # one token a row: over the cache, up to each row's position
                out = attention_lib.cached_attention(q, cache.k, cache.v, positions, **how)
        out = out.reshape(batch, length, s.num_heads * s.head_dim)
        out = checkpoint_name(out, remat_lib.CONTEXT)
        out = checkpoint_name(run(s.d_model, "o", out), remat_lib.PROJECTIONS[3])
        return out if cache is None else (out, cache)


def _keys(k, v, positions, segments) -> tuple:
    """`(k, v, segment_ids=, positions=, key_segment_ids=)` for `causal_attention`: on a context
    axis k, v, the keys' positions and segment ids gathered from every device of the group
    (`parallel.view`), which the mask reads as they lie (`layout.balanced`'s order)."""
    local, ids = view.current(), None if segments is None else segments.ids
    split = local and local.sequence()
    if split is None:
        return k, v, {"segment_ids": segments, "positions": (positions, positions)}
    if jnp.ndim(positions) < 2:
        raise ValueError("a sequence split over mesh.context needs its positions ([B, L])")
    gather, ints = split.gather, split.ints
    key_ids = None if ids is None else ints(ids)
    how = {
        "segment_ids": ids,
        "positions": (positions, ints(positions)),
        "key_segment_ids": key_ids,
    }
    return gather(k), gather(v), how


class MLP(nn.Module):  # SwiGLU: down(silu(gate(x)) * up(x)); GeGLU with mlp_act="gelu_tanh"
    shape: Shape
    dtype: layers.Dtype
    fp8: Any = None
    lora: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        run = lambda n, name, tag, h: checkpoint_name(
            layers.run_in(self.dtype, dense(n, name, self.fp8, self.lora), h), tag
        )
        gate, up, down = remat_lib.PROJECTIONS[4:7]
        h = run(self.shape.d_ff, "gate", gate, x)
        if self.shape.mlp_act == "gelu_tanh":  # in fp32, as torch computes a 16-bit GELU
            h = nn.gelu(h.astype(jnp.float32), approximate=True).astype(h.dtype)
        else:
            h = nn.silu(h)
        h = h * run(self.shape.d_ff, "up", up, x)
        return run(self.shape.d_model, "down", down, h)


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``; with ``post_norms``
    (Gemma's) ``x + norm(attn(norm(x)))``, then ``x + norm(mlp(norm(x)))``; without
    ``pre_norms`` too (OLMo 2's) ``x + norm(attn(x))``, then ``x + norm(mlp(x))``."""

    shape: Shape
    dtype: layers.Dtype
    implementation: str
    fp8: Any = None
    lora: Any = None

    @nn.compact
    def __call__(self, x: Any, positions: jax.Array, segments=None, cache=None) -> Any:
        stats = None
        if isinstance(x, tuple):  # (x, the router statistics of the layers before)
            x, stats = x
        s, x = self.shape, checkpoint_name(x, remat_lib.BLOCK_INPUT)
        pre = lambda name, h: s.norm(self.dtype, name)(h) if s.pre_norms else h
        # a tensor group's part of the heads and units, between its gather and its scatter
        local = view.current() if cache is None else None
        split = local and local.tensor()
        part, into, out = s, (lambda h: h), (lambda h: h)
        if split is not None:
            part, into, out = s.part(split.size), split.gather, split.scatter
        h = into(pre("attn_norm", x))
        attn = Attention(part, self.dtype, self.implementation, self.fp8, self.lora, name="attn")
        h = attn(h, positions, segments, cache)
        if cache is not None:
            h, cache = h
        h = out(h)
        if s.post_norms:
            h = s.norm(self.dtype, "attn_post_norm")(h)
        x = x + h
        h = pre("mlp_norm", x)
        if s.experts:
            mask = None if segments is None else segments.ids > 0  # no padding in the stats
            experts = moe.MoE(s.experts, s.top_k, s.expert_d_ff, s.norm_topk, self.dtype,
                              s.router_fp32, s.expert_kernel, name="moe")  # fmt: skip
            h, layer_stats = experts(h, mask)
            stats = None if stats is None else stats + layer_stats
        else:
            h = out(MLP(part, self.dtype, self.fp8, self.lora, name="mlp")(into(h)))
        if s.post_norms:
            h = s.norm(self.dtype, "mlp_post_norm")(h)
        x = x + h
        x = x if stats is None else (x, stats)
        return x if cache is None else (x, cache)
