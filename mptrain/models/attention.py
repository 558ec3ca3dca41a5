"""Attention for the zoo: cuDNN's fused kernel on a GPU, Pallas flash on a TPU, the
materialised fp32 island elsewhere.

Attention, shared by the zoo's transformer and the NNX example, comes in three implementations:

  * ``causal_attention(q, k, v, "cudnn")``: cuDNN's fused flash attention through
    ``jax.nn.dot_product_attention``. It never writes the ``[B, H, L, L]`` scores to memory:
    on an H100 the GPT-2-small-shaped LM's step fell from 97.6 to 27.6 ms and its temporaries
    from 19.9 to 6.1 GiB. jax only calls cuDNN when asked by name (its default is XLA's
    materialising path). Packed rows take cuDNN's packed layout instead (each example's
    length and offset, no ``[L, L]`` mask; Hopper or newer: ``segments.cudnn_packed``, whose
    module says why that way);
  * ``causal_attention(q, k, v, "flash")``: jax's Pallas flash attention kernel for TPUs
    (``jax.experimental.pallas.ops.tpu.flash_attention``, what MaxText's TPU LMs run, in its
    splash form), with the same fp32 running statistics and no ``[B, H, L, L]`` buffer; on a
    CPU it runs only in Pallas's interpret mode, where the tests check it against the
    materialised path;
  * ``causal_attention(q, k, v, "materialized")``: fp32 scores from ``einsum_f32_out``, an fp32
    softmax, probabilities cast back to ``dtype``, all of it held for the backward pass. Not
    ``jax.nn.dot_product_attention(implementation="xla")``: its fp32-result einsums are
    differentiated into fp32 matmuls, while ``einsum_f32_out`` keeps them 16-bit.

All three take grouped-query attention (GQA): k and v may have fewer heads than q, ``K`` of
them for ``H`` query heads (``K`` divides ``H``; ``K == H`` is multi-head attention, ``K == 1``
multi-query). Query head ``h`` reads kv head ``h // (H // K)``: the ``H // K`` query heads of a
group sit side by side, as in jax's ``dot_product_attention`` (its XLA path reshapes q to
``[B, L, K, H // K, D]``) and HuggingFace's ``repeat_kv``. None of them copies k or v to ``H``
heads: cuDNN and the splash kernel read a kv head once per query head of its group, and the
materialised path contracts q's group axis against the one kv head.

``choose_attention`` picks one of them: ``"auto"`` takes cuDNN wherever it can run (a CUDA GPU
of compute capability 8.0 or newer with cuDNN, bf16/fp16 compute, no attention dropout, a head
size cuDNN takes), the flash kernel on a TPU (bf16/fp16 compute, no dropout, sequences of a
multiple of 128), and says why when it takes neither. ``Backend`` is what it knows of the
machine the step is compiled for (``backend_of`` its devices).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from mptrain import errors
from mptrain.models import segments as segments_lib
from mptrain.models import splash
from mptrain.models.layers import Dtype, einsum_f32_out

ATTENTION_KEY = "model.attention"
ATTENTION_CHOICES = ("auto", "cudnn", "flash", "materialized")
FLASH_BLOCKS = splash.FLASH_BLOCKS


@dataclasses.dataclass(frozen=True)
class Backend:
    """What the attention choice needs to know of the machine the model runs on."""

    platform: str  # jax.default_backend(): "cpu", "gpu" or "tpu"
    compute_capability: tuple[int, int] | None = None  # a CUDA GPU's, e.g. (9, 0): an H100
    cudnn: bool = False  # jax finds cuDNN and traces its fused attention here
    sms: int = 0  # a GPU's multiprocessors (`core_count`), which a persistent kernel's grid takes


@functools.cache
def local_backend() -> Backend:  # this process's; cached, since on a GPU it traces a probe
    return _backend(jax.local_devices()[0])


def backend_of(devices: Sequence[jax.Device]) -> Backend:
    """What the attention choice knows of `devices`, those a step is compiled for (a mesh's):
    this process's (`local_backend`), or an absent accelerator's (`mptrain.plan`'s). Host-side."""
    first = next(iter(devices))
    return local_backend() if first in jax.local_devices() else _backend(first)


def _backend(device: jax.Device) -> Backend:
    if device.platform != "gpu":
        return Backend(device.platform)
    try:  # a string such as "9.0" on CUDA; ROCm devices name their chips ("gfx90a") instead
        capability = tuple(int(n) for n in device.compute_capability.split(".")[:2])
    except (AttributeError, ValueError):
        capability = None
    sms = getattr(device, "core_count", 0) or 0
    return Backend(device.platform, capability, cudnn=_cudnn_traces(), sms=sms)


@functools.cache
def _cudnn_traces() -> bool:
    """Whether jax's own checks of its cuDNN attention (is cuDNN installed, is its version
    right) pass: a shape-only trace asks them without compiling anything, on any host."""
    probe = jax.ShapeDtypeStruct((1, 128, 1, 64), jnp.bfloat16)
    try:
        jax.eval_shape(functools.partial(_fused_attention, implementation="cudnn"), *[probe] * 3)
    except (RuntimeError, NotImplementedError, ValueError):  # e.g. "cuDNN is not detected."
        return False
    return True


@dataclasses.dataclass(frozen=True)
class AttentionChoice:
    """The attention implementation a model runs, and why, when it is not cuDNN's."""

    implementation: str  # "cudnn" | "materialized"
    reason: str = ""

    def __str__(self) -> str:  # what the start-up log says
        if self.implementation == "cudnn":
            return "cuDNN fused (jax.nn.dot_product_attention)"
        if self.implementation == "flash":
            return "Pallas TPU flash attention (jax.experimental.pallas.ops.tpu)"
        return f"materialized [B, H, L, L] in fp32 ({self.reason})"


def _why_not_cudnn(backend: Backend, dtype: Dtype, head_dim: int, dropout_rate: float):
    """Why cuDNN's fused attention cannot serve here, or None when it can.

    The rules are jax's (``jax._src.cudnn.fused_attention_stablehlo``: 16-bit q, k, v of one
    dtype; head size a multiple of 8, at most 256 from compute capability 9.0 on and 128 before)
    and XLA's (flash attention from compute capability 8.0, Ampere, on), plus what the API
    lacks: ``jax.nn.dot_product_attention`` has no dropout on the attention probabilities.
    """
    if backend.platform != "gpu":
        return f"not on a GPU: the backend is {backend.platform}"
    if not backend.cudnn:
        return "jax finds no cuDNN fused attention on this GPU"
    capability = backend.compute_capability
    if capability is None or capability < (8, 0):
        return f"cuDNN flash attention needs compute capability 8.0 or newer, not {capability}"
    kernel = ("cuDNN attention takes", "jax.nn.dot_product_attention has")
    if why := _why_not_16_bit(dtype, dropout_rate, *kernel):
        return why
    limit = 256 if capability >= (9, 0) else 128
    if head_dim % 8 or head_dim > limit:
        return f"head_dim={head_dim}: cuDNN takes multiples of 8 up to {limit} on this GPU"
    return None


_FLASH_WORDS = ("the TPU flash kernel takes", "the TPU flash kernel has")


def _why_not_16_bit(dtype: Dtype, dropout_rate: float, takes: str, has: str) -> str | None:
    """What both fused kernels ask: 16-bit compute and no dropout ("`takes` bfloat16 or
    float16", "`has` no dropout" otherwise)."""
    name = jnp.dtype(dtype).name
    if name not in ("bfloat16", "float16"):
        return f"{name} compute: {takes} bfloat16 or float16"
    if dropout_rate > 0:
        return f"dropout_rate={dropout_rate}: {has} no dropout"
    return None


def _why_not_flash(backend: Backend, dtype: Dtype, length: int | None, dropout_rate: float):
    """Why the Pallas TPU flash kernel cannot serve here, or None when it can: a TPU, 16-bit
    compute (float32 keeps the materialised island, whose matmuls run at the precision the
    policy asks), no dropout, and a sequence the kernel's tiles divide (a multiple of 128)."""
    if backend.platform != "tpu":
        return f"not on a TPU: the backend is {backend.platform}"
    if why := _why_not_16_bit(dtype, dropout_rate, *_FLASH_WORDS):
        return why
    if length is not None and length % FLASH_BLOCKS[-1]:
        return f"a sequence of {length}: the TPU flash kernel tiles it by multiples of 128"
    return None


def choose_attention(
    requested: str,
    *,
    dtype: Dtype,
    head_dim: int,
    dropout_rate: float = 0.0,
    backend: Backend | None = None,
    length: int | None = None,
    softcap: float | None = None,
    sinks: bool = False,
) -> AttentionChoice:
    """Resolves ``model.attention`` (``"auto" | "cudnn" | "flash" | "materialized"``) for
    sequences of ``length``; host-side.

    ``"auto"`` is cuDNN wherever it can run on ``backend`` (default: ``local_backend()``), the
    Pallas flash kernel on a TPU, and the materialised island elsewhere, as torch's
    ``scaled_dot_product_attention`` keeps its math fallback; ``"cudnn"`` or ``"flash"`` where
    it cannot run is a ``ValueError`` naming the key and why. Scores with a ``softcap`` (Gemma
    2's) are not cuDNN's: its fused kernel has none (transformers runs Gemma 2 eager or with
    flash-attn's soft-cap for the same reason).
    """
    requested = errors.check_choice(ATTENTION_KEY, requested, ATTENTION_CHOICES)
    if requested == "materialized":
        return AttentionChoice("materialized", f"{ATTENTION_KEY}='materialized'")
    backend = backend or local_backend()
    sunk = "its kernel has no attention sinks (model.attn_sinks, gpt-oss's)" if sinks else None
    extra = SINK_CHANNELS if sinks else 0  # cuDNN takes them as one more key a head
    why = {
        "cudnn": _why_not_cudnn(backend, dtype, head_dim + extra, dropout_rate)
        or (softcap and f"cuDNN has no soft-cap on the scores (model.attn_softcap={softcap})"),
        "flash": _why_not_flash(backend, dtype, length, dropout_rate) or sunk,
    }
    for name in ("cudnn", "flash"):
        if why[name] is None and requested in ("auto", name):
            return AttentionChoice(name)
    if requested != "auto":
        raise ValueError(
            f"{ATTENTION_KEY}={requested!r} cannot run here: {why[requested]}; "
            "'auto' uses cuDNN or the TPU flash kernel where they run, 'materialized' runs anywhere"
        )
    return AttentionChoice(
        "materialized", why["cudnn"] if backend.platform != "tpu" else why["flash"]
    )


def _fused_attention(q, k, v, implementation: str, window=None, scale=None):
    """``jax.nn.dot_product_attention`` as the models call it: ``[B, L, H, D]`` in and out (the
    layout the heads are split in, so no transpose), causal, scores scaled by ``scale``
    (``D ** -0.5`` where None);
    with a ``window``, cuDNN's sliding window (jax's ``local_window_size``: the ``window - 1``
    keys before a query, and itself). ``local_backend`` traces the very same call to ask jax
    whether cuDNN can run it."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    local = None if window is None else (window - 1, 0)
    return jax.nn.dot_product_attention(
        q, k, v, scale=scale, is_causal=True, implementation=implementation,
        local_window_size=local,
    )  # fmt: skip


SINK_CHANNELS = 8  # the sink's extra q/k/v channels: three carry it, cuDNN takes multiples of 8


def sunk_attention(q, k, v, sinks, implementation: str, window=None, scale=None) -> jax.Array:
    """Causal attention with gpt-oss's sinks through a fused kernel that has none (cuDNN's, by
    ``jax.nn.dot_product_attention``): each head's sink is one more key, first, that every
    query sees and whose value is zero, so it joins the softmax's denominator and adds
    nothing to the output, as ``masked_attention``'s sink column does. q, k and v get
    `SINK_CHANNELS` more channels: the sink key is 1 in three of them, and each query head
    carries its sink (over ``scale``) there split into three 16-bit parts (their sum is the
    fp32 value, accumulated in fp32 with the scores); the real keys and v are 0 there. A
    query of zeros goes first too (its row dropped), so the mask stays square: causal (every
    query sees the sink and the keys up to its own), or with a ``window`` an explicit one (the
    sink, and the ``window`` keys up to its own). Gradients, the sinks' too, are the kernel's
    own. ``[B, L, H, D]`` q and ``[B, L, K, D]`` k, v in and ``[B, L, H, D]`` out."""
    batch, length, heads, depth = q.shape
    dtype = q.dtype
    scale = depth**-0.5 if scale is None else scale
    sink = sinks.astype(jnp.float32) / scale  # [H]: hi + mid + lo in the compute dtype
    parts = []
    for _ in range(3):
        parts.append(sink.astype(dtype))
        sink = sink - parts[-1].astype(jnp.float32)
    extra = SINK_CHANNELS - 3
    carried = jnp.stack([*parts, *[jnp.zeros_like(parts[0])] * extra], -1)  # [H, C]
    carried = jnp.broadcast_to(carried, (batch, length, heads, SINK_CHANNELS))
    zeros = lambda x: jnp.zeros((*x.shape[:-1], SINK_CHANNELS), dtype)
    first = lambda x, row: jnp.concatenate([jnp.broadcast_to(row, (batch, 1, *x.shape[2:])), x], 1)
    # cuDNN's backward with a mask takes even lengths: one more position last where odd, after
    # every query kept, so no query sees it (and its own row is dropped)
    tail = (length + 1) % 2
    last = lambda x: jnp.pad(x, ((0, 0), (0, tail), (0, 0), (0, 0)))
    q = last(first(jnp.concatenate([q, carried], -1), jnp.zeros((), dtype)))
    key = jnp.concatenate([jnp.zeros(depth, dtype), jnp.ones(3, dtype), jnp.zeros(extra, dtype)])
    k = last(first(jnp.concatenate([k, zeros(k)], -1), key))
    v = last(first(jnp.concatenate([v, zeros(v)], -1), jnp.zeros((), dtype)))
    mask = None
    if window is not None:  # the sink, and the window's keys up to the query's own
        at = jnp.arange(length + 1 + tail)
        seen = (at[None, :] <= at[:, None]) & (at[None, :] > at[:, None] - window)
        mask = (seen | (at[None, :] == 0))[None, None]
    out = jax.nn.dot_product_attention(
        q, k, v, mask=mask, scale=scale, is_causal=window is None, implementation=implementation
    )
    return out[:, 1 : length + 1, :, :depth]


def causal_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    implementation: str,
    *,
    dropout: Callable[[jax.Array], jax.Array] | None = None,
    segment_ids: jax.Array | segments_lib.Segments | None = None,
    window: int | None = None,
    scale: float | None = None,
    softcap: float | None = None,
    positions: tuple[jax.Array, jax.Array] | None = None,
    key_segment_ids: jax.Array | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal attention of ``[B, L, H, D]`` q and ``[B, L, K, D]`` k, v in ``dtype`` -> ``[B, L,
    H, D]``: multi-head where ``K == H``, grouped-query where ``K`` divides ``H`` (query head
    ``h`` reads kv head ``h // (H // K)``, see the module docstring); other head counts are a
    ``ValueError`` naming both.

    ``implementation`` is a resolved choice (see ``choose_attention``). Either way the softmax
    statistics are fp32: cuDNN keeps each row's running max and sum in fp32 registers and
    stores only the fp32 log-sum-exp ``[B, H, L]`` for its backward pass, which recomputes the
    probabilities; the materialised path computes fp32 scores and an fp32 softmax explicitly.
    ``dropout`` (materialised only) is applied to the ``[B, H, L, L]`` probabilities.
    ``segment_ids`` (``[B, L]`` ints, or ``Segments``): a query sees only the keys of its own
    segment, so the examples packed into a row never attend to each other: a mask on the
    materialised path, the splash kernel's ``SegmentIds``, cuDNN's packed layout (which takes
    the ``Segments``' lengths: ``cudnn_packed``). ``window``: a sliding window, a query sees
    itself and the ``window - 1`` keys before it (transformers' ``kv_idx > q_idx - window``):
    the materialised mask, cuDNN's sliding window, the splash kernel's ``LocalMask``.
    ``scale``: the scores' (None: ``D ** -0.5``); ``softcap``: Gemma 2's ``cap * tanh(s /
    cap)`` on the fp32 scores before the mask, on the materialised path and the splash kernel
    (cuDNN has none: ``choose_attention`` does not pick it then).

    ``positions``: ``(the queries', the keys')`` (``[L]`` or ``[B, L]`` each), which the
    materialised mask reads instead of the tokens' indices: a key is seen where its position is
    at most the query's (and within the window), in the same segment. Within a packed example
    positions count up from 0 as the indices do, so the mask is the same; on a context axis the
    keys are gathered from every device in `layout.balanced`'s order, with their positions and
    segment ids (``key_segment_ids``), and the positions are what still says which comes first.
    The fused kernels mask by index: on a context axis the model calls their split forms instead
    (`context_attention.split_attention`, `splash.split_attention`).
    """
    _query_heads_per_kv_head(q, k, v)
    if sinks is not None and implementation == "cudnn" and segment_ids is None:
        return sunk_attention(q, k, v, sinks, "cudnn", window, scale)  # one more key a head
    if sinks is not None and implementation != "materialized":  # packed rows: the mask's
        implementation, dropout = "materialized", None
    if softcap is not None and implementation == "cudnn":
        raise ValueError(
            f"cudnn attention has no soft-cap on its scores ({softcap}); use 'materialized'"
        )  # all three refuse the same head counts
    lengths = None
    if isinstance(segment_ids, segments_lib.Segments):
        segment_ids, lengths = segment_ids
    if implementation in ("cudnn", "flash") and dropout is not None:
        raise ValueError(f"{implementation} attention has no dropout; use 'materialized'")
    if implementation == "cudnn" and segment_ids is not None:
        if lengths is None:
            raise ValueError(
                "cudnn attention of packed rows takes their segment lengths too (Segments: "
                "data.sft's batches carry segment_lengths); or use 'materialized'"
            )
        return segments_lib.cudnn_packed(q, k, v, lengths=lengths, window=window, scale=scale)
    if implementation == "cudnn":  # it takes K < H heads as they are
        return _fused_attention(q, k, v, "cudnn", window, scale)
    if implementation == "flash":
        return splash.attention(q, k, v, segment_ids, window, scale, softcap)
    if implementation != "materialized":
        choices = "'cudnn' | 'flash' | 'materialized'"
        raise ValueError(f"attention implementation {implementation!r}: {choices}")
    if positions is None:
        positions = (jnp.arange(q.shape[1]), jnp.arange(k.shape[1]))
    at, seen = (jnp.atleast_2d(p) for p in positions)  # [B or 1, Lq], [B or 1, Lk]
    at, seen = at[:, :, None], seen[:, None, :]
    mask = seen <= at  # [B or 1, Lq, Lk]: query q sees keys k <= q
    if window is not None:  # ... and k > q - window
        mask = mask & (seen > at - window)
    if segment_ids is not None:  # [B, Lq, Lk], and only its own segment's keys
        key_ids = segment_ids if key_segment_ids is None else key_segment_ids
        mask = mask & (segment_ids[:, :, None] == key_ids[:, None, :])
    return masked_attention(q, k, v, mask, dropout, scale=scale, softcap=softcap, sinks=sinks)


def masked_attention(
    q, k, v, mask, dropout=None, heads_first: bool = False, scale=None, softcap=None, sinks=None
) -> jax.Array:
    """The materialised fp32 island: ``[B, Lq, H, D]`` q over ``[B, Lk, K, D]`` k, v (``[B, K,
    Lk, D]`` with ``heads_first``: the KV cache's layout) where ``mask`` (``[B or 1, Lq,
    Lk]``, True: seen) allows, scaled by ``scale`` (None: ``D ** -0.5``), soft-capped by
    ``softcap`` before the mask where given. ``sinks`` (``[H]``, gpt-oss's): each head's one
    more logit in the softmax's denominator, fp32 beside the fp32 scores, whose probability
    is dropped (a query may then give its keys less than all of its attention). fp32 scores
    from 16-bit operands (``einsum_f32_out``), an fp32 softmax, the probabilities cast back
    to q's dtype; grouped query heads read their kv head as it is (see the module doc). Causal
    attention's
    materialised path, and the KV cache's (``cached_attention``)."""
    kv = "bhkd" if heads_first else "bkhd"
    if heads_first:
        k_, v_ = (jnp.swapaxes(x, 1, 2) for x in (k, v))  # for the check's shapes only
        groups = _query_heads_per_kv_head(q, k_, v_)
    else:
        groups = _query_heads_per_kv_head(q, k, v)
    batch, length, heads, depth = q.shape
    kv_heads, dtype, keys = k.shape[1 + (not heads_first)], q.dtype, k.shape[2 - (not heads_first)]
    q = q * jnp.asarray(depth**-0.5 if scale is None else scale, dtype)
    # Grouped, q is [B, L, K, G, D] (a free reshape: a group's heads are adjacent) and the
    # einsums carry the group axis g, so each kv head is read as it is, never copied G times.
    # Multi-head (G == 1) has no g: the reshape is the identity and the einsums are as before.
    g = "g" if groups > 1 else ""
    q = q.reshape(batch, length, kv_heads, *[groups] * len(g), depth)
    # Scores: 16-bit operands, fp32 result that goes straight into the fp32 softmax.
    scores = einsum_f32_out(f"bqh{g}d,{kv}->bh{g}qk", q, k)  # [B, K, (G,) Lq, Lk]
    if softcap is not None:
        scores = softcap * jnp.tanh(scores / softcap)
    mask = mask.reshape(mask.shape[0], 1, *[1] * len(g), length, keys)
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1).astype(dtype)  # end of the fp32 island
    else:  # a column of each head's sink, in the softmax and then dropped
        sink = sinks.astype(jnp.float32).reshape(kv_heads, *[groups] * len(g), 1, 1)
        sink = jnp.broadcast_to(sink, (*scores.shape[:-1], 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], -1), axis=-1)[..., :-1]
        probs = probs.astype(dtype)
    if dropout is not None:  # on [B, H, Lq, Lk], whatever the grouping; the reshapes are free
        probs = dropout(probs.reshape(batch, heads, length, keys)).reshape(probs.shape)
    out = jnp.einsum(f"bh{g}qk,{kv}->bqh{g}d", probs, v)
    return out.reshape(batch, length, heads, depth)


