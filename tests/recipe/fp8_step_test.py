"""`precision="fp8-mixed"`: the transformer's dense layers in fp8, their scaling state in the
train state (checkpointed, resumed, untouched by a skipped step)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    TINY,
    assert_trees_bytes_equal,
    event_series,
    event_tags,
    load_config,
    needs_devices,
    plain_orbax_state,
    run_cli,
    tiny_config,
)

import mptrain
from mptrain import config as config_lib
from mptrain.inspect import audit
from mptrain.recipe import fp8, fp8_names, precision

FP8 = {"precision": "fp8-mixed", "num_train_steps": 4}


def _trainer(tmp_path, **overrides):
    return mptrain.Trainer(tiny_config(**{**FP8, **overrides}), tmp_path)


def _one_step(trainer):
    train, _ = trainer.build_datasets()
    state = trainer.init_state()
    step = jax.jit(mptrain.make_train_step(trainer.loss_fn))
    return state, step, train.get_batch(0)


def test_the_preset_is_bf16_mixed_with_fp8_matmuls():
    policy = precision.get_policy("fp8-mixed")
    assert policy.fp8 and policy.compute_dtype == jnp.bfloat16 and policy.param_dtype == jnp.float32
    assert str(policy) == "params=float32,compute=bfloat16,output=float32,fp8"
    assert precision.get_policy(str(policy)) == policy  # the form a checkpoint's meta records
    assert not precision.get_policy("bf16-mixed").fp8


def test_the_step_runs_the_dense_layers_in_fp8_and_the_rest_in_bf16(tmp_path):
    trainer = _trainer(tmp_path)
    state, step, batch = _one_step(trainer)
    report = audit.precision_report(step, state, batch)
    flops = report.matmul_flops
    assert flops.get("float8_e4m3fn", 0) > 0 and flops.get("float8_e5m2", 0) > 0
    assert flops.get("bfloat16", 0) > 0  # the head, the attention scores: not selected
    assert report.compute_fraction == 1.0 and not report.warnings
    assert "fp8 matmuls (" in str(report) and "block_0/attn/qkv" not in report.fp8
    assert report.fp8 == "attn/out, attn/qkv, mlp/fc_in, mlp/fc_out in layer 0 (4 matmuls)"
    assert "scatter" not in step.lower(state, batch).as_text()  # the fp8 bookkeeping included
    # every projection of every block has its scaling state; the head and embedding have none
    metas = state.model_state[fp8.META]["block_0"]
    assert set(metas["attn"]) == {"qkv", "out"} and set(metas["mlp"]) == {"fc_in", "fc_out"}
    assert "head" not in state.model_state[fp8.META]


def test_a_finite_step_records_the_amaxes_and_moves_the_scales(tmp_path):
    state, step, batch = _one_step(_trainer(tmp_path))
    new, metrics = step(state, batch)
    assert bool(metrics["applied"])
    flat = jax.tree_util.tree_flatten_with_path(new.model_state[fp8.META])[0]
    histories = [x for path, x in flat if "amax_history" in jax.tree_util.keystr(path)]
    scales = [x for path, x in flat if "scale" in jax.tree_util.keystr(path)]
    assert histories and all(bool(jnp.all(h[:, 0] > 0)) for h in histories)
    assert all(bool(jnp.all(h[:, 1:] == 0)) for h in histories)  # one step: one entry
    assert all(not bool(jnp.all(s == 1.0)) for s in scales)


class PoisonedTrainer(mptrain.Trainer):
    """Its loss is infinite when the batch's first token is even: a non-finite step."""

    def loss_fn(self, params, model_state, batch, rng):
        loss, rest = super().loss_fn(params, model_state, batch, rng)
        return loss * jnp.where(batch["inputs"][0, 0] % 2 == 0, jnp.inf, 1.0), rest


def test_a_skipped_step_leaves_the_fp8_state_bit_identical(tmp_path):
    trainer = PoisonedTrainer(tiny_config(**FP8), tmp_path)
    state, step, batch = _one_step(trainer)
    inputs = np.array(batch["inputs"])
    inputs[0, 0] = 2
    batch = {**batch, "inputs": inputs}
    new, metrics = step(state, batch)
    assert not bool(metrics["applied"])
    assert_trees_bytes_equal(jax.device_get(new.model_state), jax.device_get(state.model_state))


