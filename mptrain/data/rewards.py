"""Rewards for RL with verifiable rewards (`grpo.reward_funcs`): Python callables that score
completions, with TRL's signature (`GRPOTrainer`, 1.16), so a reward written for TRL runs here.

A reward is called once per batch of completions as

    f(prompts=[...], completions=[...], completion_ids=[[...], ...], **columns)

where `prompts` are the rows' prompts as the data gave them (a string, or a list of messages),
`completions` the decoded completions (a string each; `[{"role": "assistant", "content": ...}]`
for a conversational prompt), `completion_ids` their token ids (up to and including the end
token), and `columns` every other field of the rows as a list a field (`answer=[...]`). It
returns a float, or None where it has no opinion, per completion; a None is left out of the
group's mean and gets advantage 0 where every reward is None, as TRL does.

`grpo.reward_funcs` names them: `module:function` (imported; the module on `sys.path` or a
`.py` file's path before the colon), or a built-in of `BUILTIN`, with TRL's names where TRL has
them:

  * `think_format_reward`: 1.0 where the completion is `<think>...</think>` then the answer
    (TRL's pattern, `^<think>(?!.*<think>)(.*?)</think>.*$`, dot-all), else 0.0;
  * `answer_match_reward`: 1.0 where the completion's answer equals the row's `answer` column,
    else 0.0: each side's answer is the number after GSM8K's `####` where it writes one, else
    its last number (commas and a trailing `.0` dropped), else its stripped text; None for a
    row whose `answer` is missing or None;
  * `soft_overlong_punishment_reward`: DAPO's soft penalty on length (TRL's
    `get_soft_overlong_punishment`): 0 up to `grpo.max_completion_length -
    grpo.soft_punish_cache` tokens, then down linearly to -1 at `max_completion_length`.

A reward that raises, returns the wrong number of values or a value that is no number, is a
`RewardError` naming it and what it did (exit 2).
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from mptrain import errors

THINK_FORMAT = re.compile(r"^<think>(?!.*<think>)(.*?)</think>.*$", re.DOTALL | re.MULTILINE)
_GSM8K = re.compile(r"####\s*(-?[\d,]*\.?\d+)")
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


class RewardError(errors.ConfigError):
    """A reward function that cannot be loaded, or that failed on a batch: its name and why."""


def think_format_reward(completions: list, **kwargs) -> list[float]:
    """1.0 where a completion is `<think>...</think>` and then its answer, else 0.0."""
    return [1.0 if THINK_FORMAT.match(_text(c)) else 0.0 for c in completions]


def answer_of(text: str) -> str:
    """A text's answer: the number after `####`, else its last number, else the text stripped
    (numbers without thousands' commas, and `12.0` as `12`)."""
    found = _GSM8K.findall(text) or _NUMBER.findall(text)
    if not found:
        return text.strip()
    number = found[-1].replace(",", "")
    return number[:-2] if number.endswith(".0") else number


def answer_match_reward(completions: list, answer: list | None = None, **kwargs) -> list:
    """1.0 where a completion's answer (`answer_of`) is its row's, 0.0 where not; None for a
    row without an `answer`."""
    if answer is None:
        return [None] * len(completions)
    return [
        None if want is None else float(answer_of(_text(c)) == answer_of(str(want)))
        for c, want in zip(completions, answer, strict=True)
    ]


@dataclasses.dataclass(frozen=True)
class SoftOverlong:
    """DAPO's soft overlong penalty (TRL's `get_soft_overlong_punishment`)."""

    max_completion_length: int
    soft_punish_cache: int
    __name__ = "soft_overlong_punishment_reward"

    def __call__(self, completion_ids: list, **kwargs) -> list[float]:
        free = self.max_completion_length - self.soft_punish_cache
        out = []
        for ids in completion_ids:
            n = len(ids)
            if n <= free:
                out.append(0.0)
            elif n <= self.max_completion_length:
                out.append((free - n) / self.soft_punish_cache)
            else:
                out.append(-1.0)
        return out


BUILTIN = ("think_format_reward", "answer_match_reward", "soft_overlong_punishment_reward")


@dataclasses.dataclass(frozen=True)
class Reward:
    """A reward function as the run calls it: `name` (what the record logs it under:
    `rewards/<name>/mean`), the callable, and its weight in the summed reward."""

    name: str
    function: Callable[..., Any]
    weight: float


def load(specs: Any, weights: Any, max_completion_length: int, soft_punish_cache: int) -> list:
    """The `Reward`s `grpo.reward_funcs` names (a name or a list of them) with
    `grpo.reward_weights` (None: 1.0 each). A `RewardError` names a bad one."""
    names = [specs] if isinstance(specs, str) else specs
    if not isinstance(names, list | tuple) or not names:
        raise RewardError(
            f"grpo.reward_funcs={specs!r}: a reward's name (module:function, or one of "
            f"{', '.join(BUILTIN)}) or a list of them"
        )
    if weights is None:
        weights = [1.0] * len(names)
    if not isinstance(weights, list | tuple) or len(weights) != len(names):
        raise RewardError(
            f"grpo.reward_weights={weights!r}: one number a reward of grpo.reward_funcs "
            f"({len(names)})"
        )
    out = []
    for spec, weight in zip(names, weights, strict=True):
        if (
            isinstance(weight, bool)
            or not isinstance(weight, int | float)
            or not math.isfinite(weight)
        ):
            raise RewardError(f"grpo.reward_weights={weights!r}: {weight!r} is no finite number")
        function = _function(spec, max_completion_length, soft_punish_cache)
        name = getattr(function, "__name__", None) or str(spec)
        out.append(Reward(name, function, float(weight)))
    if len({r.name for r in out}) < len(out):
        raise RewardError(
            f"grpo.reward_funcs={specs!r}: two rewards are named alike; each logs under its name"
        )
    return out


def _function(spec: Any, max_completion_length: int, soft_punish_cache: int) -> Callable:
    key = f"grpo.reward_funcs: {spec!r}"
    if not isinstance(spec, str) or not spec.strip():
        raise RewardError(f"{key}: not a reward's name")
    if spec == "soft_overlong_punishment_reward":
        if not 0 < soft_punish_cache <= max_completion_length:
            raise RewardError(
                f"{key} with grpo.soft_punish_cache={soft_punish_cache}: the penalty ramps over "
                f"that many tokens, from 1 to grpo.max_completion_length="
                f"{max_completion_length}"
            )
        return SoftOverlong(max_completion_length, soft_punish_cache)
    if spec in BUILTIN:
        return globals()[spec]
    module_name, colon, attribute = spec.rpartition(":")
    if not colon or not module_name or not attribute:
        raise RewardError(f"{key}: neither a built-in ({', '.join(BUILTIN)}) nor module:function")
    try:
        module = _import(module_name)
    except Exception as e:  # the user's module: any error it raises on import
        raise RewardError(
            f"{key}: {module_name} does not import ({errors.first_line(e)})"
        ) from None
    function = getattr(module, attribute, None)
    if not callable(function):
        raise RewardError(f"{key}: {module_name} has no function {attribute!r}")
    return function


def _import(name: str) -> Any:
    """A module by its dotted name, or a `.py` file by its path."""
    if not name.endswith(".py"):
        return importlib.import_module(name)
    path = os.path.abspath(os.path.expanduser(name))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no such file {path}")
    module_name = f"mptrain_reward_{os.path.basename(path)[:-3]}"
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def score(
    rewards: Sequence[Reward],
    prompts: list,
    completions: list,
    completion_ids: list,
    columns: dict[str, list],
) -> np.ndarray:
    """float32 `[completions, rewards]`: each reward's values (NaN for None), called as TRL
    calls them (the module doc). A `RewardError` names a reward that fails."""
    n = len(completions)
    out = np.full((n, len(rewards)), np.nan, np.float32)
    for k, reward in enumerate(rewards):
        what = f"grpo.reward_funcs: {reward.name}"
        try:
            values = reward.function(
                prompts=prompts, completions=completions, completion_ids=completion_ids, **columns
            )
        except Exception as e:  # the user's function: whatever it raises is told in one line
            raise RewardError(f"{what} raised {type(e).__name__}: {errors.first_line(e)}") from None
        try:
            values = list(values)
        except TypeError:
            raise RewardError(
                f"{what} returned {type(values).__name__}, not a list of {n} values"
            ) from None
        if len(values) != n:
            raise RewardError(f"{what} returned {len(values)} values for {n} completions")
        for i, value in enumerate(values):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, int | float | np.number):
                raise RewardError(f"{what} returned {value!r} for completion {i}: a number or None")
            out[i, k] = value
    return out


def _text(completion: Any) -> str:
    """A completion's text: a string, or a conversation's first message's content."""
    if isinstance(completion, str):
        return completion
    return str(completion[0].get("content") or "")
