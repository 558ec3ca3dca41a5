"""Direct preference optimisation: `config.trainer="mptrain.train.dpo:DPOTrainer"` on
`data.name="dpo"` pairs (`mptrain.data.dpo`), the loss `mptrain.models.dpo_loss`'s.

Each step runs the pair's chosen and rejected sequences through the model in one forward pass
(`[B, 2, L]` as `2B` rows, each pair's two rows side by side on one device) and sums each
completion's token log-probabilities in fp32 from fp32 logits. The reference's sums come from
one of (`dpo.reference`):

  * `"adapters"` (the default under LoRA): the same model with the adapters off, the frozen
    base the run holds anyway (params without the adapters: `lora.Dense` then is its base's
    matmul alone); no second copy of any weight;
  * `"copy"` (the default for a full fine-tune): a frozen copy of the step-0 params in the
    compute dtype, the dtypes the policy's own step-0 forward reads them in, so rewards start
    at 0. It is part of the state (`model_state["dpo_reference"]`), split over the mesh as the
    params are, checkpointed: a resume keeps it. The step hands it to the reference's forward
    alone, never to the gradient's;
  * `"precomputed"`: every pair's reference sums computed once, at step 0, in fp32, by the
    step-0 model, and stored beside the pairs in the data cache (named by the pairs and the
    model's fingerprint and policy: another run of the same model on the same pairs reuses
    them) and in the workdir (`dpo_reference.json`), which a resume reads.

The reference's forward runs without a gradient, laid out as the policy's (params gathered in
the compute dtype on a mesh; `sharding.forward_fn`). Dropout is off (LoRA's too), as TRL's
`disable_dropout`. A sequence split over `mesh.context` is not built for DPO yet.
"""

from __future__ import annotations

import functools
import hashlib
import json
import zlib
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging

from mptrain import errors, files
from mptrain.data import dpo as dpo_data
from mptrain.data import token_cache
from mptrain.models import dpo_loss
from mptrain.parallel import layout, sharding
from mptrain.train import fingerprints, reference, trainer

TRAINER = dpo_data.TRAINER
REFERENCE = reference.KEY  # the model_state key of the "copy" reference
WORKDIR_FILE = "dpo_reference.json"  # the "precomputed" reference's copy in the workdir


