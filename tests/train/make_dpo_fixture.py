"""Writes TRL's DPO figures on tiny pairs, for `tests/train/dpo_test.py` (run in a venv of its own:
mptrain never imports torch, transformers or trl):

    python3 -m venv /tmp/hfvenv
    /tmp/hfvenv/bin/pip install transformers==5.24.0 torch safetensors numpy trl==1.16.0
    /tmp/hfvenv/bin/python tests/train/make_dpo_fixture.py

The folder `tests/train/dpo_fixture/` holds the inputs, committed: `tokenizer.json` (mptrain's
byte tokenizer, `data.sft.tokenizer_of("bytes").save(...)`), `tokenizer_config.json` (its
markers and mptrain's built-in "llama3" chat template), `pairs.jsonl` (plain text) and
`chats.jsonl` (conversations, one with its prompt implicit); the model is
`tests/hf/fixture`'s tiny Llama, in fp32 (`bf16=False`: TRL's config turns bf16 autocast on
by default, and with it the policy's and the reference's sums differ from fp32's by about 1e-3
relative). This script writes `reference.npz` there, for
each set (`pairs_*`, `chats_*`), from TRL's own `DPOTrainer`:

  * `ids`, `start`: each pair's chosen and rejected token ids (TRL's prompt + completion ids,
    `[pairs, 2, 64]`, -1 padded) and where its completion starts (TRL's prompt length);
  * `logps`: `[pairs, 2]`, the step-0 model's sums of completion log-probabilities
    (`compute_ref_log_probs`: TRL's fused head);
  * for each loss (`sigmoid`, `robust` with label smoothing 0.1, `hinge`, `ipo`, and
    `sigmoid` + 0.5 `sft`), on the policy's `logps` against reference sums `ref` drawn from a
    seed: `loss_<name>` and `grad_<name>` (`[pairs, 2]`, the loss's gradient with respect to
    the policy's sums: minus that with respect to the reference's, which TRL's precomputed
    path takes as inputs);
  * `history`: two steps of plain SGD (lr 0.5, no clip, constant schedule, all 4 pairs a
    step) under `trainer.train()`: per step the loss, `rewards/margins`, `rewards/accuracies`
    and the gradient norm TRL logs.
"""

import json
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import DPOConfig, DPOTrainer

HERE = Path(__file__).resolve().parent  # tests/train
OUT = HERE / "dpo_fixture"
MODEL = HERE.parent / "hf" / "fixture"
LENGTH = 64
LOSSES = {
    "sigmoid": (["sigmoid"], [1.0], 0.0),
    "robust": (["robust"], [1.0], 0.1),
    "hinge": (["hinge"], [1.0], 0.0),
    "ipo": (["ipo"], [1.0], 0.0),
    "sigmoid_sft": (["sigmoid", "sft"], [1.0, 0.5], 0.0),
}


def trainer_for(rows: list, tmp: Path, **kwargs) -> DPOTrainer:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(OUT)
    args = DPOConfig(
        output_dir=str(tmp), per_device_train_batch_size=4, use_cpu=True, report_to=[],
        optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", max_grad_norm=1e9,
        logging_steps=1, save_strategy="no", max_length=None, seed=0, bf16=False, **kwargs,
    )  # fmt: skip
    return DPOTrainer(model, args=args, train_dataset=Dataset.from_list(rows),
                      processing_class=tokenizer)  # fmt: skip


def main() -> None:
    out = {}
    for name in ("pairs", "chats"):
        rows = [json.loads(line) for line in (OUT / f"{name}.jsonl").read_text().splitlines()]
        trainer = trainer_for(rows, Path(f"/tmp/dpo_fixture_{name}"))
        data = trainer.train_dataset
        ids = np.full((len(rows), 2, LENGTH), -1, np.int32)
        for i, row in enumerate(data):
            for j, key in enumerate(("chosen_ids", "rejected_ids")):
                seq = row["prompt_ids"] + row[key]
                ids[i, j, : len(seq)] = seq
        out[f"{name}_ids"] = ids
        out[f"{name}_start"] = np.asarray([len(r["prompt_ids"]) for r in data], np.int32)
        batch = trainer.data_collator([data[i] for i in range(len(rows))])
        with torch.no_grad():
            chosen, rejected = trainer.compute_ref_log_probs(trainer.model, batch)
        logps = torch.stack([chosen, rejected], 1)
        out[f"{name}_logps"] = logps.numpy().astype(np.float32)
        ref = logps + torch.from_numpy(np.random.default_rng(0).normal(0, 3, logps.shape))
        ref = ref.float()
        out[f"{name}_ref"] = ref.numpy()
        trainer.precompute_ref_logps = True
        for loss, (types, weights, smoothing) in LOSSES.items():
            trainer.loss_types, trainer.loss_weights = types, weights
            trainer.label_smoothing = smoothing
            r = ref.clone().requires_grad_(True)
            inputs = {**batch, "ref_chosen_logps": r[:, 0], "ref_rejected_logps": r[:, 1]}
            value = trainer._compute_loss(trainer.model, inputs, False)
            value.backward()
            out[f"{name}_loss_{loss}"] = np.float32(value.item())
            out[f"{name}_grad_{loss}"] = (-r.grad).numpy().astype(np.float32)
        trainer = trainer_for(rows, Path(f"/tmp/dpo_fixture_{name}_train"), max_steps=2)
        trainer.train()
        logged = [h for h in trainer.state.log_history if "loss" in h]
        keys = ("loss", "rewards/margins", "rewards/accuracies", "grad_norm")
        out[f"{name}_history"] = np.asarray([[h[k] for k in keys] for h in logged], np.float64)
        print(name, "history (loss, margins, accuracies, grad_norm):", out[f"{name}_history"])
    np.savez(OUT / "reference.npz", **out)
    print("wrote", OUT / "reference.npz")


if __name__ == "__main__":
    main()
