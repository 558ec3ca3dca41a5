"""Every exception that ends a run, its exit code, and the value checks that raise config errors.

`main.py` exits with `exit_code` of whatever reached it; nothing else in mptrain declares a code:

    0 done · 1 a checkpoint could not be written · 2 bad usage or config, or an unusable workdir
    · 3 training went non-finite and could not recover · 75 preempted (SIGTERM), run again

The checks at the bottom are what every builder (`get_policy`, `make_optimizer`,
`create_loss_scale`, `mesh_shape`, ...) uses to reject a bad value with one message that names
it: `optimizer.eps=0.0: must be > 0`. `config.validate` builds those objects and turns their
`ValueError`s into `ConfigError`s, so each rule exists once.
"""

from __future__ import annotations

import math
from typing import Any

EXIT_OK = 0
EXIT_USAGE = 2


class ConfigError(ValueError):
    """A bad config value or usage; the message names the key, the value and what is valid."""

    exit_code = EXIT_USAGE


class StopTraining(Exception):
    """Training stopped before `num_train_steps`; `exit_code` is what `main.py` exits with."""

    exit_code = 1


class Preempted(StopTraining):
    """SIGTERM arrived; a checkpoint was written. Run the same command again to resume."""

    exit_code = 75

    def __init__(self, step: int):
        super().__init__(
            f"preempted (SIGTERM) at step {step}; checkpoint written, run the same command "
            "again to resume"
        )
        self.step = step


class NonFiniteTraining(StopTraining):
    """Non-finite steps went on past `config.max_consecutive_skips` (or the scale bottomed out)."""

    exit_code = 3


class WorkdirError(StopTraining):
    """The workdir is in use, unwritable, or holds checkpoints this config cannot resume."""

    exit_code = EXIT_USAGE


class StorageError(StopTraining):
    """A checkpoint could not be written (disk full, read-only); older ones are intact."""

    exit_code = 1


# --------------------------------------------------------------------------- value checks


def setting(section: Any, key: str, default: Any) -> Any:
    """`section[key]`, or `default` when the key is missing or None (a config placeholder)."""
    value = section.get(key, default)
    return default if value is None else value


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def check_number(
    key: str, value: Any, low: float = -math.inf, high: float = math.inf, *, open_low=False
) -> float:
    """`value` as a float when it is a finite number in `[low, high)` (`(low, high)` with
    `open_low`); else `ValueError("key=value: must be ...")`."""
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{key}={value!r}: must be a finite number")
    if (value <= low if open_low else value < low) or value >= high:
        bound = f"{'>' if open_low else '>='} {low:g}" if low > -math.inf else ""
        bound += (" and " if bound else "") + (f"< {high:g}" if high < math.inf else "")
        raise ValueError(f"{key}={value!r}: must be {bound}")
    return float(value)


def check_integer(key: str, value: Any, low: int) -> int:
    """`value` when it is an integer >= `low`; else a `ValueError` naming `key`."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key}={value!r}: must be an integer >= {low}")
    return value


def check_choice(key: str, value: Any, valid: tuple[str, ...]) -> str:
    """`value`, lower-cased and stripped, when it is one of `valid`; else a `ValueError`."""
    if not isinstance(value, str) or value.strip().lower() not in valid:
        raise ValueError(f"{key}={value!r}: not supported; valid values: {', '.join(valid)}")
    return value.strip().lower()
