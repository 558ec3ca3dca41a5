"""Optimizers for mixed precision: where the optimizer state lives, and in which dtype.

`make_optimizer(config.optimizer, num_train_steps)` turns a config's optimizer section into an
optax chain (clipping, the optimizer, the learning-rate schedule, optional gradient
accumulation) and returns the schedule with it, so the trainer can log
`schedule(optimizer_count(opt_state))`. The optimizer's count advances only on applied updates
(see `Gated`), so schedules follow them and never drift on skipped steps.

Why this module has its own `adamw`: `optax.adamw` keeps its moments in the dtype of the params
it is initialised with, so with bf16 params the optimizer state silently becomes bf16 as well.
Here moments are stored in `mu_dtype` / `nu_dtype` (fp32 unless asked otherwise), whatever the
param dtype, and every update is computed in fp32. With fp32 storage the numbers are those of
`optax.adamw`.

bf16-stored moments are rounded stochastically by default (`moment_rounding="stochastic"`),
correct in expectation: to nearest, the second moment, moving by `(1 - b2) = 0.1%` of itself
per step, below bf16's resolution (0.2-0.4%), would stand still. The random bits come from
`seed` and the optimizer count, so a resumed run rounds exactly as an uninterrupted one.
Storage that loses signal (fp16; bf16 or q8 rounded to nearest) draws an `UnsafeMomentsWarning`.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mptrain import dtypes, errors
from mptrain.dtypes import BF16, F32, to_f32
from mptrain.optim import layerwise, q8, schedules

NAMES = ("adamw", "sgd")
MOMENT_ROUNDINGS = ("stochastic", "nearest")
Q8 = "q8"  # the 8-bit block-quantized state "dtype"


# --------------------------------------------------------------------------- transformations


class Gated(optax.GradientTransformationExtraArgs):
    """A transformation whose `update(updates, state, params, apply=flag)` returns its old state
    where `flag` (a bool scalar) is False: a step the trainer skips. Its parts select before they
    compute the updates from their new state (the moments, the count), so each state leaf is
    read once and written in place. A select after a whole optax update instead reads each old
    leaf twice, and XLA copies every donated moment to keep it for the second read: a kernel per
    leaf, every step. `make_optimizer` returns one when every stateful part gates (not with
    gradient accumulation)."""


def _keep(apply: Any, new: Any, old: Any) -> Any:
    """`new` where `apply` (None: always), else `old`; leafwise, 8-bit moments included."""
    if apply is None:
        return new
    return jax.tree.map(lambda n, o: jnp.where(apply, n, o), new, old)


def state_dtype(dtype: Any, key: str) -> np.dtype | str:
    """A storage dtype for optimizer state: None means float32, "q8" stays "q8" (8-bit
    block-quantized, `mptrain.optim.q8`); errors name `key`."""
    if dtype is None:
        return F32
    if isinstance(dtype, str) and dtype == Q8:
        return Q8
    try:
        return dtypes.parse_dtype(dtype, key)
    except ValueError as e:  # its list of dtypes lacks the one that is not a dtype: q8
        raise ValueError(f"{e}, or {Q8!r} (8-bit block-quantized)") from None


class UnsafeMomentsWarning(UserWarning):
    """Adam moments stored so that they quietly lose training signal (see `moment_warnings`)."""


_WHY = {  # (storage, moment): what goes wrong; bf16 and q8 only when rounded to nearest
    ("bfloat16", "mu_dtype"): "changes of the first moment smaller than bfloat16's resolution "
    "are rounded away. Use moment_rounding='stochastic' (the default) or mu_dtype='float32'.",
    ("bfloat16", "nu_dtype"): "the second moment moves by (1 - b2) of itself per step, below "
    "bfloat16's resolution, so it stops decaying and stops tracking g**2. Use moment_rounding="
    "'stochastic' (the default) or nu_dtype='float32'.",
    ("'q8'", "mu_dtype"): "8-bit codes resolve about 6% of a value, and a moment moves by "
    "(1 - b1) or (1 - b2) of itself per step, so rounded to nearest it mostly stands still. Use "
    "moment_rounding='stochastic' (the default).",
    ("float16", "mu_dtype"): "gradients above 65504 overflow and tiny ones flush to zero. Use "
    "float32 (or bfloat16, which has float32's range).",
    ("float16", "nu_dtype"): "g**2 overflows float16 for |g| > 256 and flushes to zero for "
    "|g| < 2.4e-4, where the Adam step becomes mu / eps. Use float32 (or bfloat16, which has "
    "float32's range).",
}
_WHY["'q8'", "nu_dtype"] = _WHY["'q8'", "mu_dtype"]


def moment_warnings(mu: Any, nu: Any, rounding: Any = "stochastic", prefix: str = "") -> list[str]:
    """Why Adam moments stored in `mu`/`nu` with `rounding` lose signal: a message per unsafe
    choice naming it (`prefix` + `mu_dtype`...), [] if none. `scale_by_adam` warns them, and
    `audit.setup_warnings` (the start-up log) reports them with `prefix="optimizer."`."""
    rounding = errors.check_choice(prefix + "moment_rounding", rounding, MOMENT_ROUNDINGS)
    found = []
    for key, dtype in (("mu_dtype", mu), ("nu_dtype", nu)):
        dtype = state_dtype(dtype, prefix + key)
        shown = repr(Q8) if dtype == Q8 else dtype.name
        if shown == "float16" or (shown != "float32" and rounding == "nearest"):
            how = "" if shown == "float16" else f" with {prefix}moment_rounding='nearest'"
            found.append(f"{prefix}{key}={shown}{how}: {_WHY[shown, key]}")
    return found


def _zeros(shape: tuple[int, ...], dtype: Any, kind: str, block: int, min_size: int) -> Any:
    if dtype == Q8:
        return q8.zeros(shape, kind, block) if q8.quantized(shape, min_size) else jnp.zeros(shape)
    return jnp.zeros(shape, dtype)


def _load(tree: Any) -> Any:
    """Stored moments as fp32."""
    return jax.tree.map(
        lambda x: q8.dequantize(x) if q8.is_q8(x) else to_f32(x), tree, is_leaf=q8.is_q8
    )


def _store(tree: Any, dtype: Any, rounding: str, key: jax.Array, stored: Any) -> Any:
    """Rounds fp32 `tree` to its storage dtype; bf16 and q8 stochastically if asked. `stored`
    (the state being replaced) says which tensors are 8-bit."""
    if dtype == Q8:
        leaves, treedef = jax.tree.flatten(tree)
        if not leaves:
            return tree
        keys = jax.random.split(key, len(leaves))
        old = jax.tree.leaves(stored, is_leaf=q8.is_q8)
        new = [
            q8.quantize(x, o.kind, o.block_size, k if rounding == "stochastic" else None)
            if q8.is_q8(o)
            else x
            for x, o, k in zip(leaves, old, keys, strict=True)
        ]
        return jax.tree.unflatten(treedef, new)
    if dtype != BF16 or rounding == "nearest":
        return jax.tree.map(lambda x: x.astype(dtype), tree)
    return dtypes.stochastic_round_tree(tree, key)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    *,
    moment_rounding: str = "stochastic",
    seed: int = 0,
    q8_block_size: int = q8.BLOCK_SIZE,
    q8_min_size: int = q8.MIN_SIZE,
    _stacklevel: int = 2,  # its warnings point at the user's line: adamw's caller is one further
) -> optax.GradientTransformation:
    """Adam's rescaling with moments stored in `mu_dtype`/`nu_dtype` and arithmetic in fp32.

    The state is an `optax.ScaleByAdamState(count, mu, nu)`. Each update upcasts the incoming
    gradients and the stored moments to fp32, computes the new moments and the bias-corrected
    step exactly as `optax.scale_by_adam` does, and rounds the moments once, on the way back to
    storage. `moment_rounding` decides how bf16-stored moments are rounded ("stochastic" or
    "nearest"); fp32 and fp16 storage always round to nearest. "q8" storage (`optim.q8`) keeps
    tensors of at least `q8_min_size` elements in blocks of `q8_block_size` 8-bit codes with an
    fp32 scale each (the first moment signed, the second in square-root space) and the rest in
    fp32; `moment_rounding` applies to its codes too. Unsafe storage warns (`moment_warnings`).
    """
    mu_dtype = state_dtype(mu_dtype, "mu_dtype")
    nu_dtype = state_dtype(nu_dtype, "nu_dtype")
    moment_rounding = errors.check_choice("moment_rounding", moment_rounding, MOMENT_ROUNDINGS)
    for message in moment_warnings(mu_dtype, nu_dtype, moment_rounding):
        warnings.warn(message, UnsafeMomentsWarning, stacklevel=_stacklevel)
    block = errors.check_integer("q8_block_size", q8_block_size, 1, *q8.MAX_BLOCK)
    min_size = errors.check_integer("q8_min_size", q8_min_size, 1, errors.INT32_MAX)

    def init_fn(params):
        # Only the shapes of `params` matter: the storage dtypes are ours, not the params'.
        zeros = lambda dtype, kind: lambda p: _zeros(jnp.shape(p), dtype, kind, block, min_size)
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(zeros(mu_dtype, "signed"), params),
            nu=jax.tree.map(zeros(nu_dtype, "sqrt"), params),
        )

    def update_fn(updates, state, params=None, *, apply=None, layer=None, **extra):
        del params, extra  # `layer`: one layer's slices of a stack (`layerwise`), its own bits
        grads = to_f32(updates)
        mu = optax.tree.update_moment(grads, _load(state.mu), b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, _load(state.nu), b2, 2)
        count = optax.safe_increment(state.count)
        key = jax.random.fold_in(jax.random.key(seed), count)
        key = key if layer is None else jax.random.fold_in(key, layer)
        mu_key, nu_key = jax.random.split(key)
        new_state = optax.ScaleByAdamState(
            count=count,
            mu=_store(mu, mu_dtype, moment_rounding, mu_key, state.mu),
            nu=_store(nu, nu_dtype, moment_rounding, nu_key, state.nu),
        )
        new_state = _keep(apply, new_state, state)  # see `Gated`
        # fp32 moments: the step is computed from the kept ones (the same numbers when applied);
        # stored in fewer bits, from the fp32 values before their rounding, as always
        mu = new_state.mu if mu_dtype == F32 else mu
        nu = new_state.nu if nu_dtype == F32 else nu
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        return updates, new_state

    return Gated(init_fn, update_fn)


def _trace(momentum: float, nesterov: bool, dtype: Any) -> Gated:
    """`optax.trace` (momentum, its buffer stored in `dtype`, the same `TraceState`), gated."""

    def init_fn(params):
        return optax.TraceState(
            trace=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), dtype), params)
        )

    def update_fn(updates, state, params=None, *, apply=None, **extra):
        del params, extra
        grads = to_f32(updates)
        new = jax.tree.map(lambda g, t: g + momentum * t.astype(jnp.float32), grads, state.trace)
        kept = _keep(apply, jax.tree.map(lambda t: t.astype(dtype), new), state.trace)
        new = kept if dtype == F32 else new
        updates = jax.tree.map(lambda g, t: g + momentum * t, grads, new) if nesterov else new
        return updates, optax.TraceState(trace=kept)

    return Gated(init_fn, update_fn)


def _scale_by_schedule(learning_rate: float | optax.Schedule) -> optax.GradientTransformation:
    """`optax.scale_by_learning_rate` (the same `ScaleByScheduleState`), its count gated."""
    if not callable(learning_rate):
        return optax.scale_by_learning_rate(learning_rate)  # stateless

    def init_fn(params):
        del params
        return optax.ScaleByScheduleState(count=jnp.zeros([], jnp.int32))

    def update_fn(updates, state, params=None, *, apply=None, **extra):
        del params, extra
        count = _keep(apply, optax.safe_increment(state.count), state.count)
        scale = -learning_rate(state.count)
        updates = jax.tree.map(lambda u: (scale * u).astype(u.dtype), updates)
        return updates, optax.ScaleByScheduleState(count=count)

    return Gated(init_fn, update_fn)


def _with_fp32_params(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Hands `inner.update` fp32 params, so e.g. weight decay is computed in fp32."""

    def update_fn(updates, state, params=None):
        return inner.update(updates, state, None if params is None else to_f32(params))

    return optax.GradientTransformation(inner.init, update_fn)


