"""A LoRA run's exports, checked against transformers and peft: `--format=hf` (merged in fp32)
and `--format=peft` (the adapters alone, loaded onto the base folder by peft) must give the fp32
logits of mptrain's merged model within 1e-5 of the largest logit.

    python scripts/lora_export_check.py --workdir=RUN --out=/tmp/lora-check \\
        --hf_python=/path/to/venv-with-torch-transformers-peft/bin/python

Exports both formats in float32 into `--out`, computes mptrain's logits for a fixed batch of
tokens (the run's base with its adapters merged, under the fp32 policy), then runs this same
file with `--hf_python` and `--reference=` (`hf_side`: it imports torch, transformers and peft,
never mptrain). Prints a table and writes `--out/check.json`.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

LIMIT = 1e-5


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir")
    parser.add_argument("--out")
    parser.add_argument("--hf_python")
    for flag in ("--base", "--merged", "--adapter", "--reference"):  # the HF side's
        parser.add_argument(flag)
    args = parser.parse_args()
    if args.reference:
        return hf_side(args)
    import jax

    from mptrain import config as config_lib
    from mptrain import export, models

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for fmt in ("hf", "peft"):
        export.export(args.workdir, out / fmt, dtype="float32", format=fmt)
    config, (state, _) = export.read_run(Path(args.workdir))
    weights = jax.device_get(export._weights(config, state))
    config.precision = "fp32"
    model = models.create(config.model, config_lib.policy_of(config))
    vocab = config.model.vocab_size
    tokens = (np.arange(2 * 24, dtype=np.int32).reshape(2, 24) * 7 + 3) % vocab
    logits = np.asarray(model.apply({"params": weights}, tokens), np.float32)
    np.savez(out / "reference.npz", tokens=tokens, logits=logits)
    base = config.init_from
    found = subprocess.run(
        [args.hf_python, __file__, f"--base={base}",
         f"--merged={out / 'hf'}", f"--adapter={out / 'peft'}",
         f"--reference={out / 'reference.npz'}"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    result = json.loads(found.stdout.strip().splitlines()[-1])
    result |= {
        "limit": LIMIT,
        "workdir": str(args.workdir),
        "lora": config_lib.to_dict(config.lora),
    }
    (out / "check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{'export':<16} {'max |diff| / max |logit|':>26}")
    for key in ("merged_hf", "peft_on_base"):
        print(f"{key:<16} {result[key]:>26.2e}")
    print(f"largest logit {result['largest_logit']:.3f}; limit {LIMIT:g}; {out / 'check.json'}")
    return 0 if max(result["merged_hf"], result["peft_on_base"]) <= LIMIT else 1


def hf_side(args) -> int:
    """In the venv with torch, transformers and peft: one JSON line, for the merged HF folder
    and for the PEFT adapter loaded onto the base folder, the largest logit difference from
    mptrain's over the largest logit."""
    import peft
    import torch
    import transformers

    def logits(model, tokens) -> np.ndarray:
        with torch.no_grad():
            return model(torch.tensor(tokens)).logits.float().numpy()

    ref = np.load(args.reference)
    tokens, want = ref["tokens"], ref["logits"]
    load = transformers.AutoModelForCausalLM.from_pretrained
    merged = logits(load(args.merged, dtype=torch.float32), tokens)
    adapted = peft.PeftModel.from_pretrained(load(args.base, dtype=torch.float32), args.adapter)
    scale = float(np.abs(want).max())
    line = {
        "largest_logit": scale,
        "merged_hf": float(np.abs(merged - want).max()) / scale,
        "peft_on_base": float(np.abs(logits(adapted, tokens) - want).max()) / scale,
        "peft_version": peft.__version__,
        "transformers_version": transformers.__version__,
    }
    print(json.dumps(line))
    return 0


if __name__ == "__main__":
    sys.exit(main())
