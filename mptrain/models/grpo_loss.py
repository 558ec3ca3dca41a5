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
    return keys


def _nanstd(x: np.ndarray, axis=None) -> np.ndarray:
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
            std = np.broadcast_to(_nanstd(rewards), rewards.shape)
        else:  # "group", and "none" for the record
            std = np.repeat(_nanstd(grouped, axis=1)[:, 0], group)
        adv = rewards - mean
        if scale != "none":
            adv = adv / (std + np.float32(STD_EPS))
        record = {
            "reward": float(np.nanmean(rewards)),
            "reward_std": float(_nanstd(rewards).reshape(())),
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
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(loss, metrics)` of a batch (the module doc): `logps`, `old`, `ref` fp32 `[B, T]` (`old`
    None: `logps` without gradient; `ref` None where `beta` is 0), `advantages` `[B]`, `mask`
    `[B, T]` (the completion's tokens through its end token). `s`: `loss_type`, `beta`,
    `epsilon`, `epsilon_high`, `importance_sampling_level`, `max_completion_length`."""
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
