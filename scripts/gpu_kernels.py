"""The fused attention kernels mptrain has only compiled for a GPU, held against the materialised
path on the same inputs: outputs and the gradients of every input (`scripts/gpu_check.py`'s
part k).

  split   cuDNN's split-sequence attention (`decoder.context_attention`): every device of a
          context axis of 2 and of 4 run in turn on one GPU, each with its two chunks of
          queries and the whole sequence's keys, put back in order
  sinks   gpt-oss's sinks through cuDNN (`attention.sunk_attention`: each head's sink one more
          key), causal and with a sliding window; the sinks' own gradient too
  packed  cuDNN's packed layout of SFT rows (`segments.cudnn_packed`): each example's queries
          over its own keys, padding after the last

Each case runs the kernel in bf16 and, where it takes fp32, in fp32, against the materialised
path in fp32 on the same (bf16-representable) inputs. A row's `error` is the largest absolute
difference over the largest absolute value of the fp32 reference, for the output and each
gradient; `band` is what the materialised path itself differs by in bf16. The tolerances are
the CPU tests' bounds: 1e-5 in fp32; in bf16 3% for the split and the packed rows
(tests/models/context_attention_test.py) and 5% with sinks (tests/models/sinks_test.py), whose
gradient sums a bf16 product over every query.
With `stand_ins` (no GPU: `--dry-run`) the kernels are the ones the CPU tests run in their
place: the jnp kernel for the split, XLA's attention for the sinks, each example attended
alone for the packed rows; with `small`, at test sizes, a context axis of 4 and the window
alone.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from mptrain.models import attention, segments
from mptrain.models.decoder import context_attention

FP32_TOLERANCE = 1e-5


def error(got, want) -> float:
    """The largest |got - want| over the largest |want|."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / max(np.max(np.abs(want)), 1e-30))


def _random(shape, seed: int, dtype=jnp.float32) -> jax.Array:
    """Normal values rounded to bf16, so that every dtype sees the same numbers."""
    x = np.random.default_rng(seed).standard_normal(shape, np.float32)
    return jnp.asarray(x, jnp.bfloat16).astype(dtype)


def _outputs_and_grads(fn, args, probe):
    """`fn(*args)` and the gradients of `sum(fn(*args) * probe)` with respect to each of args."""

    def run(*args):
        out, pull = jax.vjp(fn, *args)
        return out, pull(probe.astype(out.dtype))

    return jax.jit(run)(*args)


def _compare(name: str, kernel, reference, args, probe, dtype, bound=3e-2, rows_kept=None) -> dict:
    """The kernel on `args` cast to `dtype` against the reference in fp32 (and the reference in
    bf16 for the band): errors of the output and each argument's gradient."""
    cast = lambda t: [x.astype(t) for x in args]
    want = _outputs_and_grads(reference, cast(jnp.float32), probe)
    got = _outputs_and_grads(kernel, cast(dtype), probe)
    names = ["out", *(f"d{n}" for n in "qkv"), "dsinks"][: 1 + len(args)]
    keep = (lambda x: x) if rows_kept is None else (lambda x: np.asarray(x)[rows_kept])
    flat = lambda r: [keep(r[0]), *r[1]]
    errors = {n: error(g, w) for n, g, w in zip(names, flat(got), flat(want), strict=True)}
    row = {"case": name, "dtype": jnp.dtype(dtype).name, "errors": errors}
    if dtype == jnp.float32:
        row["tolerance"] = FP32_TOLERANCE
    else:
        lower = _outputs_and_grads(reference, cast(dtype), probe)
        band = {n: error(g, w) for n, g, w in zip(names, flat(lower), flat(want), strict=True)}
        row["band"] = band
        row["tolerance"] = bound
    row["within"] = max(errors.values()) <= row["tolerance"]
    return row


def _split(kernel, context: int, q, k, v):
    """Every device's `split_attention` of a context axis of `context`, run in turn here: device
    `i` holds chunks `i` and `2 context - 1 - i` of q, k and v, and sees all of k and v as the
    axis' gather would hand them; its outputs put back in the sequence's order."""
    c = q.shape[1] // (2 * context)
    chunk = lambda x, j: x[:, j * c : (j + 1) * c]
    local = lambda x, i: jnp.concatenate([chunk(x, i), chunk(x, 2 * context - 1 - i)], 1)
    balanced = lambda x: jnp.concatenate([local(x, i) for i in range(context)], 1)
    outs = []
    for i in range(context):
        mine = {"k": local(k, i), "v": local(v, i)}
        gathered = {id(mine["k"]): balanced(k), id(mine["v"]): balanced(v)}
        gather = lambda x, gathered=gathered: gathered[id(x)]
        outs.append(
            context_attention.split_attention(
                local(q, i), mine["k"], mine["v"], jnp.int32(i), context, gather, kernel
            )
        )
    return context_attention.natural(jnp.concatenate(outs, 1), context)


