"""The kernels of a plan's step by the bytes the floor counts for them: today's count (each
slice of a stacked buffer as a slice, `roofline.kernel_bytes`) beside the whole-buffer count it
replaced (every operand and result whole), the top N of each, a table and a JSON file.

    python scripts/plan_bytes.py --config=configs/llama3.py:8b --target=h100 --devices=8 \
        --top=10 --json=plan_bytes.json
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True, help="FILE[:ARG], as the plan takes it")
    parser.add_argument("--target", default="h100")
    parser.add_argument("--devices", type=int, default=None)
    parser.add_argument("--top", type=int, default=10)
    parser.add_argument("--json", default="plan_bytes.json")
    args, overrides = parser.parse_known_args()
    from mptrain import target as target_lib

    target_lib.compile_only()
    from mptrain import main as main_lib
    from mptrain.inspect import program
    from mptrain.plan import roofline
    from mptrain.plan import step as plan_step

    argv = ["plan_bytes", f"--config={args.config}", *overrides]
    config = main_lib.parse_flags(argv, lambda fv: "", lambda fv: None).config
    seen = {}
    real = plan_step._read

    def read(chip, trainer, compiled, *rest):
        seen["prog"] = program.Program(compiled.as_text())
        seen["per"] = trainer.config.steps_per_call
        return real(chip, trainer, compiled, *rest)

    plan_step._read = read
    result = plan_step.plan(config, args.target, args.devices, check_remat=False)
    prog, per = seen["prog"], seen["per"]
    hbm = lambda t: program.type_bytes(t, hbm=True)
    rows = collections.defaultdict(lambda: [0.0, 0.0, 0.0, ""])
    for inst, runs in prog.kernels():
        whole = hbm(inst.type) + sum(hbm(prog.types.get(n, "")) for n in inst.operands)
        row = rows[inst.name]
        row[0] += runs / per
        row[1] += runs * roofline.kernel_bytes(prog, inst) / per
        row[2] += runs * whole / per
        row[3] = prog.where(inst)
    total_new, total_old = sum(r[1] for r in rows.values()), sum(r[2] for r in rows.values())
    out = {"config": args.config, "target": args.target, "devices": result.devices}
    out |= {"bytes_moved": total_new, "bytes_whole_buffers": total_old, "floor": result.floor}
    for key, column in (("top_counted", 1), ("top_whole", 2)):
        top = sorted(rows.items(), key=lambda kv: -kv[1][column])[: args.top]
        out[key] = [
            {"kernel": k, "runs": r[0], "bytes": r[1], "whole": r[2], "where": r[3]} for k, r in top
        ]
    print(f"{args.config} on {result.devices} x {args.target}")
    print(f"  bytes a step: {total_new / 1e9:,.1f} GB counted, {total_old / 1e9:,.1f} GB whole")
    floor = result.floor
    print(
        f"  floor {1e3 * floor['floor_s']:,.1f} ms, {floor['bound']}-bound (compute "
        f"{1e3 * floor['compute_s']:,.1f} ms, memory {1e3 * floor['memory_s']:,.1f} ms)"
    )
    for key, title in (("top_whole", "whole-buffer count"), ("top_counted", "counted")):
        print(f"\n  top {args.top} by the {title}: runs, GB counted, GB whole, kernel, where")
        for r in out[key]:
            print(
                f"  {r['runs']:5g} {r['bytes'] / 1e9:9.1f} {r['whole'] / 1e9:9.1f}  "
                f"{r['kernel']:<44} {r['where']}"
            )
    with open(args.json, "w") as f:
        json.dump(out, f, indent=2, default=str)


if __name__ == "__main__":
    main()
