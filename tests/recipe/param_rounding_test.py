"""16-bit params and updates below their resolution: nearest loses them, the others do not.

The tricks are tested through the compiled step, as the trainer runs it, and once more with the
program rewritten the way a compiler allowed excess precision may rewrite it (`drop_round_trips`):
XLA:GPU does by default, XLA:CPU only in some places, so the rewrite makes the hazard the same on
every backend instead of leaving it to the one the tests happen to run on.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import COMPILERS, drop_round_trips

import mptrain
from mptrain import dtypes

POLICIES = {jnp.bfloat16: "bf16-pure", jnp.float16: "params=float16,compute=float16,output=float32"}


def test_dropping_round_trips_does_what_xla_gpu_may_do():
    x = jnp.asarray([1.0 + 2**-9, 3.0], jnp.float32)  # the first is no bf16 value
    trip = lambda x: x.astype(jnp.bfloat16).astype(jnp.float32)
    bits = lambda x: jax.lax.bitcast_convert_type(
        jax.lax.bitcast_convert_type(x, jnp.uint32), x.dtype
    )
    with jax.disable_jit():  # op by op, every cast rounds
        np.testing.assert_array_equal(trip(x), [1.0, 3.0])
    np.testing.assert_array_equal(jax.jit(drop_round_trips(trip))(x), x)
    np.testing.assert_array_equal(jax.jit(drop_round_trips(lambda x: trip(bits(x))))(x), x)
    explicit = lambda x: dtypes.round_to(x, jnp.bfloat16)
    np.testing.assert_array_equal(jax.jit(drop_round_trips(explicit))(x), [1.0, 3.0])


def _run(rounding, dtype=jnp.bfloat16, steps=200, compiler="jit"):
    # w = 1.0 and each sgd update (the grad of sum(w) is 1) is eps/64: far below half of the
    # spacing of 16-bit values around 1.0 (eps/2 below it), so round-to-nearest never moves w.
    state = mptrain.TrainState.create(
        apply_fn=None,
        params={"w": jnp.ones((4096,))},
        tx=optax.sgd(float(jnp.finfo(dtype).eps) / 64),
        policy=POLICIES[dtype],
        param_rounding=rounding,
        rng=0,
    )

    def loss_fn(params, model_state, batch, rng):
        return jnp.sum(params["w"].astype(jnp.float32)), (model_state, {})

    # compiled as the trainer compiles it: the whole step, the state donated
    step = jax.jit(COMPILERS[compiler](mptrain.make_train_step(loss_fn)), donate_argnums=0)
    for _ in range(steps):
        state, _ = step(state, {})
    return state


@pytest.mark.parametrize(
    ("policy", "rounding"),
    [("bf16-pure", "stochastic"), ("p=f16,c=f16,o=f32", "nearest"), ("bf16-mixed", "nearest")],
)
def test_the_library_rounds_as_a_config_does_by_default(policy, rounding):
    """`TrainState.create` without `param_rounding` is the config's "auto": bf16 params keep
    the small updates that rounding to nearest would drop."""
    params = {"w": jnp.ones((4,))}
    state = mptrain.TrainState.create(
        apply_fn=None, params=params, tx=optax.sgd(1.0), policy=policy
    )
    assert state.param_rounding == rounding


def test_nearest_loses_small_updates():
    w = _run("nearest").params["w"]
    assert w.dtype == jnp.bfloat16 and np.all(np.asarray(w, np.float32) == 1.0)


_ROUNDINGS = {
    "stochastic-bf16": ("stochastic", jnp.bfloat16),
    "kahan-bf16": ("kahan", jnp.bfloat16),
    "kahan-fp16": ("kahan", jnp.float16),
}


# make test keeps stochastic rounding through the compiled step that drops f32 -> bf16 -> f32
# round trips, the stricter of the two; through the plain jit it is a variant, in make test-slow
@pytest.mark.parametrize(
    "rounding, dtype, compiler",
    [
        pytest.param(
            *_ROUNDINGS[name],
            compiler,
            id=f"{name}-{compiler}",
            marks=pytest.mark.slow if (name, compiler) == ("stochastic-bf16", "jit") else (),
        )
        for compiler in COMPILERS
        for name in _ROUNDINGS
    ],
)
def test_stochastic_and_kahan_keep_small_updates(rounding, dtype, compiler):
    state = _run(rounding, dtype, compiler=compiler)
    eps = float(jnp.finfo(dtype).eps)
    w = np.asarray(state.params["w"], np.float32)
    assert state.params["w"].dtype == dtype
    expected = 1.0 - 200 * eps / 64  # six 16-bit values below 1.0, where they are eps/2 apart
    if rounding == "stochastic":  # unbiased: right on average (the noise of the mean is ~eps/50)
        assert abs(w.mean() - expected) < eps / 8
    else:  # each weight is the 16-bit value nearest the sum, and the compensation holds the rest
        assert np.all(np.abs(w - expected) <= eps / 4)  # half the spacing below 1.0
        total = w + np.asarray(state.param_compensation["w"], np.float32)
        np.testing.assert_allclose(total, expected, atol=eps / 64)  # within one update


@pytest.mark.parametrize("dtype", POLICIES)
def test_kahan_rounds_explicitly_in_the_compiled_program(dtype):
    """The rounding Kahan's compensation is computed from is a `reduce-precision` op, which no
    compiler pass removes, rather than a cast round trip, which excess precision may remove."""
    state = mptrain.TrainState.create(
        apply_fn=None,
        params={"w": jnp.ones((256,))},
        tx=optax.sgd(1e-3),
        policy=POLICIES[dtype],
        param_rounding="kahan",
    )
    grads = {"w": jnp.ones((256,))}
    hlo = jax.jit(lambda s, g: s.apply_gradients(grads=g)).lower(state, grads).compile().as_text()
    info = jnp.finfo(dtype)
    assert re.search(
        rf"reduce-precision\(.*exponent_bits={info.nexp}, mantissa_bits={info.nmant}", hlo
    )


def test_stochastic_rounding_is_unbiased_and_exact_on_bf16_values():
    x = jnp.full((100_000,), 1.0 + 2**-9, jnp.float32)  # a quarter of the way to the next bf16
    r = np.asarray(dtypes.stochastic_round_to_bf16(x, jax.random.key(0)), np.float32)
    assert set(np.unique(r)) == {1.0, 1.0 + 2**-7}
    assert abs(r.mean() - float(x[0])) < 2e-5
    exact = jnp.asarray([1.5, -2.0, 0.0], jnp.float32)
    np.testing.assert_array_equal(dtypes.stochastic_round_to_bf16(exact, jax.random.key(1)), exact)


def test_rounding_needs_16_bit_params():
    with pytest.raises(ValueError, match="param_rounding='stochastic'"):
        mptrain.TrainState.create(
            apply_fn=None, params={"w": jnp.ones(2)}, tx=optax.sgd(1.0), policy="fp32",
            param_rounding="stochastic",
        )  # fmt: skip
