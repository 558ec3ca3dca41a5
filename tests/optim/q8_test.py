"""8-bit block-quantized Adam moments ("q8"): the quantizer's error bounds, the bytes they
save, skips that leave them alone, and checkpoints that resume them exactly and on other meshes."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import (
    COMPILERS,
    assert_trees_bytes_equal,
    needs_devices,
    normal,
    plain_orbax_state,
    run_cli,
    tiny_config,
)

import mptrain
from mptrain import config as config_lib
from mptrain import optim
from mptrain.inspect import audit
from mptrain.optim import q8


def make_optimizer(config, **kwargs):
    """`optim.make_optimizer` as a run calls it: the config's optimizer section, its length."""
    return optim.make_optimizer(
        config.optimizer, config.num_train_steps, seed=config.seed, **kwargs
    )


CODE_MAX = 448.0  # e4m3's largest finite value: a block's largest magnitude maps onto it


def _blockwise(x, block=256):
    return np.asarray(x, np.float64).reshape(-1, block)


def _decades(shape, seed=0):
    """Values spanning 5 decades inside every block, with both signs."""
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape) * np.logspace(-5, 0, shape[-1])).astype(np.float32)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("kind", ["signed", "sqrt"])
def test_round_trip_error_is_bounded_in_every_block(kind, stochastic):
    x = _decades((32, 512))
    values = np.abs(x) if kind == "sqrt" else x
    key = jax.random.key(3) if stochastic else None
    q = q8.quantize(jnp.asarray(values), kind, key=key)
    assert q.codes.dtype == jnp.uint8 and q.codes.shape == x.shape
    assert q.scales.dtype == jnp.float32 and q.scales.shape == (32, 2)
    coded = np.sqrt(values) if kind == "sqrt" else values  # what the codes stand for
    back = np.asarray(q8.dequantize(q))
    back_coded = np.sqrt(back) if kind == "sqrt" else back
    scale = _blockwise(coded).__abs__().max(axis=1, keepdims=True) / CODE_MAX
    err = np.abs(_blockwise(back_coded) - _blockwise(coded))
    # e4m3: 3 mantissa bits, so half a step is 1/16 of the value (a whole step rounding
    # stochastically), and steps of 2^-9 of the scale below its normal range
    relative, floor = (1 / 8, 2.0**-9) if stochastic else (1 / 16, 2.0**-10)
    bound = np.maximum(relative * np.abs(_blockwise(coded)), floor * scale) * (1 + 1e-6)
    assert np.all(err <= bound)


@pytest.mark.parametrize("stochastic", [False, True], ids=["nearest", "stochastic"])
@pytest.mark.parametrize("compiler", COMPILERS)
@pytest.mark.parametrize("kind", q8.KINDS)
def test_a_compiled_round_trip_rounds_as_the_op_by_op_one(kind, compiler, stochastic):
    """Quantized and read back in one program, the codes must still round: XLA folds the uint8
    bitcasts, and a compiler allowed excess precision may then skip a cast's rounding."""
    values = _decades((8, 512))
    values = np.abs(values) if kind == "sqrt" else values
    key = jax.random.key(3) if stochastic else None
    trip = lambda x: q8.dequantize(q8.quantize(x, kind, key=key))
    with jax.disable_jit():  # op by op: every cast rounds
        want = np.asarray(trip(values))
    np.testing.assert_array_equal(jax.jit(COMPILERS[compiler](trip))(values), want)


@pytest.mark.parametrize("compiler", COMPILERS)
def test_stochastic_codes_are_unbiased(compiler):
    x = jnp.full((256,), 0.0, jnp.float32).at[0].set(1.0).at[1:].set(0.3)  # 0.3: between codes
    compiled = lambda fn: jax.jit(COMPILERS[compiler](fn))
    trip = compiled(lambda x, key: q8.dequantize(q8.quantize(x, "signed", key=key)))
    means = np.mean([np.asarray(trip(x, jax.random.key(i))) for i in range(400)], axis=0)
    nearest = np.asarray(compiled(lambda x: q8.dequantize(q8.quantize(x, "signed")))(x))
    assert abs(nearest[1] - 0.3) > 3e-3  # rounded to nearest, 0.3 is off by 0.4% ...
    assert abs(means[1:].mean() - 0.3) < 3e-4  # ... stochastically, right on average


