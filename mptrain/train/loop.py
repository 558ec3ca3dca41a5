"""One run's live pieces, built once by `Trainer.setup`: the state, the compiled steps, the
writer, the checkpointer, and what the loop does on the host between steps (report a log step,
save, stop). What the step adds up on the device between two log steps is in `log_totals`."""

from __future__ import annotations

import dataclasses
import functools
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging

from mptrain import config as config_lib
from mptrain import errors, preemption, unused
from mptrain.recipe import fp8_names, numerics
from mptrain.recipe import loss_scale as loss_scale_lib
from mptrain.recipe import train_state as train_state_lib
from mptrain.record import curves, log_totals, numerics_log, samples, throughput
from mptrain.record import metrics as metrics_lib
from mptrain.train import checkpoint


def allow_transfers():
    # Sections that read device values on purpose say so: a caller can run the whole loop under
    # jax.transfer_guard("disallow") to prove the rest don't (log, eval, checkpoint, start-up do).
    return jax.transfer_guard("allow")


def average(eval_step: Callable, state: Any, batches: Any, prefix: str = "") -> dict:
    """Host floats: `eval_step(state, batch)`'s metrics averaged over `batches` (an iterable:
    each batch can go once its step has run), keys prefixed; scalars only."""
    metrics = [{k: v for k, v in eval_step(state, b).items() if jnp.ndim(v) == 0} for b in batches]
    sums = functools.reduce(lambda a, b: jax.tree.map(jnp.add, a, b), metrics)
    with allow_transfers():
        return {f"{prefix}{k}": float(v) / len(metrics) for k, v in jax.device_get(sums).items()}


def nonfinite_diagnostic(step: int, values: Mapping[str, float], scaler, max_skips: int, saved=0):
    """A message when training cannot recover from its non-finite steps, else None; `saved`:
    the step of the checkpoint the run stops with (after `step`, read a call late; 0: unsaid).

    `values` are a log step's scalars (`consecutive_skips`, `loss_scale`, `last_finite_loss`,
    `skipped_steps`); `scaler` is the state's loss scaler, whose `min_scale` is read (from the
    device) only after two non-finite steps in a row. The advice fits the case: a dynamic scale
    stuck at its minimum or a static one is a loss-scale overflow, and a run none of whose
    steps was finite from step 0 on never applied an update, so its learning rate is not the
    cause."""
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
        if stuck
        else f"{skips} non-finite steps in a row (config.max_consecutive_skips={max_skips})"
    )
    last = values["last_finite_loss"]
    seen = (
        f"last finite loss {last:.6g}" if math.isfinite(last) else "no step of this run was finite"
    )
    never = not math.isfinite(last) and skips == step  # from step 0: the params are the init's
    return (
        f"training went non-finite at step {step}: {why}; {seen}, loss scale {scale:g}, "
        f"{int(values['skipped_steps'])} steps skipped in all. The last good state was saved"
        + (f" (the checkpoint of step {saved}); " if saved else "; ")
        + f"{_remedy(scaler, scale, stuck, never)}, then run again"
    )


def _remedy(scaler, scale: float, stuck: bool, never: bool) -> str:
    """What to change, for `nonfinite_diagnostic`: what is true of this scaler and history."""
    causes = "lower the learning rate or check the data"
    if never:
        causes = (
            "check the data and the model's initialization (no update was applied, so the "
            "learning rate is not the cause)"
        )
    if stuck and scale > 1:
        return (
            "the gradients overflow even at the smallest loss scale allowed: lower "
            "config.loss_scale.min_scale, or train in bf16 (precision=bf16-mixed) without one"
        )
    if stuck:
        return (
            f"the gradients are not finite even at a loss scale of {scale:g}, so no loss scale "
            f"mends them: {causes}, or train in bf16 (precision=bf16-mixed: fp32's range)"
        )
    if isinstance(scaler, loss_scale_lib.DynamicLossScale):
        return (
            f"the dynamic loss scale was still backing off (its minimum is "
            f"{float(scaler.min_scale):g}): raise config.max_consecutive_skips, or lower "
            "config.loss_scale.init_scale"
        )
    if isinstance(scaler, loss_scale_lib.StaticLossScale) and scale > 1:
        return (
            f"the static loss scale {scale:g} may be what overflows: lower "
            f"config.loss_scale.init_scale or use config.loss_scale.kind=dynamic; else {causes}"
        )
    return causes


