"""The decoder's blocks (`mptrain.models.decoder`'s): RMSNorm, attention, the gated MLP or a
mixture of experts, and `BlockSpec`, what a block is, composed of its parts: its sizes
(`Shape`), its attention (`AttentionSpec`), its norms (`NormSpec`) and its feed-forward
(`MlpSpec` or `MoeSpec`). The families the decoder reads differ from the Llama in these parts'
settings, not in copies of the model (the decoder's settings build a spec a layer, `layer_specs`):

  * attention: its projections' ``bias``, ``"none"``, ``"qkv"`` (Qwen2: q, k, v with bias, o
    without) or ``"all"`` (a Llama's or Qwen3's ``attention_bias``: the four projections);
    ``qk_norm`` ``"head"``, Qwen3's RMSNorm over each head's q and k (its own scale a head
    dimension), after the projection and before RoPE, in fp32 as every norm here, or
    ``"width"``, OLMo 2's, over the whole projection (all heads) before it is split into heads;
    a sliding ``window`` (Mistral's ``sliding_window``; Qwen's, Gemma's on the layers
    ``layer_types`` names): a query sees itself and the ``window - 1`` keys before it, as
    transformers' ``sliding_window_overlay`` masks (``kv_idx > q_idx - window``); RoPE's
    ``inv_freq`` (a base of its own, or none: NoPE) and Phi-3's ``longrope``, which may differ
    from layer to layer; Gemma's scores' ``scale`` (``query_pre_attn_scalar ** -0.5``, where it
    is not ``head_dim ** -0.5``) and ``softcap`` (``cap * tanh(s / cap)`` on the fp32 scores,
    before the mask);
  * norms: Gemma's ``plus_one`` (RMSNorm scales by ``1 + w``, ``w`` from 0, in fp32) and
    ``post`` (a norm after the attention and after the feed-forward too, four a block); OLMo 2's
    block has no ``pre`` norms (norms after the attention and the MLP only);
  * feed-forward: a dense MLP (``act`` ``"gelu_tanh"``: GELU's tanh form, in fp32, for
    SwiGLU's SiLU), or a mixture of experts (`moe`).

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
    # multi-head latent attention's (`LatentSpec`): into the latents (no mesh axis splits a
    # latent's rank), and out of them to every head
    "q_a": (axes_lib.EMBED, None),
    "q_b": (None, axes_lib.Q_HEADS),
    "kv_a": (axes_lib.EMBED, None),
    "kv_b": (None, axes_lib.Q_HEADS),
}
LATENT_EPS = 1e-6  # the latents' RMSNorms' (transformers' DeepseekV3RMSNorm default, not the
# model's rms_norm_eps)


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
    """A block's sizes."""

    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int


@dataclasses.dataclass(frozen=True)
class LatentSpec:
    """DeepSeek's multi-head latent attention (MLA): q through a `q_rank` bottleneck with its
    RMSNorm (None: straight from the width), k and v from one `kv_rank` latent with its
    RMSNorm, plus a `rope_dim` part of k shared by every head; each head's q and k are
    `head_dim` (= their unrotated part + `rope_dim`), its v `v_dim`."""

    kv_rank: int
    q_rank: int | None
    rope_dim: int
    v_dim: int


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """How a block attends (the module doc): its projections' `bias` (`ATTN_BIASES`), `qk_norm`
    (None, `"head"`: Qwen3's over each head, `"width"`: OLMo 2's over the whole projection),
    the scores' `scale` (None: `head_dim ** -0.5`) and `softcap`, a sliding `window`, and RoPE:
    its frequencies `inv_freq` (none: a layer without positions), Phi-3's `longrope` and YaRN's
    `rope_scale`."""

    bias: str = "none"
    qk_norm: str | None = None
    scale: float | None = None
    softcap: float | None = None
    window: int | None = None
    inv_freq: tuple[float, ...] = ()  # `rope.rope_frequencies`
    longrope: Any = None  # a `rope.LongRope`: Phi-3's long frequencies past a length
    rope_scale: float = 1.0  # cos and sin times this: YaRN's attention factor
    interleaved: bool = False  # RoPE's pairs adjacent (DeepSeek's `rope_interleave`)
    sinks: bool = False  # a learned logit a head in the softmax's denominator (gpt-oss's)
    latent: LatentSpec | None = None  # multi-head latent attention (DeepSeek's)


