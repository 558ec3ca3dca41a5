"""The optimizer's update of a stack a layer at a time (`recipe.layerwise`) against the whole
stack's, on trees small enough to compare, the threshold lowered."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import normal

from mptrain.recipe import layerwise, optim, train_state
from mptrain.recipe.sharding import STACKED


def _state(policy, rounding, moments, params):
    adam = optim.adamw(1e-2, mu_dtype=moments, nu_dtype=moments, weight_decay=0.1,
                       moment_rounding="nearest" if rounding != "stochastic" else "stochastic",
                       q8_min_size=1)  # fmt: skip
    tx = optim.Gated(*optax.chain(layerwise.clip_by_global_norm(1.0), adam))
    return train_state.TrainState.create(
        apply_fn=None, params=params, tx=tx, policy=policy, param_rounding=rounding
    )


def _two_updates(state, grads):
    for _ in range(2):
        state = state.apply_gradients(grads=grads, apply=jnp.asarray(True))
    return state.params, state.opt_state


@pytest.mark.parametrize("moments", ["float32", "q8"])
def test_a_stack_updated_a_layer_at_a_time_is_updated_as_whole(moments, monkeypatch):
    """fp32 params, moments rounded to nearest, gradients clipped (their norm is 40, the clip
    1: the whole tree's norm, not a layer's): the same params and moments to an ulp or two
    (XLA fuses the two programs' arithmetic differently), the same 8-bit codes."""
    stack = {"w": normal(0, (3, 8, 512)), "b": normal(1, (3, 8))}
    params = {STACKED: stack, "head": normal(2, (8, 16))}
    grads = jax.tree.map(lambda p: 10 * normal(3, p.shape), params)
    state = _state("fp32", "nearest", moments, params)
    whole = jax.jit(lambda s: _two_updates(s, grads))(state)
    monkeypatch.setattr(layerwise, "LAYERWISE_MIN", 1)
    assert layerwise.applies(params, state.tx)
    sliced = jax.jit(lambda s: _two_updates(s, grads))(state)  # a new function: traced anew
    for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(sliced), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-8)


def test_each_layer_draws_its_own_random_bits(monkeypatch):
    """bf16 params rounded stochastically and q8 moments, three identical layers with identical
    gradients, updated a layer at a time: each layer folds its index into the keys, so no two
    round alike (one key for all would make them equal)."""
    layer = normal(0, (8, 512))
    params = {STACKED: {"w": jnp.stack([layer] * 3)}, "head": normal(2, (8, 16))}
    grads = {STACKED: {"w": jnp.stack([1e-3 * normal(3, (8, 512))] * 3)}, "head": params["head"]}
    monkeypatch.setattr(layerwise, "LAYERWISE_MIN", 1)
    state = _state("bf16-pure", "stochastic", "q8", params)
    new, opt_state = jax.jit(lambda s: _two_updates(s, grads))(state)
    w = np.asarray(new[STACKED]["w"], np.float32)
    assert not np.array_equal(w[0], w[1]) and not np.array_equal(w[1], w[2])
    codes = np.asarray(opt_state[1][0].mu[STACKED]["w"].codes)
    assert codes.shape[0] == 3 and not np.array_equal(codes[0], codes[1])