class EvalStopped(Exception):
    """A stop signal arrived during an evaluation (its message: the signal's name)."""


def _stoppable(eval_step: Callable) -> Callable:
    """`eval_step` that first checks for a stop signal: an evaluation takes one batch after
    another, minutes in all, and a preemption notice must not wait for its end."""

    def step(state, batch):
        if name := preemption.stop_requested():
            raise EvalStopped(name)
        return eval_step(state, batch)

    return step


@dataclasses.dataclass
class Run:
    """Everything one run needs, built once by `Trainer.setup`. `state` is the live state: the
    loop replaces it after every step, and hooks read it from here."""

    config: ml_collections.ConfigDict
    state: train_state_lib.TrainState
    start: int  # the step the run starts (or resumes) at
    train_source: Any
    eval_source: Any
    train_step: Callable  # compiled: (state, batch, totals) -> (state, metrics, totals)
    eval_step: Callable  # compiled: (state, batch) -> metrics
    totals: log_totals.LogTotals  # on the devices: the newest call's, which a checkpoint keeps
    checkpointer: checkpoint.Checkpointer
    saved_step: int | None = None  # the newest checkpoint's step
    writer: Any = None  # None: `metrics.create_writer`'s for this workdir
    hooks: list = dataclasses.field(default_factory=list)
    calls: numerics.Calls | None = None  # the module calls, when per-layer numerics are on
    workdir: Path = Path(".")
    started: float = dataclasses.field(default_factory=time.monotonic)
    drawn: float | None = None  # when `curves.png` was last redrawn (time.monotonic)
    pending: tuple | None = None  # the newest log step's (step, metrics, totals), not yet read
    fp8_saturated: Any = None  # the fp8 layers' clip counters at the last log step
    clock: throughput.Clock = dataclasses.field(default_factory=throughput.Clock)  # goodput

    def __post_init__(self):
        cfg, main = self.config, jax.process_index() == 0
        self.clock.spent["set-up and compiles"] = time.monotonic() - self.clock.began
        self.eval_step = _stoppable(self.eval_step)
        # The record resumes like the state: what a crash left past the step resumed from (a
        # log or eval line written after the newest checkpoint) goes, here and in TensorBoard.
        if self.writer is None:
            self.writer = metrics_lib.create_writer(
                self.workdir, is_main_process=main, restart=self.start + 1, config=cfg
            )
        if main:
            curves.forget_after(self.workdir, self.start, samples.SAMPLES)
        batches = getattr(self.eval_source, "num_batches", None)
        batches = batches if isinstance(batches, int) else None
        for line in unused.settings(cfg, batches, self.state.policy):
            logging.warning("mptrain: %s", line)  # settings that cannot do what they say
        self.progress = metrics_lib.ProgressLine(cfg.num_train_steps)
        self.meta = {"config": config_lib.to_dict(cfg), "policy": str(self.state.policy)}
        self.title = f"{cfg.model.name}, {cfg.precision}"  # of the curves
        self.meter = throughput.create_meter(
            cfg, self.state, self.start, self.clock, self.train_source
        )

    def report(self, step_no: int, metrics, totals, done: int) -> None:
        """Host-side. Writes a log step's metrics (and per-layer numerics); stops (exit 3) when
        training cannot recover."""
        with allow_transfers():
            metrics, totals = jax.device_get((metrics, totals))
            values = metrics_lib.scalars(metrics) | totals.to_scalars() | self.meter.values(step_no)
            if "fp8_amax" in metrics:  # names from the state's structure: no transfer
                names = fp8_names.counter_names(self.state.model_state)
                values |= fp8_names.log_values(metrics, names)
                self.warn_saturation(step_no, names, metrics["fp8_saturated"])
            self.record(step_no, values, history=metrics_lib.vectors(metrics))
            where = None
            if self.calls is not None:
                table = metrics["numerics"]
                where = numerics_log.report(
                    totals.numerics, table, step_no, self.calls, self.writer, self.workdir
                )
            diagnostic = nonfinite_diagnostic(
                step_no, values, self.state.loss_scale, self.config.max_consecutive_skips, done
            )
        if diagnostic:
            self.stop(done, errors.NonFiniteTraining(diagnostic + (f"; {where}" if where else "")))

    def warn_saturation(self, step_no: int, names: list[str], counts: Any) -> None:
        """Host-side. Names the fp8 layers whose values were clipped in two or more updates
        since the last log step (`fp8_names.clipped_again`)."""
        repeated, self.fp8_saturated = fp8_names.clipped_again(names, counts, self.fp8_saturated)
        if repeated:
            logging.warning(
                "mptrain: fp8 values clipped up to step %d in %s: the scale from the amax "
                "history lags the values",
                step_no,
                ", ".join(repeated),
            )

    def stepped(self, first: int, done: int, metrics, totals: log_totals.LogTotals) -> None:
        """Host-side, after dispatching the call that ran steps `first + 1 .. done`: reports the
        previous log step, whose values are read only now, after the next call is queued, so
        the device never waits for the host; then runs the hooks for each of those steps."""
        self.report_pending(done)
        self.totals, cfg = totals, self.config
        if done % cfg.log_every_steps == 0 or done == cfg.num_train_steps:
            self.pending = (done, metrics, totals)
        if not (done % cfg.eval_every_steps and done % cfg.checkpoint_every_steps):
            jax.block_until_ready(self.state)  # they wait for the step: train time, not theirs
        for step_no in range(first + 1, done + 1):  # clu's actions want every step
            for hook in self.hooks:
                try:
                    with self.clock.section(getattr(hook, "section", "evaluation and hooks")):
                        hook(step_no)
                except EvalStopped as stopped:  # the partial evaluation is dropped
                    logging.warning("mptrain: %s received; checkpointing step %d", stopped, done)
                    self.stop(done, errors.Preempted(done, str(stopped)))
        self.checkpointer.check()  # a background write that failed stops the run now

    def report_pending(self, done: int) -> None:
        """Host-side. Reports the newest log step if it is not reported yet."""
        if self.pending is not None:
            pending, self.pending = self.pending, None
            self.report(*pending, done)

    def record(self, step_no: int, values: dict, draw: bool = False, history=None) -> None:
        """Host-side. A step's scalars to TensorBoard, the progress line and the curves' data
        (`draw`: redraw `curves.png` too, at most once in `curves.REDRAW_S`: a redraw costs the
        loop 0.3-0.9 s of host time, which an evaluation every few seconds would pay again and
        again; the run's end always redraws). A record that cannot be written (a full disk, a
        history made read-only) stops the run with exit 1, after a checkpoint of the steps
        done where the disk still takes one: no training is lost to a record. `history`: the
        curves' data only."""
        self.writer.write_scalars(step_no, values)
        self.progress.update(step_no, values)
        try:
            curves.append(self.workdir, step_no, values | (history or {}))
            now = time.monotonic()
            if draw and now - (self.drawn or self.started) >= curves.REDRAW_S:
                curves.draw(self.workdir, self.title)
                self.drawn = now
        except errors.StorageError as error:
            with allow_transfers():
                done = int(self.state.step)
            self.stop(done, error)

    def finish(self, last_eval: dict | None, loss_unit: str | None = None) -> None:
        """Host-side, after the last step: the picture, and the summary on stdout (the eval
        loss in `loss_unit`, the Trainer's)."""
        curves.draw(self.workdir, self.title)
        if jax.process_index() == 0:
            seconds = time.monotonic() - self.started
            summary = curves.summary(
                self.workdir, self.state, last_eval, seconds, self.config, loss_unit=loss_unit
            )
            print(summary, flush=True)

    def save(self, step_no: int) -> None:
        """Host-side. Writes checkpoint `step_no` of `state`, with the log interval's totals so
        far, after the log line of a step it covers; a full disk stops the run (the
        checkpointer's `StorageError`)."""
        self.report_pending(step_no)
        with allow_transfers():
            totals = self.totals.replace(numerics=None)  # the scalars, not the layer tables
            meta = {"step": step_no, "log_totals": jax.device_get(totals).to_meta()}
            with self.clock.section("checkpoints"):
                self.checkpointer.save(step_no, self.state, meta | self.meta)
        self.saved_step = step_no

    def stop(self, done: int, error: errors.StopTraining) -> None:
        """Saves step `done` unless it is saved already, then raises `error`."""
        if self.saved_step != done:
            self.save(done)
        self.checkpointer.wait()
        raise error

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info) -> None:
        with self.clock.section("checkpoints"):
            self.checkpointer.close()  # waits for pending saves
        if exc_info[0] is None and jax.process_index() == 0:  # a run that ended: its goodput
            print(f"mptrain: {self.clock.summary()}", flush=True)
            self.writer.write_scalars(int(self.state.step), {"goodput": self.clock.goodput()})
        self.writer.flush()
        self.writer.close()