@dataclasses.dataclass(frozen=True)
class NormSpec:
    """A block's RMSNorms: their `eps`, Gemma's `plus_one` (``1 + w``), and where they sit:
    before the attention and the MLP (`pre`; OLMo 2's block has none), after them (`post`:
    Gemma's four a block)."""

    eps: float
    plus_one: bool = False
    pre: bool = True
    post: bool = False

    def make(self, dtype: layers.Dtype, name: str, names: tuple = (axes_lib.EMBED,)) -> RMSNorm:
        return RMSNorm(self.eps, dtype, self.plus_one, names, name=name)


@dataclasses.dataclass(frozen=True)
class MlpSpec:
    """A dense gated MLP: `d_ff` hidden units, SwiGLU's SiLU or GELU's tanh form (`act`)."""

    d_ff: int
    act: str = "silu"


@dataclasses.dataclass(frozen=True)
class MoeSpec:
    """A mixture of experts' MLP (`moe.MoE`): `experts` of `d_ff` units, `top_k` a token,
    renormalised (`normalise`), the router in fp32 (`router_fp32`), the grouped matmuls'
    `kernel` and the GPU's multiprocessors (`grouped.matmul`)."""

    experts: int
    top_k: int
    d_ff: int
    normalise: bool = True
    router_fp32: bool = True
    kernel: tuple[str, int] = ("xla", 0)
    shared_d_ff: int | None = None  # a shared expert beside the routed ones (Qwen2-MoE's)
    shared_gate: bool = False  # its sigmoid gate
    routing: moe.Routing = moe.SOFTMAX  # how the router scores, chooses and weighs
    bias: bool = False  # biases on each expert's gate, up and down (gpt-oss's)
    clamp: tuple[float, float] | None = None  # gpt-oss's clamped SwiGLU (limit, alpha)


