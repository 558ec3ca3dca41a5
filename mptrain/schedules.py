"""Learning-rate schedules, counted in applied optimizer updates.

The optimizer's count advances only on applied updates (a skipped step keeps the old
`opt_state`), and with gradient accumulation once per `optimizer.accumulation_steps`
micro-batches; so do these schedules, and a warmup longer than a short run is cut to fit.
"""

from __future__ import annotations

from typing import Any

import optax

from mptrain import errors

SCHEDULES = ("constant", "cosine", "linear")


def updates(config: Any) -> int | None:
    """Optimizer updates in the run: `num_train_steps // optimizer.accumulation_steps`."""
    opt = config.optimizer
    accumulation = errors.check_integer(
        "optimizer.accumulation_steps", errors.setting(opt, "accumulation_steps", 1), 1
    )
    steps = config.get("num_train_steps")
    return None if steps is None else steps // accumulation


def warmup_steps(config: Any) -> int:
    """`optimizer.warmup_steps`, cut to half the run's updates when it would take all of them.

    A run shorter than its warmup (a smoke test with a few steps) would otherwise never reach
    its learning rate, and a decaying schedule would have nothing left to decay over.
    """
    warmup = errors.check_integer(
        "optimizer.warmup_steps", errors.setting(config.optimizer, "warmup_steps", 0), 0
    )
    total = updates(config)
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