def test_zeros_huge_values_and_a_block_of_equal_values():
    zeros = q8.quantize(jnp.zeros((4, 256)), "signed")
    assert not np.any(np.asarray(zeros.scales)) and not np.any(np.asarray(q8.dequantize(zeros)))
    huge = jnp.full((256,), 3e37, jnp.float32).at[7].set(-1e38)
    np.testing.assert_allclose(q8.dequantize(q8.quantize(huge, "signed")), huge, rtol=1 / 16)
    for kind in q8.KINDS:
        same = jnp.full((512,), 0.0123, jnp.float32)
        np.testing.assert_allclose(q8.dequantize(q8.quantize(same, kind)), same, rtol=1e-6)


def test_non_finite_input_gives_non_finite_codes():
    x = jnp.ones((256,)).at[5].set(jnp.inf)
    assert not np.all(np.isfinite(np.asarray(q8.dequantize(q8.quantize(x, "signed")))))


def test_blocks_follow_the_global_shape_only():
    assert q8.scales_shape((128, 1024), 256) == (128, 4)  # rows of whole blocks
    assert q8.scales_shape((64, 4, 64), 256) == (64, 1)  # (4, 64) is one block
    assert q8.scales_shape((4097,), 256) == (17,)  # flattened, the last block padded
    assert not q8.quantized((64, 63)) and q8.quantized((64, 64))  # the 4096-element threshold
    # a leading split carries the scales with it; a split inside the blocks splits the blocks
    assert q8.scales_spec(("fsdp", None), (128, 1024), 256, 2) == ("fsdp", None)
    assert q8.scales_spec((None, "fsdp"), (128, 1024), 256, 2) == (None, "fsdp")
    assert q8.scales_spec((None, "fsdp"), (128, 256), 256, 2) == (None, None)
    # each axis by its own size: a tensor group of 8 over a 70B's k projection's 4 blocks
    sizes = {"fsdp": 2, "tensor": 8}
    spec = (None, "fsdp", "tensor")
    assert q8.scales_spec(spec, (80, 8192, 1024), 256, sizes) == (None, "fsdp", None)


class Wide(nn.Module):
    """Every tensor above the 4096-element threshold (no biases)."""

    @nn.compact
    def __call__(self, x):
        x = nn.Dense(256, use_bias=False)(x)
        return nn.Dense(128, use_bias=False)(nn.relu(x))


@pytest.mark.parametrize(
    "precision, rounding, param_bytes, bound",
    [("bf16-mixed", "nearest", 4, 6.05), ("bf16-pure", "stochastic", 2, 4.05)],
)
def test_bytes_per_parameter_with_q8_moments(precision, rounding, param_bytes, bound):
    config = config_lib.base_config()
    config.optimizer.mu_dtype = config.optimizer.nu_dtype = "q8"
    tx, _ = make_optimizer(config)
    model = Wide()
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.ones((1, 128)))["params"]
    params = jax.tree.map(lambda s: np.ones(s.shape, s.dtype), shapes)  # its bytes, not values
    state = mptrain.TrainState.create(
        apply_fn=model.apply, params=params, tx=tx, policy=precision, param_rounding=rounding
    )
    leaves = jax.tree.leaves(state.opt_state)
    assert {x.dtype.name for x in leaves if x.ndim} == {"uint8", "float32"}
    per_param = audit.state_bytes_per_param(state.params, state.opt_state)
    assert per_param <= bound
    assert per_param == param_bytes + 2 * (1 + 4 / 256)  # two moments: codes + a scale a block


def _quadratic():
    def loss_fn(params, model_state, batch, rng):
        del rng
        pred = batch["x"] @ params["w"]
        return jnp.mean((pred.astype(jnp.float32) - batch["y"]) ** 2), (model_state, {})

    x = normal(0, (16, 64))
    return loss_fn, {"x": x, "y": x @ jnp.ones((64, 128))}


def test_a_skipped_step_leaves_the_8_bit_state_bit_identical():
    loss_fn, batch = _quadratic()
    tx = optim.adamw(1e-2, mu_dtype="q8", nu_dtype="q8")
    state = mptrain.TrainState.create(
        apply_fn=None, params={"w": jnp.zeros((64, 128))}, tx=tx, policy="bf16-mixed"
    )
    step = jax.jit(mptrain.make_train_step(loss_fn))
    state, _ = step(state, batch)
    assert q8.is_q8(state.opt_state[0].mu["w"])
    before = jax.device_get(state)
    after, metrics = step(state, {"x": batch["x"].at[0, 0].set(jnp.inf), "y": batch["y"]})
    assert not bool(metrics["applied"])
    assert_trees_bytes_equal(after.opt_state, before.opt_state)
    assert_trees_bytes_equal(after.params, before.params)


