"""GRPO's advantages and losses, in fp32, as TRL's `GRPOTrainer` (1.16) defines them.

Advantages (host-side, `advantages`): each completion's reward is the weighted sum of its reward
functions' values (NaN, a function's None, left out of the sum; a completion every function
gave None has no reward and advantage 0); `A = r - mean(r over its group of num_generations)`,
and under `scale_rewards="group"` (`"batch"`) divided by the group's (the batch's) sample
standard deviation (Bessel's n - 1) plus 1e-4; `"none"` leaves it unscaled.

The loss (`loss_and_metrics`), from the per-token log-probabilities `logp` of the completion
tokens (fp32 logits over the whole vocabulary at the sampling temperature), the old ones `old`
(the params that sampled; `logp` without gradient where each batch is trained on once), and
the reference's `ref`:

    token level      w_t = exp(logp_t - old_t)
    sequence level   w   = exp(mean over the completion's tokens of (logp_t - old_t))   (GSPO)
    l_t = -min(w A, clip(w, 1 - epsilon, 1 + epsilon_high) A) + beta kl_t,
    kl_t = (exp(ref_t - logp_t) - (ref_t - logp_t) - 1) w                                  (k3,
         TRL's `use_bias_correction_kl`)

aggregated by `loss_type`: `grpo` the mean over completions of each one's token mean; `bnpo`
and `dapo` the sum over the batch's tokens divided by their count (every device's: a step is
one generation batch, so TRL's local and global token counts are the same here); `dr_grpo` the
sum divided by the completions times `max_completion_length`. The record is TRL's:
`clip_ratio/low_mean` (tokens whose ratio is below 1 - epsilon with A < 0), `high_mean`, and
`region_mean` (either), means over the batch's tokens (its completions at the sequence level);
`kl` where `beta` > 0.
"""

from __future__ import annotations

import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mptrain import errors
from mptrain.models import layers

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")
LEVELS = ("token", "sequence")
CORRECTIONS = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask", "none")
OLD_LOGPS = ("trainer", "sampler")
BAND = (0.9, 1.1)  # the ratios whose share outside is `sampling/frac_ratio_outside_0.9_1.1`
STD_EPS = 1e-4  # TRL's, added to the standard deviation
# `config.grpo`'s keys with their defaults: TRL's (`GRPOConfig`, 1.16) where TRL has the key;
# `soft_punish_cache` is the length over which `soft_overlong_punishment_reward` ramps.
SETTINGS = {
    "reward_funcs": None,
    "reward_weights": None,
    "num_generations": 8,
    "loss_type": "dapo",
    "beta": 0.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "num_iterations": 1,
    "scale_rewards": "group",
    "importance_sampling_level": "token",
    "max_completion_length": 512,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "soft_punish_cache": 0,
    "sampling_correction": "sequence_mask",
    "sampling_clip_min": None,
    "sampling_clip_max": 3.0,
    "old_logps": "trainer",
}


def settings(grpo: Any, batch_size: int) -> dict[str, Any]:
    """`config.grpo` checked (a `ValueError` names the bad key); `epsilon_high` resolved.
    `batch_size` counts completions, as TRL's does: a multiple of `num_generations`."""
    keys = errors.settings(grpo or {}, SETTINGS)
    g = errors.check_integer("grpo.num_generations", keys["num_generations"], 2)
    if batch_size % g:
        raise ValueError(
            f"batch_size={batch_size} with grpo.num_generations={g}: the batch counts "
            f"completions, {g} of each prompt; give a multiple of {g}"
        )
    keys["num_generations"] = g
    keys["loss_type"] = errors.check_choice("grpo.loss_type", keys["loss_type"], LOSS_TYPES)
    keys["scale_rewards"] = errors.check_choice(
        "grpo.scale_rewards", keys["scale_rewards"], SCALE_REWARDS
    )
    keys["importance_sampling_level"] = errors.check_choice(
        "grpo.importance_sampling_level", keys["importance_sampling_level"], LEVELS
    )
    keys["beta"] = errors.check_number("grpo.beta", keys["beta"], 0.0)
    keys["epsilon"] = errors.check_number("grpo.epsilon", keys["epsilon"], 0.0, 1.0, open_low=True)
    high = keys["epsilon"] if keys["epsilon_high"] is None else keys["epsilon_high"]
    keys["epsilon_high"] = errors.check_number("grpo.epsilon_high", high, 0.0, open_low=True)
    keys["num_iterations"] = errors.check_integer("grpo.num_iterations", keys["num_iterations"], 1)
    keys["max_completion_length"] = errors.check_integer(
        "grpo.max_completion_length", keys["max_completion_length"], 1
    )
    keys["temperature"] = errors.check_number(
        "grpo.temperature", keys["temperature"], 0.0, open_low=True
    )
    top_p = keys["top_p"]
    if isinstance(top_p, bool) or not isinstance(top_p, int | float) or not 0 < top_p <= 1:
        raise ValueError(f"grpo.top_p={top_p!r}: must be in (0, 1] (1: every token)")
    keys["top_k"] = errors.check_integer("grpo.top_k", keys["top_k"], 0)
    keys["soft_punish_cache"] = errors.check_integer(
        "grpo.soft_punish_cache", keys["soft_punish_cache"], 0
    )
    keys["sampling_correction"] = errors.check_choice(
        "grpo.sampling_correction", keys["sampling_correction"], CORRECTIONS
    )
    for key in ("sampling_clip_min", "sampling_clip_max"):
        if keys[key] is not None:
            keys[key] = errors.check_number(f"grpo.{key}", keys[key], 0.0)
    low, high = keys["sampling_clip_min"], keys["sampling_clip_max"]
    if low is not None and high is not None and low >= high:
        raise ValueError(
            f"grpo.sampling_clip_min={low} with grpo.sampling_clip_max={high}: the kept ratios "
            "lie between them; give a minimum below the maximum"
        )
    keys["old_logps"] = errors.check_choice("grpo.old_logps", keys["old_logps"], OLD_LOGPS)
    return keys


