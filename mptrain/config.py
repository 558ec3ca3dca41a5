"""The base config, every key commented, and `validate(config)` with errors that name the key.

Config files under `configs/` start from `base_config()` and change what they need; `main.py`
loads them locked, so a misspelt `--config.foo=...` override fails instead of being ignored.
"""

from __future__ import annotations

import math
from typing import Any

import ml_collections
from ml_collections import config_dict

from mptrain import loss_scale, precision, train_state


class ConfigError(ValueError):
    """A bad config value; the message names the key, the value and what would be valid."""


def base_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.seed = 0  # seeds init, dropout and the data order; batch i is a pure function of (seed, i)
    # "fp32" | "bf16-mixed" | "fp16-mixed" | "bf16-pure" | "params=..,compute=..,output=.."
    c.precision = "bf16-mixed"
    c.trainer = "mptrain.trainer:Trainer"  # "package.module:Class" of the Trainer to run
    c.num_train_steps = 1000  # batches to train on in total (a resumed run counts from 0)
    c.batch_size = 32  # global batch size, over all devices and hosts
    c.log_every_steps = 50  # fetch and write train metrics every this many steps
    c.eval_every_steps = 500  # evaluate every this many steps, and always at the last step
    c.eval_steps = 8  # batches per evaluation
    c.checkpoint_every_steps = 500  # save every this many steps, and always at the last step
    c.max_checkpoints_to_keep = 3  # older checkpoints are deleted
    c.max_consecutive_skips = 25  # stop (exit 3) after this many non-finite steps in a row
    # how fp32 updates land on 16-bit params: "nearest" | "stochastic" (bf16) | "kahan"
    c.param_rounding = "nearest"

    c.loss_scale = ml_collections.ConfigDict()
    c.loss_scale.kind = "auto"  # "auto" (dynamic for fp16 compute) | "none" | "static" | "dynamic"
    c.loss_scale.init_scale = 2.0**15  # starting (or static) scale
    c.loss_scale.growth_interval = 2000  # finite steps in a row before the scale grows
    c.loss_scale.growth_factor = 2.0  # multiplier on growth, > 1
    c.loss_scale.backoff_factor = 0.5  # multiplier on overflow, in (0, 1)
    c.loss_scale.min_scale = 1.0  # the scale never drops below this
    c.loss_scale.max_scale = 2.0**24  # ... nor grows above this
    c.loss_scale.hysteresis = 1  # overflows tolerated before backing off (1: back off at once)

    c.optimizer = ml_collections.ConfigDict()
    c.optimizer.name = "adamw"  # "adamw" | "sgd"
    c.optimizer.learning_rate = 1e-3  # peak learning rate
    c.optimizer.schedule = "cosine"  # "constant" | "cosine" | "linear" (decay after warmup)
    c.optimizer.warmup_steps = 100  # linear warmup from 0 over this many applied updates
    c.optimizer.weight_decay = 0.0  # decoupled weight decay (AdamW)
    c.optimizer.b1 = 0.9  # Adam first-moment decay
    c.optimizer.b2 = 0.999  # Adam second-moment decay
    c.optimizer.eps = 1e-8  # Adam epsilon
    c.optimizer.momentum = 0.9  # SGD momentum (0 for none)
    c.optimizer.nesterov = False  # SGD: Nesterov momentum
    c.optimizer.grad_clip_norm = 1.0  # clip the global gradient norm to this (0: no clipping)
    c.optimizer.mu_dtype = "float32"  # storage dtype of Adam's first moment
    c.optimizer.nu_dtype = "float32"  # storage dtype of Adam's second moment
    # how moments stored in bf16 are rounded: "stochastic" (unbiased) | "nearest"
    c.optimizer.moment_rounding = "stochastic"
    c.optimizer.accumulation_steps = 1  # >1: average gradients over this many batches

    c.model = ml_collections.ConfigDict()
    c.model.name = "transformer_lm"  # module under mptrain.models; its own keys sit beside it

    c.data = ml_collections.ConfigDict()
    c.data.name = "text"  # module under mptrain.data; its own keys sit beside it

    c.mesh = ml_collections.ConfigDict()
    c.mesh.data = 1  # devices along the data-parallel axis (-1: all that fsdp leaves)
    c.mesh.fsdp = 1  # devices along the parameter-sharding axis
    return c