def adamw(
    learning_rate: float | optax.Schedule,
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    *,
    mask: Any = None,
    moment_rounding: str = "stochastic",
    seed: int = 0,
    q8_block_size: int = q8.BLOCK_SIZE,
    q8_min_size: int = q8.MIN_SIZE,
) -> optax.GradientTransformation:
    """AdamW with moments stored in `mu_dtype`/`nu_dtype` (default fp32) and fp32 arithmetic.

    `learning_rate` is a float or an optax schedule; a schedule is read at the optimizer's own
    count, which advances only on applied updates. Weight decay is decoupled as in
    `optax.adamw` (added to the Adam step, then scaled by the learning rate) and applies to every
    param unless `mask` (a pytree of bools or a callable, as in optax) says otherwise. With
    float32 storage this computes what `optax.adamw` computes. The moments' storage
    (`moment_rounding`, `seed`, "q8", its warnings) is `scale_by_adam`'s.
    """
    adam = scale_by_adam(
        b1,
        b2,
        eps,
        mu_dtype,
        nu_dtype,
        moment_rounding=moment_rounding,
        seed=seed,
        q8_block_size=q8_block_size,
        q8_min_size=q8_min_size,
        _stacklevel=3,
    )
    decay = _with_fp32_params(optax.add_decayed_weights(weight_decay, mask))
    return Gated(*optax.chain(adam, decay, _scale_by_schedule(learning_rate)))


