"""The fp8 benchmark: a 1.2B-parameter byte-level LM, to compare fp8-mixed with bf16-mixed.

24 blocks of width 2,048 (16 heads of 128, MLP width 8,192) over 1,024-byte windows of the
offline stdlib text, 8 windows a step: 1.21B parameters, 14.5 GB of fp32 master params and Adam
moments, sized for one 80 GB Hopper GPU. Its matmuls are large enough for fp8 to pay (the
attention and MLP projections are about 90% of its FLOPs); the data and optimizer are
lm_gpt2s.py's (at 3e-4), and so is the `:tiny` variant.

    python -m mptrain.main --config=configs/lm_1b.py --workdir=runs/lm_1b_bf16
    python -m mptrain.main --config=configs/lm_1b.py --workdir=runs/lm_1b_fp8 \
        --config.precision=fp8-mixed

(steps/s and device memory are in each run's log and TensorBoard events).

Expected on one H100 (the contract of issue 21; not measured here, no GPU was lent): fp8-mixed
at least 1.3x faster a step than bf16-mixed, in no more memory, its first 200 losses within 2%
of bf16-mixed's. `--config=configs/lm_1b.py:tiny` is the test-sized variant.
"""

import os
import runpy


def get_config(arg: str | None = None):
    gpt2s = runpy.run_path(os.path.join(os.path.dirname(__file__), "lm_gpt2s.py"))
    c = gpt2s["get_config"](arg)  # its data, optimizer and :tiny sizes
    if arg == "tiny":
        return c
    c.num_train_steps = 1000
    c.batch_size = 8  # 1,024-byte windows
    c.eval_steps = 15  # the whole held-out split: 118 windows (the last wraps)
    c.optimizer.learning_rate = 3e-4  # a wider model than gpt2s
    c.model.d_model = 2048  # width of the residual stream
    c.model.num_layers = 24  # transformer blocks
    c.model.num_heads = 16  # attention heads (head width 128)
    c.model.d_ff = 8192  # hidden width of each MLP
    return c