def call_boundary(step: int, steps_per_call: int) -> int:
    """`step`, where a run starts or resumes, if calls of `steps_per_call` steps can start there;
    else a `ConfigError` naming the key."""
    if step % steps_per_call:
        raise errors.ConfigError(
            f"config.steps_per_call={steps_per_call}: the run resumes at step {step}, which is "
            "not a call boundary; use a steps_per_call that divides it"
        )
    return step


def steps(train_step: Callable, count: int) -> Callable:
    """`train_step(state, batch, totals)` run `count` times in one call, over `count` batches
    stacked on a leading axis (a `lax.scan`: one dispatch, one program). Returns the last
    step's metrics; the totals add up all of them. With `count == 1`, `train_step` itself."""
    if count == 1:
        return train_step

    def run_steps(state, batches, totals):
        def body(carry, batch):
            state, totals = carry
            state, metrics, totals = train_step(state, batch, totals)
            return (state, totals), metrics

        (state, totals), metrics = jax.lax.scan(body, (state, totals), batches)
        return state, jax.tree.map(lambda m: m[-1], metrics), totals

    return run_steps


def prefetch_depth(setting: int | None, platform: str) -> int:
    """`config.data.prefetch`, with None resolved for the devices' `platform`: 2 on an
    accelerator, where the host makes the next batches while the device runs the step; 0 on a
    CPU, where the host runs the step."""
    if setting is not None:
        return setting
    return 0 if platform == "cpu" else 2


