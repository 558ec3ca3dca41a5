"""Optimizers for mixed precision: where the optimizer state lives, and in which dtype.

`make_optimizer(config)` turns `config.optimizer` into an optax chain (clipping, the optimizer,
the learning-rate schedule, optional gradient accumulation) and returns the schedule with it, so
the trainer can log `schedule(optimizer_count(opt_state))`.

Why this module has its own `adamw`: `optax.adamw` keeps its moments in the dtype of the params
it is initialised with, so with bf16 params the optimizer state silently becomes bf16 as well.
Here moments are stored in `mu_dtype` / `nu_dtype` (fp32 unless asked otherwise), whatever the
param dtype, and every update is computed in fp32. With fp32 storage the numbers are those of
`optax.adamw`.

Storing a moment in bf16 has a trap of its own: bf16 keeps 8 significant bits, so rounding to
nearest drops any change smaller than half a unit in the last place, 0.2-0.4% of the value. The
second moment moves by `(1 - b2) = 0.1%` of its size per step, so rounded to nearest it mostly
cannot move at all: it neither decays nor follows small changes of `g**2`. bf16-stored moments
are therefore rounded stochastically by default (`moment_rounding="stochastic"`): correct in
expectation, so the running averages track their fp32 counterparts on average. The random bits
come from `seed` and the optimizer count, so a resumed run rounds exactly as an uninterrupted
one.

Counters: the optimizer's count lives inside `opt_state` and advances only when an update is
applied; `mptrain.make_train_step` keeps the old `opt_state` on a non-finite step, so schedules
follow applied updates and never drift on skips.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mptrain import precision
from mptrain import train_state as train_state_lib

NAMES = ("adamw", "sgd")
SCHEDULES = ("constant", "cosine", "linear")
MOMENT_ROUNDINGS = ("stochastic", "nearest")
_DTYPES = {
    "float32": np.dtype(jnp.float32),
    "f32": np.dtype(jnp.float32),
    "bfloat16": np.dtype(jnp.bfloat16),
    "bf16": np.dtype(jnp.bfloat16),
    "float16": np.dtype(jnp.float16),
    "f16": np.dtype(jnp.float16),
}
_BF16 = np.dtype(jnp.bfloat16)
_F16 = np.dtype(jnp.float16)
_F32 = np.dtype(jnp.float32)


# --------------------------------------------------------------------------- transformations


def _to_f32(tree: Any) -> Any:
    return jax.tree.map(lambda x: jnp.asarray(x).astype(jnp.float32), tree)


def _state_dtype(dtype: Any, key: str) -> np.dtype:
    """A storage dtype from None (fp32), a name or a dtype; `key` names it in errors."""
    if dtype is None:
        return _F32
    if isinstance(dtype, str):
        try:
            return _DTYPES[dtype.strip().lower()]
        except KeyError:
            raise ValueError(
                f"{key}={dtype!r} is not a known dtype; valid values: None, {', '.join(_DTYPES)}"
            ) from None
    dtype = np.dtype(dtype)
    if dtype not in (_F32, _BF16, _F16):
        raise ValueError(f"{key}={dtype.name!r}: optimizer state must be float32/bf16/fp16")
    return dtype


def _store(tree: Any, dtype: np.dtype, rounding: str, key: jax.Array) -> Any:
    """Rounds fp32 `tree` to its storage dtype; bf16 stochastically if asked."""
    if dtype != _BF16 or rounding == "nearest":
        return jax.tree.map(lambda x: x.astype(dtype), tree)
    leaves, treedef = jax.tree.flatten(tree)
    if not leaves:
        return tree
    keys = jax.random.split(key, len(leaves))
    rounded = [
        train_state_lib.stochastic_round_to_bf16(x, k) for x, k in zip(leaves, keys, strict=True)
    ]
    return jax.tree.unflatten(treedef, rounded)


def scale_by_adam(
    b1: float = 0.9,
    b2: float = 0.999,
    eps: float = 1e-8,
    mu_dtype: Any = None,
    nu_dtype: Any = None,
    *,
    moment_rounding: str = "stochastic",
    seed: int = 0,
) -> optax.GradientTransformation:
    """Adam's rescaling with moments stored in `mu_dtype`/`nu_dtype` and arithmetic in fp32.

    The state is an `optax.ScaleByAdamState(count, mu, nu)`. Each update upcasts the incoming
    gradients and the stored moments to fp32, computes the new moments and the bias-corrected
    step exactly as `optax.scale_by_adam` does, and rounds the moments once, on the way back to
    storage. `moment_rounding` decides how bf16-stored moments are rounded ("stochastic" or
    "nearest"); fp32 and fp16 storage always round to nearest.
    """
    mu_dtype = _state_dtype(mu_dtype, "mu_dtype")
    nu_dtype = _state_dtype(nu_dtype, "nu_dtype")
    if moment_rounding not in MOMENT_ROUNDINGS:
        raise ValueError(
            f"moment_rounding={moment_rounding!r}; valid values: {', '.join(MOMENT_ROUNDINGS)}"
        )

    def init_fn(params):
        # Only the shapes of `params` matter: the storage dtypes are ours, not the params'.
        return optax.ScaleByAdamState(
            count=jnp.zeros([], jnp.int32),
            mu=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), mu_dtype), params),
            nu=jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), nu_dtype), params),
        )

    def update_fn(updates, state, params=None):
        del params
        grads = _to_f32(updates)
        mu = optax.tree.update_moment(grads, _to_f32(state.mu), b1, 1)
        nu = optax.tree.update_moment_per_elem_norm(grads, _to_f32(state.nu), b2, 2)
        count = optax.safe_increment(state.count)
        mu_hat = optax.tree.bias_correction(mu, b1, count)
        nu_hat = optax.tree.bias_correction(nu, b2, count)
        updates = jax.tree.map(lambda m, v: m / (jnp.sqrt(v) + eps), mu_hat, nu_hat)
        key = jax.random.fold_in(jax.random.key(seed), count)
        mu_key, nu_key = jax.random.split(key)
        new_state = optax.ScaleByAdamState(
            count=count,
            mu=_store(mu, mu_dtype, moment_rounding, mu_key),
            nu=_store(nu, nu_dtype, moment_rounding, nu_key),
        )
        return updates, new_state

    return optax.GradientTransformation(init_fn, update_fn)


def _with_fp32_params(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Hands `inner.update` fp32 params, so e.g. weight decay is computed in fp32."""

    def update_fn(updates, state, params=None):
        return inner.update(updates, state, None if params is None else _to_f32(params))

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
) -> optax.GradientTransformation:
    """AdamW with moments stored in `mu_dtype`/`nu_dtype` (default fp32) and fp32 arithmetic.

    `learning_rate` is a float or an optax schedule; a schedule is read at the optimizer's own
    count, which advances only on applied updates. Weight decay is decoupled as in
    `optax.adamw` (added to the Adam step, then scaled by the learning rate) and applies to every
    param unless `mask` (a pytree of bools or a callable, as in optax) says otherwise. With
    float32 storage this computes what `optax.adamw` computes. `moment_rounding` and `seed`
    decide how bf16-stored moments are rounded (see the module docstring).
    """
    return optax.chain(
        scale_by_adam(b1, b2, eps, mu_dtype, nu_dtype, moment_rounding=moment_rounding, seed=seed),
        _with_fp32_params(optax.add_decayed_weights(weight_decay, mask)),
        optax.scale_by_learning_rate(learning_rate),
    )


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
    parts = []
    if momentum:
        parts.append(optax.trace(momentum, nesterov, _state_dtype(mu_dtype, "mu_dtype")))
    parts.append(_with_fp32_params(optax.add_decayed_weights(weight_decay, mask)))
    parts.append(optax.scale_by_learning_rate(learning_rate))
    return optax.chain(*parts)