def _alone(q, k, v, ids: np.ndarray):
    """Each packed example attended on its own (the padding's rows zero): the packed layout's
    meaning, computed without a segment mask."""
    rows = []
    for r in range(q.shape[0]):
        parts, at = [], 0
        for s in range(1, int(ids[r].max()) + 1):
            n = int(np.sum(ids[r] == s))
            piece = slice(at, at + n)
            parts.append(
                attention.causal_attention(
                    q[r : r + 1, piece], k[r : r + 1, piece], v[r : r + 1, piece], "materialized"
                )
            )
            at += n
        parts.append(jnp.zeros((1, q.shape[1] - at, *q.shape[2:]), q.dtype))
        rows.append(jnp.concatenate(parts, 1))
    return jnp.concatenate(rows, 0)


def check(stand_ins: bool, small: bool) -> list[dict]:
    """Every case's rows (the module doc); `small`: test sizes."""
    batch, length, heads, kv, depth = (1, 64, 4, 2, 16) if small else (2, 4096, 8, 2, 128)
    q, k, v = (_random(s, i) for i, s in enumerate([(batch, length, heads, depth)]
                                                   + [(batch, length, kv, depth)] * 2))  # fmt: skip
    probe = _random((batch, length, heads, depth), 3)
    rows = []
    materialised = functools.partial(attention.causal_attention, implementation="materialized")

    kernel = context_attention.REFERENCE if stand_ins else context_attention.CUDNN
    for context in (4,) if small else (2, 4):
        split = functools.partial(_split, kernel, context)
        rows.append(_compare(f"split over {context}", split, materialised, (q, k, v), probe,
                             jnp.bfloat16))  # fmt: skip
        exact = functools.partial(_split, context_attention.REFERENCE, context)
        rows.append(_compare(f"split over {context}, jnp kernel", exact, materialised,
                             (q, k, v), probe, jnp.float32))  # fmt: skip

    # gpt-oss: head size 64, windows of 128; an odd length, which takes the padded position
    odd = length - 1 if small else 2047
    depth64 = 16 if small else 64
    sq, sk, sv = (_random((batch, odd, h, depth64), 10 + i) for i, h in enumerate((heads, kv, kv)))
    sinks = _random((heads,), 13)
    sprobe = _random((batch, odd, heads, depth64), 14)
    impl = "xla" if stand_ins else "cudnn"
    for window in (16,) if small else (None, 128):
        sunk = lambda q, k, v, s, w=window, i=impl: attention.sunk_attention(q, k, v, s, i, w)
        want = lambda q, k, v, s, w=window: materialised(q, k, v, window=w, sinks=s)
        label = f"sinks, window {window}" if window else "sinks, causal"
        args = (sq, sk, sv, sinks)
        rows.append(_compare(label, sunk, want, args, sprobe, jnp.bfloat16, bound=5e-2))
        xla = lambda q, k, v, s, w=window: attention.sunk_attention(q, k, v, s, "xla", w)
        rows.append(_compare(f"{label}, XLA", xla, want, args, sprobe, jnp.float32))

    lengths = [(20, 30, 10), (64,)] if small else [(1000, 1500, 700, 600, 200), (4096,)]
    ids = np.zeros((2, length), np.int32)
    for r, row in enumerate(lengths):
        ids[r, : sum(row)] = np.repeat(np.arange(1, len(row) + 1), row)
    pq, pk, pv = (x[:1].repeat(2, 0) if x.shape[0] == 1 else x[:2] for x in (q, k, v))
    pprobe = jnp.where(jnp.asarray(ids > 0)[:, :, None, None], probe[:1].repeat(2, 0)
                       if probe.shape[0] == 1 else probe[:2], 0.0)  # fmt: skip
    seg = segments.Segments(jnp.asarray(ids), segments.segment_lengths(jnp.asarray(ids), 8))
    if stand_ins:
        packed = lambda q, k, v: _alone(q, k, v, ids)
    else:
        packed = lambda q, k, v: attention.causal_attention(q, k, v, "cudnn", segment_ids=seg)
    want = lambda q, k, v: materialised(q, k, v, segment_ids=seg.ids)
    rows.append(_compare("packed rows", packed, want, (pq, pk, pv), pprobe, jnp.bfloat16,
                         rows_kept=ids > 0))  # fmt: skip
    return rows
