"""jax's Pallas TPU splash attention as `mptrain.models.attention` calls it (its ``"flash"``
implementation): causal, grouped-query, packed rows, a sliding window, a soft-cap; and on a
sequence split over a context axis (`split_attention`)."""

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
    ids = None if segment_ids is None else (segment_ids, segment_ids)
    return _run(q, k, v, ids, window, scale, softcap, offset=0)


def _run(q, k, v, ids, window, scale, softcap, offset: int):
    """The splash kernel on ``[B, Lq, H, D]`` q over ``[B, Lk, K, D]`` k, v: query row ``r``
    sees the keys up to ``r + offset`` (within the window), of its own segment where ``ids``
    (the queries', the keys') are given."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as splash
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    batch, length, heads, depth = q.shape
    keys = k.shape[1]
    tile = lambda n: next((b for b in FLASH_BLOCKS if n % b == 0), n)
    sizes = {n: tile(length) for n in ("block_q", "block_q_dkv", "block_q_dq")}
    for n in ("block_kv", "block_kv_compute", "block_kv_dkv", "block_kv_dkv_compute"):
        sizes[n] = tile(keys)
    sizes["block_kv_dq"] = tile(keys)
    calls = 1 if ids is None else batch  # heads a call: every example's, or one's
    shape = (length, keys)  # causal, within the window when there is one
    mask = masks.CausalMask(shape, offset=offset)
    if window is not None:
        mask = masks.LocalMask(shape, window_size=(window - 1, 0), offset=offset)
    kernel = splash.make_splash_mha(  # one mask, shared by every (example, head)
        mask=masks.MultiHeadMask([mask] * (batch * heads // calls)),
        block_sizes=splash.BlockSizes(**sizes),
        head_shards=1,
        q_seq_shards=1,
        attn_logits_soft_cap=softcap,
    )
    q = q * jnp.asarray(depth**-0.5 if scale is None else scale, q.dtype)
    if ids is not None:  # [B, H, L, D] q and [B, K, L, D] k, v, a call an example

        def one(args):
            q, k, v, q_ids, kv_ids = args
            return kernel(q, k, v, segment_ids=splash.SegmentIds(q=q_ids, kv=kv_ids))

        heads_first = [jnp.swapaxes(x, 1, 2) for x in (q, k, v)]
        # a loop, not jax.vmap: the kernel's backward pass has no batching rule
        out = jax.lax.map(one, (*heads_first, *(x.astype(jnp.int32) for x in ids)))
        return jnp.swapaxes(out, 1, 2)
    # [B * H, L, D] q and [B * K, L, D] k, v: the kernel's layout, the examples as more heads
    flat = lambda x, n: jnp.swapaxes(x, 1, 2).reshape(-1, n, depth)
    out = kernel(flat(q, length), flat(k, keys), flat(v, keys))
    return jnp.swapaxes(out.reshape(batch, heads, length, depth), 1, 2)


def split_attention(q, k, v, index, context, split, ids=None, window=None, scale=None,
                    softcap=None):  # fmt: skip
    """Splash attention of this device's ``[B, 2c, H, D]`` queries (chunks ``index`` and ``2
    context - 1 - index`` of each sequence, `layout.balanced_order`) over the whole sequence's
    keys and values, gathered over the context axis (``split``: `layout.SequenceSplit`) and
    put back in their natural order (`context_attention.natural`). Chunk ``j``'s queries see
    the keys up to ``j c`` past their own row: the kernel's causal mask with that offset, a
    static mask for each ``j``, so each chunk runs the branch of its ``j`` (``lax.switch``);
    the kernel skips the tiles the mask leaves empty, so the devices' work is balanced. ``ids``
    (``[B, 2c]``, the queries' segment ids) keep packed rows' examples apart."""
    from mptrain.models.decoder import context_attention

    c = q.shape[1] // 2
    natural = lambda x: context_attention.natural(x, context)
    keys, values = natural(split.gather(k)), natural(split.gather(v))
    key_ids = None if ids is None else natural(split.ints(ids))
    halves = []
    for slot in range(2):  # chunk `index` (j < context), then `2 context - 1 - index`
        rows = slice(slot * c, (slot + 1) * c)
        q_ids = None if ids is None else ids[:, rows]

        def branch(j, q_ids=q_ids, rows=rows):
            both = None if q_ids is None else (q_ids, key_ids)
            return lambda: _run(q[:, rows], keys, values, both, window, scale, softcap, j * c)

        chunks = range(context) if slot == 0 else range(context, 2 * context)
        which = index if slot == 0 else context - 1 - index
        halves.append(jax.lax.switch(which, [branch(j) for j in chunks]))
    return jnp.concatenate(halves, axis=1)
