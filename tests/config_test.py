"""The config keys are part of the contract: they change only on purpose."""

import pytest

from mptrain import config as config_lib

KEYS = {
    "seed", "precision", "trainer", "num_train_steps", "batch_size", "log_every_steps",
    "eval_every_steps", "eval_steps", "checkpoint_every_steps", "max_checkpoints_to_keep",
    "max_consecutive_skips", "param_rounding",
    "loss_scale.kind", "loss_scale.init_scale", "loss_scale.growth_interval",
    "loss_scale.growth_factor", "loss_scale.backoff_factor", "loss_scale.min_scale",
    "loss_scale.max_scale", "loss_scale.hysteresis",
    "optimizer.name", "optimizer.learning_rate", "optimizer.schedule", "optimizer.warmup_steps",
    "optimizer.weight_decay", "optimizer.b1", "optimizer.b2", "optimizer.eps",
    "optimizer.momentum", "optimizer.nesterov", "optimizer.grad_clip_norm", "optimizer.mu_dtype",
    "optimizer.nu_dtype", "optimizer.moment_rounding", "optimizer.accumulation_steps",
    "model.name", "data.name", "mesh.data", "mesh.fsdp",
}  # fmt: skip


def _flat(d, prefix=""):
    for key, value in d.items():
        if isinstance(value, dict):
            yield from _flat(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}"


def test_base_config_keys_are_pinned():
    assert set(_flat(config_lib.to_dict(config_lib.base_config()))) == KEYS


def test_base_config_is_valid():
    config_lib.validate(config_lib.base_config())


def test_every_key_is_commented_in_the_source():
    import inspect

    lines = [line.strip() for line in inspect.getsource(config_lib.base_config).splitlines()]
    for key in KEYS:
        (i,) = [i for i, line in enumerate(lines) if line.startswith(f"c.{key} =")]
        assert "#" in lines[i] or lines[i - 1].startswith("#"), f"config.{key} has no comment"


@pytest.mark.parametrize(
    "key, value",
    [
        ("loss_scale.hysteresis", 0),
        ("max_consecutive_skips", 0),
        ("mesh.data", 0),
        ("param_rounding", "up"),
    ],
)
def test_bad_values_name_the_key(key, value):
    config = config_lib.base_config()
    section, _, leaf = key.rpartition(".")
    (config[section] if section else config)[leaf] = value
    with pytest.raises(config_lib.ConfigError, match=key.replace(".", r"\.")):
        config_lib.validate(config)
