import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mptrain import dtypes
from mptrain.parallel import axes
from mptrain.recipe import precision


@pytest.mark.parametrize(
    "spec, dtypes",
    [
        ("fp32", ("float32", "float32", "float32")),
        ("bf16-mixed", ("float32", "bfloat16", "float32")),
        ("fp16-mixed", ("float32", "float16", "float32")),
        ("bf16-pure", ("bfloat16", "bfloat16", "float32")),
        ("params=float32,compute=bfloat16,output=float32", ("float32", "bfloat16", "float32")),
        ("p=f32,c=f16,o=bf16", ("float32", "float16", "bfloat16")),
        (" C=bf16, P=bf16, o=f32 ", ("bfloat16", "bfloat16", "float32")),
    ],
)
def test_parses_presets_and_explicit_form(spec, dtypes):
    policy = precision.get_policy(spec)
    assert (policy.param_dtype.name, policy.compute_dtype.name, policy.output_dtype.name) == dtypes
    assert precision.get_policy(str(policy)) == policy
    assert hash(policy) == hash(precision.get_policy(str(policy)))


def test_str_is_the_explicit_long_form():
    policy = precision.get_policy("bf16-mixed")
    assert str(policy) == "params=float32,compute=bfloat16,output=float32"


@pytest.mark.parametrize(
    "spec, named",
    [
        ("bf17-mixed", "bf17-mixed"),
        ("p=f32,c=int8,o=f32", "c=int8"),
        ("p=f32,x=bf16,o=f32", "x=bf16"),
        ("p=f32,c=bf16", "output"),
        ("p=f32,c=bf16,o=f32,c=f16", "c=f16"),
    ],
)
def test_bad_spec_names_the_bad_part(spec, named):
    with pytest.raises(ValueError, match=named) as info:
        precision.get_policy(spec)
    if "=" not in spec:
        assert "bf16-mixed" in str(info.value)  # lists the presets


def test_casting_touches_only_floating_leaves():
    policy = precision.get_policy("bf16-mixed")
    tree = {
        "x": jnp.ones((2, 3), jnp.float32),
        "h": np.ones((2,), np.float16),
        "ids": jnp.arange(4, dtype=jnp.int32),
        "mask": jnp.array([True, False]),
        "u": jnp.arange(3, dtype=jnp.uint8),
    }
    out = policy.cast_to_compute(tree)
    assert out["x"].dtype == jnp.bfloat16 and out["h"].dtype == jnp.bfloat16
    assert out["ids"].dtype == jnp.int32 and out["mask"].dtype == jnp.bool_
    assert out["u"].dtype == jnp.uint8
    np.testing.assert_array_equal(out["ids"], tree["ids"])
    assert policy.cast_to_param(out)["x"].dtype == jnp.float32
    assert policy.cast_to_output(out)["h"].dtype == jnp.float32


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_round_to_gives_the_numbers_of_a_cast(dtype):
    info = jnp.finfo(dtype)
    bits = np.random.default_rng(0).integers(0, 2**32, 200_000, dtype=np.uint64)
    x = bits.astype(np.uint32).view(np.float32)  # every kind of fp32 number, nan and inf too
    ties = (np.arange(-2000, 2000) + 0.5) * float(info.smallest_subnormal)  # among subnormals
    x = np.concatenate([x, ties, [np.inf, -np.inf, 0.0, -0.0]], dtype=np.float32)
    got = np.asarray(jax.jit(lambda x: dtypes.round_to(x, dtype))(x))
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(dtype).astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert np.all(same), x[~same][:5]


def _zoo_params(name, boxed=False, **model):
    from mptrain import config as config_lib
    from mptrain.train import trainer as trainer_lib

    config = config_lib.base_config()
    config.model.name = name
    config.model.update(model)
    trainer = trainer_lib.Trainer(config, "/nonexistent")
    shape = (2, 8) if name == "transformer_lm" else (2, 32, 32, 3)
    dtype = jnp.int32 if name == "transformer_lm" else jnp.float32
    variables = jax.eval_shape(
        trainer.init_variables, jax.random.key(0), {"inputs": jnp.zeros(shape, dtype)}
    )
    return variables["params"] if boxed else axes.unboxed(variables["params"])


