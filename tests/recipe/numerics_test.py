"""The per-layer numerics recorder: it names the module and direction where a NaN or an inf
first appeared, for every module of a 2-layer transformer, and every skipped step says so."""

import json
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import event_series, needs_devices, run_cli, tiny_config

import mptrain
from mptrain.inspect import audit
from mptrain.recipe import numerics


def _poison(x, when):
    """x, with its first element made NaN when `when`."""
    return x.at[(0,) * x.ndim].add(jnp.where(when, jnp.nan, 0.0).astype(x.dtype))


@jax.custom_vjp
def _poison_gradient(x, when):
    return x


_poison_gradient.defvjp(lambda x, when: (x, when), lambda when, g: (_poison(g, when), None))


class Injector:
    """Makes the `site`-th module call (in call order) put a NaN into its output (direction 0)
    or into the gradient that flows into its output (direction 1); both are traced values, so
    one compiled step serves every site."""

    def __init__(self, site, direction):
        self.site, self.direction, self.calls = site, direction, 0

    def __call__(self, next_fun, args, kwargs, context):
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        index, self.calls = self.calls, self.calls + 1
        out = next_fun(*args, **kwargs)
        here = self.site == index
        inject = lambda y: _poison_gradient(
            _poison(y, here & (self.direction == 0)), here & (self.direction == 1)
        )
        return jax.tree.map(
            lambda y: inject(y) if jnp.issubdtype(y.dtype, jnp.floating) else y, out
        )


class InjectingTrainer(mptrain.Trainer):
    """The default LM whose loss runs under an `Injector` told by the batch where to inject."""

    def loss_fn(self, params, model_state, batch, rng):
        batch = dict(batch)
        injector = Injector(batch.pop("site"), batch.pop("direction"))
        with nn.intercept_methods(injector):
            return super().loss_fn(params, model_state, batch, rng)


@pytest.fixture(scope="module")
def injected(tmp_path_factory):
    """`run(site, direction) -> (origin index, origin direction)`, one compiled step that, as
    the trainer's, measures only the steps it picks (here step 0) and the skipped ones."""
    config = tiny_config(**{"model.num_layers": 2})
    trainer = InjectingTrainer(config, tmp_path_factory.mktemp("inject"))
    batch = trainer.build_datasets()[0].get_batch(0)
    clean = {**batch, "site": np.int32(-1), "direction": np.int32(-1)}
    state = trainer.init_state(batch)
    make = lambda **kw: jax.jit(mptrain.make_train_step(trainer.loss_fn, per_layer=True, **kw))
    step = make(measure_when=lambda state: state.step == 0)
    state, metrics = step(state, clean)  # a clean step first: nothing to diagnose
    assert metrics["numerics_origin"].tolist() == [-1, -1] and bool(metrics["applied"])
    assert np.asarray(metrics["numerics"]).any()  # step 0 was picked: measured
    calls = numerics.loss_calls(trainer.loss_fn, state, clean)
    inject = lambda site, direction: {
        **batch,
        "site": np.int32(site),
        "direction": np.int32(direction),
    }

    def run(site, direction):
        _, metrics = step(state, inject(site, direction))
        assert not bool(metrics["applied"])  # the injected step is skipped
        return tuple(metrics["numerics_origin"].tolist())

    run.step, run.make, run.state, run.inject, run.trainer = step, make, state, inject, trainer
    return run, calls


@pytest.mark.slow  # a second variant; make test keeps the fp16 overflow's module
@pytest.mark.parametrize("direction", [0, 1], ids=["forward", "backward"])
def test_every_injection_site_is_named_with_its_direction(injected, direction):
    run, calls = injected
    assert len(calls.paths) >= 20  # a 2-layer transformer: every Dense, norm, dropout, block
    found = {site: run(site, direction) for site in range(len(calls.paths))}
    wrong = {calls.paths[s]: got for s, got in found.items() if got != (s, direction)}
    assert not wrong, wrong  # 100%: the exact call, and the direction


@pytest.mark.parametrize(
    "data, fsdp, every_step",
    [
        pytest.param(1, 1, False, id="one_device"),
        pytest.param(2, 2, False, id="mesh_2x2", marks=[needs_devices(4), pytest.mark.slow]),
        pytest.param(1, 1, True, id="every_step", marks=pytest.mark.slow),
    ],
)
def test_every_skipped_step_of_an_overflowing_fp16_run_names_its_module(
    data, fsdp, every_step, tmp_path, caplog
):
    # A loss scale of 1e9: the scaled gradient entering the fp16 logits layer overflows there;
    # on a mesh, each device's table is combined before the origin is looked for.
    caplog.set_level(logging.WARNING)
    overrides = ["--config.precision=fp16-mixed", "--config.numerics.per_layer=True"]
    overrides += [f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}"]
    overrides += [f"--config.numerics.every_step={every_step}"]
    overrides += ["--config.loss_scale.init_scale=1e9", "--config.loss_scale.max_scale=1e10"]
    overrides += ["--config.max_consecutive_skips=6", "--config.num_train_steps=8"]
    code, _ = run_cli(tmp_path, *overrides)
    assert code == 3
    for step in range(6):  # skipped, one after the other, until the run stops
        assert (
            f"skipped step {step}: the first non-finite value appeared in head (backward)"
            in caplog.text
        )
        table = json.loads((tmp_path / "numerics" / f"{step}.json").read_text())
        head = next(row for row in table["layers"] if row["module"] == "head")
        assert head["grad_out_nonfinite"] == 0 and head["grad_in_nonfinite"] > 0
    assert "head (backward)" in caplog.text.split("training went non-finite")[-1]


