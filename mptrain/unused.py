"""Settings a valid config sets that cannot do what they say in this run, each told once at
start-up: one table of rules, not a branch per key.

`validate` lets a setting of another setup pass (a loss scale under bf16, a model key after
`model.name` changed, `fp8.*` under bf16-mixed), so that switching one key on the command line
stays possible; the run then warns of each. A rule of `RULES` says which keys matter only when
something holds (`matters`), and why not otherwise; a key set to other than its default where
its rule does not hold is a line. `NUMBERS` holds the settings that take effect, but not as
asked: a warmup longer than the run, micro-batches left unapplied at the end, more eval batches
than the eval split holds, a trace past the run's last step. `settings(config)` gives the
lines; the start-up log warns of them. From the command line (`command_line`), a key without
effect is told only where the user set it there, or where the config file alone leaves it
without effect: a config file's keys for the source or model it names are not the user's doing
when `--config.data.name` or `--config.model.name` switches to another.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np

from mptrain import dtypes, errors
from mptrain.optim import schedules
from mptrain.recipe import loss_scale


@dataclasses.dataclass(frozen=True)
class Run:
    """What the rules read of a config: the config itself and what it resolves to."""

    config: Any
    policy: Any
    loss_scale: str  # the resolved kind: "none" | "static" | "dynamic"
    optimizer: str  # "adamw" | "sgd"
    moments: tuple[str, ...]  # the storage dtypes of adamw's moments, by name
    eval_batches: int | None  # distinct batches of the eval source, where known


@dataclasses.dataclass(frozen=True)
class Rule:
    keys: tuple[str, ...]  # dotted keys that matter only when `matters` holds
    matters: Callable[[Run], bool]
    why: Callable[[Run], str]  # why they do not, said after "no effect, "


def _scaled(run: Run) -> tuple[str, ...]:
    return loss_scale.USES[run.loss_scale]


def _loss_scale_why(run: Run) -> str:
    asked = f"loss_scale.kind={run.config.loss_scale.kind!r}"
    if run.loss_scale == "static":
        return f"a static loss scale ({asked}) uses init_scale only"
    auto = asked.endswith("'auto'")
    return f"{asked} scales no loss" + (
        f" under {run.policy.compute_dtype.name} compute" if auto else ""
    )


_ADAM = ("b1", "b2", "eps", "moment_rounding", "q8_block_size", "q8_min_size")
RULES = [
    *(
        Rule((f"loss_scale.{key}",), lambda run, key=key: key in _scaled(run), _loss_scale_why)
        for key in loss_scale.USES["dynamic"]
    ),
    Rule(
        ("numerics.every_step",),
        lambda run: run.config.numerics.per_layer,
        lambda run: (
            "without numerics.per_layer=True (it says when the per-layer tables are "
            "measured, and none are)"
        ),
    ),
    Rule(
        ("fp8.history", "fp8.margin", "fp8.scaling"),
        lambda run: bool(run.policy.fp8),
        lambda run: f"precision={run.config.precision!r} has no fp8 matmuls",
    ),
    Rule(
        ("optimizer.momentum", "optimizer.nesterov"),
        lambda run: run.optimizer == "sgd",
        lambda run: f"optimizer.name={run.optimizer!r}: momentum is sgd's",
    ),
    Rule(
        tuple(f"optimizer.{key}" for key in _ADAM),
        lambda run: run.optimizer == "adamw",
        lambda run: f"optimizer.name={run.optimizer!r}: adamw's setting",
    ),
    Rule(
        ("optimizer.q8_block_size", "optimizer.q8_min_size"),
        lambda run: "q8" in run.moments,
        lambda run: "neither moment is stored in q8 (optimizer.mu_dtype, optimizer.nu_dtype)",
    ),
    Rule(
        ("optimizer.moment_rounding",),
        lambda run: any(m in ("bfloat16", "q8") for m in run.moments),
        lambda run: (
            "it rounds moments stored in bfloat16 or q8, and none is (float32 and "
            "float16 round to nearest)"
        ),
    ),
    Rule(
        ("matmul_precision",),
        lambda run: run.policy.compute_dtype == dtypes.F32 or run.config.keep_fp32 is not None,
        lambda run: (
            f"under {run.policy.compute_dtype.name} compute with the preset's casting rule every "
            "matmul runs in the compute dtype; it sets the precision of float32 matmuls"
        ),
    ),
    Rule(
        ("keep_fp32",),
        lambda run: run.policy.compute_dtype != dtypes.F32,
        lambda run: "under float32 compute every param reaches the model in float32",
    ),
]


def _warmup(run: Run) -> str | None:
    opt, steps = run.config.optimizer, run.config.num_train_steps
    asked, used = opt.warmup_steps, schedules.warmup_steps(opt, steps)
    if asked == used:
        return None
    return (
        f"optimizer.warmup_steps={asked}: not shorter than the run's "
        f"{schedules.updates(opt, steps)} updates; warming up over {used} instead"
    )


def _accumulation(run: Run) -> str | None:
    k = errors.setting(run.config.optimizer, "accumulation_steps", 1)
    left = run.config.num_train_steps % k
    if not left:
        return None
    return (
        f"optimizer.accumulation_steps={k}: num_train_steps={run.config.num_train_steps} leaves "
        f"its last {left} micro-batches unapplied at the end (they make no update); make "
        f"num_train_steps a multiple of {k}"
    )


def _eval_steps(run: Run) -> str | None:
    if run.eval_batches is None or run.config.eval_steps <= run.eval_batches:
        return None
    return (
        f"eval_steps={run.config.eval_steps}: the eval split holds {run.eval_batches} batches "
        f"of batch_size={run.config.batch_size}; an evaluation repeats them, each "
        f"~{run.config.eval_steps / run.eval_batches:.1f} times. Use eval_steps <= "
        f"{run.eval_batches}"
    )


def _profile(run: Run) -> str | None:
    prof, last = run.config.profile, run.config.num_train_steps
    start, steps = errors.setting(prof, "start_step", 5), errors.setting(prof, "num_steps", 0)
    if not steps or start + steps - 1 <= last:
        return None
    if start > last:
        return (
            f"profile.start_step={start}: after the run's last step (num_train_steps={last}); "
            f"no step is traced. Use profile.start_step <= {last}"
        )
    return (
        f"profile.num_steps={steps}: the run ends at step {last}; steps {start}-{last} are traced"
    )


def _label_smoothing(run: Run) -> str | None:
    dpo = run.config.get("dpo")
    smoothing = dpo.get("label_smoothing") if dpo else None
    loss = dpo.get("loss", "sigmoid") if dpo else None
    if not smoothing or loss not in ("hinge", "ipo"):
        return None
    return (
        f"dpo.label_smoothing={smoothing!r}: no effect, dpo.loss={loss!r} has no label "
        "smoothing (the sigmoid and robust losses do)"
    )


NUMBERS = [_warmup, _accumulation, _eval_steps, _profile, _label_smoothing]


def settings(config: Any, eval_batches: int | None = None, policy: Any = None) -> list[str]:
    """One line per setting of a valid `config` that cannot do what it says (see the module
    doc): a model or data key that the module named does not read, the keys of each broken rule
    set to other than their defaults (the base config's), then `NUMBERS`. `eval_batches`: the
    eval source's `num_batches`, where it has one; `policy`: the run's (None: `config`'s, built
    here); a run's start-up is the caller. Under
    `command_line`, a key that has no effect only because the command line changed what it
    depends on is not told."""
    told, found, run = _told(), [], _run(config, eval_batches, policy)
    for keys, why in _no_effect(config, run):
        if shown := [key for key in keys if told(key)]:
            found.append(
                f"{', '.join(f'{k}={_get(config, k)!r}' for k in shown)}: no effect, {why}"
            )
    return found + [line for check in NUMBERS if (line := check(run))]


def _no_effect(config: Any, run: Run | None = None) -> list[tuple[list[str], str]]:
    """`(keys, why)` for the keys set that have no effect, those of one broken rule together
    (`run`: `config`'s `Run`, where the caller has it)."""
    from mptrain import config as config_lib

    defaults, found = config_lib.base_config(), []
    for section, module in config_lib._zoo(config).items():
        for key, _ in config_lib.flat_items(config[section], f"{section}."):
            if key.partition(".")[2] not in (*module.CONFIG_KEYS, *defaults[section]):
                found.append(([key], f"{section}.name={config[section].name!r} reads no such key"))
    run, seen = run or _run(config, None), set()
    for rule in RULES:
        if rule.matters(run):
            continue
        keys = [k for k in rule.keys if k not in seen and _get(config, k) != _get(defaults, k)]
        seen |= set(rule.keys)
        if keys:
            found.append((keys, rule.why(run)))
    return found


def _run(config: Any, eval_batches: int | None, policy: Any = None) -> Run:
    from mptrain import config as config_lib
    from mptrain import optim

    opt, policy = config.optimizer, policy or config_lib.policy_of(config)
    return Run(
        config=config,
        policy=policy,
        loss_scale=loss_scale.resolve_kind(config.loss_scale.kind, policy),
        optimizer=errors.setting(opt, "name", "adamw").strip().lower(),
        moments=tuple(
            _name(optim.state_dtype(opt.get(key), key)) for key in ("mu_dtype", "nu_dtype")
        ),
        eval_batches=eval_batches,
    )


_COMMAND_LINE: list[tuple[Any, tuple[str, ...]]] = []  # (the config file's config, overrides)


@contextlib.contextmanager
def command_line(given: Any, overrides: list[str]):
    """Within it, `settings` tells a key that has no effect only where the command line set it
    (`--config.KEY=...`, `overrides` the KEYs) or where the config file's own config (`given`,
    before the overrides) leaves it with none as well: `--config.data.name=tokens` does not
    warn of the text keys the config file set for its own source."""
    _COMMAND_LINE.append((given, tuple(overrides)))
    try:
        yield
    finally:
        _COMMAND_LINE.pop()


def _told() -> Callable[[str], bool]:
    if not _COMMAND_LINE:
        return lambda key: True
    given, overrides = _COMMAND_LINE[-1]
    try:
        moot = {key for keys, _ in _no_effect(given) for key in keys}
    except Exception:  # a file config that is not valid on its own: tell every key
        return lambda key: True
    return lambda key: key in moot or any(key == o or key.startswith(f"{o}.") for o in overrides)


def _name(dtype: Any) -> str:
    return dtype if isinstance(dtype, str) else np.dtype(dtype).name


def _get(config: Any, key: str) -> Any:
    value = config
    for part in key.split("."):
        value = value.get(part) if hasattr(value, "get") else None
    return value