@dataclasses.dataclass(frozen=True)
class BlockSpec:
    """What a block is, composed of its parts (hashable: a static part of the module): its
    sizes, its attention, its norms and its feed-forward, an MLP or experts."""

    shape: Shape
    attention: AttentionSpec
    norms: NormSpec
    ffn: MlpSpec | MoeSpec

    @property
    def experts(self) -> int:  # 0: a dense MLP
        return self.ffn.experts if isinstance(self.ffn, MoeSpec) else 0

    def part(self, ways: int) -> BlockSpec:
        """One device's part of a tensor group of `ways` (`mptrain.parallel.tensor`): its heads,
        its key-value heads and its MLP units."""
        s = self.shape
        heads, kv = s.num_heads // ways, s.num_kv_heads // ways
        shape = dataclasses.replace(s, num_heads=heads, num_kv_heads=kv)
        ffn = self.ffn
        if isinstance(ffn, MlpSpec):
            ffn = dataclasses.replace(ffn, d_ff=ffn.d_ff // ways)
        return dataclasses.replace(self, shape=shape, ffn=ffn)


class Attention(nn.Module):  # grouped-query, causal, with RoPE on q and k
    spec: BlockSpec
    dtype: layers.Dtype
    implementation: str
    fp8: Any = None
    lora: Any = None  # a `lora.Spec`: adapters on the projections it names

    @nn.compact
    def __call__(self, x: jax.Array, positions: jax.Array, segments=None, cache=None) -> Any:
        s, a, (batch, length, _) = self.spec.shape, self.spec.attention, x.shape
        norm_of = self.spec.norms.make
        biased = ("q_a", "kv_a", "o") if a.latent is not None else ("q", "k", "v", "o")
        bias = lambda name: (
            name in biased and (a.bias == "all" or (a.bias == "qkv" and name != "o"))
        )
        run = lambda n, name, h: layers.run_in(
            self.dtype, dense(n, name, self.fp8, self.lora, bias(name)), h
        )

        # Three projections, each reshaped (a bitcast, no copy) to the [B, L, heads, Dh] the
        # attention kernel takes: no slices of a fused qkv output, no concatenated gradient.
        def project(n, name, tag):
            out = checkpoint_name(run(n * s.head_dim, name, x), tag)
            norm = a.qk_norm if name != "v" else None  # before RoPE: over a head, or all
            if norm == "width":  # the projection's whole width: its heads' names
                out = norm_of(self.dtype, f"{name}_norm", PROJECTIONS[name][1:])(out)
            out = out.reshape(batch, length, n, s.head_dim)
            if norm == "head":  # a head's dimensions, never split
                out = norm_of(self.dtype, f"{name}_norm", (None,))(out)
            return out

        inv_freq = np.asarray(a.inv_freq, np.float32)
        rope = lambda t: apply_rope(t, positions, inv_freq, a.longrope, a.rope_scale, a.interleaved)
        if a.latent is not None:  # DeepSeek's: k and v from one latent, v padded to q's size
            q, k, v = self.latent(x, rope, run)
        else:
            q = project(s.num_heads, "q", remat_lib.PROJECTIONS[0])
            k = project(s.num_kv_heads, "k", remat_lib.PROJECTIONS[1])
            v = project(s.num_kv_heads, "v", remat_lib.PROJECTIONS[2])
            if a.inv_freq:  # none: a layer without positions (NoPE)
                q, k = rope(q), rope(k)
        how = {"window": a.window, "scale": a.scale, "softcap": a.softcap}
        if a.sinks:  # the materialised island only (`attention.choose_attention`)
            init = axes_lib.declare(nn.initializers.zeros, (None,), fp32=True)
            how["sinks"] = self.param("sinks", init, (s.num_heads,))
        local = view.current() if cache is None else None  # the step's per-device layout
        split = local and local.sequence()
        if split is not None and self.implementation == "cudnn":  # `context_attention`
            index = jax.lax.axis_index(split.axis)
            kernel = context_attention.CUDNN
            out = context_attention.split_attention(
                q, k, v, index, split.size, split.gather, kernel, a.scale
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
        if a.latent is not None:  # the padding's share of v: zeros, dropped
            out = out[..., : a.latent.v_dim]
        out = out.reshape(batch, length, -1)
        out = checkpoint_name(out, remat_lib.CONTEXT)
        out = checkpoint_name(run(s.d_model, "o", out), remat_lib.PROJECTIONS[3])
        return out if cache is None else (out, cache)

    def latent(self, x: jax.Array, rope, run) -> tuple[jax.Array, jax.Array, jax.Array]:
        """`(q, k, v)` of multi-head latent attention (`LatentSpec`), `[B, L, H, head_dim]`
        each: q's last `rope_dim` dimensions and k's shared ones rotated (`rope`), k's first
        ones and v from the normed kv latent, v padded with zeros to `head_dim` (one head size
        for every attention kernel and the KV cache; the output drops the padding). The latents'
        norms are fp32 islands, as every norm here."""
        s, m, (batch, length, _) = self.spec.shape, self.spec.attention.latent, x.shape
        heads, nope = s.num_heads, s.head_dim - m.rope_dim
        norm = lambda name, h: RMSNorm(LATENT_EPS, self.dtype, names=(None,), name=name)(h)
        if m.q_rank is None:
            q = run(heads * s.head_dim, "q", x)
        else:
            q = run(heads * s.head_dim, "q_b", norm("q_a_norm", run(m.q_rank, "q_a", x)))
        q = checkpoint_name(q.reshape(batch, length, heads, s.head_dim), remat_lib.PROJECTIONS[0])
        kv = run(m.kv_rank + m.rope_dim, "kv_a", x)
        latent, k_rot = kv[..., : m.kv_rank], kv[..., m.kv_rank :]
        kv = run(heads * (nope + m.v_dim), "kv_b", norm("kv_a_norm", latent))
        kv = kv.reshape(batch, length, heads, nope + m.v_dim)
        k_rot = jnp.broadcast_to(rope(k_rot[:, :, None, :]), (batch, length, heads, m.rope_dim))
        q = jnp.concatenate([q[..., :nope], rope(q[..., nope:])], axis=-1)
        k = jnp.concatenate([kv[..., :nope], k_rot], axis=-1)
        v = jnp.pad(kv[..., nope:], ((0, 0),) * 3 + ((0, s.head_dim - m.v_dim),))
        tags = remat_lib.PROJECTIONS[1:3]
        return q, checkpoint_name(k, tags[0]), checkpoint_name(v, tags[1])


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


class MLP(nn.Module):  # SwiGLU: down(silu(gate(x)) * up(x)); GeGLU with act="gelu_tanh"
    spec: MlpSpec
    d_model: int
    dtype: layers.Dtype
    fp8: Any = None
    lora: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        run = lambda n, name, tag, h: checkpoint_name(
            layers.run_in(self.dtype, dense(n, name, self.fp8, self.lora), h), tag
        )
        gate, up, down = remat_lib.PROJECTIONS[4:7]
        h = run(self.spec.d_ff, "gate", gate, x)
        if self.spec.act == "gelu_tanh":  # in fp32, as torch computes a 16-bit GELU
            h = nn.gelu(h.astype(jnp.float32), approximate=True).astype(h.dtype)
        else:
            h = nn.silu(h)
        h = h * run(self.spec.d_ff, "up", up, x)
        return run(self.d_model, "down", down, h)


class Block(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))``, then ``x + ffn(norm(x))``; with ``norms.post``
    (Gemma's) ``x + norm(attn(norm(x)))``, then ``x + norm(ffn(norm(x)))``; without
    ``norms.pre`` too (OLMo 2's) ``x + norm(attn(x))``, then ``x + norm(ffn(x))``. The
    feed-forward is its spec's: a dense MLP, or a mixture of experts."""

    spec: BlockSpec
    dtype: layers.Dtype
    implementation: str
    fp8: Any = None
    lora: Any = None

    @nn.compact
    def __call__(self, x: Any, positions: jax.Array, segments=None, cache=None) -> Any:
        stats = None
        if isinstance(x, tuple):  # (x, the router statistics of the layers before)
            x, stats = x
        s, x = self.spec, checkpoint_name(x, remat_lib.BLOCK_INPUT)
        norm = lambda name: s.norms.make(self.dtype, name)
        pre = lambda name, h: norm(name)(h) if s.norms.pre else h
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
        if s.norms.post:
            h = norm("attn_post_norm")(h)
        x = x + h
        h = pre("mlp_norm", x)
        if isinstance(s.ffn, MoeSpec):
            mask = None if segments is None else segments.ids > 0  # no padding in the stats
            e = s.ffn
            experts = moe.MoE(e.experts, e.top_k, e.d_ff, e.normalise, self.dtype,
                              e.router_fp32, e.kernel, e.shared_d_ff, e.shared_gate,
                              e.routing, e.bias, e.clamp, name="moe")  # fmt: skip
            h, layer_stats = experts(h, mask)
            stats = None if stats is None else stats + layer_stats
        else:
            mlp = MLP(part.ffn, s.shape.d_model, self.dtype, self.fp8, self.lora, name="mlp")
            h = out(mlp(into(h)))
        if s.norms.post:
            h = norm("mlp_post_norm")(h)
        x = x + h
        x = x if stats is None else (x, stats)
        return x if cache is None else (x, cache)
