"""bf16-mixed against fp32 over several seeds: is the gap inside what the seed alone moves?

Trains a config (default `configs/llama3.py:tiny`, 800 steps) once per seed and precision, the
two precisions alternating, each as `python -m mptrain.main` in a workdir of its own, and reads
the final eval loss from each run's history. Prints a table and writes JSON: each seed's losses
and bf16's gap to fp32, the means over seeds and the gap of the means, and the spread of fp32's
own losses across seeds (max / min - 1), the yardstick a single pair's gap must be read against.
A workdir that already holds a finished run is read, not trained again.

  python scripts/precision_band.py --out=/tmp/band                # 3 seeds: about 20 minutes
  python scripts/precision_band.py --seeds=0 --out=/tmp/band      # one pair
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

PRECISIONS = ("fp32", "bf16-mixed")


def final_eval_loss(workdir: Path) -> float | None:
    history = workdir / "history.jsonl"
    if not history.is_file():
        return None
    losses = [json.loads(line).get("eval_loss") for line in history.read_text().splitlines()]
    losses = [x for x in losses if x is not None]
    return losses[-1] if losses else None


def train(config: str, workdir: Path, precision: str, seed: int) -> tuple[float, float]:
    """(final eval loss, seconds): the run's, trained now unless the workdir already has it."""
    if (done := final_eval_loss(workdir)) is not None:
        return done, float("nan")
    start = time.perf_counter()
    command = [sys.executable, "-m", "mptrain.main", f"--config={config}"]
    command += [f"--workdir={workdir}", f"--config.precision={precision}", f"--config.seed={seed}"]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    return final_eval_loss(workdir), time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/llama3.py:tiny")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated")
    p.add_argument("--out", default="runs/precision_band", help="workdirs and band.json")
    args = p.parse_args()
    out, seeds = Path(args.out), [int(s) for s in args.seeds.split(",")]
    rows = []
    for seed in seeds:
        row = {"seed": seed}
        for precision in PRECISIONS:
            loss, seconds = train(args.config, out / f"seed{seed}_{precision}", precision, seed)
            row[precision], row[f"{precision}_seconds"] = loss, seconds
        row["gap"] = row["bf16-mixed"] / row["fp32"] - 1
        rows.append(row)
    means = {p: statistics.fmean(r[p] for r in rows) for p in PRECISIONS}
    fp32 = [r["fp32"] for r in rows]
    summary = {
        "config": args.config,
        "runs": rows,
        "mean": means,
        "gap_of_means": means["bf16-mixed"] / means["fp32"] - 1,
        "fp32_seed_spread": max(fp32) / min(fp32) - 1,
    }
    print(f"{'seed':>4}  {'fp32':>8}  {'bf16-mixed':>10}  {'gap':>7}")
    for r in rows:
        print(f"{r['seed']:>4}  {r['fp32']:8.4f}  {r['bf16-mixed']:10.4f}  {r['gap']:+7.2%}")
    print(
        f"mean  {means['fp32']:8.4f}  {means['bf16-mixed']:10.4f}  {summary['gap_of_means']:+7.2%}"
    )
    print(f"fp32's own spread across seeds: {summary['fp32_seed_spread']:.2%}")
    out.mkdir(parents=True, exist_ok=True)
    (out / "band.json").write_text(json.dumps(summary, indent=1) + "\n")


if __name__ == "__main__":
    main()
