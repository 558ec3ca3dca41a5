"""16-bit params and updates below their resolution: nearest loses them, the others do not."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import mptrain
from mptrain import precision


def _run(rounding, steps=200, lr=1e-4):
    # w = 1.0 in bf16 has a spacing of 2**-7 = 0.0078; each sgd update is 1e-4 (grad of sum(w)
    # is 1), far below half of that, so round-to-nearest never moves the weight.
    state = mptrain.TrainState.create(
        apply_fn=None,
        params={"w": jnp.ones((4096,))},
        tx=optax.sgd(lr),
        policy="bf16-pure",
        param_rounding=rounding,
        rng=0,
    )

    def loss_fn(params, model_state, batch, rng):
        return jnp.sum(params["w"].astype(jnp.float32)), (model_state, {})

    step = jax.jit(mptrain.make_train_step(loss_fn))
    for _ in range(steps):
        state, _ = step(state, {})
    return state


def test_nearest_loses_small_updates():
    w = _run("nearest").params["w"]
    assert w.dtype == jnp.bfloat16 and np.all(np.asarray(w, np.float32) == 1.0)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_stochastic_and_kahan_keep_small_updates(rounding):
    state = _run(rounding)
    w = np.asarray(state.params["w"], np.float32)
    assert state.params["w"].dtype == jnp.bfloat16
    expected = 1.0 - 200 * 1e-4  # 0.98
    assert abs(w.mean() - expected) < 1e-3  # unbiased on average
    if rounding == "kahan":  # the compensation holds what the bf16 params could not
        total = w + np.asarray(state.param_compensation["w"], np.float32)
        np.testing.assert_allclose(total, expected, atol=5e-4)  # bf16 compensation


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    x = jnp.full((100_000,), 1.0 + 2**-9, jnp.float32)  # a quarter of the way to the next bf16
    r = np.asarray(precision.stochastic_round_to_bf16(x, jax.random.key(0)), np.float32)
    assert set(np.unique(r)) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean() - float(x[0])) < 2e-5
    exact = jnp.asarray([1.5, -2.0, 0.0], jnp.float32)
    np.testing.assert_array_equal(
        precision.stochastic_round_to_bf16(exact, jax.random.key(1)), exact
    )


def test_rounding_needs_16_bit_params():
    with pytest.raises(ValueError, match="param_rounding='stochastic'"):
        mptrain.TrainState.create(
            apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(1.0), policy="fp32",
            param_rounding="stochastic",
        )  # fmt: skip
