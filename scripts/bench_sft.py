"""Real tokens per second of SFT with packed rows against one example a row, on the same data.

Both sides are `configs/llama3.py:sft_tiny` (or `--config_arg`) on the embedded SFT set, one
with `data.packing=True` (the default: first-fit decreasing into rows of `data.seq_len`), one
with `data.packing=False` (each example alone in its row, the rest padding, as a trainer
without packing feeds it). Same model, same rows' shape, so the same step program; what
differs is how many of a row's tokens are an example's. The script alternates blocks of
`--block_steps` steps of each side in one process (which side goes first alternating too, so
the machine's drift cancels), each block timed from an idle device to its last step's end,
and counts each block's real tokens from the source (`PackedSource.real_tokens`).

  python scripts/bench_sft.py                           # 4 blocks of 10 steps a side
  python scripts/bench_sft.py --blocks=2 --block_steps=4 --out=/tmp/sft.json   # smoke
  python scripts/bench_sft.py --set=model.d_model=2048 --set=model.num_layers=16 ...   # larger

Prints a table and writes JSON (`--out`): per block, each side's ms a step and real tokens/s,
and the median ratio packed / unpacked.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import json
import runpy
import statistics
import tempfile
from pathlib import Path

from mptrain import data as data_lib

HERE = Path(__file__).resolve().parent


def configs(arg: str, overrides: dict) -> dict:
    from mptrain import config as config_lib

    get_config = runpy.run_path(str(HERE.parent / "configs" / "llama3.py"))["get_config"]
    sides = {}
    for name, packing in (("packed", True), ("unpacked", False)):
        config = config_lib.override(get_config(arg), overrides)
        config.data.packing = packing
        sides[name] = config
    return sides


def _setting(text: str) -> tuple:
    """`--set=KEY=VALUE`: VALUE as a Python literal where it reads as one, else a string."""
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"--set={text!r}: give KEY=VALUE")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config_arg", default="sft_tiny", help="argument of configs/llama3.py")
    p.add_argument("--blocks", type=int, default=4, help="timed blocks a side")
    p.add_argument("--block_steps", type=int, default=10, help="steps a block")
    p.add_argument("--seq_len", type=int, default=None, help="data.seq_len (default: config's)")
    p.add_argument("--out", default="runs/bench_sft.json", help="JSON results")
    p.add_argument(
        "--set",
        type=_setting,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config key of both sides, dotted (model.d_model=2048); repeatable",
    )
    args = p.parse_args(argv)
    overrides = dict(args.set) | ({"data.seq_len": args.seq_len} if args.seq_len else {})
    sides = configs(args.config_arg, overrides)
    trainer_blocks = runpy.run_path(str(HERE / "bench_overhead.py"))["trainer_blocks"]
    rows = []
    with contextlib.ExitStack() as stack:
        run, count = {}, {}
        for name, config in sides.items():
            workdir = stack.enter_context(tempfile.TemporaryDirectory(prefix="bench_sft_"))
            run[name] = stack.enter_context(trainer_blocks(config, workdir))
            count[name] = data_lib.create_sources(config)[0].real_tokens  # pure in (seed, i)
        for name in sides:
            run[name](range(0, args.block_steps))  # warm up both sides
        for b in range(args.blocks):
            steps = range((b + 1) * args.block_steps, (b + 2) * args.block_steps)
            row = {"block": b}
            for name in list(sides)[:: 1 if b % 2 else -1]:
                seconds = run[name](steps)
                real = count[name](steps.start, steps.stop)
                row[f"{name}_ms"] = 1e3 * seconds / len(steps)
                row[f"{name}_real_tokens_per_s"] = real / seconds
                row[f"{name}_real_share"] = real / (len(steps) * config_tokens(sides[name]))
            row["ratio"] = row["packed_real_tokens_per_s"] / row["unpacked_real_tokens_per_s"]
            rows.append(row)
    result = {
        "config": f"configs/llama3.py:{args.config_arg}",
        "overrides": overrides,
        "seq_len": sides["packed"].data.seq_len,
        "batch_size": sides["packed"].batch_size,
        "blocks": rows,
        "median_ratio": statistics.median(r["ratio"] for r in rows),
    }
    print(f"{'block':>5} {'packed ms':>10} {'unpacked ms':>12} {'packed tok/s':>13} "
          f"{'unpacked tok/s':>15} {'ratio':>6}")  # fmt: skip
    for r in rows:
        print(
            f"{r['block']:>5} {r['packed_ms']:>10.1f} {r['unpacked_ms']:>12.1f} "
            f"{r['packed_real_tokens_per_s']:>13.0f} {r['unpacked_real_tokens_per_s']:>15.0f} "
            f"{r['ratio']:>6.2f}"
        )
    print(f"median ratio, real tokens/s packed / unpacked: {result['median_ratio']:.2f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


def config_tokens(config) -> int:
    return config.batch_size * config.data.seq_len


if __name__ == "__main__":
    main()
