"""The model zoo under mixed precision: what each lowered train step computes in which dtype.

For every model the real train step (the recipe around the Trainer's default `loss_fn`) is lowered
from an abstract state, with nothing compiled, and its StableHLO is read: every matmul and
convolution has 16-bit operands, while the normalisation statistics, the softmax and the logits
are fp32.
"""

import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from helpers import load_config, matmul_dtypes

import mptrain
from mptrain import config as config_lib
from mptrain import models
from mptrain.inspect import audit
from mptrain.models import cnn, layers, mlp, resnet
from mptrain.train import trainer as trainer_lib

BATCH = 4
MODELS = {
    "mlp": {"hidden": 16, "num_layers": 2, "num_classes": 10},
    "cnn": {"features": (4, 8), "hidden": 16, "num_classes": 10},
    "resnet": {"stage_sizes": (1, 1), "width": 8, "num_classes": 10},
    "transformer_lm": {"d_model": 32, "num_layers": 1, "num_heads": 2, "d_ff": 64, "max_len": 16},
}
# BatchNorm layers of the (1, 1) ResNet: stem, 2 per block, and the projection into stage 1.
NUM_BATCH_NORMS = 1 + 2 * 2 + 1
NUM_LAYER_NORMS = 2 * MODELS["transformer_lm"]["num_layers"] + 1
SHORT = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def _batch(name):
    rng = np.random.default_rng(0)
    if name == "transformer_lm":
        tokens = rng.integers(0, 256, (BATCH, 17)).astype(np.int32)
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    shape = (BATCH, 32, 32, 3) if name == "resnet" else (BATCH, 28, 28, 1)
    return {
        "inputs": rng.standard_normal(shape).astype(np.float32),
        "targets": rng.integers(0, 10, BATCH).astype(np.int32),
    }


def _trainer(name, precision, tmp_path):
    config = config_lib.base_config()
    config.precision = precision
    config.batch_size = BATCH
    config.model.name = name
    config.model.update(MODELS[name])
    return trainer_lib.Trainer(config, tmp_path)


def lowered_train_step(name, precision, tmp_path):
    """StableHLO of the train step from an abstract state: traced and lowered, not compiled."""
    trainer = _trainer(name, precision, tmp_path)
    state = jax.eval_shape(trainer.init_state, _batch(name))
    step = jax.jit(mptrain.make_train_step(trainer.loss_fn))
    return step.lower(state, _batch(name)).as_text()


