"""The training state: master params, optimizer state, loss scaler, rng and counters.

Everything a run needs to continue bit-for-bit lives here as arrays, the loss scaler included, so
one orbax save holds it all. Counters: `step` counts batches consumed (it positions the data and
numbers checkpoints); `skipped_steps` counts non-finite steps; the optimizer's own count lives
inside `opt_state` and advances only on applied updates, so schedules do not drift on skips.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct
from flax.training import train_state

from mptrain import dtypes, errors, optim
from mptrain.optim import layerwise
from mptrain.parallel import axes as axes_lib
from mptrain.parallel import sharding
from mptrain.recipe import loss_scale as loss_scale_lib
from mptrain.recipe import precision

ROUNDINGS = ("auto", "nearest", "stochastic", "kahan")
_ROUNDING_SALT = 0x5EED


def resolve_param_rounding(rounding: str, policy: precision.Policy | str) -> str:
    """How fp32 updates land on params: "nearest", "stochastic" or "kahan" for `policy`.

    "auto" is stochastic rounding for bf16 params (unbiased, no extra memory) and a plain cast
    otherwise. The explicit choices must fit the params: fp32 params need no rounding rule, and
    stochastic rounding is implemented for bf16. Errors name `param_rounding`.
    """
    policy = precision.get_policy(policy)
    rounding = errors.check_choice("param_rounding", rounding, ROUNDINGS)
    if rounding == "auto":
        return "stochastic" if policy.param_dtype == dtypes.BF16 else "nearest"
    if rounding != "nearest" and policy.param_dtype == dtypes.F32:
        raise ValueError(
            f"param_rounding={rounding!r}: only applies to 16-bit params, but the policy "
            f"'{policy}' keeps params in float32; use 'auto' or 'nearest'"
        )
    if rounding == "stochastic" and policy.param_dtype != dtypes.BF16:
        raise ValueError(
            f"param_rounding='stochastic': supports bfloat16 params, not {policy.param_dtype}"
        )
    return rounding


def _key_data(rng: Any) -> jax.Array:
    """Raw uint32 key data from an int seed, a typed key or raw key data."""
    if rng is None or isinstance(rng, int):
        rng = jax.random.key(rng or 0)
    rng = jnp.asarray(rng)
    if jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key):
        return jax.random.key_data(rng)
    return rng.astype(jnp.uint32)


class TrainState(train_state.TrainState):
    """`flax.training.train_state.TrainState` plus what mixed precision needs to resume exactly.

    Fields beyond flax's: `loss_scale` (a scaler pytree), `rng` (raw key data, so checkpoints
    hold plain arrays), `skipped_steps` (int32), `model_state` (e.g. batch statistics, `{}` when
    unused), `param_compensation` (Kahan rounding error per param, `{}` unless
    `param_rounding="kahan"`), `frozen` (params that do not train, `recipe.frozen`: `{}` but
    under adapters; no checkpoint holds them), and the static `policy`, `param_rounding` and
    `axes` (the logical axes the model's params declared, `parallel.axes`: how every leaf of
    the state is split on a mesh; None where the model declared none).
    """

    @property
    def model_params(self) -> Any:
        """Every param the model takes: `params` and `frozen` in one tree."""
        return sharding.merge(self.params, self.frozen)

    loss_scale: Any = None
    rng: jax.Array | None = None
    skipped_steps: jax.Array | None = None
    model_state: Any = struct.field(default_factory=dict)
    param_compensation: Any = struct.field(default_factory=dict)
    frozen: Any = struct.field(default_factory=dict)
    policy: precision.Policy = struct.field(pytree_node=False, default=None)
    param_rounding: str = struct.field(pytree_node=False, default="nearest")
    axes: axes_lib.Axes | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def create(
        cls,
        *,
        apply_fn,
        params,
        tx: optax.GradientTransformation,
        policy: precision.Policy | str,
        loss_scale: Any = None,
        rng: Any = None,
        model_state: Any = None,
        param_rounding: str = "auto",
        axes: axes_lib.Axes | None = None,
        **kwargs,
    ) -> TrainState:
        """Stores `params` in `policy.param_dtype` and initialises the optimizer on them.

        `loss_scale`: a scaler, or None for no scaling. `rng`: an int seed, a typed key or raw key
        data. `param_rounding` decides how fp32 updates land on 16-bit params: "nearest" (plain
        cast), "stochastic" (unbiased random rounding, bf16 params only), "kahan" (keeps the
        rounding error in `param_compensation` and adds it back on the next update) or "auto",
        the default, as in a config (stochastic for bf16 params, else nearest): a library user
        with bf16 params no more loses small updates than a Trainer's run does. `params` may
        come as `model.init` returns them, with their declared axes (`parallel.axes`), which the
        state keeps as `axes` (or give `axes` and plain params).
        """
        boxes = jax.tree.leaves(params, is_leaf=axes_lib.is_param)
        if axes is None and any(axes_lib.is_param(x) for x in boxes):
            axes = axes_lib.declared(params)
        params = axes_lib.unboxed(params)
        policy = precision.get_policy(policy)
        if axes is not None and policy.declared is None:  # the roles the params declared
            policy = dataclasses.replace(policy, declared=axes)
        param_rounding = resolve_param_rounding(param_rounding, policy)
        params = policy.cast_to_param(params)
        compensation = {}
        if param_rounding == "kahan":
            compensation = jax.tree.map(jnp.zeros_like, params)
        return cls(
            step=jnp.asarray(0, jnp.int32),
            apply_fn=apply_fn,
            params=params,
            tx=tx,
            opt_state=tx.init(params),
            loss_scale=loss_scale_lib.NoOpLossScale() if loss_scale is None else loss_scale,
            rng=_key_data(rng),
            skipped_steps=jnp.asarray(0, jnp.int32),
            model_state={} if model_state is None else model_state,
            param_compensation=compensation,
            policy=policy,
            param_rounding=param_rounding,
            axes=axes,
            **kwargs,
        )

    def apply_gradients(self, *, grads, apply=None, global_norm=None, **kwargs) -> TrainState:
        """Applies one optax update from fp32 `grads`; does not advance `step` (the caller does).

        The update is computed and added in fp32, then rounded once to the param dtype by the
        chosen rounding, so 16-bit params never see 16-bit arithmetic on the update path.
        `apply` (a bool scalar; None: always): where False, params, optimizer state and
        compensation come back bit-identical. An `optim.Gated` optimizer keeps its own state
        (one read of each old leaf, see there); any other is selected after its update.
        `global_norm`: the gradients' norm where the caller has it (the train step does), which
        a gated clip reads (else `layerwise.norm` sums it here, in fp32).
        """
        trees = (self.params, grads, self.opt_state, self.param_compensation)
        update = functools.partial(self._update, apply=apply)
        gated = isinstance(self.tx, optim.Gated)
        if gated and global_norm is None:
            global_norm = layerwise.norm(grads)
        if layerwise.applies(self.params, gated):  # a big stack: a layer at a time
            params, opt_state, compensation = layerwise.update(update, *trees, global_norm)
        else:
            norm = {"global_norm": global_norm} if gated else {}
            params, opt_state, compensation = update(*trees, **norm)
        return self.replace(
            params=params, opt_state=opt_state, param_compensation=compensation, **kwargs
        )

    def _update(self, old, grads, opt_state, compensation, *, apply, layer=None, **extra):
        """`apply_gradients`' update of these trees (or of a layer's slices of them, `layer`:
        `layerwise`): `(params, opt_state, compensation)`."""
        params32 = dtypes.to_f32(old)
        gated = apply is not None and isinstance(self.tx, optim.Gated)
        if gated:
            extra = {**extra, "apply": apply, **({} if layer is None else {"layer": layer})}
        else:
            extra = {}
        updates, new_state = self.tx.update(grads, opt_state, params32, **extra)
        updates = dtypes.to_f32(updates)
        if self.axes is not None and self.axes.fixed:  # no gradient, and no decay either
            fixed = self.axes.is_fixed
            updates = jax.tree_util.tree_map_with_path(
                lambda path, u: jnp.zeros_like(u) if fixed(path) else u, updates
            )
        kept_compensation = compensation
        if self.param_rounding == "nearest":
            params = jax.tree.map(
                lambda p, u: (p + u).astype(self.policy.param_dtype), params32, updates
            )
        elif self.param_rounding == "stochastic":
            key = jax.random.fold_in(jax.random.wrap_key_data(self.rng), self.step)
            key = jax.random.fold_in(key, _ROUNDING_SALT)
            key = key if layer is None else jax.random.fold_in(key, layer)
            params = dtypes.stochastic_round_tree(jax.tree.map(jnp.add, params32, updates), key)
        else:  # kahan: carry the part of each update that rounding dropped into the next one
            dtype = self.policy.param_dtype
            wanted = jax.tree.map(lambda u, c: u + c.astype(jnp.float32), updates, compensation)
            # The new params are rounded explicitly and kept in fp32 for the compensation: a
            # cast to 16 bits and back is a round trip a compiler allowed excess precision may
            # skip (XLA:GPU's default), and the compensation would then always come out zero.
            new = jax.tree.map(lambda p, w: dtypes.round_to(p + w, dtype), params32, wanted)
            params = jax.tree.map(lambda n: n.astype(dtype), new)  # exact: already rounded
            compensation = jax.tree.map(
                lambda n, old, w: (w - (n - old)).astype(dtype), new, params32, wanted
            )
        if apply is not None:
            keep = lambda new, old: loss_scale_lib.select_tree(apply, new, old)
            params = keep(params, old)
            compensation = keep(compensation, kept_compensation)
            new_state = new_state if gated else keep(new_state, opt_state)
        return params, new_state, compensation
