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

The ratio's old log-probabilities, with one update a batch (`num_iterations` 1), are the
update's own without gradient, as TRL's, or the sampler's (`grpo.old_logps="sampler"`: the
ratio then carries the mismatch, and no correction is made on top of it). The trainer's side of
the mismatch then comes from the update's own forward pass: the shapes, the program and the
dtypes of the update, where a second scoring pass at other shapes would round otherwise (verl
#6280: 9.87% of bf16 tokens moved out of [0.9, 1.1] by the batch size alone).

With `num_iterations` = mu > 1, as TRL's: a batch is sampled at every mu-th step (the prompts
of generation `step // mu`) and trains mu updates. Its old log-probabilities are scored once
when it is sampled, by a forward pass of the update's shapes on the params that sampled it
(`score`), and the mismatch and its correction are measured between those and the sampler's.
The batch goes to `<workdir>/grpo_batches/<step>.npz` when it is sampled, so that a run that
resumes between its updates trains on it again (`Batches`).

The record: TRL's names (`reward`, `reward_std`, `rewards/<name>/mean|std`,
`frac_reward_zero_std`, `completions/*`, `clip_ratio/*`, `sampling/*`, `entropy`), the time
spent sampling and scoring as `generation` in the goodput line, and `rollouts.jsonl` in the
workdir: a line a completion of every logged step (the first always), whose `step` is the
history step of the update that trained on it. The KL term (`beta` > 0) is taken against the
base with the adapters off, a LoRA run's, or a frozen copy of the step-0 params in a full
fine-tune (`mptrain.train.reference`, DPO's): a forward pass before the update's
(`reference_logps`).
Not built yet: evaluation on held-out prompts, a split over `mesh.context` or `mesh.tensor`.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from mptrain import errors, files
from mptrain.data import dpo as dpo_data
from mptrain.data import grpo as grpo_data
from mptrain.data import rewards as rewards_lib
from mptrain.models import dpo_loss, grpo_loss, layers
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
        """The zoo Llama, scoring at the sampling temperature (`Llama.temperature`), each
        token's entropy beside its log-probability (`Llama.entropy`, the record's `entropy`)."""
        return super().build_model().clone(temperature=self.grpo["temperature"], entropy=True)

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
        sampled, old = batch["sampling_logps"], batch.get("old_logps")  # old: mu > 1's
        scored = jax.lax.stop_gradient(logps) if old is None else old
        is_ratio, mismatch = grpo_loss.sampling_correction(scored, sampled, mask, g)
        if g["old_logps"] == "sampler":  # the ratio carries the mismatch: nothing on top
            old, is_ratio = sampled, None
        ref = batch.get(dpo_data.REFERENCE)  # beta > 0: the base's (`reference_logps`)
        if g["beta"] and ref is None:  # a trace of the loss alone: the policy as its own
            ref = jax.lax.stop_gradient(logps)
        loss, metrics = grpo_loss.loss_and_metrics(
            logps, old, ref, batch["advantages"], mask, g, is_ratio
        )
        metrics["entropy"] = layers.masked_mean(token_entropies(out, targets), mask)
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
        params = state.frozen if self.reference == "adapters" else state.model_state[reference.KEY]
        return self.logps_of(params, state, batch)

    def policy_logps(self, state, batch) -> jax.Array:
        """Traced. fp32 `[B, L]`: the policy's own log-probabilities of the batch's targets as
        its params now stand, no gradient (`num_iterations` > 1's old ones)."""
        return self.logps_of(state.model_params, state, batch)

    def logps_of(self, params, state, batch) -> jax.Array:
        """Traced: `params`' log-probabilities of the batch's targets, the forward of the update
        in the policy's dtypes and its layout on the mesh, without gradient."""
        policy, model_state = self.policy, reference.without(state.model_state)

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
        mu, batch = self.grpo["num_iterations"], None
        for first in range(run.start, cfg.num_train_steps):
            if preemption.reached(done):
                name = preemption.signal_name
                logging.warning("mptrain: %s received; checkpointing step %d", name, done)
                run.stop(done, errors.Preempted(done, name))
            if first % mu == 0 or batch is None:  # batch None: resumed between its updates
                with run.clock.section("generation"), loop.allow_transfers():
                    batch, lines = self.sampler.batch(run, first - first % mu)
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
        g = trainer.grpo
        if g["num_iterations"] > 1 and g["old_logps"] != "sampler":  # scored when sampled
            self.zeros["old_logps"] = np.zeros((b, length), np.float32)

    def get_batch(self, index: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        return {k: v[rows] for k, v in self.zeros.items()}


class Sampler:
    """A step's batch: its prompts completed (the module doc's 1 and 2). `__call__(state,
    step)` gives the update's rows on the mesh and each completion's rollout line."""

    def __init__(self, trainer: GRPOTrainer, run: loop.Run):
        g, state = trainer.grpo, run.state
        self.trainer, self.g, self.prompts = trainer, g, run.train_source.prompts
        model = trainer.model.clone(temperature=1.0, entropy=False)  # the sampler divides itself
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
        self.score = self.batches = None
        if g["num_iterations"] > 1:  # the old log-probabilities' pass, and the kept batches
            if g["old_logps"] != "sampler":
                rows = dict(run.train_source.get_batch(0))
                rows.pop("old_logps")  # what it scores
                rows = self.place(rows)
                self.score = jax.jit(trainer.policy_logps).lower(state, rows).compile()
            self.batches = Batches(run.workdir, run.checkpointer, g["num_iterations"])

    def place(self, batch: dict) -> dict:
        """A host batch on the run's devices, its rows split as the update's."""
        return jax.device_put(batch, layout.batch_shardings(self.trainer.mesh, batch))

    def batch(self, run: loop.Run, step: int) -> tuple[dict, list[dict]]:
        """Generation `step`'s batch on the devices and its rollout lines: sampled (with its
        old log-probabilities where `num_iterations` > 1, and kept), or, for a run resumed
        between that batch's updates, read back from where it was kept."""
        if self.batches is None:
            host, lines = self(run.state, step)
            return self.place(host), lines
        if step < run.start:
            return self.batches.load(step, self)
        host, lines = self(run.state, step)
        batch = self.place(host)
        if self.score is not None:
            batch["old_logps"] = self.score(run.state, batch)
            host["old_logps"] = np.asarray(batch["old_logps"])
        self.batches.save(step, host, lines)
        return batch, lines

    def __call__(self, state, step: int) -> tuple[dict, list[dict]]:
        """Host-side: generation `step`'s prompts completed and scored; the update's rows (host
        arrays) and each completion's rollout line."""
        t, g, group = self.trainer, self.g, self.g["num_generations"]
        prompts = self.prompts.get_batch(step // g["num_iterations"])
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


class Batches:
    """The batches of a run with `num_iterations` > 1, each kept from its sampling until no
    checkpoint can resume into its updates: `<workdir>/grpo_batches/<step>.npz`, the update's
    host arrays and the rollout lines, written whole (`files.write_text`) before its
    first update, so that every checkpoint taken between its updates finds it."""

    FOLDER = "grpo_batches"

    def __init__(self, workdir, checkpointer, mu: int):
        self.folder, self.checkpointer, self.mu = Path(workdir) / self.FOLDER, checkpointer, mu
        self.folder.mkdir(parents=True, exist_ok=True)
        files.remove_temporaries(self.folder)  # what a killed write left

    def path(self, step: int) -> Path:
        return self.folder / f"{step}.npz"

    def save(self, step: int, host: dict, lines: list[dict]) -> None:
        data = io.BytesIO()
        np.savez(data, **host, lines=np.asarray(json.dumps(lines)))
        files.write_text(self.path(step), data.getvalue())  # atomic, a full disk one line
        # gone: a batch whose every update is behind the oldest checkpoint kept
        oldest = min(self.checkpointer.all_steps(), default=-1)
        for kept in self.folder.glob("*.npz"):
            if kept.stem.isdigit() and int(kept.stem) + self.mu <= oldest:
                kept.unlink(missing_ok=True)

    def load(self, step: int, sampler: Sampler) -> tuple[dict, list[dict]]:
        path = self.path(step)
        if not path.exists():
            raise errors.WorkdirError(
                f"{path}: the batch sampled at step {step}, which this run resumes between "
                "the updates of (grpo.num_iterations), is missing; resume from a checkpoint "
                "at a multiple of num_iterations, or start afresh"
            )
        with np.load(path) as saved:
            host = {k: saved[k] for k in saved.files if k != "lines"}
            lines = json.loads(str(saved["lines"]))
        return sampler.place(host), lines


def token_entropies(out: Any, targets: jax.Array) -> jax.Array:
    """fp32 `[B, L]`, no gradient: each position's entropy of the policy's distribution (at the
    temperature), from the head's dict (`lm_loss.token_loss(entropy=True)`) or fp32 logits."""
    if isinstance(out, dict):
        return jax.lax.stop_gradient(out["entropy"])
    logits = jax.lax.stop_gradient(out.astype(jnp.float32))
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.where(targets >= 0, -jnp.sum(jnp.exp(logp) * logp, axis=-1), 0.0)


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
