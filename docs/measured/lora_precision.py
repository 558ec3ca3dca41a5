"""LoRA adapters in fp32 (mptrain's default) against adapters in bf16 (torchtune's way: bf16
params rounded to nearest, bf16 moments), both over the same frozen bf16 base.

Pretrains `configs/llama3.py:tiny` briefly on its embedded text, then fine-tunes rank-8 adapters
on every projection from that checkpoint (`init_from`) on another text (this repository's docs),
once per seed and variant, the variants alternating, each as `python -m mptrain.main`. Reads
each run's final eval loss, and from the fp32 run's checkpoints (one a step) the fraction of
adapter updates that bf16 params would have lost: elements whose fp32 update is not zero but
leaves the param's bf16 value where it was. Prints a table and writes JSON. A workdir that holds
a finished run is read, not trained again. The figures in docs/fine-tuning.md ("Adapters in
fp32, the base in bf16") are its.

  python docs/measured/lora_precision.py --out=/tmp/lora_precision   # 3 seeds: about 10 minutes
"""

from __future__ import annotations

import argparse
import json
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parents[2]
final_eval_loss = runpy.run_path(str(ROOT / "scripts" / "precision_band.py"))["final_eval_loss"]
CONFIG = f"--config={ROOT / 'configs' / 'llama3.py'}:tiny"
VARIANTS = {
    "fp32 adapters": ["--config.precision=bf16-mixed"],
    "bf16 adapters": [
        "--config.precision=bf16-pure",
        "--config.param_rounding=nearest",
        "--config.optimizer.mu_dtype=bfloat16",
        "--config.optimizer.nu_dtype=bfloat16",
    ],
}


def train(workdir: Path, flags: list[str]) -> tuple[float, float]:
    """(final eval loss, seconds): the run's, trained now unless the workdir already has it."""
    if (done := final_eval_loss(workdir)) is not None:
        return done, float("nan")
    start = time.perf_counter()
    command = [sys.executable, "-m", "mptrain.main", CONFIG, f"--workdir={workdir}", *flags]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return final_eval_loss(workdir), time.perf_counter() - start


def lost_in_bf16(workdir: Path) -> float:
    """Over consecutive checkpoints of an fp32-adapter run: the fraction of adapter elements
    whose update was not zero but would not have moved a bf16 param."""
    import orbax.checkpoint as ocp

    steps = sorted(int(p.name) for p in (workdir / "checkpoints").iterdir() if p.name.isdigit())
    reader = ocp.StandardCheckpointer()
    flat = lambda step: np.concatenate(
        [
            np.asarray(x, np.float32).ravel()
            for x in _leaves(reader.restore(workdir / "checkpoints" / str(step) / "state"))
        ]
    )
    lost = moved = 0
    before = flat(steps[0])
    for step in steps[1:]:
        after = flat(step)
        update = after - before
        bf16 = lambda x: x.astype(ml_dtypes.bfloat16)
        changed = update != 0
        lost += int(np.sum(changed & (bf16(before + update) == bf16(before))))
        moved += int(np.sum(changed))
        before = after
    return lost / max(moved, 1)


def _leaves(state: dict) -> list:
    import jax

    return jax.tree.leaves(state["params"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seeds", default="0,1,2", help="comma-separated")
    p.add_argument("--pretrain_steps", type=int, default=400)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--out", default="runs/lora_precision", help="workdirs and JSON")
    args = p.parse_args()
    out, seeds = Path(args.out), [int(s) for s in args.seeds.split(",")]
    pretrain = out / "pretrain"
    base_loss, _ = train(
        pretrain,
        [f"--config.num_train_steps={args.pretrain_steps}", "--config.eval_every_steps=200"],
    )
    docs = str(ROOT / "docs" / "*.md")
    common = [
        f"--config.init_from={pretrain}", f"--config.data.files={docs}", "--config.lora.rank=8",
        "--config.lora.alpha=16", f"--config.num_train_steps={args.steps}",
        f"--config.optimizer.learning_rate={args.learning_rate}",
        "--config.optimizer.warmup_steps=20", "--config.optimizer.weight_decay=0.0",
        f"--config.eval_every_steps={args.steps}", "--config.eval_steps=20",
    ]  # fmt: skip
    rows = []
    for seed in seeds:
        row = {"seed": seed}
        for name, flags in VARIANTS.items():
            every = ["--config.checkpoint_every_steps=1", "--config.max_checkpoints_to_keep=100000"]
            extra = every if name == "fp32 adapters" else []
            workdir = out / f"seed{seed}_{name.split()[0]}"
            loss, seconds = train(workdir, [*common, *flags, *extra, f"--config.seed={seed}"])
            row[name], row[f"{name} seconds"] = loss, seconds
            if name == "fp32 adapters":
                row["lost in bf16"] = lost_in_bf16(workdir)
        rows.append(row)
    means = {name: statistics.mean(r[name] for r in rows) for name in VARIANTS}
    lost = statistics.mean(r["lost in bf16"] for r in rows)
    print(f"pretrained base ({args.pretrain_steps} steps): eval loss {base_loss:.4f} nats/byte")
    print(f"{'seed':>4} {'fp32 adapters':>14} {'bf16 adapters':>14} {'updates lost in bf16':>21}")
    for r in rows:
        print(
            f"{r['seed']:>4} {r['fp32 adapters']:>14.4f} {r['bf16 adapters']:>14.4f} "
            f"{100 * r['lost in bf16']:>20.1f}%"
        )
    print(
        f"{'mean':>4} {means['fp32 adapters']:>14.4f} {means['bf16 adapters']:>14.4f} "
        f"{100 * lost:>20.1f}%"
    )
    result = {"rows": rows, "means": means, "lost_in_bf16": lost, "base_eval_loss": base_loss}
    result["args"] = vars(args)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lora_precision.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out / 'lora_precision.json'}")


if __name__ == "__main__":
    main()
