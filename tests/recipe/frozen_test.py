"""Params that do not train (`recipe.frozen`): split from the trained ones and merged back,
stored in 16 or 8 bits, and handed to the loss, on one device and on a mesh, without a
gradient of their own."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import needs_devices, normal
from jax.sharding import Mesh

from mptrain.optim import q8
from mptrain.parallel import sharding
from mptrain.plan import memory as plan_memory
from mptrain.recipe import frozen, precision

POLICY = precision.get_policy("bf16-mixed")


def _params():
    return {
        "embed": {"embedding": normal(0, (16, 8))},
        "w": {
            "kernel": normal(1, (8, 512)),
            "lora_a": normal(2, (8, 2)),
            "lora_b": normal(3, (2, 512)),
        },
    }


def _adapter(path: str) -> bool:
    return path.rsplit("/", 1)[-1] in ("lora_a", "lora_b")


def test_split_and_merge_are_inverse_and_keep_each_leaf_on_one_side():
    params = _params()
    trained, rest = frozen.split(params, _adapter)
    assert set(trained["w"]) == {"lora_a", "lora_b"} and "embed" not in trained
    assert set(rest) == {"embed", "w"} and set(rest["w"]) == {"kernel"}
    merged = sharding.merge(trained, rest)
    assert jax.tree.structure(merged) == jax.tree.structure(params)
    jax.tree.map(np.testing.assert_array_equal, merged, params)


def test_the_frozen_params_are_stored_in_16_or_8_bits_and_cast_for_the_model_as_they_are():
    rest = frozen.split(_params(), _adapter)[1]
    kernel = lambda path, shape: path.endswith("/kernel")
    stored = frozen.store(rest, jnp.bfloat16, kernel)
    assert q8.is_q8(stored["w"]["kernel"]) and stored["embed"]["embedding"].dtype == jnp.bfloat16
    # bytes: the kernel's 8-bit codes and a scale per 256, the table's 2 bytes
    assert plan_memory.global_bytes(stored) == 8 * 512 + 4 * 16 + 16 * 8 * 2
    cast = POLICY.cast_params(stored)  # an 8-bit kernel goes to the model as it is
    assert q8.is_q8(cast["w"]["kernel"]) and cast["embed"]["embedding"].dtype == jnp.float32


def _loss(params, probes, batch, rng):
    del probes, rng
    w = params["w"]
    kernel = w["kernel"] if not q8.is_q8(w["kernel"]) else q8.dequantize(w["kernel"])
    y = batch @ (kernel.astype(batch.dtype) + w["lora_a"] @ w["lora_b"])
    return jnp.mean(jnp.square(y.astype(jnp.float32))), {}


@needs_devices(4)
def test_on_a_mesh_the_loss_sees_the_frozen_params_gathered_and_only_the_trained_get_gradients():
    trained, rest = frozen.split(_params(), _adapter)
    rest = frozen.store(rest, jnp.bfloat16)
    batch = normal(4, (8, 8)).astype(jnp.bfloat16)
    rng = jax.random.key(0)
    mesh = Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2, 1, 1, 1), sharding.AXES)
    on_one = sharding.grad_fn(_loss, POLICY, None)(trained, None, batch, rng, frozen=rest)[0]
    on_mesh = jax.jit(
        lambda t, f, b: sharding.grad_fn(_loss, POLICY, mesh)(t, None, b, rng, frozen=f)[0]
    )(trained, rest, batch)
    assert jax.tree.structure(on_mesh) == jax.tree.structure(trained)  # no frozen gradient
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-2, atol=1e-4), on_mesh, on_one
    )
    assert all(float(jnp.abs(g).max()) > 0 for g in jax.tree.leaves(on_mesh))


def test_an_8_bit_base_cannot_be_split_over_fsdp():
    from mptrain import config as config_lib
    from mptrain.errors import ConfigError

    config = config_lib.base_config()
    config.model.name, config.batch_size = "transformer_lm", 8
    config.lora.rank, config.lora.base_dtype, config.mesh.fsdp = 4, "q8", 2
    with pytest.raises(ConfigError, match="lora.base_dtype='q8'.*mesh.fsdp=2"):
        config_lib.validate(config)
