"""Llama 3.1 8B (or another `configs/llama3.py` size) planned for H100s under each remat policy,
and scanned against unrolled: memory, FLOPs, the roofline floor and compile time of the step
XLA compiles for the target, on this machine (`mptrain.plan`; nothing runs).

    python scripts/plan_llama.py                       # 8b on 8 h100, every variant
    python scripts/plan_llama.py --size=70b --devices=64 --variants=full
    python scripts/plan_llama.py --variants=full,full:unrolled --out=plan_llama.json

A variant is a remat policy (`mptrain.models.remat.POLICIES`), optionally with ":unrolled"
(`model.scan_layers=False`). Needs the extra mptrain[plan]. Prints a table; writes JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the plan compiles for the target, not here
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mptrain import plan as plan_lib  # noqa: E402
from mptrain.models import remat  # noqa: E402

GiB = 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="8b", help="configs/llama3.py's argument")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--variants", default=",".join([*remat.POLICIES, "full:unrolled"]))
    parser.add_argument("--out", default="runs/plan_llama.json")
    args = parser.parse_args()
    import runpy

    get_config = runpy.run_path(str(ROOT / "configs" / "llama3.py"))["get_config"]
    rows = []
    header = (
        f"{'variant':<26}{'temporaries':>12}{'total':>8}{'host':>7}{'fits':>6}"
        f"{'TFLOP':>9}{'GB moved':>10}{'floor ms':>10}{'util<=':>7}{'compile s':>11}"
    )
    print(f"llama3 {args.size} on {args.devices} x {args.target}, per device and step (GiB)")
    print(header)
    for variant in args.variants.split(","):
        policy, _, unrolled = variant.partition(":")
        config = get_config(args.size)
        config.model.remat = policy
        config.model.scan_layers = unrolled != "unrolled"
        result = plan_lib.plan(config, args.target, args.devices)
        memory, floor = result.memory, result.floor
        row = {
            "variant": variant,
            "temporaries_gib": memory["temporaries"] / GiB,
            "total_gib": memory["total"] / GiB,
            "host_gib": memory.get("host", 0) / GiB,
            "fits": result.fits,
            "tflop": sum(result.matmul_flops.values()) / 1e12,
            "gb_moved": result.bytes_moved / 1e9,
            "floor_ms": floor["floor_s"] * 1e3,
            "mfu_at_most": floor.get("mfu"),
            "compile_seconds": result.compile_seconds,
            "attention": result.attention["implementation"],
            "scatters": len(result.hazards),
        }
        rows.append(row)
        mfu = f"{100 * row['mfu_at_most']:.0f}%" if row["mfu_at_most"] else "-"
        print(
            f"{variant:<26}{row['temporaries_gib']:>12.2f}{row['total_gib']:>8.2f}"
            f"{row['host_gib']:>7.2f}{'yes' if row['fits'] else 'no':>6}{row['tflop']:>9.1f}"
            f"{row['gb_moved']:>10.0f}{row['floor_ms']:>10.0f}{mfu:>7}"
            f"{row['compile_seconds']:>11.1f}",
            flush=True,
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