def cached_attention(
    q, k_cache, v_cache, positions, window=None, scale=None, softcap=None, sinks=None
) -> jax.Array:
    """One decoding step's attention: ``[B, T, H, D]`` q at ``positions`` (``[B, T]``) over a
    layer's KV cache (``[B, K, S, D]``: the layout the scores' matmul reads as it lies, grouped,
    never repeated to H heads) whose slot ``j`` holds position ``j``: a query sees the slots
    up to its own position (within the last ``window``, with one). Scores ``[B, H, T, S]`` in
    fp32: no ``[S, S]`` array."""
    slots = jnp.arange(k_cache.shape[2])
    mask = slots[None, None, :] <= positions[:, :, None]
    if window is not None:
        mask = mask & (slots[None, None, :] > positions[:, :, None] - window)
    k, v = k_cache.astype(q.dtype), v_cache.astype(q.dtype)
    return masked_attention(
        q, k, v, mask, heads_first=True, scale=scale, softcap=softcap, sinks=sinks
    )


def _query_heads_per_kv_head(q, k, v) -> int:
    """``H // K`` of ``[B, L, H, D]`` q and ``[B, L, K, D]`` k, v, checked before any of the
    three runs, so that all refuse the same head counts with the same message: unchecked, the
    materialised path fails in a reshape that names no heads, and the splash kernel's message
    swaps query and key heads."""
    heads, kv_heads = q.shape[2], k.shape[2]
    if v.shape[2] != kv_heads:
        raise ValueError(f"k has {kv_heads} heads and v {v.shape[2]}: they must have as many")
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"{heads} query heads and {kv_heads} key/value heads: grouped-query attention "
            "needs the key/value heads to divide the query heads"
        )
    return heads // kv_heads
