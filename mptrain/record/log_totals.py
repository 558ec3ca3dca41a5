"""What the train step adds up on the device between two log steps (`LogTotals`), and how it
survives a resume.

The step adds each applied step's loss to the interval's sum; the host reads the totals only on
log steps. A checkpoint's meta keeps the interval's sums so far (`LogTotals.to_meta`), and a
resumed run starts from them (`make_totals`, then `totals(saved=...)`): the loss logged after a
resume is the mean over the same steps as in a run that never stopped.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from mptrain.recipe import numerics
from mptrain.record import numerics_log


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
    numerics: Any = None  # a `numerics_log.Log` when per-layer numerics are recorded
    # which steps are log steps: every `every`-th, and the run's `last`. Values the step reads,
    # not constants of its program: runs that differ only in `log_every_steps` or
    # `num_train_steps` compile the same step (a test suite's tiny runs, a longer resume).
    every: Any = 1
    last: Any = 0

    @classmethod
    def zeros(cls, numerics: Any = None, every: int = 1, last: int = 0) -> LogTotals:
        """Fresh totals (host scalars; under `jax.jit`, constants of the program)."""
        zero_f, zero_i = np.float32(0), np.int32(0)
        interval = np.int32(every), np.int32(last)
        return cls(zero_f, zero_i, zero_i, np.float32(np.nan), numerics, *interval)

    def is_log_step(self, step: jax.Array) -> jax.Array:
        """Whether `step` (0-based, the one being taken) ends on a log step."""
        return ((step + 1) % self.every == 0) | (step + 1 == self.last)

    @classmethod
    def on_devices(
        cls, sharding: Any, numerics: Any = None, saved: dict | None = None, **interval: int
    ):
        """Fresh totals made on the devices of `sharding` (a host NaN would not pass
        `device_put`'s check that every process puts the same value); with `saved`
        (`to_meta`'s, from a checkpoint), the interval's sums and the run of non-finite steps
        so far; `interval`: `every` and `last`. Per-layer numerics tables restart at a resume."""
        values = {}
        if saved:
            last = saved.get("last_finite_loss")
            values = {
                "loss_sum": np.float32(saved["loss_sum"]),
                "applied_steps": np.int32(saved["applied_steps"]),
                "consecutive_skips": np.int32(saved["consecutive_skips"]),
                "last_finite_loss": np.float32(np.nan if last is None else last),
            }
        fresh = lambda: cls.zeros(numerics, **interval).replace(**values)
        return jax.jit(fresh, out_shardings=sharding)()

    def add(self, step: jax.Array, metrics: dict[str, jax.Array]) -> LogTotals:
        """Adds step `step`'s metrics: its (fp32) loss counts only if its update was applied;
        with per-layer numerics, its table and where it first went non-finite are logged."""
        loss, applied, log = metrics["loss"], metrics["applied"], self.numerics
        if log is not None:
            log = log.record(step, applied, metrics["numerics"], metrics["numerics_origin"])
        return self.replace(
            numerics=log,
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

    def to_meta(self) -> dict[str, Any]:
        """Fetched totals as a checkpoint's meta keeps them (JSON: NaN as None), for a resumed
        run to start its interval from (`on_devices(saved=)`)."""
        last = float(self.last_finite_loss)
        return {
            "loss_sum": float(self.loss_sum),
            "applied_steps": int(self.applied_steps),
            "consecutive_skips": int(self.consecutive_skips),
            "last_finite_loss": last if math.isfinite(last) else None,
        }

    def to_scalars(self) -> dict[str, float]:
        """Host floats from fetched totals; `loss` (the interval's mean) only if a step applied."""
        values = {
            "consecutive_skips": float(self.consecutive_skips),
            "last_finite_loss": float(self.last_finite_loss),
        }
        if int(self.applied_steps):
            values["loss"] = float(self.loss_sum) / int(self.applied_steps)
        return values


def make_totals(config, sharding: Any, loss_fn: Callable, state: Any, batch: Any):
    """`(totals, calls)`: `totals()` makes a run's fresh log totals on `sharding`'s devices
    (jitted: `jax.eval_shape(totals)` gives their shapes); `calls`, the per-layer numerics'
    module calls of `loss_fn` on `state` and one `batch` (arrays or abstract), None without
    `config.numerics.per_layer`."""
    calls = numerics.loss_calls(loss_fn, state, batch) if config.numerics.per_layer else None
    log = calls and numerics_log.Log.zeros(len(calls.paths), config.log_every_steps)
    interval = {"every": config.log_every_steps, "last": config.num_train_steps}
    return functools.partial(LogTotals.on_devices, sharding, log, **interval), calls