def test_q8_adam_follows_fp32_adam_on_a_quadratic():
    loss_fn, batch = _quadratic()
    final = {}
    for dtype in ("float32", "q8"):
        tx = optim.adamw(3e-2, mu_dtype=dtype, nu_dtype=dtype)
        state = mptrain.TrainState.create(
            apply_fn=None, params={"w": jnp.zeros((64, 128))}, tx=tx, policy="fp32"
        )
        step = jax.jit(mptrain.make_train_step(loss_fn))
        for _ in range(200):
            state, metrics = step(state, batch)
        final[dtype] = float(metrics["loss"])
    assert final["float32"] < 0.05  # it learns ...
    assert final["q8"] < 1.5 * final["float32"] + 0.01  # ... and 8-bit moments as well


Q8_FLAGS = ["--config.optimizer.mu_dtype=q8", "--config.optimizer.nu_dtype=q8"]
SMALL = "--config.optimizer.q8_min_size=1024"  # more of the tiny model's tensors in 8 bits
CONSTANT = "--config.optimizer.schedule=constant"  # a 4-step run is the first half of an 8-step one


@pytest.mark.slow  # the resume is the Trainer's: trainer_test keeps byte-identical resume
def test_a_resumed_q8_run_equals_the_uninterrupted_one(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert run_cli(straight, *Q8_FLAGS, SMALL, CONSTANT, "--config.num_train_steps=8")[0] == 0
    assert run_cli(resumed, *Q8_FLAGS, SMALL, CONSTANT, "--config.num_train_steps=4")[0] == 0
    assert run_cli(resumed, *Q8_FLAGS, SMALL, CONSTANT, "--config.num_train_steps=8")[0] == 0
    state = plain_orbax_state(resumed, 8)
    assert state["opt_state"]  # 8-bit codes were saved
    codes = [x for x in jax.tree.leaves(state["opt_state"]) if x.dtype == np.uint8]
    assert len(codes) >= 8
    assert_trees_bytes_equal(plain_orbax_state(straight, 8), state)


@pytest.mark.slow  # make test keeps the resume on one mesh; a 4x2 mesh compiles twice more
@needs_devices(8)
def test_a_q8_checkpoint_from_a_4x2_mesh_resumes_on_one_device(tmp_path):
    overrides = {"optimizer.mu_dtype": "q8", "optimizer.nu_dtype": "q8"}
    overrides |= {"optimizer.q8_min_size": 1024, "num_train_steps": 4}
    wide = mptrain.Trainer(tiny_config(**overrides, **{"mesh.data": 4, "mesh.fsdp": 2}), tmp_path)
    state = wide.train_and_evaluate()
    mu = [x for x in jax.tree.leaves(state.opt_state, is_leaf=q8.is_q8) if q8.is_q8(x)]
    assert any("fsdp" in str(x.codes.sharding.spec) for x in mu)  # split as its tensor
    saved = plain_orbax_state(tmp_path, 4)
    one = mptrain.Trainer(
        tiny_config(**{**overrides, "num_train_steps": 8, "mesh.data": 1, "mesh.fsdp": 1}),
        tmp_path,
    )
    final = one.train_and_evaluate()
    assert int(final.step) == 8 and len(jax.tree.leaves(final.params)[0].sharding.device_set) == 1
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["4", "8"]
    assert np.isfinite(one.last_eval["eval_loss"])
    codes = [x for x in jax.tree.leaves(saved["opt_state"]) if x.dtype == np.uint8]
    assert codes  # the 4x2 checkpoint held 8-bit state, and one device took it up


def test_sgd_refuses_q8_naming_the_key():
    config = config_lib.base_config()
    config.optimizer.name, config.optimizer.mu_dtype = "sgd", "q8"
    with pytest.raises(ValueError, match="optimizer.mu_dtype='q8'"):
        make_optimizer(config)


def test_q8_rounded_to_nearest_draws_a_warning():
    config = config_lib.base_config()
    config.optimizer.nu_dtype, config.optimizer.moment_rounding = "q8", "nearest"
    assert any("nu_dtype='q8'" in w for w in audit.setup_warnings(config))
    config.optimizer.moment_rounding = "stochastic"
    assert not audit.setup_warnings(config)


def test_optax_chain_state_round_trips_through_tree_map():
    tx = optim.adamw(1e-3, mu_dtype="q8", nu_dtype="q8")
    state = tx.init({"w": jnp.zeros((64, 128))})
    again = jax.tree.map(lambda x: x, state)
    assert jax.tree.structure(again) == jax.tree.structure(state)
    assert isinstance(optax.tree_utils.tree_get(state, "count"), jax.Array)
