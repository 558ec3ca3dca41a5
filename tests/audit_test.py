"""State bytes per parameter, measured from the arrays, and the unsafe-setup warnings."""

import jax
import pytest

import mptrain
from mptrain import audit, optim
from mptrain import config as config_lib


@pytest.mark.parametrize(
    "policy, moments, expected",
    [
        ("fp32", None, 12),
        ("bf16-mixed", None, 12),
        ("bf16-pure", None, 10),
        ("bf16-pure", "bfloat16", 6),
    ],
)
def test_state_bytes_per_param(policy, moments, expected):
    params = {"w": jax.random.normal(jax.random.key(0), (64, 64)), "b": jax.numpy.zeros((64,))}
    tx = optim.adamw(1e-3, mu_dtype=moments, nu_dtype=moments)
    state = mptrain.TrainState.create(apply_fn=None, params=params, tx=tx, policy=policy)
    assert audit.state_bytes_per_param(state.params, state.opt_state) == expected


def _config(precision="bf16-mixed", **overrides):
    config = config_lib.base_config()
    config.precision = precision
    for key, value in overrides.items():
        section, _, leaf = key.rpartition(".")
        (config[section] if section else config)[leaf] = value
    return config


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"])
def test_no_warnings_for_the_presets_as_they_come(precision):
    assert audit.setup_warnings(_config(precision)) == []


def test_warns_for_fp16_compute_without_loss_scaling():
    (warning,) = audit.setup_warnings(_config("fp16-mixed", **{"loss_scale.kind": "none"}))
    assert "float16 compute without loss scaling" in warning and "'none'" in warning
    assert audit.setup_warnings(_config("fp16-mixed", **{"loss_scale.kind": "static"})) == []
    assert audit.setup_warnings(_config("bf16-mixed", **{"loss_scale.kind": "none"})) == []


def test_warns_for_bf16_second_moment_rounded_to_nearest():
    config = _config(**{"optimizer.nu_dtype": "bfloat16", "optimizer.moment_rounding": "nearest"})
    (warning,) = audit.setup_warnings(config)
    assert "optimizer.nu_dtype=bfloat16" in warning
    assert audit.setup_warnings(_config(**{"optimizer.nu_dtype": "bfloat16"})) == []


def test_warns_for_fp16_second_moment():
    (warning,) = audit.setup_warnings(_config("fp32", **{"optimizer.nu_dtype": "float16"}))
    assert "overflows" in warning


def test_warns_for_bf16_params_rounded_to_nearest_at_a_small_learning_rate():
    small = {"optimizer.learning_rate": 1e-4}
    (warning,) = audit.setup_warnings(_config("bf16-pure", param_rounding="nearest", **small))
    assert "rounded away" in warning
    assert audit.setup_warnings(_config("bf16-pure", **small)) == []  # auto: stochastic
    assert audit.setup_warnings(_config("bf16-pure", param_rounding="kahan", **small)) == []
    big = {"optimizer.learning_rate": 0.01}
    assert audit.setup_warnings(_config("bf16-pure", param_rounding="nearest", **big)) == []
