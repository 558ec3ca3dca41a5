import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mptrain import precision


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
    got = np.asarray(jax.jit(lambda x: precision.round_to(x, dtype))(x))
    with np.errstate(over="ignore", invalid="ignore"):
        want = x.astype(dtype).astype(np.float32)
    same = (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))
    assert np.all(same), x[~same][:5]