@pytest.fixture(scope="module")
def bf16_programs(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("models")
    return {name: lowered_train_step(name, "bf16-mixed", workdir) for name in MODELS}


def _sum_reductions(program, dims):
    """Operand types of the `reduce ... applies stablehlo.add across dimensions = dims` ops."""
    pattern = re.compile(
        r"applies stablehlo\.add across dimensions = \["
        + re.escape(dims)
        + r"\] : \((tensor<[^>]*>)"
    )
    return [m.group(1) for line in program.splitlines() if (m := pattern.search(line))]


def _result_types(program, op):
    return [line.rsplit(":", 1)[-1].strip()
            for line in program.splitlines() if f"stablehlo.{op} " in line]  # fmt: skip


@pytest.mark.parametrize("name", list(MODELS))
def test_every_matmul_and_convolution_is_bf16(bf16_programs, name):
    program = bf16_programs[name]
    dots = matmul_dtypes(program)
    assert len(dots) >= 3, dots  # forward plus the two gradients of at least one layer
    assert all(operands == ("bf16", "bf16") for operands, _ in dots), dots
    if name in ("cnn", "resnet"):
        # Two conv layers at least: forward, kernel gradients, the second's input gradient.
        assert program.count("stablehlo.convolution") >= 5


@pytest.mark.parametrize("name", list(MODELS))
def test_no_step_scatters(bf16_programs, name):
    # A GPU runs a scatter (a gather's gradient, max pooling's select-and-scatter) with atomics:
    # slow in 16 bits and never deterministic. Read on the lowered program: XLA:CPU's optimizer
    # rewrites 16-bit scatters into fp32 ones, so the compiled CPU program would hide them.
    lines = [line for line in bf16_programs[name].splitlines() if "scatter" in line]
    assert not lines, lines


@pytest.mark.parametrize("name", list(MODELS))
def test_softmax_runs_on_fp32_logits(bf16_programs, name):
    exps = _result_types(bf16_programs[name], "exponential")
    assert exps and all(t.endswith("xf32>") for t in exps), exps
    logits = "tensor<4x16x256xf32>" if name == "transformer_lm" else "tensor<4x10xf32>"
    assert logits in exps, exps  # the loss's softmax over the classes sees fp32 logits


@pytest.mark.parametrize("name", list(MODELS))
def test_the_model_returns_fp32_logits_under_bf16(name, tmp_path):
    trainer = _trainer(name, "bf16-mixed", tmp_path)
    batch = _batch(name)
    variables = jax.eval_shape(trainer.init_variables, jax.random.key(0), batch)

    def forward(variables, inputs):  # what eval_fn sees: params and inputs cast to bf16
        params = trainer.policy.cast_to_compute(variables["params"])
        inputs = trainer.policy.cast_to_compute(inputs)
        return trainer.model.apply({**variables, "params": params}, inputs, train=False)

    out = jax.eval_shape(forward, variables, batch["inputs"])
    assert out.dtype == jnp.float32
    assert out.shape[0] == BATCH and out.shape[-1] in (10, 256)


@pytest.mark.parametrize("precision", ["bf16-mixed", "fp16-mixed"])
def test_batch_norm_statistics_are_fp32(bf16_programs, precision, tmp_path):
    program = (
        bf16_programs["resnet"]
        if precision == "bf16-mixed"
        else lowered_train_step("resnet", precision, tmp_path)
    )
    low = SHORT[str(jnp.dtype(mptrain.get_policy(precision).compute_dtype))]
    matmuls = matmul_dtypes(program)
    assert matmuls and all(ops == (low, low) for ops, _ in matmuls), matmuls
    # Mean and mean of squares over batch, height and width: two per BatchNorm in the forward
    # pass (more in the backward pass), every one of them on an fp32 activation.
    stats = [t for t in _sum_reductions(program, "0, 1, 2") if t.count("x") == 4]
    assert len(stats) >= 2 * NUM_BATCH_NORMS, stats
    assert all(t.endswith("xf32>") for t in stats), stats
    rsqrts = _result_types(program, "rsqrt")
    assert len(rsqrts) >= NUM_BATCH_NORMS and all(t.endswith("xf32>") for t in rsqrts), rsqrts


def test_layer_norm_statistics_are_fp32(bf16_programs):
    program = bf16_programs["transformer_lm"]
    d_model = MODELS["transformer_lm"]["d_model"]
    stats = [t for t in _sum_reductions(program, "2") if re.match(rf"tensor<4x16x{d_model}x", t)]
    assert len(stats) >= 2 * NUM_LAYER_NORMS, stats
    assert all(t.endswith("xf32>") for t in stats), stats


@pytest.fixture(scope="module")
def small_resnet_variables():
    model = resnet.ResNet(stage_sizes=(1,), width=4)
    return jax.jit(lambda x: model.init(jax.random.key(0), x, train=False))(
        _batch("resnet")["inputs"]
    )


@pytest.mark.parametrize(
    "dtype",
    [jnp.bfloat16, pytest.param(jnp.float16, marks=pytest.mark.slow)],  # a variant
)
def test_batch_stats_update_in_fp32_and_eval_uses_them(small_resnet_variables, dtype):
    model = resnet.ResNet(stage_sizes=(1,), width=4, dtype=dtype)
    x = jnp.asarray(_batch("resnet")["inputs"], dtype)
    params = jax.tree.map(lambda p: p.astype(dtype), small_resnet_variables["params"])
    stats = small_resnet_variables["batch_stats"]
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(stats))

    @jax.jit
    def train(params, stats):
        return model.apply({"params": params, "batch_stats": stats}, x, train=True, mutable=True)

    @jax.jit
    def evaluate(params, stats):
        variables = {"params": params, "batch_stats": stats}
        return model.apply(variables, x[:1], train=False), model.apply(variables, x, train=False)

    logits, updated = train(params, stats)
    assert logits.dtype == jnp.float32
    new = updated["batch_stats"]
    assert all(s.dtype == jnp.float32 for s in jax.tree.leaves(new))
    # momentum 0.9: the stem's running mean moved a tenth of the way to the batch mean.
    assert np.all(np.abs(np.asarray(new["stem_bn"]["mean"])) > 0)
    # Eval normalises with the running statistics: one example's logits do not depend on the
    # rest of its batch.
    alone, batched = evaluate(params, new)
    np.testing.assert_allclose(alone, batched[:1], atol=1e-2)


