"""Loads a LoRA run's exports with transformers and peft and compares their fp32 logits with
mptrain's (run in the venv that has torch, transformers and peft; `lora_export_check.py` calls
it). Prints one JSON line: for the merged HF folder and for the PEFT adapter loaded onto the
base folder, the largest logit difference over the largest logit."""

import argparse
import json

import numpy as np
import torch
import transformers


def logits(model, tokens) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def main() -> None:
    parser = argparse.ArgumentParser()
    for flag in ("--base", "--merged", "--adapter", "--reference"):
        parser.add_argument(flag, required=True)
    args = parser.parse_args()
    import peft

    ref = np.load(args.reference)
    tokens, want = ref["tokens"], ref["logits"]
    load = transformers.AutoModelForCausalLM.from_pretrained
    merged = logits(load(args.merged, dtype=torch.float32), tokens)
    base = load(args.base, dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(base, args.adapter)
    with_adapter = logits(adapted, tokens)
    scale = float(np.abs(want).max())
    print(
        json.dumps(
            {
                "largest_logit": scale,
                "merged_hf": float(np.abs(merged - want).max()) / scale,
                "peft_on_base": float(np.abs(with_adapter - want).max()) / scale,
                "peft_version": peft.__version__,
                "transformers_version": transformers.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