@pytest.mark.slow  # a CLI run with per-layer numerics on; the tables themselves are tested above
def test_every_log_step_writes_measured_amax_to_tensorboard(tmp_path):
    # Log steps are measured by the replay: TensorBoard must get real numbers at each of them.
    overrides = ["--config.numerics.per_layer=True", "--config.num_train_steps=5"]
    code, _ = run_cli(tmp_path, *overrides, "--config.log_every_steps=2")
    assert code == 0
    for direction in ("forward", "backward"):
        values = event_series(tmp_path, f"numerics/{direction}/head")
        assert sorted(values) == [2, 4, 5] and min(values.values()) > 0, (direction, values)


@pytest.mark.slow  # three steps compiled: make test keeps the sites' names and the report
def test_tables_measured_on_demand_are_the_tables_measured_always(injected):
    # The trainer measures only log steps and skipped steps, by differentiating once more; the
    # tables it gets must be those of measuring in every step's own gradient, the rest zeros.
    run, calls = injected
    always = run.make()
    clean = run.inject(-1, -1)
    new_state, metrics = run.step(run.state, clean)  # step 1: applied, not picked
    assert bool(metrics["applied"]) and not np.asarray(metrics["numerics"]).any()
    assert np.asarray(always(run.state, clean)[1]["numerics"]).any()
    without = jax.jit(mptrain.make_train_step(run.trainer.loss_fn))(run.state, clean)[0]
    for a, b in zip(jax.tree.leaves(new_state), jax.tree.leaves(without), strict=True):
        np.testing.assert_array_equal(a, b)  # the update is the one without numerics, bit for bit
    for site, direction in [(0, 0), (len(calls.paths) // 2, 1), (len(calls.paths) - 1, 1)]:
        bad = run.inject(site, direction)
        np.testing.assert_array_equal(
            run.step(run.state, bad)[1]["numerics"], always(run.state, bad)[1]["numerics"]
        )


@pytest.mark.slow  # a variant: make test keeps the sites' names and the fp16 overflow's module
def test_the_precision_report_counts_an_ordinary_steps_matmuls(injected):
    # The measuring replay runs on log and skipped steps only: the report leaves it out.
    run, _ = injected
    report = lambda **kw: audit.precision_report(
        mptrain.make_train_step(run.trainer.loss_fn, **kw), run.state, run.inject(-1, -1)
    )
    without = report().matmul_flops
    assert sum(without.values()) > 0
    assert report(per_layer=True).matmul_flops == without  # the taps add no matmuls
    assert (
        report(per_layer=True, measure_when=lambda state: state.step == 0).matmul_flops == without
    )


def test_off_the_step_is_the_step_without_it(tmp_path, monkeypatch):
    trainer = mptrain.Trainer(tiny_config(), tmp_path)
    batch = trainer.build_datasets()[0].get_batch(0)
    state = trainer.init_state(batch)
    lower = lambda **kw: (
        jax.jit(mptrain.make_train_step(trainer.loss_fn, **kw)).lower(state, batch).as_text()
    )
    on, off = lower(per_layer=True), lower(per_layer=False)
    monkeypatch.setattr(numerics, "recording", None)  # never reached when off
    monkeypatch.setattr(numerics, "loss_calls", None)
    assert lower() == off and len(on) > len(off)


@pytest.mark.slow  # an optimisation's check: two per-layer steps compiled
def test_numbers_read_from_another_tap_equal_numbers_measured(tmp_path, monkeypatch):
    # A value passed from one call's tap straight to another's is measured once; the table
    # must be the one measuring the gradients at every call gives.
    config = tiny_config(**{"model.num_layers": 2, "model.dropout_rate": 0.1})
    trainer = mptrain.Trainer(config, tmp_path)
    batch = trainer.build_datasets()[0].get_batch(0)
    state = trainer.init_state(batch)
    step = lambda: jax.jit(mptrain.make_train_step(trainer.loss_fn, per_layer=True))
    table = lambda: step()(state, batch)[1]["numerics"]
    planned = numerics.loss_calls(trainer.loss_fn, state, batch)
    reused = sum(plan.measure is None and tap[1] == "in" for tap, plan in planned.plans)
    assert reused >= 4  # e.g. block_1 takes block_0's output, qkv its parent's input
    fast = np.asarray(table())
    monkeypatch.setattr(numerics, "_uses", lambda jaxpr, order: None)  # no use counts known
    np.testing.assert_array_equal(fast, np.asarray(table()))
