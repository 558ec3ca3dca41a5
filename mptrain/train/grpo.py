"""RL with verifiable rewards: `config.trainer="mptrain.train.grpo:GRPOTrainer"` on
`data.name="grpo"` prompts (`mptrain.data.grpo`), scored by `grpo.reward_funcs`
(`mptrain.data.rewards`), trained with the loss of `mptrain.models.grpo_loss`; the settings
under `config.grpo` have TRL's names and defaults (`GRPOTrainer`, 1.16).

Each step:

  1. **Sampling.** The step's prompts (`batch_size / grpo.num_generations` of them, a pure
     function of `(seed, step)`), each `num_generations` times, are completed by the KV-cache
     decoder (`decode.make_decoder`, compiled once at set-up) from the params as they are,
     cast to the compute dtype as the update casts them, on the run's devices: the sampler and
     the trainer are one model and one copy of the weights. The sampler keeps each token's
     log-probability (over the whole vocabulary, at the temperature). Its random key is
     `(seed, step)`'s, so a resumed run samples what the uninterrupted one did.
  2. **Rewards** on the host: the completions decoded, scored (`rewards.score`), the
     advantages taken (`grpo_loss.advantages`).
  3. **The update**, on rows of prompt and completion (`data.seq_len` tokens, the targets the
     completion's tokens through its end token): the trainer's log-probabilities through the
     chunked fp32 head at the sampling temperature, the loss, and the mismatch with the
     sampler's log-probabilities, measured every step and corrected
     (`grpo_loss.sampling_correction`, `grpo.sampling_correction`).

The ratio's old log-probabilities (one update a batch: `num_iterations` 1) are the update's own
without gradient, as TRL's, or the sampler's (`grpo.old_logps="sampler"`: the ratio then carries
the mismatch, and no correction is made on top of it). The trainer's side of the mismatch comes
from the update's own forward pass: the shapes, the program and the dtypes of the update, where
a second scoring pass at other shapes would round otherwise (verl #6280: 9.87% of bf16 tokens
moved out of [0.9, 1.1] by the batch size alone).

The record: TRL's names (`reward`, `reward_std`, `rewards/<name>/mean|std`,
`frac_reward_zero_std`, `completions/*`, `clip_ratio/*`, `sampling/*`), the time spent sampling
and scoring as `generation` in the goodput line, and `rollouts.jsonl` in the workdir: a line a
completion of every logged step (the first always), whose `step` is the history step of the
update that trained on it. The KL term (`beta` > 0) is taken against the base with the
adapters off, a LoRA run's, or a frozen copy of the step-0 params in a full fine-tune
(`mptrain.train.reference`, DPO's): a forward pass before the update's (`reference_logps`).
Not built yet: evaluation on held-out prompts, several updates a batch (`num_iterations` > 1),
a split over `mesh.context` or `mesh.tensor`.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from absl import logging

from mptrain import errors
from mptrain.data import dpo as dpo_data
from mptrain.data import grpo as grpo_data
from mptrain.data import rewards as rewards_lib
from mptrain.models import dpo_loss, grpo_loss
from mptrain.models import lora as lora_lib
from mptrain.models.decoder import decode
from mptrain.parallel import layout, sharding
from mptrain.record import curves
from mptrain.train import loop, reference, trainer

TRAINER = grpo_data.TRAINER
ROLLOUTS = "rollouts.jsonl"
LENGTHS = ("mean_length", "min_length", "max_length", "clipped_ratio", "mean_terminated_length")


class GRPOTrainer(trainer.Trainer):
    """The Trainer on prompts, sampling its own completions (the module doc)."""

    def __init__(self, config, workdir, **kwargs):  # `devices=`, `resolved=`: the Trainer's
        trainer.require_data(config, "grpo", TRAINER, "prompts")
        with errors.config_errors():
            self.grpo = g = grpo_data.check_run(config)
            self.data = grpo_data.settings(config, g["max_completion_length"])
        self.rewards = rewards_lib.load(
            g["reward_funcs"], g["reward_weights"], g["max_completion_length"],
            g["soft_punish_cache"],
        )  # fmt: skip
        # the KL term's reference: the base under LoRA, else a frozen copy of step 0's params
        self.reference = None
        if g["beta"]:
            self.reference = "adapters" if lora_lib.enabled(config) else "copy"
        super().__init__(config, workdir, **kwargs)
        self.codec = grpo_data.codec_of(self.data)
        self.stop_ids = sorted({*self.codec.stop_ids, self.data.base.eos_id})
        names = ["reward", "reward_std", "frac_reward_zero_std"]
        names += [f"rewards/{r.name}/{k}" for r in self.rewards for k in ("mean", "std")]
        self.record_names = tuple(names + [f"completions/{k}" for k in LENGTHS])

    def build_model(self):
        """The zoo Llama, scoring at the sampling temperature (`Llama.temperature`)."""
        model = super().build_model()
        t = self.grpo["temperature"]
        return model if t == 1.0 else model.clone(temperature=t)

    def build_datasets(self) -> tuple[Any, None]:
        """`(Rows, None)`: the update's rows over the run's prompts (`Rows`); no evaluation."""
        prompts, _ = grpo_data.create_sources(self.config)
        return Rows(prompts, self), None

    def init_variables(self, rng, batch):
        variables = super().init_variables(rng, batch)
        if self.reference == "copy":  # step 0's params, as the policy's forward reads them
            variables = reference.add(self.policy, variables)
        return variables

    def starting(self, state, saved_step, train_source, eval_source):
        """A fresh run from `init_from` makes its reference copy of the params it loaded."""
        if self.reference == "copy" and saved_step is None and self.config.init_from is not None:
            state = reference.refreshed(self.policy, state)
        return state

    # ---- the update -------------------------------------------------------------------------

    def loss_fn(self, params, model_state, batch, rng):
        """Traced. The GRPO loss of a batch of completions, TRL's metrics, the mismatch with the
        sampler and the host's figures (`record`: a row each, every row the same)."""
        g, targets = self.grpo, batch["targets"]
        model_state = reference.without(model_state)
        variables, mutable = {"params": params, **model_state}, list(model_state) or False
        kwargs = {"targets": targets} if getattr(self.model, "computes_loss", False) else {}
        out = self.model.apply(
            variables, batch["inputs"], train=True, rngs={"dropout": rng}, mutable=mutable,
            **kwargs,
        )  # fmt: skip
        out, new_state = out if mutable else (out, model_state)
        logps, mask = dpo_loss.token_logps(out, targets), targets >= 0
        sampled = batch["sampling_logps"]
        is_ratio, mismatch = grpo_loss.sampling_correction(
            jax.lax.stop_gradient(logps), sampled, mask, g
        )
        old = None
        if g["old_logps"] == "sampler":  # the ratio carries the mismatch: nothing on top
            old, is_ratio = sampled, None
        ref = batch.get(dpo_data.REFERENCE)  # beta > 0: the base's (`reference_logps`)
        if g["beta"] and ref is None:  # a trace of the loss alone: the policy as its own
            ref = jax.lax.stop_gradient(logps)
        loss, metrics = grpo_loss.loss_and_metrics(
            logps, old, ref, batch["advantages"], mask, g, is_ratio
        )
        extra = trainer.model_metrics(out)
        if "moe/aux_loss" in extra:
            loss = loss + self.model.aux_loss_coef * extra["moe/aux_loss"]
        record = batch["record"]
        host = {name: record[0, k] for k, name in enumerate(self.record_names)}
        return loss, (new_state, {**metrics, **mismatch, **host, **extra})

    def reference_logps(self, state, batch) -> jax.Array:
        """Traced. fp32 `[B, L]`: the reference's log-probabilities of the batch's targets, no
        gradient: the base without its adapters (`state.frozen`, a LoRA run's), or the frozen
        copy of step 0's params (`mptrain.train.reference`), read in the policy's dtypes and
        laid out on the mesh as the update's forward is."""
        policy, model_state = self.policy, reference.without(state.model_state)
        params = state.frozen if self.reference == "adapters" else state.model_state[reference.KEY]

        def forward(params, model_state, batch):
            variables = {"params": params, **model_state}
            out = self.model.apply(variables, batch["inputs"], targets=batch["targets"])
            return dpo_loss.token_logps(out, batch["targets"])

        with policy.matmuls():
            if self.mesh.size > 1:
                run = sharding.forward_fn(forward, policy, self.mesh, per_row=True, axes=state.axes)
                logps = run(params, model_state, batch)
            else:
                logps = forward(sharding.cast_params(policy, params), model_state, batch)
        return jax.lax.stop_gradient(logps.astype(jax.numpy.float32))

    def make_train_step(self):
        """The Trainer's step; with `beta` > 0 the reference's log-probabilities first, the
        reference's copy (a full fine-tune's) kept out of the gradient's forward."""
        inner = super().make_train_step()
        if not self.grpo["beta"]:
            return inner
        prepare = lambda state, batch: {
            **batch, dpo_data.REFERENCE: self.reference_logps(state, batch)
        }  # fmt: skip
        return reference.keeping(inner, prepare)

    # ---- the loop ---------------------------------------------------------------------------

    def setup(self, train_source, eval_source, pretrained=None) -> loop.Run:
        """The Trainer's, then the sampler compiled; a resumed run's rollouts past its step go."""
        run = super().setup(train_source, eval_source, pretrained)
        with run.clock.section("set-up and compiles"), loop.allow_transfers():
            self.sampler = Sampler(self, run)
            if jax.process_index() == 0:
                curves.forget_after(self.workdir, run.start, ROLLOUTS)
        return run

    def train(self, run: loop.Run, preemption) -> None:
        """Host-side. Each step samples, scores and updates (the module doc); the rollouts of
        each logged step go to `rollouts.jsonl`."""
        cfg, totals, done = self.config, run.totals, run.start
        for first in range(run.start, cfg.num_train_steps):
            if preemption.reached(done):
                name = preemption.signal_name
                logging.warning("mptrain: %s received; checkpointing step %d", name, done)
                run.stop(done, errors.Preempted(done, name))
            with run.clock.section("generation"), loop.allow_transfers():
                batch, lines = self.sampler(run.state, first)
            run.state, metrics, totals = run.train_step(run.state, batch, totals)
            done = first + 1
            if jax.process_index() == 0 and (
                done == 1 or done % cfg.log_every_steps == 0 or done == cfg.num_train_steps
            ):
                path = self.workdir / ROLLOUTS
                for line in lines:
                    curves.append_row(path, {"step": done, **line})
            run.stepped(first, done, metrics, totals)
        run.report_pending(done)


