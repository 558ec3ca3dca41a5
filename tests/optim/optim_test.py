"""Optimizers: state dtypes, numerics against optax, schedules and counts, config errors."""

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest
from helpers import normal

import mptrain
from mptrain import optim
from mptrain.optim import schedules


def make_optimizer(config, **kwargs):
    """`optim.make_optimizer` as a run calls it: the config's optimizer section, its length."""
    return optim.make_optimizer(
        config.optimizer, config.num_train_steps, seed=config.seed, **kwargs
    )


def _params(seed=0):
    return {
        "w": normal(seed, (64, 64)),
        "b": jnp.zeros((64,)),
    }


def _grads(params, seed):
    return {
        "w": normal(200 + 2 * seed, params["w"].shape),
        "b": normal(201 + 2 * seed, params["b"].shape),
    }


def _config(**optimizer):
    base = {
        "name": "adamw",
        "learning_rate": 1e-3,
        "warmup_steps": 0,
        "schedule": "constant",
        "weight_decay": 0.0,
        "b1": 0.9,
        "b2": 0.999,
        "eps": 1e-8,
        "grad_clip_norm": None,
        "mu_dtype": None,
        "nu_dtype": None,
        "accumulation_steps": 1,
        "momentum": None,
    }
    base.update(optimizer)
    return ml_collections.ConfigDict({"num_train_steps": 100, "seed": 0, "optimizer": base})


def _dtypes(tree):
    return {np.dtype(x.dtype) for x in jax.tree.leaves(tree) if np.ndim(x) > 0}


@jax.jit
def _apply(state, grads):
    return state.apply_gradients(grads=grads)


