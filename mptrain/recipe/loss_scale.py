"""Loss scaling for fp16 training, as pytrees whose every field survives jit and checkpoints.

Each scaler multiplies the (fp32) loss by `loss_scale` before differentiation, so that small
gradients stay above fp16's underflow threshold, and divides the gradients by it afterwards, in
fp32. The dynamic scaler also adapts the scale. All fields, hyperparameters included, are pytree
leaves held as arrays: a scaler that comes back from `jax.jit`, `jax.tree.map` or an orbax restore
is the same scaler, not one with its settings quietly reset to defaults.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mptrain import dtypes, errors
from mptrain.recipe import precision

_F32 = jnp.float32
_I32 = jnp.int32


class _Scaler:
    """Base for the scalers: a pytree with named array fields and no static data.

    Unflattening bypasses `__init__`, so whatever jax puts in the leaves (tracers, abstract
    shapes, placeholders) is stored as is; only the constructors turn Python numbers into arrays.
    """

    _fields: tuple[tuple[str, Any], ...] = ()

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        jax.tree_util.register_pytree_with_keys(
            cls, cls._tree_flatten_with_keys, cls._tree_unflatten, cls._tree_flatten
        )

    def _set(self, **values: Any) -> None:
        for name, dtype in self._fields:
            value = values[name]
            if not isinstance(value, jax.core.Tracer):
                value = jnp.asarray(value, dtype)
            object.__setattr__(self, name, value)

    def _tree_flatten_with_keys(self):
        keys = [(jax.tree_util.GetAttrKey(n), getattr(self, n)) for n, _ in self._fields]
        return keys, None

    def _tree_flatten(self):
        return [getattr(self, n) for n, _ in self._fields], None

    @classmethod
    def _tree_unflatten(cls, aux, children):
        del aux
        obj = object.__new__(cls)
        for (name, _), child in zip(cls._fields, children, strict=True):
            object.__setattr__(obj, name, child)
        return obj

    def __setattr__(self, name, value):
        raise dataclasses.FrozenInstanceError(f"{type(self).__name__} is immutable; use replace()")

    def replace(self, **updates: Any):
        """A copy with some fields replaced (values are stored as given)."""
        obj = jax.tree_util.tree_unflatten(jax.tree.structure(self), jax.tree.leaves(self))
        for name, value in updates.items():
            if name not in dict(self._fields):
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
            object.__setattr__(obj, name, value)
        return obj

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={getattr(self, n)!r}" for n, _ in self._fields)
        return f"{type(self).__name__}({body})"


def all_finite(tree: Any) -> jax.Array:
    """True (a bool[] array) when every element of every floating leaf is finite."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not leaves:
        return jnp.asarray(True)
    return jnp.stack([jnp.isfinite(x).all() for x in leaves]).all()


def select_tree(pred: jax.Array, on_true: Any, on_false: Any) -> Any:
    """Leafwise `pred ? on_true : on_false`; bit-exact, both trees must have one structure."""
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), on_true, on_false)


def _scale_tree(tree: Any, factor: jax.Array | None) -> Any:
    # Upcast before multiplying: an fp16 loss times 2**15 overflows fp16, never fp32. Gradients
    # are unscaled in fp32 for the same reason.
    if factor is None:
        return jax.tree.map(lambda x: jnp.asarray(x, _F32), tree)
    return jax.tree.map(lambda x: jnp.asarray(x, _F32) * factor, tree)


def _inf_in_float32(value: float) -> bool:
    with np.errstate(over="ignore"):
        return bool(np.isinf(np.float32(value)))


def _check_settings(**settings: Any) -> None:
    """Rejects bad Python-number settings by name; arrays (e.g. restored state) pass as they are."""
    settings = {k: v for k, v in settings.items() if isinstance(v, int | float)}
    for key in ("scale", "min_scale", "max_scale"):
        if key in settings:
            errors.check_number(key, settings[key], 0.0, open_low=True)
            if _inf_in_float32(settings[key]):  # a Python float holds 1e39, the device's not
                raise ValueError(
                    f"{key}={settings[key]!r}: inf in float32, the dtype the device keeps it "
                    f"in; must be at most {float(np.finfo(np.float32).max):g}"
                )
    for key in ("growth_interval", "hysteresis"):
        if key in settings:
            errors.check_integer(key, settings[key], 1, errors.INT32_MAX, errors.INT32_WHY)
    if "growth_factor" in settings:
        errors.check_number("growth_factor", settings["growth_factor"], 1.0, open_low=True)
    if "backoff_factor" in settings:
        errors.check_number("backoff_factor", settings["backoff_factor"], 0.0, 1.0, open_low=True)
    if settings.get("min_scale", 0) > settings.get("max_scale", math.inf):
        raise ValueError(
            f"min_scale={settings['min_scale']!r}: must be <= max_scale={settings['max_scale']!r}"
        )


