"""DPO's losses on sequence log-probabilities, in fp32, as TRL's `DPOTrainer` (1.16) defines them.

A sequence's log-probability is the fp32 sum of its completion tokens' log-probabilities, each
`logit[target] - logsumexp(logits)` from fp32 logits (`lm_loss.token_loss`, chunked; no logit
is rounded to 16 bits). With the policy's `pi` and the reference's `ref` for the chosen (`c`)
and rejected (`r`) completions, the log-ratios are `pi_c - ref_c` and `pi_r - ref_r`, and
`delta` their difference. Per pair, with `b = beta`:

    sigmoid   -(1 - e) log sigmoid(b delta) - e log sigmoid(-b delta)     (e: label_smoothing;
              TRL's "sigmoid" at e = 0; e > 0 is the conservative DPO of Mitchell's note)
    robust    (-(1 - e) log sigmoid(b delta) + e log sigmoid(-b delta)) / (1 - 2 e)
    hinge     relu(1 - b delta)
    ipo       (delta' - 1 / (2 b))^2, delta' the log-ratios each divided by its completion's
              tokens (TRL's length normalisation, which the IPO authors confirmed)

and the loss is their mean over the pairs, plus `sft_weight` times the mean negative
log-probability of the chosen completions' tokens (TRL's "sft" loss type among its
`loss_weights`). The record is TRL's: `rewards/chosen` and `rewards/rejected` (`b` times the
log-ratios, means over pairs), `rewards/margins` (their difference), `rewards/accuracies`
(the share of pairs whose chosen reward is strictly above the rejected one: 0 at step 0,
where the two are equal), `logps/chosen`, `logps/rejected` (the policy's sums, means).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from mptrain import errors
from mptrain.models import layers

LOSSES = ("sigmoid", "robust", "hinge", "ipo")
REFERENCES = ("auto", "adapters", "copy", "precomputed")
# `config.dpo`'s keys with their defaults: TRL's beta and loss; the reference "auto" is the
# base with the adapters off under LoRA, else a frozen copy of the step-0 params.
SETTINGS = {
    "beta": 0.1,
    "loss": "sigmoid",
    "label_smoothing": 0.0,
    "sft_weight": 0.0,
    "reference": "auto",
}


def settings(dpo: Any, lora: bool) -> dict[str, Any]:
    """`config.dpo` checked (a `ValueError` names the bad key); `reference` resolved."""
    keys = errors.settings(dpo or {}, SETTINGS)
    keys["beta"] = errors.check_number("dpo.beta", keys["beta"], 0.0, open_low=True)
    keys["loss"] = errors.check_choice("dpo.loss", keys["loss"], LOSSES)
    keys["label_smoothing"] = errors.check_number(
        "dpo.label_smoothing", keys["label_smoothing"], 0.0, 0.5
    )
    keys["sft_weight"] = errors.check_number("dpo.sft_weight", keys["sft_weight"], 0.0)
    reference = errors.check_choice("dpo.reference", keys["reference"], REFERENCES)
    if reference == "auto":
        reference = "adapters" if lora else "copy"
    if reference == "adapters" and not lora:
        raise ValueError(
            "dpo.reference='adapters': the reference is the base with the adapters off, and "
            "lora.rank is None (no adapters); set lora.rank, or dpo.reference='copy' or "
            "'precomputed'"
        )
    if reference == "copy" and lora:
        raise ValueError(
            "dpo.reference='copy': under LoRA the reference is the frozen base itself; use "
            "dpo.reference='adapters' (the default) or 'precomputed'"
        )
    keys["reference"] = reference
    return keys


def token_logps(out: Any, targets: jax.Array) -> jax.Array:
    """fp32 `[N, L]`: each target's log-probability (0 where the target is masked, < 0), from a
    model's output: `lm_loss.token_loss`'s dict (its `logps`) or fp32 logits `[N, L, V]`."""
    if isinstance(out, dict):
        return out["logps"]
    return jnp.where(targets >= 0, -layers.token_nll(out.astype(jnp.float32), targets), 0.0)


def sequence_logps(per_token: jax.Array, targets: jax.Array) -> jax.Array:
    """fp32 `[N]`: each row's sum of its completion tokens' log-probabilities."""
    return jnp.sum(jnp.where(targets >= 0, per_token, 0.0), axis=-1, dtype=jnp.float32)


def pair_losses(
    logps: jax.Array, reference: jax.Array, tokens: jax.Array, s: dict[str, Any]
) -> jax.Array:
    """fp32 `[B]`: each pair's loss (the module doc) from `[B, 2]` policy and reference
    log-probabilities and completion token counts (chosen, rejected)."""
    beta, e = s["beta"], s["label_smoothing"]
    ratios = logps.astype(jnp.float32) - reference.astype(jnp.float32)
    delta = ratios[:, 0] - ratios[:, 1]
    if s["loss"] == "sigmoid":
        return -(1 - e) * jax.nn.log_sigmoid(beta * delta) - e * jax.nn.log_sigmoid(-beta * delta)
    if s["loss"] == "robust":
        clean = -(1 - e) * jax.nn.log_sigmoid(beta * delta)
        return (clean + e * jax.nn.log_sigmoid(-beta * delta)) / (1 - 2 * e)
    if s["loss"] == "hinge":
        return jax.nn.relu(1 - beta * delta)
    per_token = ratios / jnp.maximum(tokens.astype(jnp.float32), 1.0)  # ipo
    return jnp.square(per_token[:, 0] - per_token[:, 1] - 1 / (2 * beta))


def loss_and_metrics(
    per_token: jax.Array, targets: jax.Array, reference: jax.Array, s: dict[str, Any]
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`(loss, metrics)` of a batch: `per_token` and `targets` `[B, 2, L]` (chosen, rejected),
    `reference` `[B, 2]` (no gradient). Means over this device's pairs; the step averages them
    over the devices (each holds as many pairs)."""
    logps = sequence_logps(per_token, targets)
    tokens = jnp.sum(targets >= 0, axis=-1)
    reference = jax.lax.stop_gradient(reference.astype(jnp.float32))
    loss = jnp.mean(pair_losses(logps, reference, tokens, s))
    if s["sft_weight"]:
        nll = layers.masked_mean(-per_token[:, 0], targets[:, 0] >= 0)
        loss = loss + s["sft_weight"] * nll
    rewards = jax.lax.stop_gradient(s["beta"] * (logps - reference))
    logps = jax.lax.stop_gradient(logps)
    return loss, {
        "rewards/chosen": jnp.mean(rewards[:, 0]),
        "rewards/rejected": jnp.mean(rewards[:, 1]),
        "rewards/margins": jnp.mean(rewards[:, 0] - rewards[:, 1]),
        "rewards/accuracies": jnp.mean((rewards[:, 0] > rewards[:, 1]).astype(jnp.float32)),
        "logps/chosen": jnp.mean(logps[:, 0]),
        "logps/rejected": jnp.mean(logps[:, 1]),
    }
