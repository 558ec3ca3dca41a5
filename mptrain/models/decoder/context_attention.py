"""Causal attention of a sequence split over a context axis, with a fused kernel: each device's
two chunks of queries against the keys they see, in two calls a chunk, merged by their
log-sum-exps.

A device holds chunks `i` and `2C - 1 - i` of each sequence (`layout.balanced_order`), and the
keys and values of all `2C` chunks gathered over the axis (`layout.sequence_gather`), put back
in their natural order. Query chunk `j` (of `c` tokens) sees every key before it and its own
chunk causally. A fused kernel's causal mask is aligned top-left (cuDNN's through jax: query
row `r` sees keys `0 .. r` of its call; jax 0.10.2 has no bottom-right alignment), so one call
cannot say "keys `0 .. j c + r`". Two calls can:

  * the diagonal: the chunk's queries over its own keys, causal (equal lengths: top-left is
    right);
  * the prefix: the chunk's queries over the first `j c` keys, no mask but their length
    (`kv_len`); chunk 0 has none, and its part is weighted 0.

Each call returns its output and the fp32 log-sum-exp of its scores, and the outputs are
merged by them, `o = sum_p exp(lse_p - lse) o_p` with `lse = logsumexp_p lse_p`, in fp32. The
backward pass is FlashAttention-2's (and ring attention's): each call's backward kernel given
the *merged* output and log-sum-exp and the output's gradient computes that call's exact share
of dQ, dK and dV (its probabilities are then `exp(s - lse)`, the merged softmax's). Every
device's share of the gathered keys' gradient goes back through the gather, reduce-scattered
in fp32. A device runs `(2C - 1) c` keys' worth of prefix and two diagonals, whichever `i`:
the work is balanced.

`Kernel` is what the merge needs of a fused kernel: `CUDNN` (jax's cuDNN fused attention, its
forward with `return_residual` and its backward primitive) and `REFERENCE` (the same two
functions in plain jnp, fp32, which the CPU tests run the whole scheme with). TransformerEngine
does the same split with cuDNN's bottom-right mask; MaxText's TPU path builds a splash mask of
the permuted queries instead.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


class Kernel(NamedTuple):
    """A fused attention kernel as the merge calls it, `[B, T, H, D]` q over `[B, S, K, D]` k and
    v (`K` divides `H`), scores times `scale`, causal (top-left) or not, keys past `kv_len`
    (an int32 scalar, or None: all) masked:
    `forward(q, k, v, kv_len, causal, scale) -> (o, lse [B, H, T] fp32)`;
    `backward(q, k, v, o, lse, do, kv_len, causal, scale) -> (dq, dk, dv)`, where `o` and `lse`
    may be another call's merged ones (module doc)."""

    forward: Callable
    backward: Callable