def _run(tx, params, steps):
    state = tx.init(params)
    update = jax.jit(tx.update)
    for i in range(steps):
        updates, state = update(_grads(params, i), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


# ------------------------------------------------------------------------------------- adamw


@pytest.mark.parametrize("mask", [None, {"w": True, "b": False}])
def test_adamw_in_fp32_matches_optax_adamw(mask):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    kwargs = {"b1": 0.8, "b2": 0.99, "eps": 1e-6, "weight_decay": 0.1, "mask": mask}
    ours, ours_state = _run(optim.adamw(schedule, **kwargs), _params(), 5)
    ref, ref_state = _run(optax.adamw(schedule, **kwargs), _params(), 5)
    for name in ("w", "b"):
        np.testing.assert_allclose(ours[name], ref[name], rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(ours_state[0].nu["w"], ref_state[0].nu["w"], rtol=1e-6)
    assert int(schedules.optimizer_count(ours_state)) == 5


def test_bf16_params_keep_fp32_moments_unless_asked():
    params = _params()
    state = mptrain.TrainState.create(
        apply_fn=None, params=params, tx=optim.adamw(1e-3), policy="bf16-pure"
    )
    assert _dtypes(state.params) == {np.dtype(jnp.bfloat16)}
    state = _apply(state, _grads(params, 0))
    assert _dtypes(state.opt_state) == {np.dtype(jnp.float32)}

    # optax's own adamw falls into the trap this module exists to avoid
    trap = mptrain.TrainState.create(
        apply_fn=None, params=params, tx=optax.adamw(1e-3), policy="bf16-pure"
    )
    assert _dtypes(trap.opt_state) == {np.dtype(jnp.bfloat16)}

    tx = optim.adamw(1e-3, mu_dtype="bfloat16")
    state = mptrain.TrainState.create(apply_fn=None, params=params, tx=tx, policy="bf16-pure")
    state = _apply(state, _grads(params, 0))
    adam_state = state.opt_state[0]
    assert _dtypes(adam_state.mu) == {np.dtype(jnp.bfloat16)}
    assert _dtypes(adam_state.nu) == {np.dtype(jnp.float32)}


def test_bf16_params_get_the_fp32_adamw_step_rounded_once():
    params, grads = _params(), _grads(_params(), 0)
    tx = optim.adamw(1e-2, weight_decay=0.1)
    state = mptrain.TrainState.create(
        apply_fn=None, params=params, tx=tx, policy="bf16-pure", param_rounding="nearest"
    )
    state = _apply(state, grads)
    params32 = jax.tree.map(lambda p: p.astype(jnp.bfloat16).astype(jnp.float32), params)
    ref = optax.adamw(1e-2, weight_decay=0.1)
    updates, _ = ref.update(grads, ref.init(params32), params32)
    expected = jax.tree.map(lambda p, u: (p + u).astype(jnp.bfloat16), params32, updates)
    jax.tree.map(np.testing.assert_array_equal, state.params, expected)


def test_bf16_second_moment_decays_with_stochastic_rounding_and_sticks_with_nearest():
    params = {"w": jnp.zeros((8192,))}
    ones, zeros = {"w": jnp.ones((8192,))}, {"w": jnp.zeros((8192,))}

    def nu_after(**kwargs):
        tx = optim.adamw(1.0, nu_dtype=kwargs.pop("nu_dtype", None), **kwargs)
        state = tx.init(params)
        update = jax.jit(tx.update)
        for _ in range(20):
            _, state = update(ones, state, params)
        for _ in range(300):  # no gradient: nu should decay by b2 each step
            _, state = update(zeros, state, params)
        return float(jnp.mean(state[0].nu["w"].astype(jnp.float32)))

    exact = nu_after()
    assert exact < 0.75 * nu_after(nu_dtype="bfloat16", moment_rounding="nearest")
    assert nu_after(nu_dtype="bfloat16") == pytest.approx(exact, rel=0.01)


# ------------------------------------------------------------------------------ make_optimizer


@pytest.mark.parametrize("schedule, at_end", [("constant", 1e-3), ("cosine", 0.0), ("linear", 0.0)])
def test_schedules_warm_up_then_take_their_shape(schedule, at_end):
    _, lr = make_optimizer(_config(schedule=schedule, warmup_steps=10))
    assert float(lr(0)) == 0.0
    assert float(lr(5)) == pytest.approx(5e-4)
    assert float(lr(10)) == pytest.approx(1e-3)
    assert float(lr(100)) == pytest.approx(at_end, abs=1e-10)
    if schedule != "constant":
        assert 0.0 < float(lr(55)) < 1e-3


def test_schedule_without_warmup_starts_at_the_learning_rate():
    _, lr = make_optimizer(_config(schedule="cosine", warmup_steps=0))
    assert float(lr(0)) == pytest.approx(1e-3)


def test_learning_rate_follows_the_optimizer_count():
    tx, lr = make_optimizer(_config(schedule="linear", warmup_steps=4))
    _, state = _run(tx, _params(), 3)
    assert int(schedules.optimizer_count(state)) == 3
    assert float(schedules.current_learning_rate(state, lr)) == pytest.approx(0.75e-3)


def test_optimizer_count_prefers_the_schedule_count():
    state = (
        optax.ScaleByAdamState(count=jnp.int32(7), mu={}, nu={}),
        optax.ScaleByScheduleState(count=jnp.int32(3)),
    )
    assert int(schedules.optimizer_count(state)) == 3
    assert int(schedules.optimizer_count(state[:1])) == 7
    with pytest.raises(ValueError, match="no integer 'count'"):
        schedules.optimizer_count({"count": jnp.zeros((3,))})


def test_clipping_bounds_the_global_norm():
    big = {"w": jnp.full((64, 64), 10.0), "b": jnp.full((64,), 10.0)}
    for clip, expected in [(1.0, 1.0), (None, float(optax.tree.norm(big)))]:
        config = _config(name="sgd", learning_rate=1.0, grad_clip_norm=clip)
        tx, _ = make_optimizer(config)
        updates, _ = tx.update(big, tx.init(_params()), _params())
        assert float(optax.tree.norm(updates)) == pytest.approx(expected, rel=1e-5)


def test_sgd_momentum_is_fp32_for_bf16_params_and_matches_optax():
    tx, _ = make_optimizer(_config(name="sgd", learning_rate=0.1, momentum=0.9))
    state = mptrain.TrainState.create(apply_fn=None, params=_params(), tx=tx, policy="bf16-pure")
    assert _dtypes(state.opt_state) == {np.dtype(jnp.float32)}
    ours, _ = _run(tx, _params(), 4)
    ref, _ = _run(optax.sgd(0.1, momentum=0.9), _params(), 4)
    np.testing.assert_allclose(ours["w"], ref["w"], rtol=1e-6)


def test_accumulation_applies_one_update_per_k_micro_batches():
    config = _config(schedule="linear", warmup_steps=0, accumulation_steps=4)
    tx, lr = make_optimizer(config)
    assert float(lr(25)) == pytest.approx(0.0, abs=1e-10)  # 100 micro-batches = 25 updates
    state = mptrain.TrainState.create(apply_fn=None, params=_params(), tx=tx, policy="bf16-pure")
    params = state.params
    for i in range(3):
        state = _apply(state, _grads(params, i))
        assert int(schedules.optimizer_count(state.opt_state)) == 0
    jax.tree.map(np.testing.assert_array_equal, state.params, params)
    state = _apply(state, _grads(params, 3))
    assert int(schedules.optimizer_count(state.opt_state)) == 1
    assert not np.array_equal(state.params["w"], params["w"])


def test_skipped_step_does_not_advance_the_optimizer_count():
    config = _config(schedule="cosine", warmup_steps=3)
    tx, lr = make_optimizer(config)

    def loss_fn(params, model_state, batch, rng):
        del rng
        return jnp.mean((batch["x"] @ params["w"] + params["b"]) ** 2), (model_state, {})

    state = mptrain.TrainState.create(apply_fn=None, params=_params(), tx=tx, policy="bf16-mixed")
    train_step = jax.jit(mptrain.make_train_step(loss_fn))
    good = {"x": jnp.ones((4, 64))}
    bad = {"x": jnp.full((4, 64), jnp.nan)}
    state, _ = train_step(state, good)
    assert int(schedules.optimizer_count(state.opt_state)) == 1
    logged = float(schedules.current_learning_rate(state.opt_state, lr))
    state, metrics = train_step(state, bad)
    assert not bool(metrics["grads_finite"])
    assert int(state.step) == 2 and int(state.skipped_steps) == 1
    assert int(schedules.optimizer_count(state.opt_state)) == 1
    assert float(schedules.current_learning_rate(state.opt_state, lr)) == logged
    state, _ = train_step(state, good)
    assert int(schedules.optimizer_count(state.opt_state)) == 2


@pytest.mark.parametrize(
    "key, value",
    [
        ("name", "adam"),
        ("schedule", "step"),
        ("mu_dtype", "float64"),
        ("nu_dtype", "fp8"),
        ("moment_rounding", "up"),
        ("learning_rate", -1.0),
        ("accumulation_steps", 0),
    ],
)
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=rf"optimizer\.{key}=") as info:
        make_optimizer(_config(**{key: value}))
    assert repr(value) in str(info.value)


def test_unknown_name_lists_the_valid_ones():
    with pytest.raises(ValueError, match="valid values: adamw, sgd"):
        make_optimizer(_config(name="lamb"))


@pytest.mark.parametrize("schedule", ["constant", "cosine"])
def test_a_run_shorter_than_its_warmup_warms_up_over_half_of_it(schedule):
    config = _config(schedule=schedule, warmup_steps=100)  # 100 updates in all
    assert schedules.warmup_steps(config.optimizer, config.num_train_steps) == 50
    _, lr = make_optimizer(config)
    assert float(lr(25)) == pytest.approx(0.5e-3) and float(lr(50)) == pytest.approx(1e-3)
    short = _config(warmup_steps=99)
    assert schedules.warmup_steps(short.optimizer, short.num_train_steps) == 99  # kept


@pytest.mark.parametrize(
    "key, value, rule",
    [("eps", 0.0, "> 0"), ("learning_rate", 0.0, "> 0"), ("b2", 1.0, "< 1")],
)
def test_one_rule_per_key(key, value, rule):
    with pytest.raises(ValueError, match=rf"optimizer\.{key}={value!r}: must be .*{rule}"):
        make_optimizer(_config(**{key: value}))


def test_sgd_rejects_a_second_moment_dtype_other_than_the_default():
    make_optimizer(_config(name="sgd", nu_dtype="float32"))
    with pytest.raises(ValueError, match=r"optimizer\.nu_dtype='bfloat16'"):
        make_optimizer(_config(name="sgd", nu_dtype="bfloat16"))


@pytest.mark.parametrize(
    "make",
    [
        lambda: optim.adamw(optax.linear_schedule(1e-3, 0.0, 10), weight_decay=0.1),
        # variants: make test keeps the fp32 and SGD states
        pytest.param(
            lambda: optim.adamw(1e-3, mu_dtype="bfloat16", nu_dtype="bfloat16"),
            marks=pytest.mark.slow,
        ),
        pytest.param(
            lambda: optim.adamw(1e-3, mu_dtype="q8", nu_dtype="q8", q8_min_size=64),
            marks=pytest.mark.slow,
        ),
        lambda: optim.sgd(optax.constant_schedule(0.1), momentum=0.9, nesterov=True),
    ],
    ids=["adamw", "adamw-bf16", "adamw-q8", "sgd-nesterov"],
)
def test_a_gated_optimizer_keeps_its_state_where_a_step_is_not_applied(make):
    from helpers import assert_trees_bytes_equal

    tx = make()
    assert isinstance(tx, optim.Gated)
    params = {"w": jnp.linspace(-1.0, 1.0, 256).reshape(16, 16), "b": jnp.ones((16,))}
    grads = jax.tree.map(lambda p: 0.1 * p + 0.01, params)
    state = tx.init(params)
    state = jax.jit(tx.update)(grads, state, params)[1]  # non-zero moments and counts
    plain = jax.jit(tx.update)(grads, state, params)
    applied = jax.jit(lambda *a: tx.update(*a, apply=jnp.bool_(True)))(grads, state, params)
    skipped = jax.jit(lambda *a: tx.update(*a, apply=jnp.bool_(False)))(grads, state, params)
    assert_trees_bytes_equal(applied, plain)  # applied: what the update computes without it
    assert_trees_bytes_equal(skipped[1], state)  # skipped: the old state, bit for bit


def test_the_step_copies_no_optimizer_state(tmp_path):
    # A select after a plain optax update reads every old moment twice, and XLA copies each
    # donated one to keep it: a kernel per leaf, every step. Gated optimizers select first.
    if jax.default_backend() != "cpu":
        pytest.skip("reads XLA:CPU's compiled program; a GPU's copy insertion may differ")
    from helpers import tiny_config

    trainer = mptrain.Trainer(tiny_config(), tmp_path)
    source = trainer.build_datasets()[0]
    state = trainer.init_state(source.get_batch(0))
    # the step a run compiles (the state donated): the program the tiny runs share
    step, make_totals, _ = trainer.make_run_step(state, source.get_batch(0))
    batch = trainer.device_batch(source, 0)
    program = step.lower(state, batch, make_totals()).compile().as_text()
    entry = program[program.index("\nENTRY") :]
    copies = [line for line in entry.splitlines() if " copy(%state" in line and "[]" not in line]
    assert not copies, copies  # of the donated state's arrays; scalars (counters) aside
