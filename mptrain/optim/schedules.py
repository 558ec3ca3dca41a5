"""Learning-rate schedules, counted in applied optimizer updates, and that count.

The optimizer's count advances only on applied updates (a skipped step keeps the old
`opt_state`), and with gradient accumulation once per `optimizer.accumulation_steps`
micro-batches; so do these schedules, and a warmup longer than a short run is cut to fit.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from mptrain import errors

SCHEDULES = ("constant", "cosine", "linear")


def updates(optimizer: Any, steps: int | None) -> int | None:
    """Optimizer updates in a run of `steps` batches (`num_train_steps`; None: unbounded):
    `steps // optimizer.accumulation_steps` (`optimizer`: the config's section)."""
    accumulation = errors.check_integer(
        "optimizer.accumulation_steps",
        errors.setting(optimizer, "accumulation_steps", 1),
        1,
        errors.INT32_MAX,
        errors.INT32_WHY,
    )
    if steps is None:
        return None
    if isinstance(steps, int) and 0 < steps < accumulation:
        raise ValueError(
            f"optimizer.accumulation_steps={accumulation}: more micro-batches per update than "
            f"the run's num_train_steps={steps}, so no update would ever be applied; use at "
            f"most {steps}"
        )
    return steps // accumulation


def warmup_steps(optimizer: Any, steps: int | None) -> int:
    """`optimizer.warmup_steps`, cut to half the updates of a run of `steps` batches when it
    would take all of them.

    A run shorter than its warmup (a smoke test with a few steps) would otherwise never reach
    its learning rate, and a decaying schedule would have nothing left to decay over.
    """
    warmup = errors.check_integer(
        "optimizer.warmup_steps",
        errors.setting(optimizer, "warmup_steps", 0),
        0,
        errors.INT32_MAX,
        errors.INT32_WHY,
    )
    total = updates(optimizer, steps)
    return warmup if total is None or warmup < total else total // 2


def make_schedule(
    name: str, learning_rate: float, warmup_steps: int, total_steps: int | None
) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then `name`'s shape until `total_steps`.

    "constant" holds `learning_rate`; "cosine" and "linear" decay it to 0 at `total_steps`
    (both counted in optimizer updates, which must outnumber the warmup).
    """
    name = errors.check_choice("optimizer.schedule", name, SCHEDULES)
    if name == "constant":
        after = optax.constant_schedule(learning_rate)
    else:
        if total_steps is None or total_steps <= warmup_steps:
            raise ValueError(
                f"optimizer.warmup_steps={warmup_steps}: optimizer.schedule={name!r} decays over "
                f"the updates after warmup, and there are {total_steps}"
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


# --------------------------------------------------------------------------- reading the count


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