class Prefetcher:
    """Batches made on the devices ahead of the step, in order, by one background thread.

    `fetch(i)` puts the batch (or stack of batches) that starts at step `i` on the devices;
    iterating yields `fetch(i)` for each `i` in `starts`. With `depth > 0` a thread keeps up to
    `depth` of them ready, so the host's batch building and the copy overlap the running step;
    with 0 each is made when asked for. Either way batch `i` is the same arrays, so prefetching
    changes no result. An error in the thread is raised where the batch is asked for.
    """

    def __init__(self, fetch: Callable[[int], Any], starts: range, depth: int, clock=None):
        self.fetch, self.starts, self.depth = fetch, starts, depth
        self.clock = clock or throughput.Clock()  # the time the loop waits for a batch
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread = None

    def _fill(self) -> None:
        for i in self.starts:
            try:
                item = (self.fetch(i), None)
            except BaseException as e:  # handed to the consumer, which raises it
                item = (None, e)
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if self._stop.is_set() or item[1] is not None:
                return

    def __iter__(self):
        if self.depth == 0:
            for i in self.starts:
                with self.clock.section("data waits"):
                    batch = self.fetch(i)
                yield batch
            return
        self._thread = threading.Thread(target=self._fill, name="mptrain-prefetch", daemon=True)
        self._thread.start()
        for _ in self.starts:
            with self.clock.section("data waits"):
                batch, error = self._queue.get()
            if error is not None:
                raise error
            yield batch

    def close(self) -> None:
        """Stops the thread (a run that ends early leaves batches unasked for)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