class DPOTrainer(trainer.Trainer):
    """The Trainer on preference pairs (the module doc)."""

    def __init__(self, config, workdir, **kwargs):  # `devices=`, `resolved=`: the Trainer's
        trainer.require_data(config, "dpo", TRAINER, "pairs")
        with errors.config_errors():
            self.dpo = dpo_data.check_run(config)
        super().__init__(config, workdir, **kwargs)

    # ---- the model on pairs ------------------------------------------------------------------

    def init_variables(self, rng: jax.Array, batch: dict[str, Any]) -> dict[str, Any]:
        variables = self.model.init({"params": rng}, batch["inputs"][:, 0], train=False)
        if self.dpo["reference"] == "copy":  # step 0's params, as the policy's forward reads them
            variables = reference.add(self.policy, variables)
        return variables

    def token_logps(self, params, model_state, batch, train: bool = True):
        """`(logps [B, 2, L] fp32, new model_state, the model's own metrics)`: each target's
        log-probability; a mixture of experts' load-balancing loss among the metrics."""
        inputs, targets = batch["inputs"], batch["targets"]
        rows = lambda x: x.reshape(-1, x.shape[-1])  # [B, 2, L] -> [2B, L]: pairs side by side
        variables, mutable = {"params": params, **model_state}, list(model_state) or False
        kwargs = {"targets": rows(targets)} if getattr(self.model, "computes_loss", False) else {}
        out = self.model.apply(variables, rows(inputs), train=train, mutable=mutable, **kwargs)
        out, new_state = out if mutable else (out, model_state)
        per_token = dpo_loss.token_logps(out, rows(targets))
        return per_token.reshape(targets.shape), new_state, trainer.model_metrics(out)

    def loss_fn(self, params, model_state, batch, rng):
        """Traced. The DPO loss of a batch of pairs and TRL's metrics (`dpo_loss`); a batch
        without the reference's sums (a trace of the loss alone) takes the policy's own."""
        model_state = reference.without(model_state)
        per_token, new_state, extra = self.token_logps(params, model_state, batch)
        ref = batch.get(dpo_data.REFERENCE)
        if ref is None:
            ref = dpo_loss.sequence_logps(per_token, batch["targets"])
        loss, metrics = dpo_loss.loss_and_metrics(per_token, batch["targets"], ref, self.dpo)
        if "moe/aux_loss" in extra:  # as TRL adds it where the model outputs router logits
            loss = loss + self.model.aux_loss_coef * extra["moe/aux_loss"]
        return loss, (new_state, {**metrics, **extra})

    # ---- the reference ----------------------------------------------------------------------

    def reference_params(self, state) -> Any:
        """The params the reference's forward takes (the module doc)."""
        if self.dpo["reference"] == "adapters" or (
            self.dpo["reference"] == "precomputed" and jax.tree.leaves(state.frozen)
        ):
            return state.frozen  # the base: no adapters
        if self.dpo["reference"] == "copy":
            return state.model_state[REFERENCE]
        return state.params

    def reference_logps(self, params, model_state, batch, axes=None) -> jax.Array:
        """Traced. fp32 `[B, 2]`: the sums of `params`' log-probabilities, no gradient; `axes`:
        their declared axes (the state's), by which a mesh splits them."""
        model_state = reference.without(model_state)

        def forward(p, model_state, batch):
            per_token = self.token_logps(p, model_state, batch, train=False)[0]
            return dpo_loss.sequence_logps(per_token, batch["targets"])

        policy = self.policy
        with policy.matmuls():
            if self.mesh.size > 1:
                run = sharding.forward_fn(forward, policy, self.mesh, per_row=True, axes=axes)
                logps = run(params, model_state, batch)
            else:
                logps = forward(sharding.cast_params(policy, params), model_state, batch)
        return jax.lax.stop_gradient(logps.astype(jnp.float32))

    def _with_reference(self, state, batch):
        """`(state, batch)`: the batch with the reference's sums (computed now where they were
        not computed ahead), the state without the reference's copy (the gradient's forward
        never takes it)."""
        if dpo_data.REFERENCE not in batch:
            logps = self.reference_logps(
                self.reference_params(state), state.model_state, batch, state.axes
            )
            batch = {**batch, dpo_data.REFERENCE: logps}
        return state.replace(model_state=reference.without(state.model_state)), batch

    def make_train_step(self):
        prepare = lambda state, batch: self._with_reference(state, batch)[1]
        return reference.keeping(super().make_train_step(), prepare)

    def make_eval_step(self):
        inner = super().make_eval_step()
        return lambda state, batch: inner(*self._with_reference(state, batch))

    def starting(self, state, saved_step, train_source, eval_source):
        """Step 0 fixes the reference: the copy is made of the step-0 params (`init_from`'s
        where set); precomputed sums are computed (or read from the cache) and handed to the
        sources; a resume keeps what its checkpoint and workdir hold."""
        fresh = saved_step is None and self.config.init_from is not None
        if self.dpo["reference"] == "copy" and fresh:  # else the init's copy is step 0's
            state = reference.refreshed(self.policy, state)
        if self.dpo["reference"] == "precomputed":
            logps = self._precomputed(state, saved_step, train_source, eval_source)
            train_source.reference = logps[: len(train_source.rows)]
            if eval_source is not None:
                eval_source.reference = logps[len(train_source.rows) :]
        return state

    def _precomputed(self, state, saved_step, train_source, eval_source) -> np.ndarray:
        """fp32 `[pairs, 2]` (train, then eval): the workdir's on a resume, else the cache's,
        computed there first where no run of this model on these pairs has."""
        kept = self.workdir / WORKDIR_FILE
        sources = [s for s in (train_source, eval_source) if s is not None]
        if saved_step is not None:
            return _kept(kept, sum(len(s.rows) for s in sources))
        if jax.process_count() > 1:
            raise errors.ConfigError(
                "dpo.reference='precomputed' is computed by one process; with several, use "
                "dpo.reference='copy' (or 'adapters' under LoRA)"
            )
        params = self.reference_params(state)
        model = f"{fingerprints.fingerprint(params)}|{self.policy}|{self.config.model.to_json()}"
        pairs = dpo_data.settings(self.config)  # loads the tokenizer: once
        tag = hashlib.sha256(model.encode()).hexdigest()[:16]
        path = pairs.path().replace(".npy", f"-ref-{tag}.npy")
        forward = jax.jit(functools.partial(self.reference_logps, axes=state.axes))

        def write(path: str) -> str:
            out = []
            for source in sources:
                n, size = len(source.rows), self.config.batch_size
                for start in range(0, n, size):
                    batch = source.batch_of(np.arange(start, start + size) % n)
                    batch = jax.device_put(batch, layout.batch_shardings(self.mesh, batch))
                    out.append(np.asarray(forward(params, state.model_state, batch))[: n - start])
            token_cache.write_array(np.concatenate(out), path, {"model": model})
            return f"computed the reference's log-probabilities of {sum(map(len, out)):,} pairs"

        what = "DPO reference log-probabilities"
        logps, _ = token_cache.load(path, np.dtype(np.float32), pairs.base.cache_dir, write, what)
        logps = np.asarray(logps).reshape(-1, 2)
        _keep(kept, model, logps)
        logging.info("mptrain: dpo: the reference's log-probabilities: %s (and %s)", path, kept)
        return logps


def _keep(kept: Path, model: str, logps: np.ndarray) -> None:
    """Writes the reference's `[pairs, 2]` sums to the workdir's `kept`, with their CRC-32."""
    logps = np.asarray(logps, np.float32)
    crc = zlib.crc32(logps.tobytes())
    files.write_json(kept, {"model": model, "logps": logps.tolist(), "crc32": crc})


def _kept(kept: Path, pairs: int) -> np.ndarray:
    """The `[pairs, 2]` sums a run's workdir keeps, checked before a resume trusts them: read
    whole, of the run's pairs, equal to their CRC-32 (written beside them; a file from before
    it was is checked for its shape only). A `ConfigError` naming the file otherwise: the
    reference cannot be made again from a checkpoint past step 0."""
    what = f"dpo.reference='precomputed': {kept}"
    again = (
        "the reference cannot be made again from a checkpoint past step 0: start a new --workdir"
    )
    if not kept.exists():
        raise errors.ConfigError(f"{what} is gone; {again}")
    try:
        saved = json.loads(kept.read_text())
        logps = np.asarray(saved["logps"], np.float32)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise errors.ConfigError(f"{what} is damaged ({errors.first_line(e)}); {again}") from None
    if logps.shape != (pairs, 2):
        raise errors.ConfigError(
            f"{what} is damaged: it holds sums of shape {list(logps.shape)}, the run's {pairs} "
            f"pairs take [{pairs}, 2]; {again}"
        )
    if "crc32" in saved and zlib.crc32(logps.tobytes()) != saved["crc32"]:
        raise errors.ConfigError(f"{what} is damaged: its sums do not match their CRC-32; {again}")
    return logps