def _scores(q, k, kv_len, causal, scale):
    """fp32 scores `[B, K, G, T, S]` with the mask applied, and the mask."""
    batch, length, heads, depth = q.shape
    kv = k.shape[2]
    q = q.reshape(batch, length, kv, heads // kv, depth).astype(jnp.float32)
    s = jnp.einsum("btkgd,bskd->bkgts", q, k.astype(jnp.float32)) * scale
    rows, cols = jnp.arange(length)[:, None], jnp.arange(k.shape[1])[None, :]
    mask = (cols <= rows) if causal else jnp.ones((length, k.shape[1]), bool)
    if kv_len is not None:
        mask = mask & (cols < kv_len)
    return jnp.where(mask, s, -jnp.inf), mask


def _reference_forward(q, k, v, kv_len, causal, scale):
    s, _ = _scores(q, k, kv_len, causal, scale)
    lse = jax.nn.logsumexp(s, axis=-1)  # [B, K, G, T]
    p = jnp.exp(s - lse[..., None])
    o = jnp.einsum("bkgts,bskd->btkgd", p, v.astype(jnp.float32))
    batch, length = q.shape[:2]
    return o.reshape(q.shape).astype(q.dtype), lse.reshape(batch, q.shape[2], length)


def _reference_backward(q, k, v, o, lse, do, kv_len, causal, scale):
    batch, length, heads, depth = q.shape
    kv, groups = k.shape[2], heads // k.shape[2]
    s, mask = _scores(q, k, kv_len, causal, scale)
    p = jnp.where(mask, jnp.exp(s - lse.reshape(batch, kv, groups, length)[..., None]), 0.0)
    grouped = lambda x: x.reshape(batch, length, kv, groups, depth).astype(jnp.float32)
    do, o = grouped(do), grouped(o)
    dv = jnp.einsum("bkgts,btkgd->bskd", p, do)
    dp = jnp.einsum("btkgd,bskd->bkgts", do, v.astype(jnp.float32))
    ds = p * (dp - jnp.einsum("btkgd,btkgd->bkgt", do, o)[..., None]) * scale
    dq = jnp.einsum("bkgts,bskd->btkgd", ds, k.astype(jnp.float32)).reshape(q.shape)
    dk = jnp.einsum("bkgts,btkgd->bskd", ds, grouped(q))
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


REFERENCE = Kernel(_reference_forward, _reference_backward)


def _cudnn_args(q, k, kv_len, causal):
    from jax._src.cudnn import fused_attention_stablehlo as fused

    batch = q.shape[0]
    lengths = None
    if kv_len is not None:  # a padding mask: every query row, the first kv_len keys
        lengths = (
            jnp.full((batch,), q.shape[1], jnp.int32),
            jnp.broadcast_to(jnp.asarray(kv_len, jnp.int32), (batch,)),
        )
    kinds = {
        (True, False): fused.MaskType.CAUSAL,
        (False, True): fused.MaskType.PADDING,
        (False, False): fused.MaskType.NO_MASK,
    }
    return fused, lengths, kinds[causal, lengths is not None]


def _cudnn_forward(q, k, v, kv_len, causal, scale):
    fused, lengths, mask = _cudnn_args(q, k, kv_len, causal)
    q_len, kv_lens = lengths or (None, None)
    return fused.dot_product_attention(
        q, k, v, q_seqlen=q_len, kv_seqlen=kv_lens, scale=scale, mask_type=mask,
        return_residual=True,
    )  # fmt: skip


def _cudnn_backward(q, k, v, o, lse, do, kv_len, causal, scale):
    fused, lengths, mask = _cudnn_args(q, k, kv_len, causal)
    unused = jnp.zeros(0, q.dtype)
    q_len, kv_lens = lengths or (unused, unused)
    grads = fused._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, q_len, kv_lens, unused, unused, unused, unused, lse, o, do,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=mask,
        layout=fused.AttentionLayout.BTNH.value, sliding_window_length=None,
    )  # fmt: skip
    return tuple(grads[:3])


CUDNN = Kernel(_cudnn_forward, _cudnn_backward)