def nanstd(x: np.ndarray, axis=None) -> np.ndarray:
    """The sample standard deviation of `x`'s non-NaN values (NaN with fewer than two)."""
    count = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    mean = np.nanmean(x, axis=axis, keepdims=True)
    variance = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True)
    variance = variance * np.where(count > 1, count / np.maximum(count - 1, 1), np.nan)
    return np.sqrt(variance).astype(np.float32)


def advantages(
    per_func: np.ndarray, weights: np.ndarray, group: int, scale: str
) -> tuple[np.ndarray, dict[str, float]]:
    """`(advantages [N], record)` of `per_func` (float32 `[N, F]`, NaN for None; the `N`
    completions in groups of `group` consecutive ones) weighted by `weights` `[F]` (the module
    doc). `record`: `reward`, `reward_std`, `frac_reward_zero_std`."""
    per_func = np.asarray(per_func, np.float32)
    with np.errstate(invalid="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a group all NaN: TRL's NaN, wanted
        unscorable = np.isnan(per_func).all(axis=1)
        rewards = np.nansum(per_func * np.asarray(weights, np.float32)[None], axis=1)
        rewards = np.where(unscorable, np.nan, rewards).astype(np.float32)
        grouped = rewards.reshape(-1, group)
        mean = np.repeat(np.nanmean(grouped, axis=1), group)
        if scale == "batch":
            std = np.broadcast_to(nanstd(rewards), rewards.shape)
        else:  # "group", and "none" for the record
            std = np.repeat(nanstd(grouped, axis=1)[:, 0], group)
        adv = rewards - mean
        if scale != "none":
            adv = adv / (std + np.float32(STD_EPS))
        record = {
            "reward": float(np.nanmean(rewards)),
            "reward_std": float(nanstd(rewards).reshape(())),
            "frac_reward_zero_std": float(np.mean(np.isclose(std, 0.0, rtol=1e-5, atol=1e-8))),
        }
    return np.nan_to_num(adv.astype(np.float32), nan=0.0), record


def loss_and_metrics(
    logps: jax.Array,
    old: jax.Array | None,
    ref: jax.Array | None,
    advantages: jax.Array,
    mask: jax.Array,
    s: dict[str, Any],
    is_ratio: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(loss, metrics)` of a batch (the module doc): `logps`, `old`, `ref` fp32 `[B, T]` (`old`
    None: `logps` without gradient; `ref` None where `beta` is 0), `advantages` `[B]`, `mask`
    `[B, T]` (the completion's tokens through its end token). `s`: `loss_type`, `beta`,
    `epsilon`, `epsilon_high`, `importance_sampling_level`, `max_completion_length`.
    `is_ratio`: the sampler's correction (`sampling_correction`, `[B, T]` or `[B, 1]`), which
    multiplies each token's clipped term before the KL is added, as TRL applies vLLM's."""
    logps = logps.astype(jnp.float32)
    valid = mask.astype(bool)
    m = valid.astype(jnp.float32)
    old = jax.lax.stop_gradient(logps if old is None else old.astype(jnp.float32))
    adv = advantages.astype(jnp.float32)[:, None]
    log_ratio = logps - old
    if s["importance_sampling_level"] == "sequence":
        tokens = jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1.0)
        log_ratio = jnp.sum(log_ratio * m, axis=-1, keepdims=True) / tokens
    coef = jnp.exp(log_ratio)
    low, high = 1 - s["epsilon"], 1 + s["epsilon_high"]
    per_token = -jnp.minimum(coef * adv, jnp.clip(coef, low, high) * adv)
    if is_ratio is not None:
        per_token = per_token * jax.lax.stop_gradient(is_ratio)
    per_token = jnp.broadcast_to(per_token, logps.shape)
    metrics = {}
    if s["beta"]:
        diff = jax.lax.stop_gradient(ref.astype(jnp.float32)) - logps
        kl = (jnp.exp(diff) - diff - 1) * coef
        per_token = per_token + s["beta"] * kl
        metrics["kl"] = layers.masked_mean(jax.lax.stop_gradient(kl), valid)
    kind = s["loss_type"]
    if kind == "grpo":
        per_sequence = jnp.sum(per_token * m, axis=-1) / jnp.maximum(jnp.sum(m, axis=-1), 1.0)
        loss = jnp.mean(per_sequence)
    elif kind == "dr_grpo":
        loss = jnp.sum(per_token * m) / (logps.shape[0] * s["max_completion_length"])
    else:  # bnpo, dapo
        loss = layers.masked_mean(per_token, valid)
    # the clipped share: of the tokens, or at the sequence level of the completions (TRL's)
    coef = jax.lax.stop_gradient(coef)
    counted = valid if coef.shape == logps.shape else jnp.ones(coef.shape, bool)
    low_clipped = (coef < low) & (adv < 0)
    high_clipped = (coef > high) & (adv > 0)
    share = lambda clipped: layers.masked_mean(clipped.astype(jnp.float32), counted)
    metrics["clip_ratio/low_mean"] = share(low_clipped)
    metrics["clip_ratio/high_mean"] = share(high_clipped)
    metrics["clip_ratio/region_mean"] = share(low_clipped | high_clipped)
    return loss, metrics


def sampling_correction(
    old: jax.Array, sampled: jax.Array, mask: jax.Array, s: dict[str, Any]
) -> tuple[jax.Array | None, dict[str, jax.Array]]:
    """`(is_ratio, metrics)`: the sampler/trainer mismatch of a batch, measured and corrected as
    TRL does with vLLM (`grpo_trainer.py`, 1.16), from the trainer's log-probabilities of the
    sampled tokens `old` (fp32 `[B, T]`, no gradient) and the sampler's `sampled`, over the
    completion tokens `mask`:

      d_t = old_t - sampled_t; the ratio exp(d_t) a token (`token_*`), exp(sum_t d_t) a
      completion (`sequence_*`); `*_truncate` clamps it to [clip_min, clip_max], `*_mask` sets
      it to 0 outside; `none`: no correction (`is_ratio` None), the mismatch still measured.

    `metrics`, TRL's names: `sampling/sampling_logp_difference/mean|max` (|d_t| over the tokens),
    `sampling/importance_sampling_ratio/min|mean|max` (of the corrected ratio: over the tokens,
    or the completions at the sequence level; of the raw token ratio under `none`), and the
    tail a mean hides, `sampling/frac_ratio_outside_0.9_1.1`: the share of tokens whose own
    ratio exp(d_t) leaves [0.9, 1.1]."""
    valid = mask.astype(bool)
    d = jnp.where(valid, old.astype(jnp.float32) - sampled.astype(jnp.float32), 0.0)
    mode, low, high = s["sampling_correction"], s["sampling_clip_min"], s["sampling_clip_max"]
    sequence = mode.startswith("sequence")
    ratio = jnp.exp(jnp.sum(d, axis=-1, keepdims=True) if sequence else d)
    if mode.endswith("truncate"):
        ratio = jnp.clip(ratio, low, high)
    elif mode.endswith("mask"):
        low = -jnp.inf if low is None else low
        high = jnp.inf if high is None else high
        ratio = jnp.where((ratio < low) | (ratio > high), 0.0, ratio)
    counted = jnp.ones(ratio.shape, bool) if sequence else valid
    big, token_ratio = jnp.finfo(jnp.float32).max, jnp.exp(d)
    outside = (token_ratio < BAND[0]) | (token_ratio > BAND[1])
    metrics = {
        "sampling/sampling_logp_difference/mean": layers.masked_mean(jnp.abs(d), valid),
        "sampling/sampling_logp_difference/max": jnp.max(jnp.where(valid, jnp.abs(d), 0.0)),
        "sampling/importance_sampling_ratio/min": jnp.min(jnp.where(counted, ratio, big)),
        "sampling/importance_sampling_ratio/mean": layers.masked_mean(
            jnp.broadcast_to(ratio, counted.shape), counted
        ),
        "sampling/importance_sampling_ratio/max": jnp.max(jnp.where(counted, ratio, -big)),
        "sampling/frac_ratio_outside_0.9_1.1": layers.masked_mean(
            outside.astype(jnp.float32), valid
        ),
    }
    return (None if mode == "none" else ratio), metrics
