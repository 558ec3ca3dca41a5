"""State bytes per parameter, measured from the arrays, and the unsafe-setup warnings."""

import logging
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import tiny_config

import mptrain
from mptrain import audit, metrics, optim
from mptrain import config as config_lib
from mptrain.models import layers


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


# -------------------------------------------------------------------------- precision report


def _step_and_args(trainer, batch):
    state = trainer.init_state(batch)
    totals = metrics.LogTotals.zeros()
    return jax.jit(trainer.make_train_step()), state, trainer.device_batch(_Fixed(batch), 0), totals


class _Fixed:
    def __init__(self, batch):
        self.batch = batch

    def get_batch(self, index):
        return self.batch


def _lm_batch(config):
    tokens = np.random.default_rng(0).integers(0, 256, (config.batch_size, 33)).astype(np.int32)
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}


def test_the_default_step_runs_its_matmuls_in_bf16(tmp_path):
    trainer = mptrain.Trainer(tiny_config(), tmp_path)
    report = audit.precision_report(*_step_and_args(trainer, _lm_batch(trainer.config)))
    assert report.compute_dtype == "bfloat16"
    assert report.compute_fraction >= 0.99 and set(report.matmul_flops) == {"bfloat16"}
    assert report.state_bytes["params"] == 4.0 and report.state_bytes["opt_state.mu"] == 4.0
    assert any("transformer_lm.py" in where for where in report.islands)  # the fp32 softmax
    assert "matmul FLOPs" in str(report)


class Fp32ReadoutTrainer(mptrain.Trainer):
    """Multiplies the (fp32) logits by an fp32 matrix: a matmul the compute dtype never sees."""

    def loss_fn(self, params, model_state, batch, rng):
        logits = self.model.apply({"params": params}, batch["inputs"], train=True)
        mixed = logits @ jnp.asarray(np.eye(256), jnp.float32)  # the fp32 matmul
        return layers.cross_entropy(mixed, batch["targets"]), (model_state, {})


FP32_LINE = next(
    i
    for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
    if "# the fp32 matmul" in line
)


def test_an_fp32_matmul_is_counted_and_the_trainer_names_its_line(tmp_path, caplog):
    config = tiny_config(num_train_steps=1, trainer=f"{__name__}:Fp32ReadoutTrainer")
    report = audit.precision_report(
        *_step_and_args(Fp32ReadoutTrainer(config, tmp_path), _lm_batch(config))
    )
    assert report.matmul_flops["float32"] > 0 and report.compute_fraction < 0.95
    (where, dtype, _), *_ = report.offenders()
    assert where.endswith(f"audit_test.py:{FP32_LINE}") and dtype == "float32"
    caplog.set_level(logging.WARNING)
    Fp32ReadoutTrainer(config, tmp_path / "run").train_and_evaluate()
    assert (
        f"audit_test.py:{FP32_LINE}" in caplog.text
        and "of the matmul FLOPs run in bfloat16" in caplog.text
    )
    written = (tmp_path / "run" / "precision_report.txt").read_text()
    assert f"audit_test.py:{FP32_LINE}" in written


def test_the_matmul_table_sums_to_a_hand_count_for_a_one_layer_mlp(tmp_path):
    config = config_lib.base_config()
    config.model.name, config.model.num_layers, config.batch_size = "mlp", 1, 4
    config.model.hidden = 32
    batch, features, hidden, classes = 4, 16, 32, 10
    trainer = mptrain.Trainer(config, tmp_path)
    data = {"inputs": np.ones((batch, features), np.float32), "targets": np.zeros(batch, np.int32)}
    report = audit.precision_report(*_step_and_args(trainer, data))
    # forward: x @ W1, h @ W2; backward: h^T @ g (W2's gradient), g @ W2^T (h's gradient),
    # x^T @ dh (W1's gradient); no gradient for the data itself. 2 FLOPs per multiply-add.
    macs = batch * (features * hidden + hidden * classes)  # forward
    macs += batch * (hidden * classes + classes * hidden + features * hidden)  # backward
    assert sum(report.matmul_flops.values()) == 2 * macs
    assert report.matmul_flops == {"bfloat16": 2 * macs}
    assert f"{2 * macs:,}" in str(report) or str(2 * macs) in str(report)
