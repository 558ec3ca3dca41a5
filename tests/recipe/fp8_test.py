"""mptrain.recipe.fp8: the fp8 matmul's numerics, its program, and its scaling state."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import normal

from mptrain.recipe import fp8

RECIPE = fp8.Recipe(history=4)
_DOT = re.compile(r"stablehlo\.dot_general .*: \(tensor<(?:\d+x)*(\w+)>, tensor<(?:\d+x)*(\w+)>\)")


def _dot_operand_types(lowered: str) -> set[tuple[str, str]]:
    return {m.groups() for m in map(_DOT.search, lowered.splitlines()) if m}


def _operands(seed=0, rows=64, k=128, n=32, dtype=jnp.bfloat16):
    x = normal(3 * seed, (rows, k), dtype, scale=3.0)
    kernel = normal(3 * seed + 1, (k, n), dtype, scale=0.05)
    dy = normal(3 * seed + 2, (rows, n), dtype, scale=1e-3)
    return x, kernel, dy


def _calibrated(x, kernel, dy, recipe=RECIPE):
    """The meta after one step that measured these tensors' amaxes."""
    amaxes = jnp.stack([jnp.max(jnp.abs(t.astype(jnp.float32))) for t in (x, kernel, dy)])
    return fp8.update(fp8.init_meta(recipe), amaxes, recipe)


def _vjp(x, kernel, meta, dy, recipe=RECIPE):
    y, pull = jax.vjp(lambda a, b, p: fp8.matmul(a, b, meta, p, recipe), x, kernel, fp8.probe())
    return y, pull(dy)


def _rel(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("current", [False, True])
def test_fp8_forward_and_backward_follow_the_exact_matmul(current):
    x, kernel, dy = _operands()
    recipe = fp8.Recipe(history=4, current=current)
    meta = _calibrated(x, kernel, dy) if not current else fp8.init_meta(recipe)
    y, (dx, dk, _) = _vjp(x, kernel, meta, dy, recipe)
    x32, k32, g32 = (t.astype(jnp.float32) for t in (x, kernel, dy))
    assert y.dtype == dx.dtype == dk.dtype == jnp.bfloat16
    # e4m3 keeps 3 mantissa bits, e5m2 2: a few percent per element, less over a long sum
    assert _rel(y, x32 @ k32) < 0.05
    assert _rel(dx, g32 @ k32.T) < 0.1
    assert _rel(dk, x32.T @ g32) < 0.1


def test_the_probes_cotangent_is_the_three_amaxes_exactly():
    x, kernel, dy = _operands(1)
    _, (_, _, amaxes) = _vjp(x, kernel, fp8.init_meta(RECIPE), dy)
    expected = [np.max(np.abs(np.asarray(t, np.float32))) for t in (x, kernel, dy)]
    np.testing.assert_array_equal(np.asarray(amaxes), np.asarray(expected, np.float32))


def test_the_step_program_multiplies_f8_operands():
    x, kernel, dy = _operands()
    meta = _calibrated(x, kernel, dy)
    step = jax.jit(lambda a, b, g: _vjp(a, b, meta, g))
    found = _dot_operand_types(step.lower(x, kernel, dy).as_text())
    # forward e4m3 x e4m3; backward e5m2 gradient against e4m3 kernel, e4m3 input against it
    assert found == {("f8E4M3FN", "f8E4M3FN"), ("f8E5M2", "f8E4M3FN"), ("f8E4M3FN", "f8E5M2")}


def test_an_uncalibrated_scale_saturates_and_a_delayed_one_does_not():
    x, kernel, dy = _operands()
    ones = jnp.ones(3)
    assert int(fp8.saturated(x, ones[0], fp8.E4M3)) == 0  # |x| ~ 3 sigma of 3: under 448
    assert int(fp8.saturated(dy * 1e8, ones[2], fp8.E5M2)) > 0
    meta = _calibrated(x, kernel, dy * 1e8)
    assert int(fp8.saturated(dy * 1e8, meta["scale"][2], fp8.E5M2)) == 0


def test_delayed_scaling_rolls_the_history_and_scales_by_its_max():
    meta = fp8.init_meta(fp8.Recipe(history=3))
    recipe = fp8.Recipe(history=3, margin=1)
    for amaxes in ([4.0, 1.0, 2.0], [8.0, 0.5, 1.0], [2.0, 0.25, 4.0], [1.0, 0.1, 1.0]):
        meta = fp8.update(meta, jnp.array(amaxes, jnp.float32), recipe)
    np.testing.assert_array_equal(meta["amax_history"][0], [1.0, 2.0, 8.0])  # 4.0 rolled out
    expected = np.array([8.0 * 2 / 448, 0.5 * 2 / 448, 4.0 * 2 / 57344], np.float32)
    np.testing.assert_array_equal(meta["scale"], expected)


def test_a_non_finite_or_zero_amax_keeps_the_scale():
    meta = fp8.update(fp8.init_meta(RECIPE), jnp.array([2.0, 3.0, 4.0]), RECIPE)
    again = fp8.update(
        {**meta, "amax_history": jnp.zeros_like(meta["amax_history"])},
        jnp.array([0.0, jnp.inf, jnp.nan]),
        RECIPE,
    )
    np.testing.assert_array_equal(again["scale"][0], meta["scale"][0])
    assert bool(jnp.all(jnp.isfinite(again["scale"])))


def test_micro_batches_max_combined_give_the_whole_batchs_amaxes_to_the_bit():
    x, kernel, dy = _operands(2, rows=64)
    meta = _calibrated(x, kernel, dy)

    @jax.jit
    def amaxes(x, dy):
        return _vjp(x, kernel, meta, dy)[1][2]

    whole = amaxes(x, dy)
    for parts in (2, 8):
        combined = None
        for xs, gs in zip(jnp.split(x, parts), jnp.split(dy, parts), strict=True):
            a = amaxes(xs, gs)
            combined = a if combined is None else fp8.combine(combined, a)
        np.testing.assert_array_equal(np.asarray(combined), np.asarray(whole))


def test_a_micro_batchs_gradient_is_quantized_at_the_micro_batch_count_times_the_scale():
    # each of k micro-batches' mean losses gives k times the batch's gradient; the meta's
    # scales are the batch's, so the gradient's is multiplied by k at use: the same codes
    x, kernel, dy = _operands()
    meta = _calibrated(x, kernel, dy)
    _, (dx, dk, _) = _vjp(x, kernel, meta, dy)
    _, (dx8, dk8, _) = _vjp(x, kernel, {**meta, "micro_batches": jnp.float32(8)}, dy * 8)
    np.testing.assert_array_equal(np.asarray(dx8, np.float32), 8 * np.asarray(dx, np.float32))
    np.testing.assert_array_equal(np.asarray(dk8, np.float32), 8 * np.asarray(dk, np.float32))
