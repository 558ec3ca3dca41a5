"""Loss scaling for fp16 training, as pytrees whose every field survives jit and checkpoints.

Each scaler multiplies the (fp32) loss by `loss_scale` before differentiation, so that small
gradients stay above fp16's underflow threshold, and divides the gradients by it afterwards, in
fp32. The dynamic scaler also adapts the scale. All fields, hyperparameters included, are pytree
leaves held as arrays: a scaler that comes back from `jax.jit`, `jax.tree.map` or an orbax restore
is the same scaler, not one with its settings quietly reset to defaults.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from mptrain import precision

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


class NoOpLossScale(_Scaler):
    """No scaling: the choice for fp32 and bf16 compute, whose range matches fp32's."""

    @property
    def loss_scale(self) -> jax.Array:
        return jnp.asarray(1.0, _F32)

    def scale(self, tree: Any) -> Any:
        return _scale_tree(tree, None)

    def unscale(self, tree: Any) -> Any:
        return _scale_tree(tree, None)

    def adjust(self, grads_finite: jax.Array) -> NoOpLossScale:
        del grads_finite
        return self


class StaticLossScale(_Scaler):
    """A fixed scale; non-finite steps are still skipped, the scale never changes."""

    _fields = (("loss_scale", _F32),)

    def __init__(self, scale: Any = 2.0**15):
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

    `hysteresis` is how many non-finite steps are tolerated before backing off (1: back off on
    every overflow). `counter` counts consecutive finite steps and `hysteresis_left` is what
    remains of the hysteresis budget; both are state and are checkpointed with the scale.
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
        self._set(
            loss_scale=scale,
            growth_interval=growth_interval,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            min_scale=min_scale,
            max_scale=max_scale,
            hysteresis=hysteresis,
            counter=counter,
            hysteresis_left=hysteresis if hysteresis_left is None else hysteresis_left,
        )

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
        # back off (never below min_scale) and refill.
        left = self.hysteresis_left - 1
        backoff = left <= 0
        shrunk = jnp.maximum(self.min_scale, self.loss_scale * self.backoff_factor)
        bad_scale = jnp.where(backoff, shrunk, self.loss_scale)
        bad_hysteresis = jnp.where(backoff, self.hysteresis, left)

        return self.replace(
            loss_scale=jnp.where(finite, ok_scale, bad_scale).astype(_F32),
            counter=jnp.where(finite, ok_counter, 0).astype(_I32),
            hysteresis_left=jnp.where(finite, ok_hysteresis, bad_hysteresis).astype(_I32),
        )


LossScale = NoOpLossScale | StaticLossScale | DynamicLossScale

KINDS = ("auto", "none", "static", "dynamic")


def create_loss_scale(
    kind: str = "auto", policy: precision.Policy | str | None = None, **hparams: Any
) -> LossScale:
    """Builds a scaler by name. `"auto"`: dynamic for fp16 compute, none for bf16/fp32 compute.

    `hparams` are `init_scale` plus the `DynamicLossScale` settings; keys that the chosen kind
    does not use are ignored, so one config block serves every kind.
    """
    if kind == "auto":
        if policy is None:
            raise ValueError("loss_scale kind 'auto' needs the precision policy")
        compute = precision.get_policy(policy).compute_dtype
        kind = "dynamic" if compute == jnp.float16 else "none"
    init_scale = hparams.pop("init_scale", None)
    if kind == "none":
        return NoOpLossScale()
    if kind == "static":
        return StaticLossScale(2.0**15 if init_scale is None else init_scale)
    if kind == "dynamic":
        names = {n for n, _ in DynamicLossScale._fields} - {"counter", "hysteresis_left"}
        kwargs = {k: v for k, v in hparams.items() if k in names and v is not None}
        if init_scale is not None:
            kwargs["scale"] = init_scale
        return DynamicLossScale(**kwargs)
    raise ValueError(f"unknown loss_scale kind {kind!r}; valid kinds: {', '.join(KINDS)}")
