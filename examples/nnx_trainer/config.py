"""Config of the NNX example: the default byte-level LM task with the model written in flax NNX.

From the repository root (so that `examples` is importable):

    python -m mptrain.main --config=examples/nnx_trainer/config.py --workdir=runs/nnx

`:tiny` is the test-sized variant; `--config.precision=...` takes any preset.
"""

import runpy
from pathlib import Path

DEFAULT = Path(__file__).resolve().parents[2] / "configs" / "default.py"


def get_config(arg: str | None = None):
    c = runpy.run_path(str(DEFAULT))["get_config"](arg)  # the default task, data and schedule
    c.trainer = "examples.nnx_trainer.trainer:NNXTrainer"
    c.model.name = "nnx_byte_lm"  # informative only: NNXTrainer.build_model builds it
    return c
