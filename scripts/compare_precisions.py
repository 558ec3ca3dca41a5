"""Short runs of the default LM under each precision recipe: loss curves and loss-scale traces.

Every recipe trains the default byte-level LM from the same seed and data for --steps steps in a
small-gradient setting: the loss is multiplied by --loss_factor (2^-10 by default) before
differentiation and the reported loss divided back, as when a loss is averaged over many more
tokens or summed with small weights. Adam is invariant to that factor, so fp32, bf16-mixed and
fp16 with dynamic loss scaling train as usual, while fp16 without loss scaling loses the
gradients that underflow fp16 (below 6e-8) and trains visibly worse. bf16-pure is shown rounded
to nearest and stochastically. Writes one PNG (loss per recipe, and the loss scale) and a CSV of
every logged point.

  python scripts/compare_precisions.py                  # about 12 minutes on a 2-core CPU
  python scripts/compare_precisions.py --steps=20 --out=/tmp/cmp   # smoke
"""

from __future__ import annotations

import argparse
import csv
import runpy
import tempfile
from pathlib import Path

from mptrain import config as config_lib
from mptrain import models
from mptrain.record import curves
from mptrain.train import trainer as trainer_lib

ROOT = Path(__file__).resolve().parent.parent

RECIPES = {
    "fp32": {"precision": "fp32"},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "fp16-mixed, dynamic loss scale": {"precision": "fp16-mixed", "loss_scale.kind": "dynamic"},
    "fp16-mixed, no loss scale": {"precision": "fp16-mixed", "loss_scale.kind": "none"},
    "bf16-pure, nearest": {"precision": "bf16-pure", "param_rounding": "nearest"},
    "bf16-pure, stochastic": {"precision": "bf16-pure", "param_rounding": "stochastic"},
}


class SmallGradientTrainer(trainer_lib.Trainer):
    """The default LM with its loss multiplied by `loss_factor` (its logged train and eval
    losses too: `run` divides them back out). Its own `loss_fn` has no `loss_unit`: the run
    summary shows the multiplied loss without one."""

    loss_factor = 1.0

    def loss_fn(self, params, model_state, batch, rng):
        loss, (state, aux) = super().loss_fn(params, model_state, batch, rng)
        return loss * self.loss_factor, (state, aux)


def run(name: str, overrides: dict, args, workdir: Path) -> dict:
    config = runpy.run_path(str(ROOT / "configs" / "default.py"))["get_config"](None)
    config_lib.override(config, overrides)
    config.num_train_steps = args.steps
    config.log_every_steps = args.log_every
    config.eval_every_steps = config.checkpoint_every_steps = args.steps
    config.eval_steps = 4
    folder = workdir / name.replace(" ", "_").replace(",", "")
    SmallGradientTrainer.loss_factor = args.loss_factor
    trainer = SmallGradientTrainer(config, folder)
    trainer.train_and_evaluate()
    series = curves.load(folder)
    steps, losses = series["loss"]
    return {
        "name": name,
        "steps": steps,
        "loss": [v / args.loss_factor for v in losses],  # the LM's own loss again
        "unit": models.loss_unit(config),  # of the base Trainer's loss: nats/byte
        "loss_scale": series["loss_scale"][1],
        "eval_loss": trainer.last_eval["eval_loss"] / args.loss_factor,
    }


def draw(results: list[dict], path: Path, factor: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    fig, (loss_ax, scale_ax) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    for r in results:
        loss_ax.plot(r["steps"], r["loss"], label=f"{r['name']} (eval {r['eval_loss']:.3f})")
        if r["name"].startswith("fp16"):
            scale_ax.plot(r["steps"], r["loss_scale"], label=r["name"])
    unit = results[0]["unit"]
    loss_ax.set(title=f"train loss / {factor:g} ({unit})", xlabel="step", ylim=(1.4, 5.8))
    loss_ax.legend(fontsize=8)
    scale_ax.set(title="loss scale", xlabel="step")
    scale_ax.set_yscale("log", base=2)
    scale_ax.legend(fontsize=8)
    for ax in (loss_ax, scale_ax):
        ax.grid(alpha=0.3)
    fig.suptitle(f"default LM, loss x {factor:g} (small gradients)")
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--log_every", type=int, default=10)
    p.add_argument("--loss_factor", type=float, default=2.0**-10)
    p.add_argument("--out", default="docs/compare_precisions", help="writes OUT.png and OUT.csv")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    results = []
    with tempfile.TemporaryDirectory() as workdir:
        for name, overrides in RECIPES.items():
            results.append(run(name, overrides, args, Path(workdir)))
            print(f"{name:32s} final loss {results[-1]['loss'][-1]:.4f} "
                  f"eval {results[-1]['eval_loss']:.4f}", flush=True)  # fmt: skip
    draw(results, out.with_suffix(".png"), args.loss_factor)
    with open(out.with_suffix(".csv"), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["recipe", "step", "loss", "loss_scale"])
        for r in results:
            scales = r["loss_scale"] or [None] * len(r["steps"])
            for row in zip(r["steps"], r["loss"], scales, strict=True):
                writer.writerow([r["name"], *row])
    print(f"wrote {out.with_suffix('.png')} and {out.with_suffix('.csv')}")


if __name__ == "__main__":
    main()