@pytest.mark.slow  # the resume is the Trainer's: trainer_test keeps byte-identical resume
def test_a_resumed_fp8_run_equals_the_uninterrupted_one(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    flags = ["--config.precision=fp8-mixed", "--config.optimizer.schedule=constant"]
    assert run_cli(straight, *flags, "--config.num_train_steps=8")[0] == 0
    assert run_cli(resumed, *flags, "--config.num_train_steps=4")[0] == 0
    assert run_cli(resumed, *flags, "--config.num_train_steps=8")[0] == 0
    state = plain_orbax_state(resumed, 8)
    assert state["model_state"][fp8.META]  # the scaling state was saved
    assert_trees_bytes_equal(plain_orbax_state(straight, 8), state)


@pytest.mark.slow  # make test keeps the resume on one mesh; a 4x2 mesh compiles twice more
@needs_devices(8)
def test_an_fp8_checkpoint_from_a_4x2_mesh_resumes_on_one_device(tmp_path):
    wide = _trainer(tmp_path, **{"mesh.data": 4, "mesh.fsdp": 2})
    wide.train_and_evaluate()
    saved = plain_orbax_state(tmp_path, 4)
    one = _trainer(tmp_path, **{"num_train_steps": 8, "mesh.data": 1, "mesh.fsdp": 1})
    final = one.train_and_evaluate()
    assert int(final.step) == 8 and np.isfinite(one.last_eval["eval_loss"])
    history = jax.tree.leaves(saved["model_state"][fp8.META])[0]
    assert history.shape == (3, fp8.Recipe().history) and history[:, 0].max() > 0


@pytest.mark.parametrize("name", ["mnist_cnn", "cifar10_resnet"])
def test_fp8_on_a_model_without_fp8_layers_is_a_config_error(name, tmp_path, capsys):
    config = load_config(name, precision="fp8-mixed")
    with pytest.raises(ValueError, match="has no fp8 matmuls"):
        config_lib.validate(config)
    code, err = run_cli(
        tmp_path / "run",
        "--config.precision=fp8-mixed",
        capsys=capsys,
        config=TINY.replace("default.py", f"{name}.py"),
    )
    assert code == 2 and "has no fp8 matmuls" in err and not (tmp_path / "run").exists()


@pytest.mark.slow  # a run: make test keeps fp8's steps, skips and the recipe's choices
def test_micro_batches_of_one_batch_give_one_history_entry_with_the_batchs_amaxes(tmp_path):
    whole = _trainer(tmp_path / "whole").build_datasets()[0].get_batch(0)  # 8 sequences
    after = {}
    for k in (1, 2, 8):
        overrides = {"optimizer.accumulation_steps": k, "batch_size": 8 // k, "num_train_steps": 8}
        trainer = _trainer(tmp_path / str(k), **overrides)
        state = trainer.init_state(whole)
        step = jax.jit(mptrain.make_train_step(trainer.loss_fn))
        for part in range(k):
            micro = jax.tree.map(lambda x, part=part, k=k: np.split(x, k)[part], whole)
            state, metrics = step(state, micro)
            assert bool(metrics["applied"])
        after[k] = jax.device_get(state.model_state[fp8.META])
    metas = {k: [m for path, m in _metas(tree)] for k, tree in after.items()}
    for one in metas[1]:
        assert one["amax_history"][:, 0].min() > 0 and one["amax_history"][:, 1:].max() == 0
        assert one["pending"].max() == 0  # the update took it
    for k in (2, 8):
        for one, other in zip(metas[1], metas[k], strict=True):
            # input and kernel amaxes: the same bits however the batch was split
            np.testing.assert_array_equal(other["amax_history"][:2], one["amax_history"][:2])
            np.testing.assert_array_equal(other["scale"][:2], one["scale"][:2])
            # the gradient's: close, not equal: a first step quantizes each micro-batch's
            # gradient by its own amax (no history yet), so the gradients carried back differ
            # a little, and XLA compiles the backward of a batch of 1 differently
            np.testing.assert_allclose(other["amax_history"][2], one["amax_history"][2], rtol=0.1)
    for k in (1, 2, 8):  # what a micro-batch's gradient scale is multiplied by
        assert all(float(m["micro_batches"]) == k for m in metas[k])


def _metas(tree):
    from flax import traverse_util

    flat = traverse_util.flatten_dict(tree)
    layers = sorted({path[: path.index("meta")] for path in flat})
    return [
        (layer, {p[-1]: v for p, v in flat.items() if p[: len(layer)] == layer}) for layer in layers
    ]


def test_an_update_whose_amax_outgrew_its_scale_is_counted():
    recipe = fp8.Recipe(history=4)
    meta = fp8.update(fp8.init_meta(recipe), jnp.array([2.0, 2.0, 2.0]), recipe)  # scales 1 held
    np.testing.assert_array_equal(meta["saturated"], [0, 0, 0])
    meta = fp8.update(meta, jnp.array([2.0, 1e4, 2.0]), recipe)  # 1e4 > 448 x 2/448
    np.testing.assert_array_equal(meta["saturated"], [0, 1, 0])


@pytest.mark.slow  # a run: make test keeps fp8's steps, skips and the recipe's choices
def test_a_layer_clipped_again_and_again_is_named_at_the_log_step(tmp_path, monkeypatch, caplog):
    # scales stuck at 1e-6: every fp8 operand saturates at every update
    real_init = fp8.init_meta
    monkeypatch.setattr(fp8, "init_meta", lambda r: {**real_init(r), "scale": jnp.full(3, 1e-6)})
    monkeypatch.setattr(fp8, "scale_for", lambda amax, fp8_max, margin, previous: previous)
    caplog.set_level("WARNING")
    trainer = _trainer(tmp_path, **{"num_train_steps": 4, "log_every_steps": 2})
    trainer.train_and_evaluate()
    warned = [r.getMessage() for r in caplog.records if "fp8 values clipped" in r.getMessage()]
    assert warned and "block_0/mlp/fc_in x (2x)" in warned[0], warned
    tags = event_tags(tmp_path)  # per layer and tensor, in TensorBoard
    assert {"fp8_amax/block_0/mlp/fc_in/grad", "fp8_clipped/block_0/attn/qkv/x"} <= tags
    clipped = event_series(tmp_path, "fp8_clipped/block_0/mlp/fc_in/x")
    assert clipped[2] == 2 and clipped[4] == 4  # every update clipped
    names = fp8_names.counter_names(trainer.init_state().model_state)
    assert names[:3] == ["block_0/attn/out x", "block_0/attn/out kernel", "block_0/attn/out grad"]


@pytest.mark.parametrize(
    "key, value", [("fp8.scaling", "just-in-time"), ("fp8.history", 0), ("fp8.margin", -1)]
)
def test_a_bad_fp8_setting_exits_2_naming_it(key, value, tmp_path, capsys):
    code, err = run_cli(tmp_path / "run", f"--config.{key}={value}", capsys=capsys)
    assert code == 2 and f"config.{key}=" in err and not (tmp_path / "run").exists()


@pytest.mark.slow  # moved by the programs it compiles; make test keeps fp8's steps
def test_the_config_chooses_the_recipe_the_layers_and_the_step_use(tmp_path):
    config = tiny_config(**{**FP8, "fp8.scaling": "current", "fp8.history": 16, "fp8.margin": 2})
    recipe = config_lib.policy_of(config).fp8
    assert recipe == fp8.Recipe(history=16, margin=2, current=True)
    trainer = mptrain.Trainer(config, tmp_path)
    state, step, batch = _one_step(trainer)
    meta = jax.tree.leaves(state.model_state[fp8.META])[0]
    assert meta.shape == (3, 16)  # the layers' history length
    new, _ = step(state, batch)
    (one,) = [m for path, m in _metas(jax.device_get(new.model_state[fp8.META]))][:1]
    amax = one["amax_history"][:, 0]
    np.testing.assert_allclose(one["scale"], amax * 4 / np.array([448, 448, 57344]), rtol=1e-6)
