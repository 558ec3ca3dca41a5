"""Metrics: the device-side log totals, TensorBoard and console writers, the progress line.

This is the only module that imports `clu.metric_writers`. clu's writers pull in TensorFlow, so
the import waits until `create_writer` is called, after `main.py` has hidden accelerators from
TensorFlow.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Mapping
from typing import Any, TextIO

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct


@struct.dataclass
class LogTotals:
    """What the train step adds up on the device between two log steps, so the host reads it
    only on log steps: the sum and count of the applied steps' losses (for the mean loss since the
    last log), and two values that span log intervals, the current run of non-finite steps and
    the last finite loss (for the diagnostic when training cannot recover)."""

    loss_sum: jax.Array
    applied_steps: jax.Array
    consecutive_skips: jax.Array
    last_finite_loss: jax.Array
    numerics: Any = None  # a `numerics.Log` when per-layer numerics are recorded

    @classmethod
    def zeros(cls, numerics: Any = None) -> LogTotals:
        """Fresh totals (host scalars; under `jax.jit`, constants of the program)."""
        zero_f, zero_i = np.float32(0), np.int32(0)
        return cls(zero_f, zero_i, zero_i, np.float32(np.nan), numerics)

    @classmethod
    def on_devices(cls, sharding: Any, numerics: Any = None) -> LogTotals:
        """Fresh totals made on the devices of `sharding` (a host NaN would not pass
        `device_put`'s check that every process puts the same value)."""
        return jax.jit(lambda: cls.zeros(numerics), out_shardings=sharding)()

    def update(self, loss: jax.Array, applied: jax.Array) -> LogTotals:
        """Adds one step: its (fp32) loss counts only if its update was applied."""
        return self.replace(
            loss_sum=self.loss_sum + jnp.where(applied, loss, 0.0),
            applied_steps=self.applied_steps + applied.astype(jnp.int32),
            consecutive_skips=jnp.where(applied, 0, self.consecutive_skips + 1),
            last_finite_loss=jnp.where(applied, loss, self.last_finite_loss),
        )

    def reset(self) -> LogTotals:
        """A new log interval: the sums restart; the values that span intervals stay."""
        return self.replace(
            loss_sum=jnp.zeros_like(self.loss_sum),
            applied_steps=jnp.zeros_like(self.applied_steps),
            numerics=None if self.numerics is None else self.numerics.reset(),
        )

    def to_scalars(self) -> dict[str, float]:
        """Host floats from fetched totals; `loss` (the interval's mean) only if a step applied."""
        values = {
            "consecutive_skips": float(self.consecutive_skips),
            "last_finite_loss": float(self.last_finite_loss),
        }
        if int(self.applied_steps):
            values["loss"] = float(self.loss_sum) / int(self.applied_steps)
        return values


def nonfinite_diagnostic(step: int, values: Mapping[str, float], scaler, max_skips: int):
    """A message when training cannot recover from its non-finite steps, else None.

    `values` are a log step's scalars (`consecutive_skips`, `loss_scale`, `last_finite_loss`,
    `skipped_steps`); `scaler` is the state's loss scaler, whose `min_scale` is read (from the
    device) only after two non-finite steps in a row.
    """
    skips = int(values["consecutive_skips"])
    if skips == 0:
        return None
    scale = values["loss_scale"]
    min_scale = getattr(scaler, "min_scale", None)  # only a dynamic scaler moves
    stuck = min_scale is not None and skips >= 2 and scale <= float(min_scale)
    if skips < max_skips and not stuck:
        return None
    why = (
        f"the dynamic loss scale is stuck at its minimum {scale:g}"
        if skips < max_skips
        else f"{skips} non-finite steps in a row (config.max_consecutive_skips={max_skips})"
    )
    return (
        f"training went non-finite at step {step}: {why}; last finite loss "
        f"{values['last_finite_loss']:.6g}, loss scale {scale:g}, "
        f"{int(values['skipped_steps'])} steps skipped in all. The last good state was "
        "saved; lower the learning rate or check the data, then run again"
    )


def report_start(workdir, config, state, compiled_step, mesh, start: int, report) -> None:
    """Writes `<workdir>/precision_report.txt` (process 0) and logs how a run starts: precision,
    loss scale, params, state bytes per param and per device, the compiled step's memory, the
    mesh, any warmup cut, and the report's warnings (unsafe setups, matmuls outside the compute
    dtype)."""
    from mptrain import audit, optim

    if jax.process_index() == 0:
        with open(os.path.join(workdir, "precision_report.txt"), "w") as f:
            f.write(str(report))
    with jax.transfer_guard("allow"):
        scale = float(state.loss_scale.loss_scale)
    per_param = audit.state_bytes_per_param(state.params, state.opt_state)
    on_one = sum(x.addressable_shards[0].data.nbytes for x in jax.tree.leaves(state))
    memory = compiled_step.memory_analysis()
    logging.info(
        f"mptrain: precision {state.policy}, param rounding {state.param_rounding}, loss scale "
        f"{type(state.loss_scale).__name__} (scale {scale:g}), "
        f"{sum(x.size for x in jax.tree.leaves(state.params))} params, {per_param:.1f} state "
        f"bytes/param, mesh {dict(mesh.shape)}"
    )
    logging.info(
        f"mptrain: per device: state {on_one / 2**20:.1f} MiB; the compiled train step "
        f"{memory.temp_size_in_bytes / 2**20:.1f} MiB temporaries, "
        f"{memory.argument_size_in_bytes / 2**20:.1f} MiB arguments"
    )
    warmup = optim.warmup_steps(config)
    if warmup != config.optimizer.warmup_steps:
        logging.info(
            f"mptrain: optimizer.warmup_steps={config.optimizer.warmup_steps} is not shorter "
            f"than the run's updates; warming up over {warmup} instead"
        )
    for warning in report.warnings:
        logging.warning("mptrain: %s", warning)
    if start:
        logging.info("mptrain: resuming from step %d", start)


def create_writer(workdir: str | os.PathLike, *, is_main_process: bool = True):
    """TensorBoard events in `workdir` and absl log lines; on other processes, nothing."""
    from clu import metric_writers

    if not is_main_process:
        return metric_writers.MultiWriter([])
    return metric_writers.create_default_writer(os.fspath(workdir), asynchronous=True)


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