class Rows:
    """The update's rows over a run's prompts (`prompts`, a `PromptSource`): batches of
    `batch_size` completions in rows of `data.seq_len`. `get_batch` gives zeros of that layout,
    what the programs compile on: a step's real rows are sampled (`Sampler`)."""

    def __init__(self, prompts: grpo_data.PromptSource, trainer: GRPOTrainer):
        self.prompts = prompts
        b, length = trainer.config.batch_size, trainer.data.base.seq_len
        self.zeros = {
            "inputs": np.zeros((b, length), np.int32),
            "targets": np.full((b, length), -1, np.int32),
            "advantages": np.zeros((b,), np.float32),
            "sampling_logps": np.zeros((b, length), np.float32),
            "record": np.zeros((b, len(trainer.record_names)), np.float32),
        }

    def get_batch(self, index: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        return {k: v[rows] for k, v in self.zeros.items()}


class Sampler:
    """A step's batch: its prompts completed (the module doc's 1 and 2). `__call__(state,
    step)` gives the update's rows on the mesh and each completion's rollout line."""

    def __init__(self, trainer: GRPOTrainer, run: loop.Run):
        g, state = trainer.grpo, run.state
        self.trainer, self.g, self.prompts = trainer, g, run.train_source.prompts
        model = trainer.model.clone(temperature=1.0)  # the sampler divides by it itself
        decoder = decode.make_decoder(model, g["max_completion_length"], keep_logps=True)
        cast = trainer.policy.cast_params  # inside the decoder's program: no cast copy kept
        sample = jax.jit(lambda params, *args: decoder(cast(params), *args))
        self.sampling = decode.Sampling(g["temperature"], g["top_k"], g["top_p"]).values()
        self.stops = decode.stops(trainer.stop_ids)
        per_step = trainer.config.batch_size
        width = self.prompts.rows.shape[1] - 1  # the longest prompt: every batch's width
        ids = np.zeros((per_step, width), np.int32)
        params = state.model_params  # as each step's are: laid out on the mesh
        lowered = sample.lower(params, ids, ids[:, 0] + 1, self.sampling, 0, self.stops)
        self.decode = lowered.compile()
        self.seed = trainer.config.seed

    def __call__(self, state, step: int) -> tuple[dict, list[dict]]:
        t, g, group = self.trainer, self.g, self.g["num_generations"]
        prompts = self.prompts.get_batch(step)
        ids = np.repeat(prompts["prompt_ids"], group, axis=0)
        lengths = np.repeat(prompts["prompt_lengths"], group).astype(np.int32)
        index = np.repeat(prompts["index"], group)
        seed = (self.seed * 1_000_003 + step) % 2**31  # the step's key: a resume draws it again
        tokens, logps = self.decode(
            state.model_params, ids, lengths, self.sampling, seed, self.stops
        )
        tokens, logps = np.asarray(tokens), np.asarray(logps)
        counts = (tokens != decode.PAD).sum(axis=1)
        completion_ids = [row[:n].tolist() for row, n in zip(tokens, counts, strict=True)]
        ended = np.asarray([bool(c) and c[-1] in t.stop_ids for c in completion_ids])
        texts = [t.codec.decode(c) for c in completion_ids]
        given = [self.prompts.prompts[i] for i in index]
        completions = [
            text if isinstance(p, str) else [{"role": "assistant", "content": text}]
            for text, p in zip(texts, given, strict=True)
        ]
        keys = sorted({k for i in index for k in self.prompts.columns[i]})
        columns = {k: [self.prompts.columns[i].get(k) for i in index] for k in keys}
        per_func = rewards_lib.score(t.rewards, given, completions, completion_ids, columns)
        weights = np.asarray([r.weight for r in t.rewards], np.float32)
        advantages, figures = grpo_loss.advantages(per_func, weights, group, g["scale_rewards"])
        figures |= _reward_figures(t.rewards, per_func) | _length_figures(counts, ended)
        batch = _rows(t, ids, lengths, completion_ids, logps, advantages, figures)
        batch = jax.device_put(batch, layout.batch_shardings(t.mesh, batch))
        rewards = np.nansum(per_func * weights[None], axis=1)
        lines = []
        for r, c in enumerate(completion_ids):
            n = lengths[r]
            lines.append({
                "prompt": t.codec.prompt(given[r]),
                "completion": texts[r],
                "prompt_ids": ids[r, :n].tolist(),
                "completion_ids": c,
                "rewards": {
                    f.name: None if np.isnan(v) else float(v)
                    for f, v in zip(t.rewards, per_func[r], strict=True)
                },
                "reward": float(rewards[r]),
                "advantage": float(advantages[r]),
                "sampling_logps": logps[r, : len(c)].tolist(),
            })  # fmt: skip
        return batch, lines


def _reward_figures(rewards: list, per_func: np.ndarray) -> dict[str, float]:
    """`rewards/<name>/mean|std` of each reward function (None left out; TRL's)."""
    out = {}
    for k, reward in enumerate(rewards):
        column = per_func[:, k]
        seen = column[~np.isnan(column)]
        out[f"rewards/{reward.name}/mean"] = float(seen.mean()) if seen.size else float("nan")
        out[f"rewards/{reward.name}/std"] = float(grpo_loss.nanstd(column).reshape(()))
    return out


def _length_figures(counts: np.ndarray, ended: np.ndarray) -> dict[str, float]:
    """`completions/*`, TRL's: the lengths (end token included), the share that never ended
    (`clipped_ratio`) and the mean length of those that did (0 where none did)."""
    finished = counts[ended]
    return {
        "completions/mean_length": float(counts.mean()),
        "completions/min_length": float(counts.min()),
        "completions/max_length": float(counts.max()),
        "completions/clipped_ratio": float(1.0 - ended.mean()),
        "completions/mean_terminated_length": float(finished.mean()) if finished.size else 0.0,
    }


def _rows(t: GRPOTrainer, ids, lengths, completion_ids, logps, advantages, figures) -> dict:
    """The update's batch: each completion after its prompt in a row of `data.seq_len` tokens,
    its tokens the targets (each at the position before it) with the sampler's log-probs
    beside them; the advantages; the host's figures (`record`, the same in every row)."""
    b, length = len(completion_ids), t.data.base.seq_len
    inputs = np.zeros((b, length), np.int32)
    targets = np.full((b, length), -1, np.int32)
    sampled = np.zeros((b, length), np.float32)
    for r, c in enumerate(completion_ids):
        p, n = int(lengths[r]), len(c)
        inputs[r, :p], inputs[r, p : p + n] = ids[r, :p], c
        targets[r, p - 1 : p - 1 + n] = c
        sampled[r, p - 1 : p - 1 + n] = logps[r, :n]
    record = np.asarray([figures[name] for name in t.record_names], np.float32)
    return {
        "inputs": inputs,
        "targets": targets,
        "advantages": np.asarray(advantages, np.float32),
        "sampling_logps": sampled,
        "record": np.broadcast_to(record, (b, len(record))).copy(),
    }
