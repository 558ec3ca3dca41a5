"""jax's Pallas TPU splash attention as `mptrain.models.attention` calls it (its ``"flash"``
implementation): causal, grouped-query, packed rows, a sliding window, a soft-cap."""

from __future__ import annotations

import jax
import jax.numpy as jnp

FLASH_BLOCKS = (512, 256, 128)  # the kernel's tiles along the sequence, largest first


def attention(q, k, v, segment_ids=None, window=None, scale=None, softcap=None):
    """jax's Pallas TPU splash attention, the flash kernel MaxText's TPU LMs run, on ``[B, L, H,
    D]`` q and ``[B, L, K, D]`` k, v: causal, scores scaled by ``D ** -0.5``. It walks the keys
    tile by tile with each row's running max and sum in fp32 and never writes the ``[B, H, L,
    L]`` scores; its backward pass recomputes them from the fp32 log-sum-exp ``[B, H, L]`` (the
    older ``flash_attention`` kernel keeps those statistics 128 lanes wide: 2 GiB more of
    temporaries on GPT-2-small's shape). Tiles of the largest of ``FLASH_BLOCKS`` that divides
    ``L`` (``L`` itself when none does: Pallas's interpret mode on a CPU takes any, a TPU wants
    multiples of 128).

    Grouped queries are the kernel's own: ``make_splash_mha`` takes fewer kv heads than q
    heads, reads kv head ``h // (q heads // kv heads)`` for q head ``h`` (its index maps), and
    its dk, dv kernel sums over the q heads of each kv head. With the examples folded into the
    heads, q head ``b * H + h`` reads kv head ``(b * H + h) // G == b * K + h // G`` (``G = H //
    K``): its own example's, so one call serves every example and kv head, as for ``K == H``.
    ``make_splash_mqa`` (one ``[L, D]`` k, v for all q heads) would need a vmap over ``B * K``
    for the same work. With ``segment_ids`` the examples differ in their segments, which the
    kernel takes one set of a call: it runs over the examples in a loop (``lax.map``), each
    call with its ``H`` q heads, ``K`` kv heads and ``SegmentIds``."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    batch, length, heads, depth = q.shape
    block = next((b for b in FLASH_BLOCKS if length % b == 0), length)
    sizes = ("block_q", "block_kv", "block_kv_compute", "block_q_dkv", "block_kv_dkv")
    sizes += ("block_kv_dkv_compute", "block_q_dq", "block_kv_dq")
    calls = 1 if segment_ids is None else batch  # heads a call: every example's, or one's
    shape = (length, length)  # causal, within the window when there is one
    mask = masks.CausalMask(shape)
    if window is not None:
        mask = masks.LocalMask(shape, window_size=(window - 1, 0), offset=0)
    kernel = splash.make_splash_mha(  # one mask, shared by every (example, head)
        mask=masks.MultiHeadMask([mask] * (batch * heads // calls)),
        block_sizes=splash.BlockSizes(**dict.fromkeys(sizes, block)),
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=softcap,
    )
    q = q * jnp.asarray(depth**-0.5 if scale is None else scale, q.dtype)
    if segment_ids is not None:  # [B, H, L, D] q and [B, K, L, D] k, v, a call an example

        def one(args):
            q, k, v, ids = args
            return kernel(q, k, v, segment_ids=splash.SegmentIds(q=ids, kv=ids))

        heads_first = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
        # a loop, not jax.vmap: the kernel's backward pass has no batching rule
        out = jax.lax.map(one, (*heads_first, segment_ids.astype(jnp.int32)))
        return jnp.swapaxes(out, 1, 2)
    # [B * H, L, D] q and [B * K, L, D] k, v: the kernel's layout, the examples as more heads
    flat = lambda x: jnp.swapaxes(x, 1, 2).reshape(-1, length, depth)
    out = kernel(flat(q), flat(k), flat(v))
    return jnp.swapaxes(out.reshape(batch, heads, length, depth), 1, 2)
