"""The Trainer: host-side hooks, traced hooks, and the loop that runs them.

Subclass it and override a few hooks; everything else (precision, loss scaling, checkpoints,
metrics, resuming) comes with it.

- Host-side hooks run once and may do I/O: `build_model`, `build_optimizer`, `build_datasets`,
  `build_hooks`.
- Traced hooks run under `jax.jit`, must be pure and read only immutable attributes
  (`self.config`, `self.model`, `self.policy`): `loss_fn`, `eval_fn`.
- Drivers: `init_state`, `train_and_evaluate`.

The loop dispatches step n+1 before it reads the metrics of step n, so the host never waits on
the device except on log, eval and checkpoint steps; the train step is jitted once, with the
state donated.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
from absl import logging

import mptrain
from mptrain import config as config_lib
from mptrain import loss_scale as loss_scale_lib
from mptrain import optim, precision, sharding, step
from mptrain import train_state as train_state_lib


def _allow_transfers():
    # Sections that read device values on purpose (log, eval, checkpoint, start-up) say so; a
    # caller can run the whole loop under jax.transfer_guard("disallow") to prove the rest don't.
    return jax.transfer_guard("allow")


def classification_metrics(logits: jax.Array, targets: jax.Array) -> dict[str, jax.Array]:
    """Mean cross-entropy (nats) and accuracy over integer targets, computed from fp32 logits."""
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()
    accuracy = (jnp.argmax(logits, -1) == targets).astype(jnp.float32).mean()
    return {"loss": loss, "accuracy": accuracy}


class Trainer:
    """Trains `config.model` on `config.data` under `config.precision`; see the module doc."""

    def __init__(self, config: ml_collections.ConfigDict, workdir: str | Path):
        self.config = config
        self.workdir = Path(workdir)
        self.policy = precision.get_policy(config.precision)
        data, fsdp = sharding.mesh_shape(config)
        self.mesh = sharding.create_mesh(config) if data * fsdp > 1 else None
        self.model = self.build_model()
        self.tx, self.schedule = self.build_optimizer()
        self.train_step_traces = 0  # how often the train step was traced (= compiled)

    # ---- host-side hooks: run once, may do I/O --------------------------------------------

    def build_model(self) -> nn.Module:
        """Host-side. The flax module; by default `mptrain.models.<config.model.name>`."""
        module = importlib.import_module(f"mptrain.models.{self.config.model.name}")
        return module.create_model(self.config.model, self.policy.compute_dtype)

    def build_optimizer(self) -> tuple[optax.GradientTransformation, optax.Schedule]:
        """Host-side. The optax transformation and its learning-rate schedule (for logging)."""
        return optim.make_optimizer(self.config)

    def build_datasets(self) -> tuple[Any, Any]:
        """Host-side. `(train, eval)` sources whose `get_batch(i)` is a pure function of i."""
        from mptrain import data

        return data.create_sources(self.config)

    def build_hooks(self, writer, checkpointer) -> list:
        """Host-side. clu periodic actions called after every step; extend via `super()`."""
        from clu import periodic_actions

        cfg = self.config
        last = [cfg.num_train_steps]
        return [
            periodic_actions.ReportProgress(
                num_train_steps=cfg.num_train_steps,
                writer=writer,
                every_steps=cfg.log_every_steps,
                every_secs=None,
            ),
            periodic_actions.PeriodicCallback(
                every_steps=cfg.eval_every_steps,
                on_steps=last,
                callback_fn=lambda step, t: self.evaluate(self.state, step, writer),
            ),
            periodic_actions.PeriodicCallback(
                every_steps=cfg.checkpoint_every_steps,
                on_steps=last,
                callback_fn=lambda step, t: self.save_checkpoint(checkpointer, self.state, step),
            ),
        ]

    def init_variables(self, rng: jax.Array, batch: dict[str, Any]) -> dict[str, Any]:
        """Traced once at start. The model's variables (params plus any state collections)."""
        return self.model.init({"params": rng, "dropout": rng}, batch["inputs"], train=False)

    # ---- traced hooks: pure, run under jit ------------------------------------------------

    def loss_fn(self, params, model_state, batch, rng):
        """Traced. `(loss, (new_model_state, aux))` from compute-dtype params and batch."""
        variables = {"params": params, **model_state}
        if model_state:
            logits, new_state = self.model.apply(
                variables,
                batch["inputs"],
                train=True,
                rngs={"dropout": rng},
                mutable=list(model_state),
            )
        else:
            logits = self.model.apply(variables, batch["inputs"], train=True, rngs={"dropout": rng})
            new_state = model_state
        metrics = classification_metrics(logits, batch["targets"])
        return metrics.pop("loss"), (new_state, metrics)

    def eval_fn(self, params, model_state, batch) -> dict[str, jax.Array]:
        """Traced. Scalar metrics of one eval batch (averaged over `config.eval_steps`).

        The default runs the model with `train=False` and reports loss and accuracy. A subclass
        that overrides only `loss_fn` gets that loss and its aux instead (with a fixed rng), so a
        new model needs no eval code of its own.
        """
        if type(self).loss_fn is not Trainer.loss_fn:
            loss, (_, aux) = self.loss_fn(params, model_state, batch, jax.random.key(0))
            return {"loss": loss, **aux}
        logits = self.model.apply({"params": params, **model_state}, batch["inputs"], train=False)
        return classification_metrics(logits, batch["targets"])

    # ---- driver -------------------------------------------------------------------------

    def create_loss_scale(self):
        hparams = dict(self.config.loss_scale)
        return loss_scale_lib.create_loss_scale(hparams.pop("kind"), self.policy, **hparams)

    def init_state(self) -> train_state_lib.TrainState:
        """The step-0 state: fp32 init, then stored per the policy, with the loss scaler."""
        cfg = self.config
        init_rng, state_rng = jax.random.split(jax.random.key(cfg.seed))
        sample = jax.tree.map(lambda x: x[:1], self.train_source.get_batch(0))
        variables = jax.jit(self.init_variables)(init_rng, sample)
        variables = dict(variables)
        params = variables.pop("params")
        return train_state_lib.TrainState.create(
            apply_fn=self.model.apply,
            params=params,
            tx=self.tx,
            policy=self.policy,
            loss_scale=self.create_loss_scale(),
            rng=state_rng,
            model_state=variables,
            param_rounding=cfg.param_rounding,
        )

    def make_train_step(self):
        """The jittable step the loop runs: the recipe plus device-side metric accumulation."""
        recipe = step.make_train_step(self.loss_fn)
        schedule = self.schedule

        def train_step(state, batch, totals):
            self.train_step_traces += 1  # runs only while tracing
            new_state, metrics = recipe(state, batch)
            if self.mesh is not None:  # the new state keeps the old one's layout
                shardings = sharding.state_shardings(self.mesh, state)
                new_state = jax.lax.with_sharding_constraint(new_state, shardings)
            metrics["learning_rate"] = schedule(optim.optimizer_count(state.opt_state))
            finite = metrics["applied"]
            totals = {
                "loss_sum": totals["loss_sum"] + jnp.where(finite, metrics["loss"], 0.0),
                "finite_steps": totals["finite_steps"] + finite.astype(jnp.int32),
                "consecutive_skips": jnp.where(finite, 0, totals["consecutive_skips"] + 1),
                "last_finite_loss": jnp.where(finite, metrics["loss"], totals["last_finite_loss"]),
            }
            return new_state, metrics, totals

        return train_step

    def device_batch(self, batch: dict[str, np.ndarray]) -> Any:
        """Host-side. Puts a host batch on the device(s), split over the mesh if there is one."""
        if self.mesh is None:
            return jax.device_put(batch)
        return jax.device_put(batch, sharding.batch_sharding(self.mesh))

    def _batch(self, source, index: int) -> Any:
        return self.device_batch(source.get_batch(index))

    def evaluate(self, state, step_no: int, writer) -> dict[str, float]:
        """Host-side. Averages `eval_fn` over `config.eval_steps` batches and writes it."""
        sums = None
        for i in range(self.config.eval_steps):
            metrics = self._eval_step(state, self._batch(self.eval_source, i))
            sums = metrics if sums is None else jax.tree.map(jnp.add, sums, metrics)
        with _allow_transfers():
            values = {
                f"eval_{k}": float(v) / self.config.eval_steps
                for k, v in jax.device_get(sums).items()
            }
        writer.write_scalars(step_no, values)
        self.last_eval = values
        self._progress.update(step_no, values)
        return values

    def checkpoint_meta(self, step_no: int) -> dict[str, Any]:
        return {
            "step": step_no,
            "config": config_lib.to_dict(self.config),
            "policy": str(self.policy),
            "version": mptrain.__version__,
        }

    def save_checkpoint(self, checkpointer, state, step_no: int) -> None:
        """Host-side. Writes checkpoint `step_no`; a full or read-only disk stops the run."""
        with _allow_transfers():
            try:
                checkpointer.save(step_no, state, self.checkpoint_meta(step_no))
            except OSError as e:
                raise StorageError(
                    f"could not write the checkpoint for step {step_no} in "
                    f"{checkpointer.directory}: {e.strerror or e}; the checkpoints already "
                    f"there are intact (steps {checkpointer.all_steps()})"
                ) from e
        self._saved_step = step_no

    def _write_train_metrics(self, writer, step_no, metrics, totals) -> dict[str, float]:
        with _allow_transfers():
            metrics, totals = jax.device_get((metrics, totals))
        from mptrain import metrics as metrics_lib

        values = metrics_lib.scalars(metrics)
        finite_steps = int(totals["finite_steps"])
        if finite_steps:
            values["loss"] = float(totals["loss_sum"]) / finite_steps  # mean since last log
        values["consecutive_skips"] = float(totals["consecutive_skips"])
        values["last_finite_loss"] = float(totals["last_finite_loss"])
        writer.write_scalars(step_no, values)
        self._progress.update(step_no, values)
        return values

    def _check_finite(self, step_no: int, values: dict[str, float]) -> str | None:
        """A diagnostic when training cannot recover from non-finite steps, else None."""
        skips = int(values["consecutive_skips"])
        if skips == 0:
            return None
        scale = values["loss_scale"]
        scaler = self.state.loss_scale
        stuck = isinstance(scaler, loss_scale_lib.DynamicLossScale) and skips >= 2
        with _allow_transfers():
            stuck = stuck and scale <= float(scaler.min_scale)
        if skips < self.config.max_consecutive_skips and not stuck:
            return None
        why = (
            f"the dynamic loss scale is stuck at its minimum {scale:g}"
            if stuck and skips < self.config.max_consecutive_skips
            else f"{skips} non-finite steps in a row (config.max_consecutive_skips="
            f"{self.config.max_consecutive_skips})"
        )
        return (
            f"training went non-finite at step {step_no}: {why}; last finite loss "
            f"{values['last_finite_loss']:.6g}, loss scale {scale:g}, "
            f"{int(values['skipped_steps'])} steps skipped in all. The last good state was "
            "saved; lower the learning rate or check the data, then run again"
        )

    def train_and_evaluate(self) -> train_state_lib.TrainState:
        """Trains to `config.num_train_steps`, resuming from the newest checkpoint if any.

        Raises `Preempted` after checkpointing when SIGTERM arrives, `NonFiniteTraining` when
        training cannot recover from non-finite steps, `WorkdirError` when the workdir is in
        use, unwritable, or holds checkpoints of an incompatible run, `StorageError` when a
        checkpoint cannot be written.
        """
        with _allow_transfers():  # data problems surface before anything touches the workdir
            self.train_source, self.eval_source = self.build_datasets()
        with _workdir_lock(self.workdir), _PreemptionFlag() as preemption:
            return self._train(preemption)

    def _restore(self, checkpointer, state):
        from mptrain import checkpoint

        try:
            restored = checkpointer.restore(state)
        except checkpoint.CheckpointMismatchError as e:
            raise WorkdirError(
                f"the checkpoints in {checkpointer.directory} belong to a different model, "
                f"optimizer or precision: {e}. Use another --workdir to start a new run"
            ) from None
        except checkpoint.InvalidCheckpointError as e:
            raise WorkdirError(str(e)) from None
        if restored is None:
            return state, None
        state, meta = restored
        saved_policy = meta.get("policy")
        if saved_policy is not None and saved_policy != str(self.policy):
            raise WorkdirError(
                f"the checkpoint at step {meta.get('step')} was trained with precision "
                f"'{saved_policy}', the config asks for '{self.policy}'; resuming would recast "
                "the master params. Use another --workdir, or the old precision"
            )
        changes = _config_changes(meta.get("config") or {}, config_lib.to_dict(self.config))
        for key, (old, new) in changes.items():
            logging.info("mptrain: config.%s changed since the checkpoint: %r -> %r", key, old, new)
        return state, meta

    def _train(self, preemption) -> train_state_lib.TrainState:
        from mptrain import checkpoint
        from mptrain import metrics as metrics_lib

        cfg = self.config
        preemption.exit_now_ok = True  # until the first step: nothing that a SIGTERM could lose
        with _allow_transfers():
            state = self.init_state()
            if self.mesh is not None:
                state = jax.device_put(state, sharding.state_shardings(self.mesh, state))
            checkpointer = checkpoint.Checkpointer(
                self.workdir / "checkpoints", max_to_keep=cfg.max_checkpoints_to_keep
            )
            state, meta = self._restore(checkpointer, state)
            start = int(state.step)
            self._saved_step = start if meta is not None else None
            checkpoint.write_json(self.workdir / "config.json", config_lib.to_dict(cfg))
            zero_totals = jax.device_put(
                {
                    "loss_sum": np.float32(0),
                    "finite_steps": np.int32(0),
                    "consecutive_skips": np.int32(0),
                    "last_finite_loss": np.float32(np.nan),
                },
                None if self.mesh is None else sharding.replicated(self.mesh),
            )
        writer = metrics_lib.create_writer(self.workdir, is_main_process=jax.process_index() == 0)
        self._progress = metrics_lib.ProgressLine(cfg.num_train_steps)
        self._log_start(state, start)
        self.state = state
        # Compile everything up front, while a SIGTERM can still end the run at once; the
        # loop then never stops to compile.
        train_step = jax.jit(self.make_train_step(), donate_argnums=0)
        train_step = train_step.lower(state, self._batch(self.train_source, start), zero_totals)
        train_step = train_step.compile()
        eval_step = jax.jit(step.make_eval_step(self.eval_fn))
        self._eval_step = eval_step.lower(state, self._batch(self.eval_source, 0)).compile()
        carried = ("consecutive_skips", "last_finite_loss")  # these span log intervals
        keep_last = jax.jit(
            lambda t: {k: v if k in carried else jnp.zeros_like(v) for k, v in t.items()}
        )
        keep_last = keep_last.lower(zero_totals).compile()
        hooks = self.build_hooks(writer, checkpointer)
        preemption.exit_now_ok = False

        def stop(done: int, error: Exception):
            if self._saved_step != done:
                self.save_checkpoint(checkpointer, self.state, done)
            checkpointer.wait()
            raise error

        def report(pending, done: int):
            """Writes a log step's metrics; stops (exit 3) if training cannot recover."""
            values = self._write_train_metrics(writer, *pending)
            diagnostic = self._check_finite(pending[0], values)
            if diagnostic:
                stop(done, NonFiniteTraining(diagnostic))

        try:
            totals, pending = zero_totals, None
            done = start
            if preemption.requested:
                stop(done, Preempted(done))
            for step_no in range(start, cfg.num_train_steps):
                batch = self._batch(self.train_source, step_no)
                self.state, metrics, totals = train_step(self.state, batch, totals)
                done = step_no + 1
                if pending is not None:  # the previous log step's values, read after dispatch
                    report(pending, done)
                    pending = None
                if done % cfg.log_every_steps == 0 or done == cfg.num_train_steps:
                    pending, totals = (done, metrics, totals), keep_last(totals)
                for hook in hooks:
                    hook(done)
                if preemption.requested:
                    logging.warning("mptrain: SIGTERM received; checkpointing step %d", done)
                    stop(done, Preempted(done))
            if pending is not None:
                report(pending, done)
        finally:
            checkpointer.wait()
            checkpointer.close()
            writer.flush()
            writer.close()
        return self.state

    def _log_start(self, state, start: int) -> None:
        with _allow_transfers():
            scaler = state.loss_scale
            n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(state.params))
            per_param = optim.state_bytes_per_param(state.params, state.opt_state)
            scale = float(scaler.loss_scale)
        logging.info(
            "mptrain: precision %s, loss scale %s (scale %g), %d params, %.1f state bytes/param",
            self.policy,
            type(scaler).__name__,
            scale,
            n_params,
            per_param,
        )
        for warning in optim.check_state_dtypes(self.policy, self.config):
            logging.warning("mptrain: %s", warning)
        if start:
            logging.info("mptrain: resuming from step %d", start)


