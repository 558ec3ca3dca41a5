"""MXFP8 (`fp8.scaling="mxfp8"`): blocks of 32 along the contracted axis, each with its own
power-of-two scale and e4m3 values; emulated on a CPU, compiled to cuDNN's block-scaled GEMM for
a B200 (the plan's test)."""

import jax
import jax.numpy as jnp
import numpy as np
from helpers import load_config

import mptrain
from mptrain import config as config_lib
from mptrain.inspect import audit
from mptrain.recipe import fp8, fp8_names, mxfp8


def test_each_block_of_32_keeps_its_own_scale_so_an_outlier_costs_only_its_block():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32) * 1e-3
    x[0, 0] = 1e3  # an outlier in the first block of row 0
    q = np.asarray(mxfp8.quantize(jnp.asarray(x), axis=1))
    rel = np.abs(q - x) / np.abs(x)
    # e4m3 keeps 3 mantissa bits: at most 2**-4 relative for values within 2**6 of their
    # block's amax (below that they reach e4m3's subnormals)
    block_max = np.repeat(np.abs(x).reshape(4, 2, 32).max(axis=2), 32, axis=1)
    normal = np.abs(x) >= block_max / 64
    assert rel[normal].max() <= 2**-4 and normal[1:].mean() > 0.9
    assert rel[0, 32:][normal[0, 32:]].max() <= 2**-4  # the outlier's row, its other block
    assert (q[0, 1:32] == 0).mean() > 0.9  # a per-tensor scale would do that to every value
    # the scales are powers of two: a block times 2**k quantizes to the same block times 2**k
    np.testing.assert_array_equal(mxfp8.quantize(jnp.asarray(x * 8.0), 1), q * 8.0)
    # along axis 0: the same as the transpose along axis 1
    np.testing.assert_array_equal(mxfp8.quantize(jnp.asarray(x.T), 0), q.T)


def test_the_emulated_matmul_quantizes_forward_and_both_gradients_along_their_contraction():
    rng = np.random.default_rng(1)
    x, k, g = (
        jnp.asarray(rng.standard_normal(s), jnp.float32) for s in [(64, 96), (96, 32), (64, 32)]
    )
    y, vjp = jax.vjp(mxfp8.emulated, x, k)
    dx, dk = vjp(g)
    q = mxfp8.quantize
    np.testing.assert_allclose(y, q(x, 1) @ q(k, 0), rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(dx, q(g, 1) @ q(k, 1).T, rtol=1e-6, atol=1e-5)
    np.testing.assert_allclose(dk, q(x, 0).T @ q(g, 0), rtol=1e-6, atol=1e-5)
    for got, exact in ((y, x @ k), (dx, g @ k.T), (dk, x.T @ g)):  # near the exact products
        assert np.abs(got - exact).max() < 0.1 * np.abs(exact).max()
    # the probe's gradient: the amaxes of input, kernel and incoming gradient
    _, vjp = jax.vjp(lambda p: mxfp8.matmul(x, k, p, True), fp8.probe())
    np.testing.assert_allclose(vjp(g)[0], [jnp.abs(x).max(), jnp.abs(k).max(), jnp.abs(g).max()])


def test_mxfp8_is_a_scaling_that_keeps_no_scales_and_trains_the_tiny_llama(tmp_path):
    config = load_config(
        "llama3",
        "tiny",
        **{
            "precision": "fp8-mixed",
            "fp8.scaling": "mxfp8",
            "fp8.bf16_layers": 0,
            "fp8.min_size": 0,
        },
    )
    recipe = config_lib.policy_of(config).fp8
    assert recipe.block and not recipe.current and not recipe.emulate
    trainer = mptrain.Trainer(config, tmp_path)
    assert trainer.model.fp8.emulate  # a CPU: the emulation
    state = trainer.init_state()
    # the MLP's 344 features are no multiple of 32: its matmuls stay bf16
    want = "attn/k, attn/o, attn/q, attn/v in layers 0-1 (8 matmuls)"
    assert fp8_names.describe(state.model_state) == want
    step = jax.jit(mptrain.make_train_step(trainer.loss_fn))
    train = trainer.build_datasets()[0]
    # the emulation's matmuls take bf16 operands (MXFP8 values are exact in bf16): the report
    # sees the compute dtype, not an fp32 matmul to warn about
    report = audit.precision_report(step, state, train.get_batch(0))
    assert report.compute_fraction == 1.0 and not report.warnings, str(report)
    said = f"fp8 matmuls (MXFP8 emulated: rounded to its blocks, multiplied in bfloat16): {want}"
    assert said in str(report).splitlines(), str(report)
    losses = []
    for i in range(4):
        state, metrics = step(state, train.get_batch(i))
        losses.append(float(metrics["loss"]))
    assert np.isfinite(losses).all() and losses[-1] < losses[0]
    history = jax.tree.leaves(state.model_state[fp8.META])[0]  # amaxes logged per layer
    assert history.shape[:2] == (2, 3) and (history[:, :, :4] > 0).all()
    assert int(np.asarray(fp8.counters(state.model_state)).sum()) == 0  # nothing "clipped"