def test_create_model_reads_the_config():
    config = ml_collections.ConfigDict(MODELS["cnn"])
    model = cnn.create_model(config, jnp.bfloat16)
    assert (tuple(model.features), model.hidden, model.dtype) == ((4, 8), 16, jnp.bfloat16)
    model = mlp.create_model(ml_collections.ConfigDict({"num_classes": 3}), jnp.float16)
    assert (model.hidden, model.num_layers, model.num_classes) == (256, 2, 3)
    model = resnet.create_model(ml_collections.ConfigDict(), jnp.float32)
    assert tuple(model.stage_sizes) == (2, 2, 2, 2) and model.width == 64  # ResNet-18
    shapes = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, 32, 32, 3)))
    n_params = sum(int(np.prod(p.shape)) for p in jax.tree.leaves(shapes["params"]))
    assert 11.1e6 < n_params < 11.2e6  # the CIFAR ResNet-18's 11.17M


def test_conv_kernels_are_drawn_with_their_fan_in():
    # an "rbg" key: XLA's own bit generator, a program of 13 KB where threefry's is 20 KB,
    # over the threshold by which the suite counts its compiled programs
    init = layers.kernel_init_as_matrix(jax.nn.initializers.he_normal())
    kernel = jax.jit(init, static_argnums=1)(jax.random.key(0, impl="rbg"), (3, 3, 64, 128))
    assert kernel.shape == (3, 3, 64, 128) and kernel.dtype == jnp.float32
    np.testing.assert_allclose(np.std(kernel), np.sqrt(2.0 / (3 * 3 * 64)), rtol=0.05)


@pytest.mark.parametrize("keep_fp32", [None, pytest.param("", marks=pytest.mark.slow)])
def test_a_large_vocabulary_scatters_under_neither_casting_rule(keep_fp32, tmp_path):
    # Above the one-hot size the embedding gathers, and its gradient is a one-hot matmul in
    # chunks (`layers.embed`), not a scatter-add, whether the table reaches it in fp32 (the
    # default rule) or bf16 (every param cast).
    trainer = _trainer("transformer_lm", "bf16-mixed", tmp_path)
    trainer.config.model.vocab_size = layers.ONE_HOT_MAX_VOCAB + 8
    trainer.config.keep_fp32 = keep_fp32
    trainer = trainer_lib.Trainer(trainer.config, tmp_path)
    batch = _batch("transformer_lm")
    state = jax.eval_shape(trainer.init_state, batch)
    report = audit.precision_report(mptrain.make_train_step(trainer.loss_fn), state, batch)
    assert report.hazards == []
    assert report.casting.startswith(f"keep_fp32={trainer.policy.keep_fp32!r}")


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("mnist_cnn", {}),
        ("mnist_cnn", {"model.name": "mlp", "model.hidden": 24}),
        ("cifar10_resnet", {}),
        ("lm_gpt2s", {}),
        ("llama3", {}),
    ],
)
def test_every_model_reads_a_plain_dict_as_it_reads_a_config_dict(name, overrides):
    """A model config as a plain dict (what `hf.load` gives, or `config.to_dict()`) builds the
    model the ConfigDict builds (issue 42, group 6: `errors.settings` read attributes only, so
    a dict built a default-sized model, and a shape error came far from the cause)."""
    config = load_config(name, "tiny", **overrides)
    module = models.import_model(config.model.name)
    from_dict = module.create_model(config.model.to_dict())
    assert from_dict == module.create_model(config.model)
    assert from_dict != module.create_model({})  # the config's own sizes, not the defaults
