"""A fine-tuned run's HuggingFace export, loaded by transformers: the fp32 logits transformers
computes from `python -m mptrain.export --format=hf` must be mptrain's own, within 1e-5 of the
largest logit, for any family the decoder reads (the folder is written as its family's).

    python scripts/hf_export_check.py --workdir=RUN --out=/tmp/export-check \\
        --hf_python=/path/to/venv-with-torch-transformers/bin/python

Exports the run's newest checkpoint in float32 into `--out/hf`, computes mptrain's logits for a
fixed batch of tokens (the exported weights, under the fp32 policy), then has
`tests/hf/make_fixture.py --check` (the HF fixtures' maker, run by `--hf_python`) load the
folder with transformers and print how far its logits are. Prints a line and writes
`--out/check.json`.
"""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

from mptrain import export, hf
from mptrain.models import decoder

LIMIT = 1e-5


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--hf_python", required=True)
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sidecar = export.export(args.workdir, out / "hf", dtype="float32", format="hf")
    model_config, params = hf.load(out / "hf")
    model = decoder.create_model({**model_config, "attention": "materialized"})
    vocab = model_config["vocab_size"]
    ids = (np.arange(2 * 40, dtype=np.int32).reshape(2, 40) * 7 + 3) % vocab
    logits = np.asarray(model.apply({"params": params}, ids), np.float32)
    np.savez(out / "reference.npz", ids=ids, logits=logits)
    script = Path(__file__).resolve().parents[1] / "tests" / "hf" / "make_fixture.py"
    check = [f"--check={out / 'hf'}", f"--reference={out / 'reference.npz'}"]
    found = subprocess.run(
        [args.hf_python, str(script), *check], capture_output=True, text=True, check=True
    )
    line = found.stdout.strip().splitlines()[-1]
    relative = float(re.search(r"\(([0-9.e+-]+) of max\)", line)[1])
    result = {
        "workdir": args.workdir,
        "family": model_config["family"],
        "architecture": json.loads((out / "hf" / "config.json").read_text())["architectures"],
        "step": sidecar["source"]["step"],
        "max_diff_of_max_logit": relative,
        "limit": LIMIT,
    }
    (out / "check.json").write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{model_config['family']:<8} step {result['step']}: transformers' logits of the export "
        f"differ from mptrain's by {relative:.3g} of the largest (limit {LIMIT:g})"
    )
    return 0 if relative < LIMIT else 1


if __name__ == "__main__":
    sys.exit(main())
