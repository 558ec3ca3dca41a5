"""The Trainer: host-side hooks, traced hooks, and the loop that runs them.

Subclass it and override a few hooks; everything else (precision, loss scaling, checkpoints,
metrics, resuming) comes with it.

- Host-side hooks run once and may do I/O: `build_model`, `build_optimizer`, `build_datasets`,
  `build_hooks`, `init_variables`.
- Traced hooks run under `jax.jit`, must be pure and read only immutable attributes
  (`self.config`, `self.model`, `self.policy`, `self.mesh`): `loss_fn`, `eval_fn`.
- Drivers: `init_state`, `evaluate`, `setup`, `train_and_evaluate`.
- `loss_unit`: what the run summary calls the eval loss's unit. The built-in `loss_fn` (a
  cross-entropy) has the zoo's (`models.loss_unit`: "nats/byte" for the LM on byte-level text,
  also shown in bits/byte, else "nats"); a subclass with its own `loss_fn` has None (no unit
  printed) unless it sets `loss_unit` itself (a class attribute).

`Trainer(config, workdir, devices=..., resolved=...)` runs with what validation built
(`config.validate` returns it: the policy, the mesh, the model, the optimizer; `mptrain.run`,
`mptrain.plan` and export hand it over), so nothing is built twice; without it the Trainer
builds them itself, for `devices` (default: JAX's own; `mptrain.plan` passes the compile-only
devices of an accelerator that is not here): the mesh takes them, and every choice made by
backend (attention "auto") follows them, not this host.

A run is set up once (`setup` returns a `Run` holding the sources, the state, the compiled
steps, the writer, the checkpointer and the hooks), then a short loop steps it. The loop
dispatches step n+1 before it reads the metrics of step n, so the host never waits on the device
except on log, eval and checkpoint steps; the train step is compiled once, with the state donated.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import ml_collections
import optax
from absl import logging

from mptrain import config as config_lib
from mptrain import data, errors, files, models, optim, runtime
from mptrain.inspect import audit
from mptrain.models import layers
from mptrain.models import nnx as nnx_models
from mptrain.optim import schedules
from mptrain.parallel import axes as axes_lib
from mptrain.parallel import layout, sharding
from mptrain.recipe import loss_scale as loss_scale_lib
from mptrain.recipe import step
from mptrain.recipe import train_state as train_state_lib
from mptrain.record import log_totals, loggers, profile, samples, throughput
from mptrain.record import metrics as metrics_lib
from mptrain.train import adapters, checkpoint, init_from, loop


class Trainer:
    """Trains `config.model` on `config.data` under `config.precision`; see the module doc."""

    def __init__(
        self, config: ml_collections.ConfigDict, workdir: str | Path, *, devices=None,
        resolved: config_lib.Resolved | None = None,
    ):  # fmt: skip
        files.check_local("workdir", workdir)
        self.config, self.workdir, self.resolved = config, Path(workdir), resolved
        self.policy = resolved.policy if resolved else config_lib.policy_of(config)
        loggers.check(config)  # a missing extra stops the run before anything compiles
        # see the module doc; 1x1x1x1x1 on one device
        if resolved is None:
            self.mesh = layout.create_mesh(config.mesh, config.batch_size, devices)
        else:
            self.mesh = resolved.mesh
        self.model = nnx_models.wrap(self.build_model())  # an NNX module behind linen calls
        self.tx, self.schedule = self.build_optimizer()
        self.last_eval: dict[str, float] | None = None  # the newest evaluation's metrics

    @property
    def loss_unit(self) -> str | None:
        """The eval loss's unit in the run summary (None: no unit); see the module doc."""
        return None if type(self).loss_fn is not Trainer.loss_fn else models.loss_unit(self.config)

    # ---- host-side hooks: run once, may do I/O --------------------------------------------

    def build_model(self) -> nn.Module:
        """Host-side. The flax module; by default `mptrain.models.<config.model.name>` (the one
        validation built, where the Trainer was handed it)."""
        if self.resolved is not None and self.resolved.model is not None:
            return self.resolved.model
        cfg, devices = self.config, self.mesh.devices.flat
        return models.create(cfg.model, self.policy, devices, cfg.get("loss"), cfg.get("lora"))

    def build_optimizer(self) -> tuple[optax.GradientTransformation, optax.Schedule]:
        """Host-side. The optax transformation and its learning-rate schedule (for logging)."""
        if self.resolved is not None:
            return self.resolved.tx, self.resolved.schedule
        cfg = self.config
        return optim.make_optimizer(cfg.optimizer, cfg.num_train_steps, seed=cfg.seed)

    def build_datasets(self) -> tuple[Any, Any]:
        """Host-side. `(train, eval)` sources whose `get_batch(i)` is a pure function of i."""
        return data.create_sources(self.config)

    def build_hooks(self, run: loop.Run) -> list:
        """Host-side. clu periodic actions called with the step after every step; they read the
        live state as `run.state`. Extend via `super()`."""
        periodic_actions = metrics_lib.import_clu("periodic_actions")
        cfg, last = self.config, [self.config.num_train_steps]
        sample = samples.create(self, run)  # what the model says (`config.sample`)

        def evaluate(step: int, t: float) -> None:  # clu passes these by name
            self.last_eval = self.evaluate(run.state, run.eval_source, run.eval_step)
            run.record(step, self.last_eval, draw=True)
            sample(step)

        evaluations = (  # none without an eval split (data.eval_fraction=0)
            [] if run.eval_source is None else [periodic_actions.PeriodicCallback(
                every_steps=cfg.eval_every_steps, on_steps=last, callback_fn=evaluate
            )]
        )  # fmt: skip
        return [  # the speed of the steps is `Run.report`'s (`throughput`)
            *evaluations,
            periodic_actions.PeriodicCallback(
                every_steps=cfg.checkpoint_every_steps,
                on_steps=last,
                callback_fn=lambda step, t: run.save(step),
            ),
            profile.Tracer(run),  # the steps config.profile names, traced
        ]

    def init_variables(self, rng: jax.Array, batch: dict[str, Any]) -> dict[str, Any]:
        """Traced once at start. The model's variables (params plus any state collections), as
        `model.init` returns them: each param boxed with the logical axes it declared
        (`parallel.axes`), by which the state is split on the mesh."""
        return self.model.init({"params": rng, "dropout": rng}, batch["inputs"], train=False)

    # ---- traced hooks: pure, run under jit ------------------------------------------------

    def loss_fn(self, params, model_state, batch, rng):
        """Traced. `(loss, (new_model_state, aux))` from compute-dtype params and batch. The
        default's aux is empty: an accuracy (an argmax over the logits) in every train step cost
        a small LM a tenth of its step, for a number the evaluation reports anyway."""
        variables, mutable = {"params": params, **model_state}, list(model_state) or False
        out = _apply(self.model, variables, batch, True, rngs={"dropout": rng}, mutable=mutable)
        out, new_state = out if mutable else (out, model_state)
        return _loss(self.policy, out, batch["targets"]), (new_state, model_metrics(out))

    def eval_fn(self, params, model_state, batch) -> dict[str, jax.Array]:
        """Traced. Scalar metrics of one eval batch (averaged over `config.eval_steps`).

        The default runs the model with `train=False` and reports loss and accuracy. A subclass
        that overrides only `loss_fn` gets that loss and its aux instead (with a fixed rng), so a
        new model needs no eval code of its own.
        """
        if type(self).loss_fn is not Trainer.loss_fn:
            loss, (_, aux) = self.loss_fn(params, model_state, batch, jax.random.key(0))
            return {"loss": loss, **aux}
        out = _apply(self.model, {"params": params, **model_state}, batch, False)
        if isinstance(out, dict):  # the model's own loss (`_apply`)
            return {"loss": out["cross_entropy"], "accuracy": out["accuracy"]}
        return layers.classification_metrics(self.policy.cast_to_output(out), batch["targets"])

    # ---- drivers --------------------------------------------------------------------------

    def init_state(self, sample_batch: Any = None) -> train_state_lib.TrainState:
        """Host-side. The step-0 state, created on the mesh directly in its shardings;
        `sample_batch` gives the input shapes (default: batch 0 of `build_datasets`)."""
        with loop.allow_transfers():
            if sample_batch is None:
                sample_batch = self.build_datasets()[0].get_batch(0)
            init, args = self.make_init(sample_batch)
            return init(*args)

    def make_init(self, sample_batch: Any) -> tuple[Callable, tuple]:
        """Host-side. `(init, args)`: `init(*args)` is the step-0 state, made in its shardings."""
        cfg = self.config
        sample = jax.tree.map(lambda x: x[:1], sample_batch)
        init_rng, state_rng = jax.random.split(jax.random.key(cfg.seed))

        def create(init_rng, state_rng, sample):
            variables = dict(self.init_variables(init_rng, sample))
            axes = axes_lib.declared(variables["params"])  # how the state splits on the mesh
            variables = axes_lib.unboxed(variables)
            return train_state_lib.TrainState.create(  # params and frozen (`adapters`)
                apply_fn=self.model.apply, tx=self.tx, policy=self.policy, rng=state_rng,
                **adapters.split(self.model, self.policy, cfg, variables.pop("params"), axes),
                loss_scale=self.loss_scale(),
                model_state=variables, param_rounding=cfg.param_rounding, axes=axes,
            )  # fmt: skip

        return sharding.sharded_init(create, self.mesh, init_rng, state_rng, sample)

    def loss_scale(self) -> Any:
        """Host-side. The run's loss scaler at step 0 (`config.loss_scale`), as validated."""
        if self.resolved is not None:
            return self.resolved.loss_scale
        return loss_scale_lib.create_loss_scale(policy=self.policy, **self.config.loss_scale)

    def make_train_step(self) -> Callable:
        """The jittable step the loop runs: the recipe, the state kept in its shardings, and the
        log totals, which restart on the device after each log step."""
        cfg, schedule = self.config, self.schedule

        def train_step(state, batch, totals: log_totals.LogTotals):
            when = None if cfg.numerics.every_step else lambda s: totals.is_log_step(s.step)
            recipe = step.make_train_step(
                self.loss_fn, mesh=self.mesh, per_layer=cfg.numerics.per_layer, measure_when=when
            )
            fresh = state.step % totals.every == 0
            totals = loss_scale_lib.select_tree(fresh, totals.reset(), totals)
            new_state, metrics = recipe(state, batch)
            shardings = sharding.state_shardings(self.mesh, state)
            new_state = jax.lax.with_sharding_constraint(new_state, shardings)
            metrics["learning_rate"] = schedule(schedules.optimizer_count(state.opt_state))
            return new_state, metrics, totals.add(state.step, metrics)

        return train_step

    def make_eval_step(self) -> Callable:
        """The jittable `eval_step(state, batch) -> metrics`: `eval_fn` on the mesh."""
        return step.make_eval_step(self.eval_fn, self.mesh)

    def starting(self, state, saved_step: int | None, train_source, eval_source):
        """Host-side. The state a run starts from (`saved_step` None: step 0's), to which a
        subclass adds what step 0 fixes for the whole run (DPO: its reference)."""
        return state

    def make_run_step(self, state, batch) -> tuple[Callable, Callable, Any]:
        """Host-side. What a run compiles for `state` and one `batch` (arrays, or abstract): the
        train step, jitted (`loop.steps`, state donated), and `log_totals.make_totals`'s."""
        cfg, replicated = self.config, sharding.replicated(self.mesh)
        jitted = jax.jit(loop.steps(self.make_train_step(), cfg.steps_per_call), donate_argnums=0)
        return jitted, *log_totals.make_totals(cfg, replicated, self.loss_fn, state, batch)

    def device_batch(self, source: Any, index: int, count: int | None = None) -> Any:
        """Host-side. Batch `index` of `source` on the mesh (`count`: stacked, `layout`'s)."""
        return layout.device_batch(self.mesh, source, index, self.config.batch_size, count)

    def evaluate(self, state, source: Any = None, eval_step: Callable | None = None) -> dict:
        """Host-side. `eval_fn` averaged over `config.eval_steps` batches, keys prefixed `eval_`;
        `source` defaults to the eval source of `build_datasets`, `eval_step` to a freshly
        jitted `make_eval_step(self.eval_fn)` (a run passes its own, compiled once)."""
        if source is None:
            with loop.allow_transfers():
                source = self.build_datasets()[1]
        eval_step = eval_step or jax.jit(self.make_eval_step())
        batches = (self.device_batch(source, i) for i in range(self.config.eval_steps))
        return loop.average(eval_step, state, batches, prefix="eval_")

    def setup(self, train_source: Any, eval_source: Any, pretrained: Any = None) -> loop.Run:
        """Host-side. Builds everything a run needs, once: the state (the newest valid
        checkpoint's, else with `pretrained`'s params: `init_from.resume`), the compiled steps,
        the writer, checkpointer and hooks. Writes `config.json`; the `Run` is a context manager."""
        cfg, workdir, clock = self.config, self.workdir, throughput.Clock()  # set-up is timed
        save_bg = checkpoint.use_async(cfg.checkpoint_async, layout.platform(self.mesh))
        with loop.allow_transfers():
            checkpointer = checkpoint.Checkpointer(
                workdir / "checkpoints", max_to_keep=cfg.max_checkpoints_to_keep, async_save=save_bg
            )
            checkpoint.check_continues(checkpointer, self.policy, config_lib.to_dict(cfg))
        state = self.init_state(train_source.get_batch(0))
        with loop.allow_transfers():
            state, saved_step, meta = init_from.resume(
                checkpointer, state, self.policy, cfg, pretrained
            )
            state = self.starting(state, saved_step, train_source, eval_source)
            start, k = loop.call_boundary(int(state.step), cfg.steps_per_call), cfg.steps_per_call
            if jax.process_index() == 0:  # the workdir's one writer: what a kill left goes
                files.remove_temporaries(workdir, workdir / "numerics")
                files.write_json(workdir / "config.json", config_lib.to_dict(cfg))
            jitted, make_totals, calls = self.make_run_step(state, train_source.get_batch(0))
            totals = make_totals(saved=(meta or {}).get("log_totals"))  # the interval so far
        # Compile everything up front: the loop then never stops to compile. The one trace of
        # the step is compiled and read by the precision report.
        batches = self.device_batch(train_source, start, k if k > 1 else None)
        traced = jitted.trace(state, batches, totals)
        train_step = traced.lower().compile()
        report = audit.make_report(traced.jaxpr, train_step, (state,), config=cfg)
        eval_step = None  # no eval split (data.eval_fraction=0): no evaluation
        if eval_source is not None:
            eval_step = jax.jit(self.make_eval_step())
            eval_step = eval_step.lower(state, self.device_batch(eval_source, 0)).compile()
        run = loop.Run(
            config=cfg,
            state=state,
            start=start,
            train_source=train_source,
            eval_source=eval_source,
            train_step=train_step,
            eval_step=eval_step,
            totals=totals,
            checkpointer=checkpointer,
            saved_step=saved_step,
            calls=calls,
            workdir=workdir,
            clock=clock,
        )
        run.hooks = self.build_hooks(run)
        metrics_lib.report_start(workdir, state, train_step, self.mesh, start, report)
        return run

    def train_and_evaluate(self) -> train_state_lib.TrainState:
        """Trains to `config.num_train_steps`, resuming from the newest checkpoint if any.

        Raises `errors.Preempted` after checkpointing on SIGTERM or SIGINT, `NonFiniteTraining`
        when non-finite steps do not recover, `WorkdirError` or `ConfigError` when the workdir
        is in use or belongs to another run (`checkpoint.resume`), `StorageError` on a failed save.
        """
        with loop.allow_transfers():  # data problems surface before anything touches the workdir
            sources = self.build_datasets()
            pretrained = init_from.read(self, sources[0])  # config.init_from's too: no workdir
        with runtime.workdir_lock(self.workdir), runtime.PreemptionFlag() as preemption:
            with preemption.starting_up():  # nothing to save yet: SIGTERM exits at once
                run = self.setup(*sources, pretrained)
            with run:
                self.train(run, preemption)
                run.finish(self.last_eval, self.loss_unit)
        return run.state

    def train(self, run: loop.Run, preemption: runtime.PreemptionFlag) -> None:
        """Host-side. The loop: heed SIGTERM, step, report and run the hooks (`Run.stepped`).
        Each call runs `config.steps_per_call` steps on batches the prefetcher made ahead."""
        cfg, totals, done, k = self.config, run.totals, run.start, self.config.steps_per_call
        calls = range(run.start, cfg.num_train_steps, k)
        fetch = lambda i: self.device_batch(run.train_source, i, k if k > 1 else None)
        depth = loop.prefetch_depth(cfg.data.prefetch, layout.platform(self.mesh))
        with loop.Prefetcher(fetch, calls, depth, run.clock) as batches:
            for first, batch in zip(calls, batches, strict=True):
                if preemption.reached(done):
                    name = preemption.signal_name
                    logging.warning("mptrain: %s received; checkpointing step %d", name, done)
                    run.stop(done, errors.Preempted(done, name))
                run.state, metrics, totals = run.train_step(run.state, batch, totals)
                done = first + k
                run.stepped(first, done, metrics, totals)
        run.report_pending(done)