class NoOpLossScale(_Scaler):
    """No scaling: the choice for fp32 and bf16 compute, whose range matches fp32's."""

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.asarray(1.0, _F32)

    def scale(self, tree: Any) -> Any:
        return _scale_tree(tree, None)

    def unscale(self, tree: Any) -> Any:
        # Nothing to divide: bf16 gradients (bf16 params' under FSDP, `sharding._gather`) stay
        # bf16, 2 bytes a parameter until the update upcasts them a leaf at a time; fp16 ones
        # are upcast, as fp16's range cannot hold what the update makes of them.
        return jax.tree.map(lambda x: x if x.dtype == jnp.bfloat16 else jnp.asarray(x, _F32), tree)

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        del grads_finite
        return self


class StaticLossScale(_Scaler):
    """A fixed scale; non-finite steps are still skipped, the scale never changes."""

    _fields = (("loss_scale", _F32),)

    def __init__(self, scale: Any = 2.0**15):
        _check_settings(scale=scale)
        self._set(loss_scale=scale)

    def scale(self, tree: Any) -> Any:
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: Any) -> Any:
        return _scale_tree(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> StaticLossScale:
        del grads_finite
        return self


class DynamicLossScale(_Scaler):
    """Grows the scale after `growth_interval` finite steps in a row; backs off on overflow.

    The rule: on the `growth_interval`-th finite step in a row the scale is multiplied by
    `growth_factor` (never above `max_scale`, never to inf), the counter resets and hysteresis
    refills. A non-finite step resets the counter and spends one unit of hysteresis; once it is
    spent, every non-finite step multiplies the scale by `backoff_factor` (never below
    `min_scale`), and hysteresis refills only when the scale next grows. `hysteresis=1` is
    torch's GradScaler rule (plus the clamps); Megatron-LM and DeepSpeed default to 2.

    `counter` (consecutive finite steps) and `hysteresis_left` (what remains of the budget) are
    state and are checkpointed with the scale. Bad settings raise a `ValueError` naming them.
    """

    _fields = (
        ("loss_scale", _F32),
        ("growth_interval", _I32),
        ("growth_factor", _F32),
        ("backoff_factor", _F32),
        ("min_scale", _F32),
        ("max_scale", _F32),
        ("hysteresis", _I32),
        ("counter", _I32),
        ("hysteresis_left", _I32),
    )

    def __init__(
        self,
        scale: Any = 2.0**15,
        growth_interval: Any = 2000,
        growth_factor: Any = 2.0,
        backoff_factor: Any = 0.5,
        min_scale: Any = 1.0,
        max_scale: Any = 2.0**24,
        hysteresis: Any = 1,
        counter: Any = 0,
        hysteresis_left: Any = None,
    ):
        settings = {
            "growth_interval": growth_interval,
            "growth_factor": growth_factor,
            "backoff_factor": backoff_factor,
            "min_scale": min_scale,
            "max_scale": max_scale,
            "hysteresis": hysteresis,
        }
        _check_settings(scale=scale, **settings)
        left = hysteresis if hysteresis_left is None else hysteresis_left
        self._set(loss_scale=scale, counter=counter, hysteresis_left=left, **settings)

    def scale(self, tree: Any) -> Any:
        return _scale_tree(tree, self.loss_scale)

    def unscale(self, tree: Any) -> Any:
        return _scale_tree(tree, 1.0 / self.loss_scale)

    def adjust(self, grads_finite: jax.Array) -> DynamicLossScale:
        finite = jnp.asarray(grads_finite, jnp.bool_)

        # Finite step: count it; on the growth_interval-th in a row, grow (clamped, never to
        # inf), reset the counter and refill hysteresis.
        count = self.counter + 1
        grow = count >= self.growth_interval
        grown = jnp.minimum(self.loss_scale * self.growth_factor, self.max_scale)
        grown = jnp.where(jnp.isfinite(grown), grown, self.loss_scale)
        ok_scale = jnp.where(grow, grown, self.loss_scale)
        ok_counter = jnp.where(grow, 0, count)
        ok_hysteresis = jnp.where(grow, self.hysteresis, self.hysteresis_left)

        # Non-finite step: reset the counter and spend one unit of hysteresis; once it is spent,
        # back off (never below min_scale) at every non-finite step until the scale next grows.
        # This is the rule of Megatron-LM's DynamicGradScaler and DeepSpeed's DynamicLossScaler:
        # an isolated overflow is forgiven, a burst means the scale is too high.
        left = self.hysteresis_left - 1
        shrunk = jnp.maximum(self.min_scale, self.loss_scale * self.backoff_factor)
        bad_scale = jnp.where(left <= 0, shrunk, self.loss_scale)
        bad_hysteresis = jnp.maximum(left, 0)

        return self.replace(
            loss_scale=jnp.where(finite, ok_scale, bad_scale).astype(_F32),
            counter=jnp.where(finite, ok_counter, 0).astype(_I32),
            hysteresis_left=jnp.where(finite, ok_hysteresis, bad_hysteresis).astype(_I32),
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale

KINDS = ("auto", "none", "static", "dynamic")
# The settings (by their `config.loss_scale` names) that each kind of scaler uses; a setting of
# another kind cannot take effect (`mptrain.unused.settings` warns of those changed).
USES = {
    "none": (),
    "static": ("init_scale",),
    "dynamic": (
        "init_scale",
        "growth_interval",
        "growth_factor",
        "backoff_factor",
        "min_scale",
        "max_scale",
        "hysteresis",
    ),
}


def resolve_kind(kind: str, policy: precision.Policy | str | None) -> str:
    """`kind` with "auto" resolved: dynamic for fp16 compute, none for bf16/fp32 compute."""
    kind = errors.check_choice("kind", kind, KINDS)
    if kind != "auto":
        return kind
    if policy is None:
        raise ValueError("kind='auto': needs the precision policy")
    return "dynamic" if precision.get_policy(policy).compute_dtype == dtypes.F16 else "none"


def _check_start(init_scale: Any, settings: dict[str, Any]) -> None:
    """A dynamic scale starts within `[min_scale, max_scale]`: above the max, every step would
    be scaled past the range the rule keeps it in (the scale only clamps when it next moves).
    It reads the Python values, not the scaler built from them: under a jit (the trainer's init)
    that one holds tracers."""
    defaults = inspect.signature(DynamicLossScale).parameters
    value = lambda name: settings.get(name, defaults[name].default)
    scale = defaults["scale"].default if init_scale is None else init_scale
    low, high = value("min_scale"), value("max_scale")
    numbers = all(isinstance(v, int | float) for v in (scale, low, high))
    if numbers and not low <= scale <= high:
        raise ValueError(
            f"init_scale={scale!r}: outside [min_scale, max_scale] = [{low:g}, {high:g}], "
            "where the dynamic scale stays; set it within, or widen the range"
        )


def create_loss_scale(
    kind: str = "auto", policy: precision.Policy | str | None = None, **hparams: Any
) -> LossScale:
    """Builds a scaler by name. `"auto"`: dynamic for fp16 compute, none for bf16/fp32 compute.

    `hparams` are `init_scale` plus the `DynamicLossScale` settings, by the names of the
    `config.loss_scale` keys. They are checked whatever the kind, so a bad value is reported now
    rather than on the day the kind changes; the chosen kind then uses what it needs (`USES`).
    A dynamic scale must start within `[min_scale, max_scale]`.
    """
    kind = resolve_kind(kind, policy)
    names = {n for n, _ in DynamicLossScale._fields} - {"counter", "hysteresis_left", "loss_scale"}
    kwargs = {k: v for k, v in hparams.items() if k in names and v is not None}
    init_scale = hparams.get("init_scale")
    try:
        dynamic = DynamicLossScale(
            **kwargs, **({} if init_scale is None else {"scale": init_scale})
        )
    except ValueError as e:  # the constructor's `scale` is the config's `init_scale`
        message = str(e)
        raise ValueError("init_" + message if message.startswith("scale=") else message) from None
    if kind == "static":
        return StaticLossScale(2.0**15 if init_scale is None else init_scale)
    if kind == "dynamic":
        _check_start(init_scale, kwargs)
        return dynamic
    return NoOpLossScale()