class StopTraining(Exception):
    """Training stopped before `num_train_steps`; `exit_code` is what `main.py` exits with."""

    exit_code = 1


class Preempted(StopTraining):
    """SIGTERM arrived; a checkpoint was written. Run the same command again to resume."""

    exit_code = 75

    def __init__(self, step: int):
        super().__init__(
            f"preempted (SIGTERM) at step {step}; checkpoint written, run the same command "
            "again to resume"
        )
        self.step = step


class NonFiniteTraining(StopTraining):
    """Non-finite steps went on past `config.max_consecutive_skips` (or the scale bottomed out)."""

    exit_code = 3


class WorkdirError(StopTraining):
    """The workdir is in use, unwritable, or holds checkpoints this config cannot resume."""

    exit_code = 2


class StorageError(StopTraining):
    """A checkpoint could not be written (disk full, read-only); older ones are intact."""

    exit_code = 1


def _config_changes(old: dict, new: dict, prefix: str = "") -> dict[str, tuple[Any, Any]]:
    changes = {}
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes |= _config_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes[f"{prefix}{key}"] = (a, b)
    return changes


@contextlib.contextmanager
def _workdir_lock(workdir: Path):
    """Holds an exclusive lock on `<workdir>/.lock` for the run; a second run is refused.

    The lock is an flock, so the kernel drops it when the process dies, even under kill -9.
    """
    if jax.process_index() != 0:
        yield
        return
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        handle = open(workdir / ".lock", "a+")  # noqa: SIM115 (held for the whole run)
    except OSError as e:
        raise WorkdirError(f"workdir {workdir} is not writable: {e.strerror or e}") from None
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            raise WorkdirError(
                f"workdir {workdir} is in use by another run ({holder}); wait for it to end "
                "or use another --workdir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        yield
    finally:
        handle.close()  # closing releases the lock


class _PreemptionFlag:
    """Turns SIGTERM into a flag that the loop checks after each step (main thread only).

    Python runs signal handlers only between bytecodes, so a SIGTERM that lands while XLA
    compiles would wait for the compiler. The wakeup fd is written by the C-level handler at
    once; a watcher thread reads it and, while `exit_now_ok` says that nothing is unsaved (the
    start-up: restore and compilation), exits with 75 straight away.
    """

    def __init__(self):
        self.requested = False
        self.exit_now_ok = False
        self._previous = None

    def _handle(self, signum, frame):
        del signum, frame
        self.requested = True

    def _watch(self, read_fd: int) -> None:
        while data := os.read(read_fd, 64):
            if signal.SIGTERM in data:
                self.requested = True
                if self.exit_now_ok:
                    sys.stderr.write(
                        "mptrain: preempted (SIGTERM) while starting up; nothing new to save, "
                        "run the same command again to resume\n"
                    )
                    sys.stderr.flush()
                    os._exit(Preempted.exit_code)
        os.close(read_fd)

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            read_fd, self._write_fd = os.pipe()
            os.set_blocking(self._write_fd, False)
            self._previous_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
            threading.Thread(target=self._watch, args=(read_fd,), daemon=True).start()
        return self

    def __exit__(self, *exc_info):
        self.exit_now_ok = False
        if self._previous is not None:
            signal.set_wakeup_fd(self._previous_fd)
            os.close(self._write_fd)  # the watcher reads EOF and ends
            signal.signal(signal.SIGTERM, self._previous)


def import_trainer(spec: str) -> type[Trainer]:
    """Imports `"package.module:Class"`; errors name the spec."""
    module_name, sep, class_name = spec.partition(":")
    if not sep or not module_name or not class_name:
        raise config_lib.ConfigError(
            f"config.trainer={spec!r}: expected 'package.module:Class', e.g. "
            "'mptrain.trainer:Trainer'"
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise config_lib.ConfigError(f"config.trainer={spec!r}: cannot import: {e}") from None
    cls = getattr(module, class_name, None)
    if not (isinstance(cls, type) and issubclass(cls, Trainer)):
        raise config_lib.ConfigError(
            f"config.trainer={spec!r}: {module_name} has no Trainer subclass {class_name!r}"
        )
    return cls


def run(config: ml_collections.ConfigDict, workdir: str | Path) -> train_state_lib.TrainState:
    """What `python -m mptrain.main` does, from Python: validate, build the trainer, train."""
    config_lib.validate(config)
    trainer_cls = import_trainer(config.trainer)
    started = time.monotonic()
    state = trainer_cls(config, workdir).train_and_evaluate()
    logging.info("mptrain: done in %.1f s", time.monotonic() - started)
    return state
