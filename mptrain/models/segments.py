"""Attention over packed rows (`data.sft`): the examples in a row and how each attention
implementation keeps them apart.

`Segments` is what a model hands attention for a batch of packed rows: each token's segment id
and each example's length. The materialised path and the TPU's splash kernel read the ids
(`attention.causal_attention`); on a GPU, cuDNN reads the lengths as its packed layout
(`cudnn_packed`), which needs no `[L, L]` mask: of the three ways to keep a row's examples
apart on a GPU, compiled for an H100 at the 8B plan's shapes (`tests/plan/plan_test.py`'s
8B on packed SFT rows), it alone adds neither an `[L, L]` buffer nor bytes to read (a mask
reaches cuDNN as a bias it reads for every head; the Pallas Triton kernel takes one head
count, so k and v are copied to every query head).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

ATTENTION_KEY = "model.attention"


class Segments(NamedTuple):
    """The examples packed into each row (`data.sft`'s rows): ``ids`` ``[B, L]`` (1, 2, ... a
    row's examples in order, 0 padding last) and ``lengths`` ``[B, M]`` (``segment_lengths``:
    each example's tokens, 0 past the row's last; M, the most examples a row holds, is the
    static bound cuDNN's packed layout is compiled for), which the GPU path reads."""

    ids: jax.Array
    lengths: jax.Array | None = None


def segments(ids: jax.Array | None, lengths: jax.Array | None) -> Segments | None:
    """A model's ``segment_ids`` and ``segment_lengths`` as one ``Segments`` (None: no
    packing); lengths without ids are a ``ValueError``."""
    if ids is None:
        if lengths is not None:
            raise ValueError("segment_lengths without segment_ids: give both, or neither")
        return None
    return Segments(ids, lengths)


def segment_lengths(segment_ids: jax.Array, max_segments: int) -> jax.Array:
    """``[B, M]`` lengths of the segments 1 .. M of ``[B, L]`` segment ids (0 where a row has
    fewer), for rows as ``data.sft`` packs them: each example one run of its id, 1, 2, ... in
    order, padding (0) last."""
    ids = jnp.arange(1, max_segments + 1, dtype=segment_ids.dtype)
    return jnp.sum(segment_ids[:, :, None] == ids, axis=1, dtype=jnp.int32)


def packed_layout(lengths: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(seqlen [B, M], offsets [B, M + 1])`` of cuDNN's packed layout from ``[B, M]`` segment
    lengths (jax's cuDNN module's form): segment ``s`` of row ``b`` holds the tokens
    ``offsets[b, s] .. offsets[b, s] + seqlen[b, s] - 1``; -1 fills the entries past a row's
    last segment, and the offsets' last entry."""
    present = lengths > 0
    starts = jnp.cumsum(lengths, axis=1) - lengths
    none = jnp.full((lengths.shape[0], 1), -1, jnp.int32)
    seqlen = jnp.where(present, lengths, -1).astype(jnp.int32)
    offsets = jnp.concatenate([jnp.where(present, starts, -1).astype(jnp.int32), none], axis=1)
    return seqlen, offsets


def cudnn_packed(
    q, k, v, segment_ids=None, *, lengths=None, max_segments=None, window=None, scale=None
):
    """cuDNN's fused attention in its packed layout: each row's segments handed to cuDNN as
    their lengths and offsets, so that a query attends causally within its own segment only and
    no ``[L, L]`` mask or bias exists (the kernel skips the tiles between segments). ``lengths``
    is ``[B, M]`` (``segment_lengths``; computed from ``segment_ids`` and ``max_segments``
    where not given); a row with more than ``M`` segments would lose the rest, so the packer
    caps the examples a row takes at ``M``. jax reaches this layout through its cuDNN module,
    not ``jax.nn.dot_product_attention`` (which takes one length a row)."""
    from jax._src.cudnn import fused_attention_stablehlo as fused

    if not fused.check_compute_capability("9.0"):  # jax's rule (`Target.devices` answers it
        raise ValueError(  # for the GPU a plan compiles for)
            f"{ATTENTION_KEY}: cuDNN keeps the examples of packed rows apart on Hopper GPUs or "
            f"newer only (its packed layout); set {ATTENTION_KEY}='materialized'"
        )
    if lengths is None:
        lengths = segment_lengths(segment_ids, max_segments)
    seqlen, offsets = packed_layout(lengths)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return fused.dot_product_attention(
        q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets, kv_offsets=offsets,
        scale=scale, mask_type=fused.MaskType.PADDING_CAUSAL,
        sliding_window_length=window,  # the window - 1 keys before a query, and itself
    )  # fmt: skip