# --------------------------------------------------------------------------- from a config


def _get(section: Any, key: str, default: Any) -> Any:
    value = section.get(key, default)
    return default if value is None else value


def _number(value: Any, key: str, low: float, high: float = float("inf"), *, open_low=False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (low < value if open_low else low <= value) and value < high
    if not ok:
        bound = f"{'>' if open_low else '>='} {low}" + (f" and < {high}" if high < 1e300 else "")
        raise ValueError(f"{key}={value!r}; it must be a number {bound}")
    return value


def _integer(value: Any, key: str, low: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < low:
        raise ValueError(f"{key}={value!r}; it must be an integer >= {low}")
    return int(value)


def _choice(value: Any, key: str, valid: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value.strip().lower() not in valid:
        raise ValueError(f"{key}={value!r} is not supported; valid values: {', '.join(valid)}")
    return value.strip().lower()


def make_schedule(
    name: str, learning_rate: float, warmup_steps: int, total_steps: int | None
) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then `name`'s shape until `total_steps`.

    "constant" holds `learning_rate`; "cosine" and "linear" decay it to 0 at `total_steps`
    (both counted in optimizer updates). Errors name the config keys they come from.
    """
    name = _choice(name, "optimizer.schedule", SCHEDULES)
    if name == "constant":
        after = optax.constant_schedule(learning_rate)
    else:
        if total_steps is None or total_steps <= warmup_steps:
            raise ValueError(
                f"optimizer.schedule={name!r} decays over the optimizer updates after warmup, but "
                f"there are {total_steps} updates (num_train_steps / "
                f"optimizer.accumulation_steps) and optimizer.warmup_steps={warmup_steps}; make "
                "num_train_steps larger or warmup_steps smaller"
            )
        decay_steps = total_steps - warmup_steps
        if name == "cosine":
            after = optax.cosine_decay_schedule(learning_rate, decay_steps, alpha=0.0)
        else:
            after = optax.linear_schedule(learning_rate, 0.0, decay_steps)
    if warmup_steps == 0:
        return after
    warmup = optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.join_schedules([warmup, after], [warmup_steps])


def make_optimizer(
    config: Any, *, weight_decay_mask: Any = None
) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """Builds `(tx, schedule)` from `config.optimizer` and `config.num_train_steps`.

    The chain is: `clip_by_global_norm` (when `optimizer.grad_clip_norm` is set and non-zero),
    the optimizer with the learning rate scheduled, and, when `optimizer.accumulation_steps > 1`,
    all of it wrapped in `optax.MultiSteps`. With accumulation the trainer's `step` counts
    micro-batches, while the optimizer's count (and so the schedule, `warmup_steps` included)
    counts applied updates: `num_train_steps // accumulation_steps` of them. The accumulator is
    fp32. `weight_decay_mask` is passed to the optimizer as optax's `mask`.

    Log the learning rate as `schedule(optimizer_count(state.opt_state))`. Bad values raise a
    `ValueError` that names the key and lists what is valid.
    """
    opt = config.optimizer
    name = _choice(_get(opt, "name", "adamw"), "optimizer.name", NAMES)
    learning_rate = _number(opt.get("learning_rate"), "optimizer.learning_rate", 0.0)
    warmup_steps = _integer(_get(opt, "warmup_steps", 0), "optimizer.warmup_steps", 0)
    weight_decay = _number(_get(opt, "weight_decay", 0.0), "optimizer.weight_decay", 0.0)
    clip = _number(_get(opt, "grad_clip_norm", 0.0), "optimizer.grad_clip_norm", 0.0)
    accumulation = _integer(_get(opt, "accumulation_steps", 1), "optimizer.accumulation_steps", 1)
    mu_dtype = _state_dtype(opt.get("mu_dtype"), "optimizer.mu_dtype")
    nu_dtype = _state_dtype(opt.get("nu_dtype"), "optimizer.nu_dtype")

    num_train_steps = config.get("num_train_steps")
    total = None
    if num_train_steps is not None:
        total = _integer(num_train_steps, "num_train_steps", 1) // accumulation
    schedule = make_schedule(_get(opt, "schedule", "constant"), learning_rate, warmup_steps, total)

    if name == "adamw":
        tx = adamw(
            schedule,
            b1=_number(_get(opt, "b1", 0.9), "optimizer.b1", 0.0, 1.0),
            b2=_number(_get(opt, "b2", 0.999), "optimizer.b2", 0.0, 1.0),
            eps=_number(_get(opt, "eps", 1e-8), "optimizer.eps", 0.0, open_low=True),
            weight_decay=weight_decay,
            mu_dtype=mu_dtype,
            nu_dtype=nu_dtype,
            mask=weight_decay_mask,
            moment_rounding=_choice(
                _get(opt, "moment_rounding", "stochastic"),
                "optimizer.moment_rounding",
                MOMENT_ROUNDINGS,
            ),
            seed=int(_get(config, "seed", 0)),
        )
    else:  # sgd
        if nu_dtype != _F32:  # the fp32 default is harmless; anything else was meant for adam
            raise ValueError(
                f"optimizer.nu_dtype={opt.get('nu_dtype')!r} has no meaning for "
                "optimizer.name='sgd' (it has no second moment); set it to None or 'float32'"
            )
        tx = sgd(
            schedule,
            momentum=_number(_get(opt, "momentum", 0.0), "optimizer.momentum", 0.0, 1.0),
            nesterov=bool(_get(opt, "nesterov", False)),
            weight_decay=weight_decay,
            mu_dtype=mu_dtype,
            mask=weight_decay_mask,
        )
    if clip:
        tx = optax.chain(optax.clip_by_global_norm(clip), tx)
    if accumulation > 1:
        tx = optax.MultiSteps(tx, every_k_schedule=accumulation, accumulator_dtype=jnp.float32)
        tx = _fp32_init(tx.gradient_transformation())
    return tx, schedule


def _fp32_init(inner: optax.GradientTransformation) -> optax.GradientTransformation:
    """Initialises `inner` from fp32 copies of the params.

    `optax.MultiSteps` sizes a few buffers from the params it is initialised with; our own states
    choose their dtypes explicitly, so only the shapes matter, and fp32 keeps any other buffer
    from quietly becoming bf16.
    """
    return optax.GradientTransformation(lambda params: inner.init(_to_f32(params)), inner.update)


# --------------------------------------------------------------------------- inspecting state


def _is_counter(path, value) -> bool:
    del path
    dtype = getattr(value, "dtype", None)
    return dtype is not None and jnp.issubdtype(dtype, jnp.integer) and jnp.ndim(value) == 0


def optimizer_count(opt_state: Any) -> jax.Array:
    """The optimizer's applied-update count (int32), the one the learning-rate schedule reads.

    Prefers the count of a `ScaleByScheduleState` (the schedule's own), else the first integer
    scalar named `count` (e.g. Adam's). Works inside `jit` and through `optax.MultiSteps`, whose
    inner counts advance once per applied update.
    """
    found = optax.tree_utils.tree_get_all_with_path(opt_state, "count", _is_counter)
    if not found:
        raise ValueError(
            "opt_state holds no integer 'count'; build the optimizer with a schedule "
            "(mptrain.optim.make_optimizer does) so the applied updates are counted"
        )
    for path, value in found:
        last = path[-1] if path else None
        if getattr(last, "tuple_name", None) == "ScaleByScheduleState":
            return jnp.asarray(value, jnp.int32)
    return jnp.asarray(found[0][1], jnp.int32)


def current_learning_rate(opt_state: Any, schedule: Callable[[Any], Any]) -> jax.Array:
    """`schedule` at the optimizer's applied-update count: the rate the next update will use."""
    return jnp.asarray(schedule(optimizer_count(opt_state)), jnp.float32)


def _nbytes(x: Any) -> int:
    return int(np.prod(np.shape(x), dtype=np.int64)) * np.dtype(x.dtype).itemsize


def state_bytes_per_param(params: Any, opt_state: Any) -> float:
    """Persistent bytes of params plus optimizer state, per parameter, measured from the arrays.

    Counts every param leaf and every optimizer-state array with at least one dimension
    (moments, momentum, accumulators); scalars such as step counts are per-state, not per-param,
    and are left out. Works on arrays and on `jax.ShapeDtypeStruct`s. AdamW gives 12 for fp32
    and bf16-mixed, 10 for bf16 params with fp32 moments and 6 with bf16 moments (Kahan
    compensation, kept in the TrainState and not in `opt_state`, would add 2 more).
    """
    param_leaves = [x for x in jax.tree.leaves(params) if hasattr(x, "dtype")]
    count = sum(int(np.prod(np.shape(x), dtype=np.int64)) for x in param_leaves)
    if count == 0:
        raise ValueError("params hold no arrays; cannot compute bytes per parameter")
    state_leaves = [
        x
        for x in jax.tree.leaves(opt_state)
        if hasattr(x, "dtype")
        and np.ndim(x) > 0
        and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
    ]
    total = sum(_nbytes(x) for x in param_leaves) + sum(_nbytes(x) for x in state_leaves)
    return total / count


def check_state_dtypes(
    policy: precision.Policy | str, config: Any, *, param_rounding: str | None = None
) -> list[str]:
    """Human-readable warnings about state dtypes that quietly lose training signal.

    Reads `config.optimizer.{name, learning_rate, mu_dtype, nu_dtype, moment_rounding}` and the
    param rounding (`param_rounding`, else `config.param_rounding`, else "nearest"). Warns when:
    - params are 16-bit, rounded to nearest, and `learning_rate` is below half the dtype's
      epsilon (bf16: 0.0039, fp16: 0.00049). Round-to-nearest drops any update smaller than
      half a unit in the last place, so a step of about `learning_rate` (the size of an Adam
      step) leaves every weight with |w| > learning_rate / (eps / 2) unchanged, which by then
      includes weights of magnitude 1. A decaying schedule makes this worse as training ends;
    - adamw keeps its second moment in bf16 with round-to-nearest: it moves by `(1 - b2)` of
      itself per step, below bf16's resolution, so it stops decaying and tracking `g**2`
      (likewise, more mildly, for the first moment);
    - adamw keeps a moment in fp16: `g**2` overflows above |g| ~ 256 and flushes to zero below
      |g| ~ 2.4e-4, which turns the Adam step into `mu / eps`.
    sgd's momentum buffer changes by `(1 - momentum)` of itself per step, which bf16 resolves,
    so it draws no warning.
    Returns an empty list when nothing is unsafe. Invalid values raise as in `make_optimizer`.
    """
    policy = precision.get_policy(policy)
    opt = config.optimizer
    warnings = []
    if param_rounding is None:
        param_rounding = _get(config, "param_rounding", "nearest")
    learning_rate = opt.get("learning_rate")
    param_dtype = np.dtype(policy.param_dtype)
    if param_dtype in (_BF16, _F16) and param_rounding == "nearest":
        half_eps = float(jnp.finfo(param_dtype).eps) / 2
        if isinstance(learning_rate, (int, float)) and learning_rate < half_eps:
            warnings.append(
                f"params are stored in {param_dtype.name} and rounded to nearest, and "
                f"optimizer.learning_rate={learning_rate:g} is below {half_eps:.3g}: an update "
                f"of about the learning rate is rounded away for every weight with |w| > "
                f"{learning_rate / half_eps:.3g}, so those weights stop training. Use "
                "param_rounding='stochastic' or 'kahan', or fp32 params (e.g. 'bf16-mixed')."
            )
    if _get(opt, "name", "adamw") != "adamw":
        return warnings  # sgd's momentum changes by (1 - momentum) per step: bf16 copes
    nearest = _get(opt, "moment_rounding", "stochastic") == "nearest"
    for key in ("mu_dtype", "nu_dtype"):
        dtype = _state_dtype(opt.get(key), f"optimizer.{key}")
        if dtype == _BF16 and nearest and key == "nu_dtype":
            warnings.append(
                "optimizer.nu_dtype=bfloat16 with optimizer.moment_rounding='nearest': the "
                "second moment moves by (1 - b2) of itself per step, below bfloat16's "
                "resolution, so it stops decaying and stops tracking g**2. Use "
                "moment_rounding='stochastic' (the default) or nu_dtype='float32'."
            )
        elif dtype == _BF16 and nearest:
            warnings.append(
                "optimizer.mu_dtype=bfloat16 with optimizer.moment_rounding='nearest': changes "
                "of the first moment smaller than bfloat16's resolution are rounded away. Use "
                "moment_rounding='stochastic' (the default) or mu_dtype='float32'."
            )
        elif dtype == _F16 and key == "nu_dtype":
            warnings.append(
                "optimizer.nu_dtype=float16: g**2 overflows float16 for |g| > 256 and flushes to "
                "zero for |g| < 2.4e-4, where the Adam step becomes mu / eps. Use float32 (or "
                "bfloat16, which has float32's range)."
            )
        elif dtype == _F16:
            warnings.append(
                "optimizer.mu_dtype=float16: gradients above 65504 overflow and tiny ones flush "
                "to zero. Use float32 (or bfloat16, which has float32's range)."
            )
    return warnings
