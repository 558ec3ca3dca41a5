"""A Llama's decoding step compiled for a GPU here (no GPU needed: `mptrain.target`), read:
the bytes one token moves against the floor of reading the weights and the cache once.

Decoding at batch 1 is bound by memory: each token reads every weight once and the KV cache
once. The script compiles the step `mptrain.models.decode` runs a token (one token a row
attending over a bf16 KV cache of `--context` slots; the weights in the compute dtypes the
run casts to) for `--target`, and reads the program: the bytes its kernels move
(`roofline.bytes_moved`, each slice of a stacked buffer counted as a slice), the floor (the
weights' bytes, one row of the embedding table, and the cache's keys and values, read once),
their ratio and the time each takes at the chip's memory bandwidth, the temporaries, and the
largest arrays the kernels write (no `[.., S, S]` one: a token's scores are `[B, H, 1, S]`).
Only the token's own input is read: the prompt is never computed again.

    python scripts/plan_decode.py --config=configs/llama3.py:8b --target=h100 --context=2048

Prints a table and writes JSON (`--out`).
"""

from __future__ import annotations

import argparse
import json
import math
import runpy
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/llama3.py:8b", help="FILE:ARG of a Llama")
    p.add_argument("--target", default="h100")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=2048, help="the KV cache's slots")
    p.add_argument("--out", default="runs/plan_decode.json")
    args = p.parse_args(argv)
    from mptrain import target

    target.compile_only()
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mptrain import config as config_lib
    from mptrain import models
    from mptrain.inspect import program
    from mptrain.models import decode
    from mptrain.plan import roofline

    path, _, arg = args.config.partition(":")
    config = runpy.run_path(str(HERE.parent / path))["get_config"](arg or None)
    chip, _ = target.get(args.target)
    device = chip.devices(1)[0]
    policy = config_lib.policy_of(config)
    model = models.create(config.model, policy, [device])
    where = jax.sharding.SingleDeviceSharding(device)
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    shapes = shapes["params"]
    dtypes = policy.compute_dtypes(shapes)
    params = jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s.shape, d), shapes, dtypes)
    params = jax.eval_shape(lambda p: decode.unscanned(model, p)[1], params)  # as decoded
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), params)
    model = model.clone(scan_layers=False)
    shape, batch, slots = model.shape, args.batch, args.context
    cache_shape = (batch, shape.num_kv_heads, slots, shape.head_dim)
    one = jax.ShapeDtypeStruct(cache_shape, model.dtype, sharding=where)
    cache = tuple(decode.KVCache(one, one) for _ in range(model.num_layers))
    token = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=where)

    def step(params, cache, token, position):
        return model.apply({"params": params}, token, positions=position, cache=cache)

    compiled = jax.jit(step, donate_argnums=1).trace(params, cache, token, token).lower().compile()
    prog = program.Program(compiled.as_text())
    moved = roofline.bytes_moved(prog)
    leaves = jax.tree_util.tree_leaves_with_path(params)
    weight_bytes = 0
    for keys, leaf in leaves:
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        if "embed" in jax.tree_util.keystr(keys) and not config.model.tie_embeddings:
            nbytes //= leaf.shape[0]  # a token reads one row of the embedding table
        weight_bytes += nbytes
    cache_bytes = 2 * model.num_layers * math.prod(cache_shape) * np.dtype(model.dtype).itemsize
    floor = weight_bytes + cache_bytes
    bandwidth = chip.roofline["bandwidth"]
    square = [b for b in prog.largest() if b["array"].count(str(slots)) >= 2]
    out = {
        "config": args.config,
        "target": args.target,
        "batch": batch,
        "context": slots,
        "bytes_moved": moved,
        "floor_bytes": floor,
        "weights_bytes": weight_bytes,
        "cache_bytes": cache_bytes,
        "ratio": moved / floor,
        "ms_moved": 1e3 * moved / bandwidth,
        "ms_floor": 1e3 * floor / bandwidth,
        "temporaries_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "largest": prog.largest(),
        "square_buffers": square,
    }
    print(f"decode step of {args.config} on one {args.target}, batch {batch}, {slots} cache slots")
    print(f"  bytes moved a token   {moved / 1e9:9.3f} GB   {out['ms_moved']:7.3f} ms")
    print(f"  floor (weights+cache) {floor / 1e9:9.3f} GB   {out['ms_floor']:7.3f} ms")
    print(f"    weights {weight_bytes / 1e9:.3f} GB, cache {cache_bytes / 1e9:.3f} GB")
    print(f"  moved / floor         {out['ratio']:9.3f}")
    print(f"  temporaries           {out['temporaries_mib']:9.1f} MiB")
    print(f"  [.., {slots}, {slots}] buffers: {len(square)}")
    for b in prog.largest()[:5]:
        print(f"    {b['count']:g} x {b['array']} {b['bytes'] / 2**20:.1f} MiB  {b['where']}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
