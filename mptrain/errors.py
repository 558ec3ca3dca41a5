"""Every exception that ends a run, its exit code, and the value checks that raise config errors.

`main.py` exits with `exit_code` of whatever reached it; nothing else in mptrain declares a code:

    0 done · 1 a checkpoint could not be written · 2 bad usage or config, or an unusable workdir
    · 3 training went non-finite and could not recover · 75 preempted (SIGTERM or a first
    Ctrl-C), a checkpoint written: run again · 130 a second Ctrl-C, stopped at once

The checks at the bottom are what every builder (`get_policy`, `make_optimizer`,
`create_loss_scale`, `mesh_shape`, ...) uses to reject a bad value with one message that names
it: `optimizer.eps=0.0: must be > 0`. `config.validate` builds those objects and turns their
`ValueError`s into `ConfigError`s, so each rule exists once.
"""

from __future__ import annotations

import contextlib
import difflib
import math
from collections.abc import Iterable, Mapping
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
    """A stop signal (SIGTERM, or Ctrl-C's SIGINT) arrived; a checkpoint was written. Run the
    same command again to resume."""

    exit_code = 75

    def __init__(self, step: int, signal_name: str = "SIGTERM"):
        super().__init__(
            f"preempted ({signal_name}) at step {step}; checkpoint written, run the same "
            "command again to resume"
        )
        self.step = step
        self.signal_name = signal_name


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


@contextlib.contextmanager
def config_errors():
    """Within the block, a check's `ValueError` (``model.hidden=0: ...``) becomes the
    `ConfigError` ``config.model.hidden=0: ...`` (exit 2); a `ConfigError` passes unchanged."""
    try:
        yield
    except ConfigError:
        raise
    except ValueError as e:
        raise ConfigError(f"config.{e}") from None


def first_line(error: BaseException) -> str:
    """An exception's first non-empty line of text, or its type's name when it has none."""
    lines = [line for line in str(error).splitlines() if line.strip()]
    return lines[0].strip() if lines else type(error).__name__


def setting(section: Any, key: str, default: Any) -> Any:
    """`section[key]`, or `default` when the key is missing or None (a config placeholder)."""
    value = section.get(key, default)
    return default if value is None else value


def settings(section: Any, defaults: dict[str, Any]) -> dict[str, Any]:
    """Each key of `defaults` as `section` (a ConfigDict, a dict such as `hf.load` gives, or any
    object with attributes) sets it, its default where it is missing or None."""
    if isinstance(section, Mapping):
        found = {key: section.get(key) for key in defaults}
    else:
        found = {key: getattr(section, key, None) for key in defaults}
    return {key: default if found[key] is None else found[key] for key, default in defaults.items()}


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
        bounds = [f"{'>' if open_low else '>='} {low:g}"] if low > -math.inf else []
        bounds += [f"< {high:g}"] if high < math.inf else []
        raise ValueError(f"{key}={value!r}: must be {' and '.join(bounds)}")
    return float(value)


# The upper bound of a count the device keeps as int32 (the step, the scaler's counters).
INT32_MAX = 2**31 - 1
INT32_WHY = "the device counts it in a 32-bit integer"


def check_integer(key: str, value: Any, low: int, high: int | None = None, why: str = "") -> int:
    """`value` when it is an integer in `[low, high]`; else a `ValueError` naming `key`, the
    bound it passes and, for `high`, `why` that bound follows from what the key means."""
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{key}={value!r}: must be an integer >= {low}")
    if high is not None and value > high:
        raise ValueError(f"{key}={value!r}: must be at most {high:,}" + (f": {why}" if why else ""))
    return value


def bytes_text(count: float) -> str:
    """`12.0 GiB`, `3.1 TiB`, `512 B`: a byte count for a message."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:.1f} {unit}"
    return f"{int(count)} B"


def check_integers(key: str, value: Any, low: int) -> tuple[int, ...]:
    """`value` as a tuple when it is a non-empty sequence of integers >= `low` (layer widths,
    blocks per stage); else a `ValueError` naming `key`."""
    items = tuple(value) if isinstance(value, list | tuple) else None
    if not items or any(isinstance(v, bool) or not isinstance(v, int) or v < low for v in items):
        raise ValueError(f"{key}={value!r}: must be a non-empty tuple of integers >= {low}")
    return items


def did_you_mean(name: str, valid: Iterable[str], *, list_all: bool = False) -> str:
    """`"did you mean 'x'?"` naming the entry of `valid` closest to `name`; all of them as well
    with `list_all`, or when none is close."""
    valid = sorted(valid)
    section, _, leaf = name.rpartition(".")
    short = [  # `lr` for `learning_rate`, `warmup` for `warmup_steps`: abbreviations first
        v
        for v in valid
        if v.rpartition(".")[0] == section
        and len(leaf) >= 2
        and (
            leaf == "".join(w[0] for w in v.rpartition(".")[2].split("_"))
            or v.rpartition(".")[2].startswith(leaf)
        )
    ]
    close = short[:1] or difflib.get_close_matches(name, valid, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}?" if close else ""
    if list_all or not close:
        listed = f"valid: {', '.join(valid) or 'none'}"
        hint = f"{hint} ({listed})" if hint else listed
    return hint


def check_choice(key: str, value: Any, valid: tuple[str, ...]) -> str:
    """`value`, lower-cased and stripped, when it is one of `valid`; else a `ValueError`."""
    if not isinstance(value, str) or value.strip().lower() not in valid:
        raise ValueError(f"{key}={value!r}: not supported; valid values: {', '.join(valid)}")
    return value.strip().lower()
