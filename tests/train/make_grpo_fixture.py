"""Writes TRL's GRPO figures on fixed completions, for `tests/train/grpo_test.py` (run in a venv
of its own: mptrain never imports torch, transformers or trl):

    python3 -m venv /tmp/trlvenv
    /tmp/trlvenv/bin/pip install torch==2.13.0 transformers==5.24.0 trl==1.16.0 datasets
    /tmp/trlvenv/bin/python tests/train/make_grpo_fixture.py

The model is `tests/hf/fixture`'s tiny Llama in fp32, its tokenizer `tests/train/dpo_fixture`'s
byte tokenizer. Two prompts of the same length (no padding: TRL left-pads prompts and the
positions would then start past 0), four completions each (`num_generations` 4), fixed, of 3 to
8 tokens, some ending in the end token; two reward functions with fixed values, one None among
them, weighted 1 and 0.5. TRL's own `GRPOTrainer` builds the batch (`_generate` replaced by the
fixed completions) and computes, for every `loss_type` x `beta` (0, 0.04) x
`importance_sampling_level`, with old log-probs shifted so that the ratio leaves [0.8, 1.2] on
both sides, for advantages of both signs, and reference log-probs shifted by half as much:

  * `prompt_ids [2, P]`, `completion_ids [8, C]` (0-padded), `completion_mask`;
  * `rewards [8, 2]` (NaN for None), `advantages [8]` for `scale_rewards` group, batch, none;
  * `logps [8, C]`: TRL's per-token log-probabilities of the completion tokens (fp32 logits
    over the whole vocabulary at temperature 1); `entropies [8, C]`, each position's entropy
    of that distribution (the record's `entropy`); `old`, `ref`: the shifted ones;
  * per case `loss_<type>_<beta>_<level>`, the loss; `grad_..._<param>`, every parameter's
    gradient under its HF name; `clip_..._{low,high,region}` and `kl_...`, TRL's metrics.
"""

import json
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

HERE = Path(__file__).resolve().parent  # tests/train
OUT = HERE / "grpo_fixture"
MODEL = HERE.parent / "hf" / "fixture"
TOKENIZER = HERE / "dpo_fixture"
PROMPTS = ["Q: 2 + 3 =", "Q: 9 - 4 ="]  # the same length in bytes
END = 256  # the byte tokenizer's <|end_of_text|>
COMPLETIONS = [
    [32, 53, END], [32, 53, 46, 32, 56, 33, 10, END], [49, 50, 51], [32, 54, 46, 10, 53, END],
    [32, 53, END], [32, 52, 50, 50], [32, 53, 46, 46, 46, END], [32, END],
]  # fmt: skip
REWARDS = [[1.0, 0.2], [0.0, None], [0.0, 0.5], [1.0, 1.0], [1.0, 0.0], [0.0, 0.1],
           [1.0, None], [0.0, 0.3]]  # fmt: skip
WEIGHTS = [1.0, 0.5]
MAX_COMPLETION = 8


def first(prompts, completions, **kwargs):
    return [REWARDS[i][0] for i in range(len(completions))]


def second(prompts, completions, **kwargs):
    return [REWARDS[i][1] for i in range(len(completions))]


def trainer_for(tmp: Path, **kwargs) -> GRPOTrainer:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(TOKENIZER)
    tokenizer.pad_token_id = 0
    args = GRPOConfig(
        output_dir=str(tmp), per_device_train_batch_size=8, num_generations=4, use_cpu=True,
        report_to=[], max_completion_length=MAX_COMPLETION, bf16=False, seed=0,
        reward_weights=WEIGHTS, **kwargs,
    )  # fmt: skip
    data = Dataset.from_list([{"prompt": p} for p in PROMPTS])
    trainer = GRPOTrainer(
        model=model, reward_funcs=[first, second], args=args, train_dataset=data,
        processing_class=tokenizer,
    )  # fmt: skip
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    ids = [prompt_ids[i // 4] for i in range(8)]
    texts = [tokenizer.decode(c, skip_special_tokens=True) for c in COMPLETIONS]
    fixed = (ids, COMPLETIONS, None, texts, None, {}, None, None)
    trainer._generate = lambda prompts: fixed
    trainer.current_gradient_accumulation_steps = 1  # what trainer.train() sets for a step
    trainer.model.train()
    return trainer


def batch_of(trainer: GRPOTrainer) -> dict:
    inputs = [{"prompt": PROMPTS[i // 4]} for i in range(8)]
    return trainer._generate_and_score_completions(inputs)


def main() -> None:
    import tempfile

    out, tmp = {}, Path(tempfile.mkdtemp())
    for scale in ("group", "batch", "none"):
        batch = batch_of(trainer_for(tmp, scale_rewards=scale))
        out[f"advantages_{scale}"] = batch["advantages"].numpy()
    trainer = trainer_for(tmp)
    batch = batch_of(trainer)
    out["prompt_ids"] = batch["prompt_ids"][::4].numpy()
    out["completion_ids"] = batch["completion_ids"].numpy()
    out["completion_mask"] = batch["completion_mask"].numpy()
    out["rewards"] = np.asarray([[np.nan if v is None else v for v in r] for r in REWARDS])
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, entropies, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, ids, mask, batch["completion_ids"].size(1), compute_entropy=True
        )
    out["logps"], out["entropies"] = logps.numpy(), entropies.numpy()
    # each row's mean shifted by +-0.3 (past log 1.2 at the sequence level), each token by +-0.4
    # about it: ratios leave [0.8, 1.2] on both sides, with advantages of both signs
    rows = torch.tensor([1.0, -1, 1, -1, 1, -1, -1, 1])[:, None]
    tokens = torch.where(torch.arange(logps.shape[1]) % 2 == 0, 0.4, -0.4)[None]
    shift = 0.3 * rows + tokens
    out["old"], out["ref"] = (logps - shift).numpy(), (logps + 0.5 * shift).numpy()
    for loss_type in ("grpo", "bnpo", "dr_grpo", "dapo"):
        for beta in (0.0, 0.04):
            for level in ("token", "sequence"):
                name = f"{loss_type}_{beta:g}_{level}"
                trainer = trainer_for(
                    tmp, loss_type=loss_type, beta=beta, importance_sampling_level=level
                )
                batch = batch_of(trainer)
                batch["old_per_token_logps"] = torch.from_numpy(out["old"])
                batch["ref_per_token_logps"] = torch.from_numpy(out["ref"])
                trainer.model.zero_grad()
                loss = trainer._compute_loss(trainer.model, batch)
                loss.backward()
                out[f"loss_{name}"] = loss.detach().numpy()
                for key, param in trainer.model.named_parameters():
                    out[f"grad_{name}_{key}"] = param.grad.numpy().copy()
                metrics = trainer._metrics["train"]
                for side in ("low", "high", "region"):
                    out[f"clip_{name}_{side}"] = np.float32(metrics[f"clip_ratio/{side}_mean"][-1])
                if beta:
                    out[f"kl_{name}"] = np.float32(metrics["kl"][-1])
    OUT.mkdir(exist_ok=True)
    np.savez_compressed(OUT / "reference.npz", **out)
    (OUT / "settings.json").write_text(
        json.dumps(
            {"prompts": PROMPTS, "weights": WEIGHTS, "max_completion_length": MAX_COMPLETION}
        )
        + "\n"
    )
    print(f"wrote {OUT / 'reference.npz'}: {len(out)} arrays")


if __name__ == "__main__":
    main()
