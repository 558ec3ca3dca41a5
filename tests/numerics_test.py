"""The per-layer numerics recorder: it names the module and direction where a NaN or an inf
first appeared, for every module of a 2-layer transformer, and every skipped step says so."""

import json
import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_cli, tiny_config

import mptrain
from mptrain import numerics


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
    """`run(site, direction) -> (origin index, origin direction)`, one compiled step."""
    config = tiny_config(**{"model.num_layers": 2})
    trainer = InjectingTrainer(config, tmp_path_factory.mktemp("inject"))
    batch = trainer.build_datasets()[0].get_batch(0)
    clean = {**batch, "site": np.int32(-1), "direction": np.int32(-1)}
    state = trainer.init_state(batch)
    step = jax.jit(mptrain.make_train_step(trainer.loss_fn, per_layer=True))
    state, metrics = step(state, clean)  # a clean step first: nothing to diagnose
    assert metrics["numerics_origin"].tolist() == [-1, -1] and bool(metrics["applied"])
    calls = numerics.loss_calls(trainer.loss_fn, state, clean)

    def run(site, direction):
        _, metrics = step(
            state, {**batch, "site": np.int32(site), "direction": np.int32(direction)}
        )
        assert not bool(metrics["applied"])  # the injected step is skipped
        return tuple(metrics["numerics_origin"].tolist())

    return run, calls


@pytest.mark.parametrize("direction", [0, 1], ids=["forward", "backward"])
def test_every_injection_site_is_named_with_its_direction(injected, direction):
    run, calls = injected
    assert len(calls.paths) >= 20  # a 2-layer transformer: every Dense, norm, dropout, block
    found = {site: run(site, direction) for site in range(len(calls.paths))}
    wrong = {calls.paths[s]: got for s, got in found.items() if got != (s, direction)}
    assert not wrong, wrong  # 100%: the exact call, and the direction


@pytest.mark.parametrize("data, fsdp", [(1, 1), (2, 2)], ids=["one_device", "mesh_2x2"])
def test_every_skipped_step_of_an_overflowing_fp16_run_names_its_module(
    data, fsdp, tmp_path, caplog
):
    # A loss scale of 1e9: the scaled gradient entering the fp16 logits layer overflows there;
    # on a mesh, each device's table is combined before the origin is looked for.
    caplog.set_level(logging.WARNING)
    overrides = ["--config.precision=fp16-mixed", "--config.numerics.per_layer=True"]
    overrides += [f"--config.mesh.data={data}", f"--config.mesh.fsdp={fsdp}"]
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
