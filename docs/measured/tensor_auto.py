"""Whether XLA places a tensor group's collectives as well as mptrain's explicit ones
(docs/multi-host.md): configs/llama3.py:8b at 8 x 8,192 tokens on 8 H100s, fsdp 4 x tensor 2,
its train step compiled for the chip twice from this machine (`mptrain.plan`, nothing runs):

  * explicit, as mptrain runs it: the step's per-device function is manual over every mesh
    axis, and a tensor group's four collectives a block are written out (`parallel.tensor`:
    16-bit gathers of the normed tokens, the out projections' partial sums reduce-scattered in
    fp32, sequence-parallel norms between the blocks);
  * XLA's: the function manual over data, fsdp, expert and context only (`sharding.grad_fn`'s
    `manual=`), so each layer runs whole along `tensor` and XLA's partitioner splits it by the
    params' shardings (heads, units and vocabulary over `tensor`, as declared).

Prints each plan's memory, the bytes each mesh axis moves and how much of it runs behind a
matmul, the collectives by dtype, the kernels and the floor, and writes them as JSON.

    python docs/measured/tensor_auto.py [--out=tensor_auto.json]   # needs mptrain[plan]
"""

from __future__ import annotations

import argparse
import functools
import json
import runpy
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# cuDNN's fused attention partitions itself (`custom_partitioning`); the materialised attention
# is XLA's to partition like any op, which a comparison of the collectives needs
MATERIALIZED = {"model.attention": "materialized", "data.seq_len": 2048}
GiB = 2**30


def planned(manual: tuple[str, ...] | None, overrides: dict | None = None) -> dict:
    from mptrain import config as config_lib
    from mptrain import plan as plan_lib
    from mptrain.parallel import sharding

    config = runpy.run_path(str(ROOT / "configs" / "llama3.py"))["get_config"]("8b")
    keys = {"batch_size": 8, "mesh.fsdp": 4, "mesh.tensor": 2}
    config_lib.override(config, keys | (overrides or {}))
    real = sharding.grad_fn
    if manual is not None:
        sharding.grad_fn = functools.partial(real, manual=manual)
    try:
        plan = plan_lib.plan(config, "h100", 8)
    finally:
        sharding.grad_fn = real
    return {
        "memory_gib": round(plan.memory["total"] / GiB, 2),
        "axis_bytes_gb": {k: round(v / 1e9, 1) for k, v in plan.axis_bytes.items()},
        "hidden_gb": {k: round(v["hidden"] / 1e9, 1) for k, v in plan.axis_overlap.items()},
        "collectives": {
            kind: {dtype: round(n / 1e9, 1) for dtype, n in by_dtype.items()}
            for kind, by_dtype in plan.collectives.items()
        },
        "kernels": int(plan.kernels),
        "floor_ms": round(1e3 * plan.floor["floor_s"], 1),
        "bound": plan.floor["bound"],
        "fits": plan.fits,
        "involuntary": plan.involuntary,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="tensor_auto.json")
    args = parser.parse_args()
    found, xla = {}, ("data", "fsdp", "expert", "context")
    # as configured (cuDNN's attention), and with the materialised attention at 2,048 tokens
    for label, overrides in (("", None), (" materialized 2k", MATERIALIZED)):
        for name, manual in (("explicit", None), ("xla", xla)):
            try:
                found[name + label] = planned(manual, overrides)
            except Exception as e:  # what refuses to compile is a finding too
                found[name + label] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    for name, row in found.items():
        if "error" in row:
            print(f"{name:24} {row['error']}")
            continue
        print(f"{name:24} {row['memory_gib']:7.2f} GiB  {row['kernels']:6} kernels  floor "
              f"{row['floor_ms']:8.1f} ms ({row['bound']})  bytes by axis {row['axis_bytes_gb']}  "
              f"hidden {row['hidden_gb']}  {row['collectives']}")  # fmt: skip
    Path(args.out).write_text(json.dumps(found, indent=2, default=str))


if __name__ == "__main__":
    main()
