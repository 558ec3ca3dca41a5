"""What XLA compiles the mixture-of-experts MLP's grouped matmuls to, for an H100 and a TPU that
are not here (`python -m mptrain.plan`'s deviceless compile; needs `pip install 'mptrain[plan]'`):

    JAX_PLATFORMS=cpu python docs/measured/moe_compiled.py --out=/tmp/moe_compiled.json

One Qwen3-30B-A3B MoE layer (width 2,048, 128 experts of 768, top 8), bf16, a batch of
`--tokens` tokens, its forward and backward on one device, by each grouped-matmul kernel a
chip takes (`mptrain.models.decoder.grouped`: XLA's `ragged_dot` everywhere, JAX's Mosaic kernels on
an H100). Prints a line a target and kernel and writes JSON: the temporaries, the grouped
kernels (TPU: `ragged-dot` custom calls; H100: `mosaic_gpu` custom calls), and whether
`ragged_dot` became a dense matmul of every token copy against every expert.
Measured 2026-11-29, jax 0.10.2, 8,192 tokens: the table in docs/mixture-of-experts.md.
"""

import argparse
import json
import math
import re

import jax
import jax.numpy as jnp

from mptrain import target as target_lib
from mptrain.models.decoder import moe
from mptrain.parallel import axes

D, E, F, K = 2048, 128, 768, 8


def compiled(name: str, tokens: int, kernel: str) -> dict:
    target, _ = target_lib.get(name)
    device = target.devices(1)[0]
    sms = getattr(device, "core_count", 0) or 0
    layer = moe.MoE(E, K, F, True, jnp.bfloat16, kernel=(kernel, sms))
    x = jax.ShapeDtypeStruct((1, tokens, D), jnp.bfloat16)
    params = jax.eval_shape(lambda: layer.init(jax.random.key(0), jnp.zeros((1, 8, D))))
    params = axes.unboxed(params)

    sharding = jax.sharding.SingleDeviceSharding(device)
    place = lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sharding)
    args = jax.tree.map(place, (params, x))
    loss = lambda params, x: jnp.sum(layer.apply(params, x)[0].astype(jnp.float32))
    program = jax.jit(jax.grad(loss)).trace(*args).lower().compile()
    text = program.as_text()
    ragged = [line for line in text.splitlines() if "ragged_dot" in line or "ragged-dot" in line]
    shapes = re.findall(r"(?:bf16|f32)\[([\d,]+)\]", "\n".join(ragged))
    size = lambda s: math.prod(int(d) for d in s.split(","))
    widest = max(shapes, key=size, default="")
    return {
        "target": name,
        "kernel": kernel,
        "tokens": tokens,
        "temporaries_bytes": program.memory_analysis().temp_size_in_bytes,
        "grouped_kernel_calls": len(re.findall(r"%ragged-dot-none[.\d]* = ", text))
        + len(re.findall(r'custom_call_target="mosaic_gpu', text)),
        "dense_expansion": str(tokens * K) + "," + str(E * D) in widest.replace(" ", ""),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--targets", default="h100,v5e")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target_lib.compile_only()
    kernels = {"h100": ("xla", "mosaic_gpu")}
    rows = [
        compiled(name, args.tokens, kernel)
        for name in args.targets.split(",")
        for kernel in kernels.get(name, ("xla",))
    ]
    for r in rows:
        dense = " (dense: token copies x every expert's rows)" if r["dense_expansion"] else ""
        print(
            f"{r['target']} {r['kernel']}: {r['tokens']:,} tokens forward and backward, "
            f"temporaries {r['temporaries_bytes'] / 2**30:.2f} GiB, grouped kernels "
            f"{r['grouped_kernel_calls']}{dense}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
