"""Every lean recipe on the default model: eval loss, bytes per parameter, step time.

Trains the default LM (configs/default.py, its full step count unless --steps) once per recipe,
from the same seed and data, and reads:
- eval loss (nats/byte) at the end, and its ratio to bf16-mixed's;
- bytes per parameter of the persistent state (params, optimizer state, Kahan compensation),
  summed from the arrays of the final TrainState;
- step time relative to bf16-mixed: every recipe's jitted trainer step run in blocks of
  --block_steps, the recipes taking turns (bf16-mixed, recipe, bf16-mixed, recipe, ...), the
  median over --rounds of each block's time over the neighbouring bf16-mixed block's.

  python scripts/lean_recipes.py                        # the whole table (about 40 min on CPU)
  python scripts/lean_recipes.py --steps=20 --rounds=2 --recipes=bf16-mixed,bf16-mixed+q8
"""

from __future__ import annotations

import argparse
import runpy
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from mptrain import config as config_lib
from mptrain import files
from mptrain.record import log_totals
from mptrain.train import trainer as trainer_lib

ROOT = Path(__file__).resolve().parent.parent

# name -> config overrides
RECIPES = {
    "fp32": {"precision": "fp32"},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "fp8-mixed": {"precision": "fp8-mixed"},  # the projections in fp8 (emulated on a CPU)
    "bf16-mixed+q8": {
        "precision": "bf16-mixed", "optimizer.mu_dtype": "q8", "optimizer.nu_dtype": "q8"
    },
    "bf16-pure+sr (fp32 moments)": {"precision": "bf16-pure", "param_rounding": "stochastic"},
    "bf16-pure+sr (bf16 moments)": {
        "precision": "bf16-pure",
        "param_rounding": "stochastic",
        "optimizer.mu_dtype": "bfloat16",
        "optimizer.nu_dtype": "bfloat16",
    },
    "bf16-pure+sr (q8 moments)": {
        "precision": "bf16-pure",
        "param_rounding": "stochastic",
        "optimizer.mu_dtype": "q8",
        "optimizer.nu_dtype": "q8",
    },
    "bf16-pure+kahan (bf16 moments)": {
        "precision": "bf16-pure",
        "param_rounding": "kahan",
        "optimizer.mu_dtype": "bfloat16",
        "optimizer.nu_dtype": "bfloat16",
    },
    "bf16-pure+nearest (bf16 moments)": {
        "precision": "bf16-pure",
        "param_rounding": "nearest",
        "optimizer.mu_dtype": "bfloat16",
        "optimizer.nu_dtype": "bfloat16",
    },
}  # fmt: skip
BASELINE = "bf16-mixed"


def make_config(overrides: dict, steps: int | None):
    config = runpy.run_path(str(ROOT / "configs" / "default.py"))["get_config"](None)
    config_lib.override(config, overrides)
    if steps:
        config.num_train_steps = steps
    config.checkpoint_every_steps = config.num_train_steps  # one checkpoint, at the end
    return config


def state_bytes_per_param(state) -> float:
    """Persistent bytes per parameter: params, optimizer-state arrays (not scalars), and the
    Kahan compensation, measured from the arrays."""
    count = sum(x.size for x in jax.tree.leaves(state.params))
    arrays = jax.tree.leaves((state.params, state.param_compensation))
    arrays += [x for x in jax.tree.leaves(state.opt_state) if np.ndim(x) > 0]
    return sum(x.size * x.dtype.itemsize for x in arrays) / count


def train(name: str, overrides: dict, steps: int | None, workdir: Path) -> dict:
    config = make_config(overrides, steps)
    trainer = trainer_lib.Trainer(config, workdir / name.replace(" ", "_"))
    start = time.perf_counter()
    state = trainer.train_and_evaluate()
    return {
        "recipe": name,
        "overrides": overrides,
        "steps": int(state.step),
        "eval_loss": float(trainer.last_eval["eval_loss"]),
        "bytes_per_param": state_bytes_per_param(state),
        "train_seconds": time.perf_counter() - start,
    }


def step_timer(overrides: dict):
    """`time(n) -> seconds` for n steps of the recipe's jitted trainer step (state donated)."""
    config = make_config(overrides, None)
    trainer = trainer_lib.Trainer(config, tempfile.mkdtemp())
    source = trainer.build_datasets()[0]
    batch = trainer.device_batch(source, 0)
    holder = {"state": trainer.init_state(source.get_batch(0))}
    step = jax.jit(trainer.make_train_step(), donate_argnums=0)
    totals = log_totals.LogTotals.zeros()

    def run(n: int) -> float:
        jax.block_until_ready(holder["state"])
        begin = time.perf_counter()
        state = holder["state"]
        for _ in range(n):
            state, _, _ = step(state, batch, totals)
        jax.block_until_ready(state)
        holder["state"] = state
        return time.perf_counter() - begin

    run(2)  # compile
    return run


def step_time_ratios(names: list[str], rounds: int, block_steps: int) -> dict[str, float]:
    timers = {name: step_timer(RECIPES[name]) for name in dict.fromkeys([BASELINE, *names])}
    ratios: dict[str, list[float]] = {name: [] for name in timers}
    for _ in range(rounds):
        for name in timers:
            base = timers[BASELINE](block_steps)
            ratios[name].append(timers[name](block_steps) / base)
    return {name: statistics.median(r) for name, r in ratios.items()}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=None, help="train steps (default: the config's)")
    p.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated recipe names")
    p.add_argument("--rounds", type=int, default=15, help="alternated timing rounds")
    p.add_argument("--block_steps", type=int, default=5, help="steps per timed block")
    p.add_argument("--out", default="runs/lean_recipes.json", help="JSON results")
    args = p.parse_args(argv)
    names = [n.strip() for n in args.recipes.split(",") if n.strip()]
    unknown = [n for n in names if n not in RECIPES]
    if unknown:
        p.error(f"unknown recipe(s) {unknown}; known: {list(RECIPES)}")
    print(f"jax {jax.__version__}, device {jax.devices()[0].platform}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for name in names:
            rows.append(train(name, RECIPES[name], args.steps, Path(workdir)))
            row = rows[-1]
            print(f"trained {name}: eval loss {row['eval_loss']:.4f}", flush=True)
    ratios = step_time_ratios(names, args.rounds, args.block_steps)
    base = next((r["eval_loss"] for r in rows if r["recipe"] == BASELINE), None)
    print(f"\n{'recipe':34s} {'eval loss':>9s} {'vs bf16-mixed':>13s} {'bytes/param':>11s} "
          f"{'step time':>9s}")  # fmt: skip
    for row in rows:
        row["step_time_vs_bf16_mixed"] = ratios[row["recipe"]]
        row["eval_loss_vs_bf16_mixed"] = row["eval_loss"] / base if base else None
        vs = f"{row['eval_loss_vs_bf16_mixed']:.4f}" if base else "-"
        print(
            f"{row['recipe']:34s} {row['eval_loss']:9.4f} {vs:>13s} "
            f"{row['bytes_per_param']:11.3f} {row['step_time_vs_bf16_mixed']:9.3f}"
        )
    files.write_json(
        args.out,
        {
            "jax": jax.__version__,
            "device": str(jax.devices()[0]),
            "rounds": args.rounds,
            "block_steps": args.block_steps,
            "recipes": rows,
        },
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
