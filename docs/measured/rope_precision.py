"""What the precision of the RoPE rotation changes: the error of bf16-mixed attention scores
q.k / sqrt(d) against a float64 reference, at positions up to 8,192, for the two ways of
rotating q and k:

  * fp32 (mptrain's, torchtitan's): angles, cos/sin and the rotation in fp32, the rotated
    q and k rounded to bf16 once, for the attention matmul;
  * bf16 (HF transformers' Llama): angles and cos/sin computed in fp32, cos/sin cast to bf16,
    the rotation's multiplies and adds in bf16.

q and k are random bf16 values (what the projections hand over), with Llama 3.1 8B's
frequencies (head size 128, theta 500,000, Llama 3 scaling 8 / 1 / 4 / 8,192). Scores are taken
with bf16 operands and fp32 accumulation in both, as the attention kernels do; the reference
rotates the same bf16 q and k in float64, so only the rotation's rounding is measured. The
figures in docs/models-and-data.md ("Llama-class models") are its.

    python docs/measured/rope_precision.py [--out=rope_precision.json]
"""

import argparse
import json

import jax
import jax.numpy as jnp
import numpy as np

from mptrain.models import decoder

HEAD_DIM, THETA, SCALING, LENGTH = 128, 500_000.0, (8.0, 1.0, 4.0, 8192), 8192


def rotate(x, positions, inv_freq, dtype_of_rotation):
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq, jnp.float32)
    cos, sin = jnp.cos(angles).astype(dtype_of_rotation), jnp.sin(angles).astype(dtype_of_rotation)
    x = x.astype(dtype_of_rotation)
    a, b = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([a * cos - b * sin, b * cos + a * sin], -1).astype(jnp.bfloat16)


def reference(x, positions, inv_freq):
    x, angles = np.asarray(x, np.float64), positions[:, None] * np.asarray(inv_freq, np.float64)
    a, b = np.split(x, 2, axis=-1)
    cos, sin = np.cos(angles), np.sin(angles)
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], -1)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="rope_precision.json")
    args = parser.parse_args()
    inv_freq = decoder.rope_frequencies(HEAD_DIM, THETA, SCALING)
    positions = np.arange(LENGTH)
    keys = jax.random.split(jax.random.key(0), 2)
    q, k = (jax.random.normal(key, (LENGTH, HEAD_DIM)).astype(jnp.bfloat16) for key in keys)
    queries = np.arange(0, LENGTH, 16)  # every 16th query position against every key before it
    want = reference(q, positions, inv_freq)[queries] @ reference(k, positions, inv_freq).T
    want /= np.sqrt(HEAD_DIM)
    causal = positions[None, :] <= queries[:, None]
    rows = []
    for name, dtype in (
        ("fp32 rotation (mptrain)", jnp.float32),
        ("bf16 rotation (HF)", jnp.bfloat16),
    ):
        rq, rk = (rotate(x, jnp.asarray(positions), inv_freq, dtype) for x in (q, k))
        got = jnp.einsum("qd,kd->qk", rq[queries], rk, preferred_element_type=jnp.float32)
        err = np.abs(np.asarray(got / np.sqrt(HEAD_DIM), np.float64) - want)
        row = {"rotation": name}
        for lo, hi in ((0, 1024), (1024, 4096), (4096, 8192)):
            band = causal & (queries[:, None] >= lo) & (queries[:, None] < hi)
            row[f"mean_abs_err_q{lo}-{hi}"] = float(err[band].mean())
            row[f"max_abs_err_q{lo}-{hi}"] = float(err[band].max())
        row["mean_abs_err_all"] = float(err[causal].mean())
        row["rms_score"] = float(np.sqrt((want[causal] ** 2).mean()))
        rows.append(row)
    keys = [key for key in rows[0] if key != "rotation"]
    print(f"{'':28}" + "".join(f"{key:>24}" for key in keys))
    for row in rows:
        print(f"{row['rotation']:28}" + "".join(f"{row[key]:>24.3e}" for key in keys))
    ratio = rows[1]["mean_abs_err_all"] / rows[0]["mean_abs_err_all"]
    print(f"bf16 rotation / fp32 rotation, mean abs error of the scores: {ratio:.2f}x")
    with open(args.out, "w") as f:
        json.dump({"rows": rows, "ratio": ratio, "jax": jax.__version__}, f, indent=1)


if __name__ == "__main__":
    main()
