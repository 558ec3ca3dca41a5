"""Metric writing: TensorBoard event files plus the console. The only clu.metric_writers importer.

clu's writers pull in TensorFlow, so this module is imported lazily by the trainer, after
`main.py` has hidden accelerators from TensorFlow.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import numpy as np
from clu import metric_writers


def create_writer(workdir: str | os.PathLike, *, is_main_process: bool = True):
    """TensorBoard events in `workdir` and absl log lines; other hosts only log."""
    return metric_writers.create_default_writer(
        os.fspath(workdir), just_logging=not is_main_process, asynchronous=True
    )


def scalars(metrics: Mapping[str, Any]) -> dict[str, float]:
    """Host floats from fetched metrics (bools become 0/1)."""
    return {k: float(np.asarray(v)) for k, v in metrics.items() if np.ndim(v) == 0}


def _fmt_secs(seconds: float) -> str:
    seconds = max(0, int(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class ProgressLine:
    """One live status line (step, loss, scale, steps/s, ETA) when the stream is a terminal.

    On a terminal the line is redrawn in place; otherwise nothing is printed, since the log
    lines of the writer already carry the same numbers into files and pipes.
    """

    def __init__(self, num_train_steps: int, stream: TextIO | None = None):
        self.num_train_steps = num_train_steps
        self.stream = stream or sys.stdout
        self.live = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._last: tuple[int, float] | None = None
        self._rate: float | None = None

    def update(self, step: int, values: Mapping[str, float]) -> str:
        now = time.monotonic()
        if self._last is not None and step > self._last[0]:
            self._rate = (step - self._last[0]) / max(now - self._last[1], 1e-9)
        self._last = (step, now)
        parts = [f"step {step}/{self.num_train_steps}"]
        for key, fmt in (("loss", ".4f"), ("eval_loss", ".4f"), ("loss_scale", "g")):
            if key in values:
                parts.append(f"{key} {values[key]:{fmt}}")
        if values.get("skipped_steps"):
            parts.append(f"skipped {int(values['skipped_steps'])}")
        if self._rate:
            eta = (self.num_train_steps - step) / self._rate
            parts.append(f"{self._rate:.2f} steps/s ETA {_fmt_secs(eta)}")
        line = " | ".join(parts)
        if self.live:
            end = "\n" if step >= self.num_train_steps else ""
            self.stream.write("\r\x1b[2K" + line + end)
            self.stream.flush()
        return line
