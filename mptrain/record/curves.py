"""The picture of a run, and the summary it ends with.

The trainer appends each log step's and each evaluation's numbers to
`<workdir>/history.jsonl` (process 0 only; a run resuming at step S first drops the lines past
S, which a crash left after the checkpoint, then appends; a line a crash cut short is skipped,
and the next one starts on a line of its own), and redraws `<workdir>/curves.png` from it at
an evaluation (at most once in `REDRAW_S` seconds) and at the end: train and eval loss, the
learning rate, the loss scale and the skipped steps.
"""

from __future__ import annotations

import json
import math
import os
import shlex
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mptrain import files

HISTORY = "history.jsonl"
PICTURE = "curves.png"
REDRAW_S = 60.0  # the picture is redrawn at an evaluation this long after its last drawing
KEYS = (
    *("loss", "eval_loss", "learning_rate", "loss_scale", "skipped_steps"),
    # speed (`throughput.KEYS`, named here: this module sits below the one that measures them)
    *("step_time_s", "steps_per_sec", "tokens_per_s", "tokens_per_s_per_device"),
    *("examples_per_s", "examples_per_s_per_device", "tflops_per_device", "mfu", "goodput"),
    *("reward", "reward_std", "frac_reward_zero_std", "kl", "entropy"),  # GRPO's, TRL's names
)
# ... and every value under these names' groups: DPO's and GRPO's record, as TRL names it
# (`dpo_loss`, `mptrain.train.grpo`)
GROUPS = ("rewards/", "logps/", "eval_rewards/", "eval_logps/", "moe/")
GROUPS += ("completions/", "clip_ratio/", "sampling/")


def append(workdir: str | os.PathLike, step: int, values: dict[str, Any]) -> None:
    """Adds one line to the history: `step` and those of `KEYS` (and `GROUPS`) that `values`
    holds."""
    if jax.process_index() != 0:
        return
    row = {"step": int(step), **{k: float(values[k]) for k in KEYS if k in values}}
    as_json = lambda v: [round(float(x), 6) for x in np.ravel(v)] if np.ndim(v) else float(v)
    row |= {k: as_json(v) for k, v in values.items() if k.startswith(GROUPS)}
    append_row(Path(workdir) / HISTORY, row)


def append_row(path: Path, row: dict) -> None:
    """Adds `row` as one JSON line to the file `path` (a line a crash cut short ended first)."""
    with files.writing(path), open(path, "a+b") as f:  # writes go to the end, reads anywhere
        size = f.seek(0, os.SEEK_END)
        f.seek(max(size - 1, 0))
        cut_short = size > 0 and f.read(1) != b"\n"  # a crash mid-line: end that line first
        f.write(b"\n" * cut_short + json.dumps(row).encode() + b"\n")


def _rows(path: Path) -> list[tuple[str, dict]]:
    """`(line, row)` of the history's whole lines (a line a crash cut short is skipped)."""
    found = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            found.append((line, row))
    return found


def forget_after(workdir: str | os.PathLike, step: int, *names: str) -> None:
    """Drops the lines past `step` of the history (and of the workdir's other files `names`
    of such lines: the samples) that a run resuming at `step` writes again, atomically: a
    reader sees the old file or the new one."""
    for name in (HISTORY, *names):
        path = Path(workdir) / name
        rows = _rows(path)
        kept = [line + "\n" for line, row in rows if row["step"] <= step]
        if len(kept) < len(rows) or (path.exists() and not path.read_text().endswith("\n")):
            files.write_text(path, "".join(kept))


def load(workdir: str | os.PathLike) -> dict[str, tuple[list[int], list[float]]]:
    """`{key: (steps, values)}` from the history, in step order, the latest line per step."""
    series: dict[str, dict[int, float]] = {k: {} for k in KEYS}
    for _, row in _rows(Path(workdir) / HISTORY):
        for key in KEYS:
            if isinstance(row.get(key), int | float):
                series[key][row["step"]] = row[key]
    return {k: (sorted(v), [v[s] for s in sorted(v)]) for k, v in series.items()}


def draw(workdir: str | os.PathLike, title: str = "") -> Path | None:
    """Redraws `<workdir>/curves.png` from the history (process 0; written beside, then
    renamed, so a reader never sees half a picture). Returns its path."""
    if jax.process_index() != 0:
        return None
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    series = load(workdir)
    fig, axes = plt.subplots(2, 2, figsize=(10, 6.5))
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.9, wspace=0.2, hspace=0.42)
    (loss_ax, lr_ax), (scale_ax, skip_ax) = axes
    for key, style in (("loss", "-"), ("eval_loss", "o-")):
        steps, values = series[key]
        finite = [(s, v) for s, v in zip(steps, values, strict=True) if math.isfinite(v)]
        if finite:
            loss_ax.plot(*zip(*finite, strict=True), style, label=key.replace("_", " "), ms=3)
    loss_ax.set(title="loss", xlabel="step")
    if loss_ax.lines:
        loss_ax.legend()
    for ax, key, name in (
        (lr_ax, "learning_rate", "learning rate"),
        (scale_ax, "loss_scale", "loss scale"),
        (skip_ax, "skipped_steps", "skipped steps (total)"),
    ):
        steps, values = series[key]
        if steps:
            ax.plot(steps, values, "-")
        ax.set(title=name, xlabel="step")
    if series["loss_scale"][1] and min(series["loss_scale"][1]) > 0:
        scale_ax.set_yscale("log", base=2)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    path = Path(workdir) / PICTURE
    staging = path.with_name(f".{PICTURE}.tmp.png")
    with files.writing(path):
        fig.savefig(staging, dpi=100)
        plt.close(fig)
        os.replace(staging, path)
    return path


def loss_text(loss: float) -> str:
    """A loss for people: four decimals (1.5048), or three digits where those would read
    0.0000 (a regression's 3.545e-03)."""
    return f"{loss:.4f}" if abs(loss) >= 0.01 or loss == 0 else f"{loss:.3e}"


def summary(
    workdir: str | os.PathLike,
    state: Any,
    last_eval: dict | None,
    seconds: float,
    config: Any,
    *,
    loss_unit: str | None = None,
) -> str:
    """The lines a run ends with: what it did and where everything is. The eval loss is shown
    in `loss_unit` (the Trainer's `loss_unit`; None: no unit), nats/byte in bits/byte too."""
    workdir = Path(workdir)
    lines = [f"mptrain: done: {int(state.step)} steps in {_duration(seconds)}"]
    if last_eval and "eval_loss" in last_eval:
        loss = last_eval["eval_loss"]
        text = f"  final eval loss {loss_text(loss)}" + (f" {loss_unit}" if loss_unit else "")
        if loss_unit == "nats/byte":
            text += f" = {loss / math.log(2):.3f} bits/byte"
        lines.append(text)
    lines.append(f"  skipped steps {int(state.skipped_steps)}, precision {config.precision}")
    for name, where in (
        ("checkpoints", workdir / "checkpoints"),
        ("precision report", workdir / "precision_report.txt"),
        ("curves", workdir / PICTURE),
    ):
        lines.append(f"  {name + ':':18s}{where}")
    lines.append(f"  tensorboard --logdir {shlex.quote(str(workdir))}")  # a shell's words
    return "\n".join(lines)


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(round(seconds), 60)
    return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