def natural(x: jax.Array, context: int) -> jax.Array:
    """`[B, L, ...]` gathered in `layout.balanced_order` -> natural order: device `i`'s pair is
    chunks `i` and `2C - 1 - i`, so the first of each pair are chunks `0 .. C - 1` in order and
    the second, reversed, `C .. 2C - 1`. Slices and a reversal, whose transposes are too (an
    indexed gather's would be a scatter-add)."""
    batch, length = x.shape[:2]
    pairs = x.reshape(batch, context, 2, length // (2 * context), *x.shape[2:])
    x = jnp.concatenate([pairs[:, :, 0], jnp.flip(pairs[:, :, 1], axis=1)], axis=1)
    return x.reshape(batch, length, *x.shape[3:])


def split_attention(q, k, v, index, context: int, gather: Callable, kernel: Kernel, scale=None):
    """Causal attention of this device's `[B, 2c, H, D]` queries and `[B, 2c, K, D]` keys and
    values (chunks `index` and `2 context - 1 - index` of each sequence) over the whole
    sequence's keys, gathered by `gather` (module doc) -> `[B, 2c, H, D]`."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys, values = (natural(gather(x), context) for x in (k, v))
    return _attend(kernel, context, scale, q, k, v, keys, values, index)


def _chunks(index, context: int) -> tuple:
    return (index, 2 * context - 1 - index)


def _parts(kernel, context, scale, q, k, v, keys, values, index):
    """Per local chunk: `[(diagonal, prefix)]`, each `(args, kv_len, causal)` of a kernel call."""
    c = q.shape[1] // 2
    halves = lambda x: (x[:, :c], x[:, c:])
    out = []
    for qc, kc, vc, j in zip(*map(halves, (q, k, v)), _chunks(index, context), strict=True):
        prefix_len = jnp.maximum(j * c, c)  # chunk 0 has no prefix: a dummy length, weight 0
        out.append((((qc, kc, vc), None, True), ((qc, keys, values), prefix_len, False), j))
    return out


def _merge(parts_out, has_prefix):
    """`(o, lse)` of the diagonal and the prefix merged by their log-sum-exps, in fp32."""
    (od, ld), (op, lp) = parts_out
    lp = jnp.where(has_prefix, lp, -jnp.inf)
    lse = jnp.logaddexp(ld, lp)  # [B, H, T]
    weight = lambda l_: jnp.swapaxes(jnp.exp(l_ - lse), 1, 2)[..., None]  # [B, T, H, 1]
    o = weight(ld) * od.astype(jnp.float32) + weight(lp) * op.astype(jnp.float32)
    return o.astype(od.dtype), lse


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _attend(kernel, context, scale, q, k, v, keys, values, index):
    return _attend_forward(kernel, context, scale, q, k, v, keys, values, index)[0]


def _attend_forward(kernel, context, scale, q, k, v, keys, values, index):
    outs, stats = [], []
    for diagonal, prefix, j in _parts(kernel, context, scale, q, k, v, keys, values, index):
        calls = [
            kernel.forward(*args, kv_len, causal, scale)
            for args, kv_len, causal in (diagonal, prefix)
        ]
        o, lse = _merge(calls, j > 0)
        outs.append(o)
        stats.append(lse)
    o = jnp.concatenate(outs, axis=1)
    return o, (q, k, v, keys, values, index, o, jnp.concatenate(stats, axis=2))


def _attend_backward(kernel, context, scale, residuals, do):
    q, k, v, keys, values, index, o, lse = residuals
    c = q.shape[1] // 2
    dq, dk, dv = [], [], []
    dkeys = jnp.zeros(keys.shape, jnp.float32)
    dvalues = jnp.zeros(values.shape, jnp.float32)
    parts = _parts(kernel, context, scale, q, k, v, keys, values, index)
    for n, (diagonal, prefix, j) in enumerate(parts):
        rows = slice(n * c, (n + 1) * c)
        o_n, lse_n, do_n = o[:, rows], lse[:, :, rows], do[:, rows]
        (args, kv_len, causal) = diagonal
        gq, gk, gv = kernel.backward(*args, o_n, lse_n, do_n, kv_len, causal, scale)
        (args, kv_len, causal) = prefix
        live = (j > 0).astype(do_n.dtype)  # chunk 0's dummy prefix: no gradient
        pq, pk, pv = kernel.backward(*args, o_n, lse_n, do_n * live, kv_len, causal, scale)
        dq.append((gq.astype(jnp.float32) + pq.astype(jnp.float32)).astype(q.dtype))
        dk.append(gk)
        dv.append(gv)
        dkeys, dvalues = dkeys + pk.astype(jnp.float32), dvalues + pv.astype(jnp.float32)
    cat = lambda xs: jnp.concatenate(xs, axis=1)
    zero = np.zeros(np.shape(index), jax.dtypes.float0)
    return (cat(dq), cat(dk), cat(dv), dkeys.astype(keys.dtype), dvalues.astype(values.dtype), zero)


_attend.defvjp(_attend_forward, _attend_backward)
