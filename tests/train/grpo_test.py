"""GRPO against TRL 1.16 (issue 71): the advantages from the same rewards, the per-token
log-probabilities and entropies of the same completions, and for every loss type, beta 0 and
0.04, token and sequence level, with clipping on both sides, the loss, TRL's clip and KL figures
and every parameter's gradient, all fp32 (`tests/train/make_grpo_fixture.py` says how TRL
made them)."""

import json

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
import safetensors.numpy
from helpers import ROOT

from mptrain import config as config_lib
from mptrain import hf, models
from mptrain.models import grpo_loss
from mptrain.train import grpo

FIXTURE = ROOT / "tests" / "train" / "grpo_fixture"
MODEL = ROOT / "tests" / "hf" / "fixture"  # a tiny Llama, fp32
REF = np.load(FIXTURE / "reference.npz")
SETTINGS = json.loads((FIXTURE / "settings.json").read_text())
CASES = [
    (kind, beta, level)
    for kind in grpo_loss.LOSS_TYPES
    for beta in (0.0, 0.04)
    for level in grpo_loss.LEVELS
]


@pytest.mark.parametrize("scale", grpo_loss.SCALE_REWARDS)
def test_advantages_are_trls_from_the_same_rewards(scale):
    """Two reward functions weighted 1 and 0.5, one None among them; groups of 4."""
    adv, record = grpo_loss.advantages(REF["rewards"], SETTINGS["weights"], 4, scale)
    np.testing.assert_allclose(adv, REF[f"advantages_{scale}"], rtol=0, atol=1e-6)
    assert record["frac_reward_zero_std"] == 0.0


def test_a_group_whose_rewards_agree_has_advantage_0_and_is_counted():
    rewards = np.array([[1.0], [1.0], [np.nan], [0.5], [np.nan], [np.nan]], np.float32)
    adv, record = grpo_loss.advantages(rewards, [1.0], 3, "group")
    np.testing.assert_array_equal(adv[:3], 0.0)  # agree; an unscorable one: 0
    assert adv[3] == 0.0 and not np.isnan(record["reward_std"])
    assert record["frac_reward_zero_std"] == 0.5  # the first group's std is 0


@pytest.fixture(scope="module")
def computed():
    """mptrain's per-token log-probabilities of the fixture's completions and, for every case,
    its loss, metrics and gradients: one compiled program for all of them. Returns the folder's
    model config too."""
    model_config, params = hf.load(MODEL)
    config = config_lib.base_config()
    config.model, config.precision = ml_collections.ConfigDict(model_config), "fp32"
    model = models.create(config.model, config_lib.policy_of(config))
    prompts, completions = REF["prompt_ids"], REF["completion_ids"]
    mask = jnp.asarray(REF["completion_mask"], bool)
    ids = jnp.concatenate([jnp.repeat(prompts, 4, axis=0), completions], axis=1)
    start = prompts.shape[1]

    def logps_of(params):
        logits = model.apply({"params": params}, ids)[:, start - 1 : -1]
        logits = logits.astype(jnp.float32)
        picked = jnp.take_along_axis(logits, completions[..., None], axis=-1)[..., 0]
        targets = jnp.where(mask, completions, -1)
        return picked - jax.nn.logsumexp(logits, axis=-1), grpo.token_entropies(logits, targets)

    adv = jnp.asarray(REF["advantages_group"])
    old, ref = jnp.asarray(REF["old"]), jnp.asarray(REF["ref"])

    def losses(params):
        logps, entropies = logps_of(params)
        out = []
        for kind, beta, level in CASES:
            s = {"loss_type": kind, "beta": beta, "epsilon": 0.2, "epsilon_high": 0.2,
                 "importance_sampling_level": level,
                 "max_completion_length": SETTINGS["max_completion_length"]}  # fmt: skip
            out.append(grpo_loss.loss_and_metrics(logps, old, ref, adv, mask, s))
        return jnp.stack([loss for loss, _ in out]), ([m for _, m in out], logps, entropies)

    grads, (values, (metrics, logps, entropies)) = jax.jit(
        lambda p: (jax.jacrev(lambda q: losses(q)[0])(p), losses(p))
    )(params)
    per_token = np.asarray(logps), np.asarray(entropies)
    return model_config, per_token, np.asarray(values), metrics, grads


def test_the_per_token_log_probabilities_and_entropies_are_trls(computed):
    """The entropies: the record's `entropy` is their mean over the completion tokens."""
    _, (logps, entropies), *_ = computed
    mask = REF["completion_mask"].astype(bool)
    np.testing.assert_allclose(logps[mask], REF["logps"][mask], rtol=0, atol=1e-5)
    np.testing.assert_allclose(entropies[mask], REF["entropies"][mask], rtol=0, atol=1e-5)
    assert not np.any(entropies[~mask])


def test_every_loss_its_figures_and_every_parameters_gradient_are_trls(computed, tmp_path):
    model_config, _, values, metrics, grads = computed
    for k, (kind, beta, level) in enumerate(CASES):
        name = f"{kind}_{beta:g}_{level}"
        np.testing.assert_allclose(values[k], REF[f"loss_{name}"], rtol=1e-5, err_msg=name)
        for side in ("low", "high", "region"):
            got = float(metrics[k][f"clip_ratio/{side}_mean"])
            assert got == pytest.approx(float(REF[f"clip_{name}_{side}"]), abs=1e-6), name
        if beta:
            got = float(metrics[k]["kl"])
            assert got == pytest.approx(float(REF[f"kl_{name}"]), rel=1e-5), name
        folder = tmp_path / name  # the gradient under the HF names, as the export writes them
        hf.save(folder, model_config, jax.tree.map(lambda g, k=k: g[k], grads), "float32")
        tensors = safetensors.numpy.load_file(str(folder / "model.safetensors"))
        assert len(tensors) == len([key for key in REF.files if key.startswith(f"grad_{name}_")])
        for key, got in tensors.items():
            want = REF[f"grad_{name}_{key}"]
            scale = np.abs(want).max()
            np.testing.assert_allclose(
                got, want, rtol=0, atol=1e-5 * scale, err_msg=f"{name} {key}"
            )
