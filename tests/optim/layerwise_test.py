"""The optimizer's update of a stack a layer at a time (`optim.layerwise`) against the whole
stack's, on trees small enough to compare, the threshold lowered while one side is traced."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import normal

from mptrain import optim
from mptrain.optim import layerwise
from mptrain.parallel.sharding import STACKED
from mptrain.recipe import train_state


def _state(policy, rounding, moments, params):
    adam = optim.adamw(1e-2, mu_dtype=moments, nu_dtype=moments, weight_decay=0.1,
                       moment_rounding="nearest" if rounding != "stochastic" else "stochastic",
                       q8_min_size=1)  # fmt: skip
    tx = optim.Gated(*optax.chain(layerwise.clip_by_global_norm(1.0), adam))
    return train_state.TrainState.create(
        apply_fn=None, params=params, tx=tx, policy=policy, param_rounding=rounding
    )


def _two_updates(state, grads, layered: bool):
    """Two updates, the stack's a layer at a time where `layered` (the threshold lowered while
    this is traced)."""
    before = layerwise.LAYERWISE_MIN
    layerwise.LAYERWISE_MIN = 1 if layered else before
    try:
        assert layerwise.applies(state.params, True) == layered
        for _ in range(2):
            state = state.apply_gradients(grads=grads, apply=jnp.asarray(True))
    finally:
        layerwise.LAYERWISE_MIN = before
    return state.params, state.opt_state


def _equal_and_own_bits(moments):
    # fp32 params rounded to nearest: two stacks of 3 and 2 layers (a model whose layers'
    # params differ in shape, `sharding.stacks`), each sliced as whole; the norm of the
    # gradients is 40 and the clip 1, so a layer's own norm would clip otherwise
    stack = {"0-3": {"w": normal(0, (3, 8, 512)), "b": normal(1, (3, 8))}}
    stack["3-5"] = {"w": normal(4, (2, 8, 256))}
    params = {STACKED: stack, "head": normal(2, (8, 16))}
    grads = jax.tree.map(lambda p: 10 * normal(3, p.shape), params)
    state = _state("fp32", "nearest", moments, params)
    # bf16 params rounded stochastically, q8 moments: three equal layers, equal gradients
    same = {STACKED: {"w": jnp.stack([normal(0, (8, 512))] * 3)}, "head": normal(2, (8, 16))}
    same_grads = {STACKED: {"w": jnp.stack([1e-3 * normal(3, (8, 512))] * 3)}, "head": same["head"]}
    bf16 = _state("bf16-pure", "stochastic", "q8", same)

    def both(state, bf16):
        whole, sliced = (_two_updates(state, grads, layered) for layered in (False, True))
        return whole, sliced, _two_updates(bf16, same_grads, True)

    return jax.jit(both)(state, bf16)  # one program


@pytest.mark.parametrize("moments", ["q8", pytest.param("float32", marks=pytest.mark.slow)])
def test_a_stack_updated_a_layer_at_a_time_is_updated_as_whole(moments):
    """The same params and moments to an ulp or two (XLA fuses the two programs' arithmetic
    differently), the same 8-bit codes, two stacks of other lengths each a layer at a time;
    the clip reads the whole tree's norm. And with
    stochastic rounding each layer folds its index into the keys: three equal layers with equal
    gradients round apart (one key for all would keep them equal)."""
    whole, sliced, (new, opt_state) = _equal_and_own_bits(moments)
    for x, y in zip(jax.tree.leaves(whole), jax.tree.leaves(sliced), strict=True):
        np.testing.assert_allclose(y, x, rtol=1e-6, atol=1e-8)
    w = np.asarray(new[STACKED]["w"], np.float32)
    assert not np.array_equal(w[0], w[1]) and not np.array_equal(w[1], w[2])
    codes = np.asarray(opt_state[1][0].mu[STACKED]["w"].codes)
    assert codes.shape[0] == 3 and not np.array_equal(codes[0], codes[1])
