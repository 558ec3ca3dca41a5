"""The decoding step of a zoo Llama compiled for an accelerator here, read: what one token
costs against the floor of reading the weights and the KV cache once (`python -m mptrain.plan
--decode`).

Decoding at a small batch is bound by memory: each token reads every weight once and the KV
cache once. `plan_decode` compiles the step `mptrain.models.decoder.decode` runs a token (the layers
unrolled, one token a row attending over a KV cache of `context` slots in the compute dtype,
the weights in the dtypes the run casts them to) for the target, and reads the program: the
bytes its kernels move (`roofline.bytes_moved`: each slice of a stacked buffer counted as a
slice), the floor (the weights' bytes with one row of an untied embedding table, and the
cache's keys and values, read once), their ratio and the time each takes at the chip's memory
bandwidth, the temporaries, and any `[.., S, S]` array (none: a token's scores are `[B, H, 1,
S]`). Only the token's own input goes in: the prompt is never computed again.
"""

from __future__ import annotations

import math
from typing import Any


def plan_decode(config: Any, target_name: str, batch: int = 1, context: int = 2048) -> dict:
    """The decode step of `config`'s Llama on one device of `target_name` (the module doc)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from mptrain import config as config_lib
    from mptrain import errors, models, target
    from mptrain.inspect import program
    from mptrain.models.decoder import decode
    from mptrain.parallel import axes
    from mptrain.plan import roofline

    if not getattr(models.record_of(config), "decodes", False):
        raise errors.ConfigError(
            f"--decode: model.name={config.model.name!r} does not decode; it plans "
            f"{models.able('decodes')}"
        )
    chip, _ = target.get(target_name)
    device = chip.devices(1)[0]
    policy = config_lib.policy_of(config)
    model = models.create(config.model, policy, [device])
    where = jax.sharding.SingleDeviceSharding(device)
    _, shapes = axes.declared_of(model.init, jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
    dtypes = policy.compute_dtypes(shapes)
    params = jax.tree.map(lambda s, d: jax.ShapeDtypeStruct(s.shape, d), shapes, dtypes)
    params = jax.eval_shape(lambda p: decode.unscanned(model, p)[1], params)  # as decoded
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=where), params)
    model = model.clone(scan_layers=False)
    shape = model.specs[0].shape
    cache_shape = (batch, shape.num_kv_heads, context, shape.head_dim)
    one = jax.ShapeDtypeStruct(cache_shape, model.dtype, sharding=where)
    cache = tuple(decode.KVCache(one, one) for _ in range(model.num_layers))
    token = jax.ShapeDtypeStruct((batch, 1), jnp.int32, sharding=where)

    def step(params, cache, token, position):
        return model.apply({"params": params}, token, positions=position, cache=cache)

    compiled = jax.jit(step, donate_argnums=1).trace(params, cache, token, token).lower().compile()
    prog = program.Program(compiled.as_text())
    moved = roofline.bytes_moved(prog)
    weights = 0
    for keys, leaf in jax.tree_util.tree_leaves_with_path(params):
        nbytes = math.prod(leaf.shape) * np.dtype(leaf.dtype).itemsize
        if "embed" in jax.tree_util.keystr(keys) and not config.model.tie_embeddings:
            nbytes //= leaf.shape[0]  # a token reads one row of the embedding table
        weights += nbytes
    cache_bytes = 2 * model.num_layers * math.prod(cache_shape) * np.dtype(model.dtype).itemsize
    floor, bandwidth = weights + cache_bytes, chip.roofline["bandwidth"]
    return {
        "target": chip.name,
        "batch": batch,
        "context": context,
        "bytes_moved": moved,
        "floor_bytes": floor,
        "weights_bytes": weights,
        "cache_bytes": cache_bytes,
        "ratio": moved / floor,
        "ms_moved": 1e3 * moved / bandwidth,
        "ms_floor": 1e3 * floor / bandwidth,
        "temporaries_mib": compiled.memory_analysis().temp_size_in_bytes / 2**20,
        "largest": prog.largest(),
        "square_buffers": [b for b in prog.largest() if b["array"].count(str(context)) >= 2],
    }


def text(out: dict) -> str:
    """The decode plan as the command prints it."""
    lines = [
        f"decode: one token a row on one {out['target']}, batch {out['batch']}, "
        f"{out['context']} cache slots",
        f"  bytes moved a token   {out['bytes_moved'] / 1e9:9.3f} GB  {out['ms_moved']:8.3f} ms",
        f"  floor: weights+cache  {out['floor_bytes'] / 1e9:9.3f} GB  {out['ms_floor']:8.3f} ms"
        f"  (weights {out['weights_bytes'] / 1e9:.3f} GB, cache {out['cache_bytes'] / 1e9:.3f} GB)",
        f"  moved / floor         {out['ratio']:9.3f}",
        f"  temporaries           {out['temporaries_mib']:9.1f} MiB",
        f"  [.., S, S] arrays     {len(out['square_buffers'])}",
        "largest arrays the kernels write:",
    ]
    for b in out["largest"][:5]:
        lines.append(f"  {b['count']:g} x {b['array']} {b['bytes'] / 2**20:.1f} MiB  {b['where']}")
    return "\n".join(lines) + "\n"
