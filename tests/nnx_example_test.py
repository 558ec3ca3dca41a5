"""NNX models: examples/nnx_trainer trains from the CLI under every preset, runs its matmuls in
the compute dtype, resumes byte-identically, picks its attention by the zoo's rule; an NNX
module's non-param state is model_state."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import (
    ROOT,
    assert_trees_bytes_equal,
    cudnn_as_xla,
    integers,
    load_config,
    matmul_dtypes,
    normal,
    plain_orbax_state,
    pretend_gpu,
    run_cli,
    run_cli_process,
)

import mptrain
from mptrain.models import nnx as nnx_models

CONFIG = f"--config={ROOT / 'examples' / 'nnx_trainer' / 'config.py'}:tiny"


# A CLI process each, about 15 s cold: make test keeps the example's batch statistics.
@pytest.mark.slow
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"])
def test_trains_from_the_command_line_under_every_preset(precision, tmp_path):
    result = run_cli_process(CONFIG, f"--workdir={tmp_path}", f"--config.precision={precision}")
    assert result.returncode == 0, result.stderr[-3000:]
    state = plain_orbax_state(tmp_path, 8)
    assert "blocks" in state["params"] and int(state["skipped_steps"]) == 0
    assert "mptrain: done: 8 steps" in result.stdout


def _example_trainer(tmp_path, **overrides):
    import sys

    sys.path.insert(0, str(ROOT))  # `examples` importable in-process
    from examples.nnx_trainer.trainer import NNXTrainer

    config = load_config("default", **overrides)
    config.trainer = "examples.nnx_trainer.trainer:NNXTrainer"
    return NNXTrainer(config, tmp_path)


@pytest.mark.slow  # moved by the programs it compiles; make test keeps its batch statistics
def test_bf16_mixed_step_runs_its_matmuls_in_bf16_and_scatters_nothing(tmp_path):
    trainer = _example_trainer(tmp_path)
    batch = trainer.build_datasets()[0].get_batch(0)
    state = trainer.init_state(batch)
    assert {x.dtype for x in jax.tree.leaves(state.params)} == {jnp.dtype("float32")}
    step = jax.jit(mptrain.make_train_step(trainer.loss_fn))
    program = step.lower(state, batch).as_text()
    dots = matmul_dtypes(program)
    assert len(dots) >= 10
    for operands, _ in dots:
        assert set(operands) == {"bf16"}, dots
    assert "scatter" not in program  # the embedding is a one-hot matmul (see the example)


@pytest.mark.slow  # a variant: make test keeps the example's batch statistics
def test_per_layer_numerics_on_an_nnx_model_record_nothing_and_harm_nothing(tmp_path):
    # the recorder intercepts linen module calls; an NNX model trains with an empty table
    assert run_cli(tmp_path, "--config.numerics.per_layer=True", config=CONFIG)[0] == 0
    assert int(plain_orbax_state(tmp_path, 8)["step"]) == 8


@pytest.mark.slow  # a variant: trainer_test keeps byte-identical resume
def test_resume_is_byte_identical(tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    common = ("--config.optimizer.schedule=constant",)
    assert run_cli(straight, *common, config=CONFIG)[0] == 0
    assert run_cli(resumed, *common, "--config.num_train_steps=4", config=CONFIG)[0] == 0
    assert run_cli(resumed, *common, config=CONFIG)[0] == 0
    assert_trees_bytes_equal(plain_orbax_state(straight, 8), plain_orbax_state(resumed, 8))


class Normed(nnx.Module):
    def __init__(self, rngs):
        self.dense = nnx.Linear(8, 16, rngs=rngs)
        self.bn = nnx.BatchNorm(16, rngs=rngs)
        self.out = nnx.Linear(16, 1, rngs=rngs)

    def __call__(self, x):
        return self.out(self.bn(self.dense(x)))


def test_an_nnx_modules_batch_statistics_are_model_state_and_skips_keep_them():
    model = nnx_models.wrap(nnx.jit(lambda: Normed(nnx.Rngs(0)))())
    variables = model.init(None)
    assert set(variables) == {"params", "nnx_state"}
    assert set(variables["nnx_state"]["bn"]) == {"mean", "var"}

    def loss_fn(params, model_state, batch, rng):
        variables = {"params": params, **model_state}
        pred, new_state = model.apply(variables, batch["x"], train=True, mutable=["nnx_state"])
        return jnp.mean((pred[:, 0].astype(jnp.float32) - batch["y"]) ** 2), (new_state, {})

    state = mptrain.TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=optax.adam(1e-2),
        policy="bf16-mixed",
        model_state={"nnx_state": variables["nnx_state"]},
    )
    batch = {"x": normal(1, (32, 8)) + 3.0, "y": jnp.ones((32,))}
    step = jax.jit(mptrain.make_train_step(loss_fn))
    state, metrics = step(state, batch)
    mean = np.asarray(state.model_state["nnx_state"]["bn"]["mean"])
    assert bool(metrics["applied"]) and np.abs(mean).max() > 0  # the statistics moved
    assert mean.dtype == np.float32  # kept in fp32, like linen's batch_stats
    before = jax.device_get(state)
    after, metrics = step(state, {**batch, "x": batch["x"].at[0, 0].set(jnp.nan)})
    assert not bool(metrics["applied"])
    assert_trees_bytes_equal(after.model_state, before.model_state)


def test_nnx_rngs_held_by_the_module_are_refused_with_a_clear_error():
    class Dropping(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 4, rngs=rngs)
            self.drop = nnx.Dropout(0.1, rngs=rngs)

    with pytest.raises(ValueError, match="nnx.Rngs"):
        nnx_models.wrap(Dropping(nnx.Rngs(0)))


@pytest.mark.slow  # a variant: make test keeps the example's batch statistics
def test_the_example_chooses_attention_by_the_zoos_rule_and_keeps_its_params(monkeypatch):
    import sys

    sys.path.insert(0, str(ROOT))
    from examples.nnx_trainer.trainer import ByteLM

    dims = (32, 2, 4, 64, 16)  # d_model, layers, heads (of 8), d_ff, max_len
    tokens = integers(1, (2, 16), 256)
    # built under one jit: each parameter's initialiser run eagerly is a program of its own
    build = lambda *args: nnx.jit(lambda: ByteLM(*dims, *args, rngs=nnx.Rngs(0)))()
    materialized = build(jnp.bfloat16, "materialized")
    pretend_gpu(monkeypatch)
    asked = cudnn_as_xla(monkeypatch)
    fused = build(jnp.bfloat16, "auto")  # cuDNN on the pretend H100
    assert [block.attention for block in fused.blocks] == ["cudnn", "cudnn"]
    # The same params under the same names as before the choice existed, whichever runs.
    params = nnx.state(fused, nnx.Param)
    assert_trees_bytes_equal(params, nnx.state(materialized, nnx.Param))
    assert params["blocks"][0]["qkv"]["kernel"].shape == (32, 96)
    assert params["blocks"][1]["out"]["kernel"].shape == (32, 32)
    logits = jax.jit(lambda m, t: m(t))(fused, tokens)
    assert asked == ["cudnn", "cudnn"]  # both blocks went through attention.causal_attention
    want = jax.jit(lambda m, t: m(t))(materialized, tokens)
    np.testing.assert_allclose(logits, want, atol=0.1)
    # An fp32 model takes the materialised path even on a GPU.
    fp32 = build(jnp.float32, "auto")
    assert [block.attention for block in fp32.blocks] == ["materialized", "materialized"]