def sgd(
    learning_rate: float | optax.Schedule,
    momentum: float | None = None,
    nesterov: bool = False,
    weight_decay: float = 0.0,
    mu_dtype: Any = None,
    *,
    mask: Any = None,
) -> optax.GradientTransformation:
    """SGD with optional (Nesterov) momentum kept in `mu_dtype` (default fp32) and fp32 updates.

    `optax.sgd` keeps the momentum buffer in the params' dtype; this one does not. Weight decay
    is added after the momentum (decoupled, like `adamw`) and scaled by the learning rate. The
    momentum buffer is rounded to nearest: its relative change per step, `1 - momentum`, is
    large enough for bf16.
    """
    parts = [_trace(momentum, nesterov, state_dtype(mu_dtype, "mu_dtype"))] if momentum else []
    parts.append(_with_fp32_params(optax.add_decayed_weights(weight_decay, mask)))
    parts.append(_scale_by_schedule(learning_rate))
    return Gated(*optax.chain(*parts))


# --------------------------------------------------------------------------- from a config


def make_optimizer(
    optimizer: Any, steps: int | None, *, seed: int = 0, weight_decay_mask: Any = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds `(tx, schedule)` from a config's `optimizer` section, for a run of `steps`
    batches (`num_train_steps`) seeded with `seed` (stochastic rounding's draws).

    The chain is: `clip_by_global_norm` (when `optimizer.grad_clip_norm` is set and non-zero),
    the optimizer with the learning rate scheduled, and, when `optimizer.accumulation_steps > 1`,
    all of it wrapped in `optax.MultiSteps`. With accumulation the trainer's `step` counts
    micro-batches, while the optimizer's count (and so the schedule, `warmup_steps` included)
    counts applied updates: `num_train_steps // accumulation_steps` of them. The accumulator is
    fp32. The warmup is `schedules.warmup_steps`. `weight_decay_mask` is passed to the
    optimizer as optax's `mask`. This is the one place that checks the `optimizer.*` keys: a bad
    value raises a `ValueError` that names the key and says what is valid (`config.validate`
    calls this). Unsafe moments draw no `UnsafeMomentsWarning` here (see the comment inside).
    """
    opt = optimizer
    get = lambda check, key, default, *a, **kw: check(
        f"optimizer.{key}", errors.setting(opt, key, default), *a, **kw
    )
    name = get(errors.check_choice, "name", "adamw", NAMES)
    lr = get(errors.check_number, "learning_rate", None, 0.0, open_low=True)
    weight_decay = get(errors.check_number, "weight_decay", 0.0, 0.0)
    clip = get(errors.check_number, "grad_clip_norm", 0.0, 0.0)
    mu_dtype = state_dtype(opt.get("mu_dtype"), "optimizer.mu_dtype")
    nu_dtype = state_dtype(opt.get("nu_dtype"), "optimizer.nu_dtype")
    schedule_name = errors.setting(opt, "schedule", "constant")
    schedule = schedules.make_schedule(
        schedule_name, lr, schedules.warmup_steps(opt, steps), schedules.updates(opt, steps)
    )

    if name == "adamw":
        rounding = get(errors.check_choice, "moment_rounding", "stochastic", MOMENT_ROUNDINGS)
        # Quiet: a run logs each problem at start-up (`audit.setup_warnings`, with the rest);
        # a Python warning too would repeat each.
        with warnings.catch_warnings(action="ignore", category=UnsafeMomentsWarning):
            tx = adamw(
                schedule,
                b1=get(errors.check_number, "b1", 0.9, 0.0, 1.0),
                b2=get(errors.check_number, "b2", 0.999, 0.0, 1.0),
                eps=get(errors.check_number, "eps", 1e-8, 0.0, open_low=True),
                weight_decay=weight_decay,
                mu_dtype=mu_dtype,
                nu_dtype=nu_dtype,
                mask=weight_decay_mask,
                moment_rounding=rounding,
                seed=int(seed),
                q8_block_size=get(errors.check_integer, "q8_block_size", *q8.BLOCK_SETTING),
                q8_min_size=get(errors.check_integer, "q8_min_size", q8.MIN_SIZE, 1),
            )
    else:  # sgd
        if mu_dtype == Q8:
            raise ValueError(
                "optimizer.mu_dtype='q8': 8-bit state is built for adamw's moments; with "
                "optimizer.name='sgd' use 'float32' or 'bfloat16'"
            )
        if nu_dtype != F32:  # the fp32 default is harmless; anything else was meant for adam
            raise ValueError(
                f"optimizer.nu_dtype={opt.get('nu_dtype')!r}: has no meaning for "
                "optimizer.name='sgd' (it has no second moment); set it to None or 'float32'"
            )
        tx = sgd(
            schedule,
            momentum=get(errors.check_number, "momentum", 0.0, 0.0, 1.0),
            nesterov=bool(errors.setting(opt, "nesterov", False)),
            weight_decay=weight_decay,
            mu_dtype=mu_dtype,
            mask=weight_decay_mask,
        )
    if clip:  # stateless: the chain still gates
        tx = Gated(*optax.chain(layerwise.clip_by_global_norm(clip), tx))
    accumulation = errors.setting(opt, "accumulation_steps", 1)
    if accumulation > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=accumulation, accumulator_dtype=jnp.float32)
        inner = tx.gradient_transformation()  # its buffers from fp32 params, not bf16 ones
        tx = optax.GradientTransformation(lambda p: inner.init(to_f32(p)), inner.update)
    return tx, schedule