LM = {"d_model": 16, "num_layers": 1, "num_heads": 2, "d_ff": 32, "max_len": 8}
RESNET = {"stage_sizes": (1, 1), "width": 8, "num_classes": 10}


@pytest.mark.parametrize("spec", ["bf16-mixed", "fp16-mixed", "bf16-pure"])
def test_the_default_rule_keeps_embeddings_and_norms_in_fp32(spec):
    policy = precision.get_policy(spec)
    lm = _zoo_params("transformer_lm", **LM)
    assert policy.kept_fp32_paths(lm) == [
        "Embed_0/embedding",
        "block_0/ln_attn/bias",
        "block_0/ln_attn/scale",
        "block_0/ln_mlp/bias",
        "block_0/ln_mlp/scale",
        "ln_final/bias",
        "ln_final/scale",
        "pos_embedding",
    ]
    dtypes = {precision.path_name(p): d for p, d in jax.tree_util.tree_flatten_with_path(
        policy.compute_dtypes(lm))[0]}  # fmt: skip
    assert dtypes["Embed_0/embedding"] == np.float32
    assert dtypes["block_0/attn/qkv/kernel"] == policy.compute_dtype
    kept = policy.kept_fp32_paths(_zoo_params("resnet", **RESNET))
    assert kept and all(p.endswith(("/scale", "/bias")) and "bn" in p for p in kept), kept
    assert not [p for p in kept if "conv" in p.split("/")[-2]]


def test_fp32_compute_and_an_empty_rule_cast_everything():
    lm = _zoo_params("transformer_lm", **LM)
    assert precision.get_policy("fp32").kept_fp32_paths(lm) == []
    everything = precision.get_policy("bf16-mixed", keep_fp32="")
    assert everything.kept_fp32_paths(lm) == []
    cast = jax.eval_shape(everything.cast_params, lm)
    assert {x.dtype for x in jax.tree.leaves(cast)} == {jnp.dtype("bfloat16")}
    heads = precision.get_policy("bf16-mixed", keep_fp32=r"^head/")
    assert heads.kept_fp32_paths(lm) == ["head/kernel"]
    assert "1 params in fp32 for compute (head/kernel)" in heads.describe_rules(lm)


def test_a_bad_rule_names_the_key():
    from mptrain import config as config_lib

    with pytest.raises(ValueError, match=r"keep_fp32='\(': not a regular expression"):
        precision.get_policy("bf16-mixed", keep_fp32="(")
    config = config_lib.base_config()
    config.keep_fp32 = "[a-"
    with pytest.raises(config_lib.ConfigError, match=r"config\.keep_fp32="):
        config_lib.validate(config)


def test_the_default_rule_keeps_what_each_param_declares_and_undeclared_ones_by_name():
    """A state's policy keeps the params whose declared role is fp32 (`parallel.axes`): for
    the zoo's LM the same params its names would; a role wins over a name, and a param no
    model declared is kept by its name."""
    lm = _zoo_params("transformer_lm", **LM, boxed=True)
    state_policy = dataclasses.replace(
        precision.get_policy("bf16-mixed"), declared=axes.declared(lm)
    )
    by_name = precision.get_policy("bf16-mixed")
    assert state_policy.kept_fp32_paths(axes.unboxed(lm)) == by_name.kept_fp32_paths(
        axes.unboxed(lm)
    )
    zeros, ones = jax.nn.initializers.zeros, jax.nn.initializers.ones
    key = jax.random.key(0)
    tree = {
        "norm": {"scale": axes.declare(ones, (axes.EMBED,))(key, (4,))},  # declared: no fp32
        "w": {"kernel": axes.declare(zeros, (axes.EMBED, None), fp32=True)(key, (4, 2))},
        "other_norm": {"scale": jnp.ones(4)},  # undeclared: by its name
    }
    policy = dataclasses.replace(by_name, declared=axes.declared(tree))
    assert policy.kept_fp32_paths(axes.unboxed(tree)) == ["other_norm/scale", "w/kernel"]
    assert "declared role" in policy.describe_rules(axes.unboxed(tree))
