"""Which GPU attention keeps a packed row's examples apart best: each candidate compiled for an
H100 here (no GPU needed: `mptrain.target`), at the 8B plan's per-device shapes, and read.

Attention forward and backward (the gradient of a weighted sum of its output with respect to
q, k and v) at `[B, L, H, D] = [2, 8192, 32, 128]` queries over 8 kv heads, bf16, causal, the
row holding several examples (`--segments`, of equal length) that must not attend to each
other. Candidates:

  * `cudnn`: cuDNN's fused attention with no segments: the unpacked baseline (wrong for a
    packed row; it is what packing must not cost more than);
  * `cudnn_mask`: the same with a `[B, 1, L, L]` mask of the row's segments, which jax passes
    to cuDNN as a bias it reads for every head;
  * `cudnn_packed`: cuDNN's packed layout: each row's segments given as sequence lengths and
    offsets (`q_seqlen`, `q_offsets`, ...), no `[L, L]` array at all;
  * `pallas`: the Pallas GPU (Triton) flash kernel, which takes segment ids (kv heads repeated
    to the query heads: it takes one head count);
  * `materialized`: the fp32 island with the mask, `[B, H, L, L]` scores in fp32.

For each: the compiled program's temporaries (`memory_analysis`), its kernels (custom calls:
cuDNN's, Triton's), and the largest `[L, L]`-sized buffer the program holds. Prints a table and
writes JSON (`--out`). Needs the extra `mptrain[plan]` (`make test-plan` installs it).

  JAX_PLATFORMS=cpu python scripts/attention_paths.py --out=runs/attention_paths.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp

from mptrain import target
from mptrain.models import attention
from mptrain.models import segments as segments_lib

B, L, H, K, D = 2, 8192, 32, 8, 128


def segment_ids(segments: int) -> jax.Array:
    return jnp.repeat(jnp.arange(1, segments + 1, dtype=jnp.int32), L // segments)[None].repeat(
        B, 0
    )


def candidates(segments: int) -> dict:
    scale = D**-0.5

    def cudnn(q, k, v, ids):
        return jax.nn.dot_product_attention(
            q, k, v, scale=scale, is_causal=True, implementation="cudnn"
        )

    def cudnn_mask(q, k, v, ids):
        mask = (ids[:, :, None] == ids[:, None, :])[:, None]
        return jax.nn.dot_product_attention(
            q, k, v, mask=mask, scale=scale, is_causal=True, implementation="cudnn"
        )

    def cudnn_packed(q, k, v, ids):
        return segments_lib.cudnn_packed(q, k, v, ids, max_segments=segments)

    def pallas(q, k, v, ids):
        from jax.experimental.pallas.ops.gpu import attention as gpu_attention

        k, v = (jnp.repeat(x, H // K, axis=2) for x in (k, v))
        return gpu_attention.mha(q, k, v, ids, sm_scale=scale, causal=True)

    def materialized(q, k, v, ids):
        return attention.causal_attention(q, k, v, "materialized", segment_ids=ids)

    return {
        "cudnn": cudnn,
        "cudnn_mask": cudnn_mask,
        "cudnn_packed": cudnn_packed,
        "pallas": pallas,
        "materialized": materialized,
    }


def read(compiled) -> dict:
    text = compiled.as_text()
    memory = compiled.memory_analysis()
    calls = re.findall(r'custom_call_target="([^"]+)"', text)
    kernels = sorted({c for c in calls if "cudnn" in c or "triton" in c.lower()})
    shapes = re.findall(r"\b(f32|bf16|pred|s32|f16)\[([\d,]+)\]", text)
    square = 0
    for dtype, dims in shapes:
        sizes = [int(x) for x in dims.split(",")]
        if sizes.count(L) >= 2:
            itemsize = {"f32": 4, "s32": 4, "bf16": 2, "f16": 2, "pred": 1}[dtype]
            n = itemsize
            for s in sizes:
                n *= s
            square = max(square, n)
    return {
        "temp_mib": memory.temp_size_in_bytes / 2**20,
        "kernels": kernels,
        "triton_fusions": len(re.findall(r"__triton", text)),
        "largest_LxL_mib": square / 2**20,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--segments", type=int, default=4, help="examples in each row")
    p.add_argument("--only", default="", help="comma-separated candidates (default: all)")
    p.add_argument("--out", default="runs/attention_paths.json")
    args = p.parse_args(argv)
    target.compile_only()
    h100, _ = target.get("h100")
    device = h100.devices(1)[0]
    spec = jax.sharding.SingleDeviceSharding(device)
    q = jax.ShapeDtypeStruct((B, L, H, D), jnp.bfloat16, sharding=spec)
    kv = jax.ShapeDtypeStruct((B, L, K, D), jnp.bfloat16, sharding=spec)
    ids = jax.ShapeDtypeStruct((B, L), jnp.int32, sharding=spec)
    weights = jax.ShapeDtypeStruct((B, L, H, D), jnp.bfloat16, sharding=spec)
    chosen = [c for c in args.only.split(",") if c] or list(candidates(args.segments))
    rows = {}
    for name in chosen:
        fn = candidates(args.segments)[name]

        def step(q, k, v, ids, w, fn=fn):
            loss = lambda q, k, v: jnp.sum(fn(q, k, v, ids).astype(jnp.float32) * w)
            return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

        start = time.perf_counter()
        try:
            compiled = jax.jit(step).trace(q, kv, kv, ids, weights).lower().compile()
        except Exception as e:  # a candidate that does not compile is a row that says why
            rows[name] = {"error": str(e).splitlines()[0][:200]}
        else:
            rows[name] = read(compiled) | {"compile_s": time.perf_counter() - start}
        print(name, json.dumps(rows[name]), file=sys.stderr, flush=True)
    print(f"{'path':>14} {'temporaries':>12} {'largest LxL':>12}  kernels")
    for name, row in rows.items():
        if "error" in row:
            print(f"{name:>14}  does not compile: {row['error']}")
            continue
        kernels = ", ".join(row["kernels"]) or f"{row['triton_fusions']} triton fusions"
        print(
            f"{name:>14} {row['temp_mib']:>9.1f} MiB {row['largest_LxL_mib']:>8.1f} MiB  {kernels}"
        )
    result = {"shape": {"B": B, "L": L, "H": H, "K": K, "D": D}, "segments": args.segments}
    result["paths"] = rows
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