def _apply(model: Any, variables: dict, batch: Any, train: bool, **kwargs: Any) -> Any:
    """`model.apply` on the batch's inputs. A model that computes its own loss (`computes_loss`:
    the LMs' chunked fp32 cross-entropy) gets the targets too, so the [tokens, vocab] logits
    never leave it, and returns `lm_loss.token_loss`'s dict. A batch of packed rows passes its
    `positions` and `segment_ids` on."""
    if getattr(model, "computes_loss", False):
        kwargs["targets"] = batch["targets"]
    for key in ("positions", "segment_ids", "segment_lengths"):  # packed rows (`data.sft`)
        if key in batch:
            kwargs[key] = batch[key]
    return model.apply(variables, batch["inputs"], train=train, **kwargs)


def require_data(config: Any, name: str, trainer: str, what: str) -> None:
    """For a Trainer that trains on `data.name=name` alone (`trainer`: its spec, `what` the
    data's kind): a `ConfigError` naming both where the config names other data."""
    if config.data.name != name:
        raise errors.ConfigError(
            f"config.trainer={trainer!r} trains on data.name={name!r} {what}, not "
            f"data.name={config.data.name!r}"
        )


def model_metrics(out: Any) -> dict[str, Any]:
    """What a model's own loss dict reports beside the loss: a mixture of experts' `moe/`
    values (its load-balancing loss, each expert's share of the routed tokens)."""
    return {k: v for k, v in out.items() if k.startswith("moe/")} if isinstance(out, dict) else {}


def _loss(policy: Any, out: Any, targets: Any) -> Any:
    """The train loss of `_apply`'s output: the model's own, or the cross-entropy of its logits
    in the policy's output dtype."""
    if isinstance(out, dict):
        return out["loss"]
    return layers.cross_entropy(policy.cast_to_output(out), targets)