_POSITIVE_INTS = (
    "num_train_steps",
    "batch_size",
    "log_every_steps",
    "eval_every_steps",
    "eval_steps",
    "checkpoint_every_steps",
    "max_checkpoints_to_keep",
    "max_consecutive_skips",
    "optimizer.accumulation_steps",
    "loss_scale.growth_interval",
    "loss_scale.hysteresis",
)


def _get(config: ml_collections.ConfigDict, key: str) -> Any:
    value = config
    for part in key.split("."):
        if part not in value:
            raise ConfigError(f"config is missing the key {key!r}")
        value = value[part]
    return value


def _fail(key: str, value: Any, wanted: str) -> None:
    raise ConfigError(f"config.{key}={value!r}: {wanted}")


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        _fail(key, value, "must be a number")
    if not math.isfinite(value):
        _fail(key, value, "must be finite")
    return float(value)


def validate(config: ml_collections.ConfigDict) -> None:
    """Raises `ConfigError` naming the first bad key and value; returns None when all is well."""
    for key in _POSITIVE_INTS:
        value = _get(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            _fail(key, value, "must be a positive integer")
    for key in ("seed",):
        if not isinstance(_get(config, key), int):
            _fail(key, _get(config, key), "must be an integer")
    try:
        policy = precision.get_policy(_get(config, "precision"))
    except ValueError as e:
        raise ConfigError(f"config.precision: {e}") from None
    if _get(config, "param_rounding") not in train_state.ROUNDINGS:
        _fail("param_rounding", config.param_rounding, f"valid: {', '.join(train_state.ROUNDINGS)}")
    if config.param_rounding != "nearest" and policy.param_dtype.itemsize == 4:
        _fail("param_rounding", config.param_rounding, f"needs 16-bit params; {policy} keeps fp32")
    trainer = _get(config, "trainer")
    if not isinstance(trainer, str) or not trainer.strip():
        _fail("trainer", trainer, "must name a class as 'package.module:Class'")

    lr = _number("optimizer.learning_rate", _get(config, "optimizer.learning_rate"))
    if lr <= 0:
        _fail("optimizer.learning_rate", lr, "must be > 0")
    warmup = _get(config, "optimizer.warmup_steps")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        _fail("optimizer.warmup_steps", warmup, "must be an integer >= 0")
    for key in ("optimizer.weight_decay", "optimizer.eps", "optimizer.grad_clip_norm"):
        if _number(key, _get(config, key)) < 0:
            _fail(key, _get(config, key), "must be >= 0")
    for key in ("optimizer.b1", "optimizer.b2", "optimizer.momentum"):
        if not 0 <= _number(key, _get(config, key)) < 1:
            _fail(key, _get(config, key), "must be in [0, 1)")

    kind = _get(config, "loss_scale.kind")
    if kind not in loss_scale.KINDS:
        _fail("loss_scale.kind", kind, f"valid kinds: {', '.join(loss_scale.KINDS)}")
    for key in ("loss_scale.init_scale", "loss_scale.min_scale", "loss_scale.max_scale"):
        if _number(key, _get(config, key)) <= 0:
            _fail(key, _get(config, key), "must be > 0")
    if _number("loss_scale.growth_factor", config.loss_scale.growth_factor) <= 1:
        _fail("loss_scale.growth_factor", config.loss_scale.growth_factor, "must be > 1")
    if not 0 < _number("loss_scale.backoff_factor", config.loss_scale.backoff_factor) < 1:
        _fail("loss_scale.backoff_factor", config.loss_scale.backoff_factor, "must be in (0, 1)")
    if config.loss_scale.min_scale > config.loss_scale.max_scale:
        _fail("loss_scale.min_scale", config.loss_scale.min_scale, "must be <= max_scale")

    for key in ("mesh.data", "mesh.fsdp"):
        value = _get(config, key)
        if isinstance(value, bool) or not isinstance(value, int) or (value < 1 and value != -1):
            _fail(key, value, "must be a positive integer or -1 (all remaining devices)")
    from mptrain import optim  # the optimizer's own checks: names, schedules, dtypes

    try:
        optim.make_optimizer(config)
    except ValueError as e:
        raise ConfigError(f"config.{e}" if not str(e).startswith("config.") else str(e)) from None
    for key in ("model.name", "data.name"):
        value = _get(config, key)
        if not isinstance(value, str) or not value.isidentifier():
            _fail(key, value, "must name a module (a Python identifier)")


def to_dict(config: ml_collections.ConfigDict) -> dict[str, Any]:
    """A plain, JSON-ready dict of the resolved config."""
    return config_dict.ConfigDict(config).to_dict()
