"""fp8-mixed against bf16-mixed on the tiny Llama (configs/llama3.py:tiny), several seeds.

Trains the tiny Llama (2 blocks of width 128, scanned, rematerialised) for its full step count
(800) once per variant and seed, the variants taking turns within each seed, and prints each
run's final eval loss, each variant's mean and its ratio to bf16-mixed's mean; --out gets the
same as JSON. On a CPU fp8 is emulated: this says whether the numerics hold, not the speed.

The variants: bf16-mixed; fp8-mixed with the Llama's defaults (both of tiny's blocks are an
end of the stack and its matmuls are below the size filter, so no matmul runs in fp8: the bf16
program); the same with the bf16 layers off, or the filter off (still none); and both off,
every projection of both blocks in fp8, delayed and current scaling.

  python scripts/fp8_llama_tiny.py                     # 3 seeds x 6 variants (about 30 min)
  python scripts/fp8_llama_tiny.py --seeds=0 --steps=50 --variants=bf16-mixed,fp8-all
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import tempfile
from pathlib import Path

from mptrain import config as config_lib
from mptrain import files
from mptrain.recipe import fp8_names
from mptrain.train import trainer as trainer_lib

ROOT = Path(__file__).resolve().parent.parent
FP8 = {"precision": "fp8-mixed"}
VARIANTS = {  # name -> config overrides
    "bf16-mixed": {"precision": "bf16-mixed"},
    "fp8 (Llama defaults)": FP8,
    "fp8 bf16_layers=0": {**FP8, "fp8.bf16_layers": 0},
    "fp8 min_size=0": {**FP8, "fp8.min_size": 0},
    "fp8-all": {**FP8, "fp8.bf16_layers": 0, "fp8.min_size": 0},
    "fp8-all delayed": {**FP8, "fp8.bf16_layers": 0, "fp8.min_size": 0, "fp8.scaling": "delayed"},
}


def train(overrides: dict, seed: int, steps: int | None, workdir: Path) -> dict:
    config = runpy.run_path(str(ROOT / "configs" / "llama3.py"))["get_config"]("tiny")
    config = config_lib.override(config, {**overrides, "seed": seed})
    if steps is not None:
        config = config_lib.override(config, {"num_train_steps": steps})
    trainer = trainer_lib.Trainer(config, workdir)
    state = trainer.train_and_evaluate()
    return {
        "eval_loss": float(trainer.last_eval["eval_loss"]),
        "fp8_matmuls": fp8_names.describe(state.model_state) if trainer.policy.fp8 else "",
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated seeds")
    p.add_argument("--steps", type=int, default=None, help="train steps (default: the config's)")
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names")
    p.add_argument("--out", default="runs/fp8_llama_tiny.json", help="JSON results")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise SystemExit(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    runs: dict[str, dict[int, dict]] = {name: {} for name in names}
    root = Path(tempfile.mkdtemp(prefix="fp8_llama_tiny_"))
    for seed in seeds:  # the variants take turns within a seed
        for name in names:
            workdir = root / f"{name.replace(' ', '_')}_{seed}"
            runs[name][seed] = train(VARIANTS[name], seed, args.steps, workdir)
            print(f"seed {seed} {name}: eval loss {runs[name][seed]['eval_loss']:.4f}", flush=True)
    base = statistics.mean(r["eval_loss"] for r in runs[names[0]].values())
    rows = []
    print(f"\n{'variant':<24} " + " ".join(f"seed {s:<4}" for s in seeds) + "   mean    ratio")
    for name in names:
        losses = [runs[name][s]["eval_loss"] for s in seeds]
        mean = statistics.mean(losses)
        print(
            f"{name:<24} "
            + " ".join(f"{x:9.4f}" for x in losses)
            + f" {mean:7.4f} {mean / base:8.4f}"
        )
        matmuls = runs[name][seeds[0]]["fp8_matmuls"]
        row = {"variant": name, "overrides": VARIANTS[name], "eval_loss": losses, "mean": mean}
        rows.append(row | {"ratio_to_first": mean / base, "fp8_matmuls": matmuls})
    for row in rows:
        print(f"  {row['variant']}: fp8 matmuls: {row['fp8_matmuls'] or '(bf16-mixed)'}")
    result = {"seeds": seeds, "steps": args.steps, "rows": rows}
    files.write_json(Path(args.out), result)
    return result


if __name__ == "__main__":
    main()
