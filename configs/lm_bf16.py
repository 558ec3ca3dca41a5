"""A bigger, longer byte-level transformer LM than `default.py`, bf16-mixed.

Same offline data (the Python standard library's source, no download) and model family as
`configs/default.py`: 4 blocks of width 256 over 256-byte windows (3.3M parameters), 4,000 steps
of 32 windows, fp32 master weights and bf16 compute, no loss scaling (bf16 has fp32's range).

    python -m mptrain.main --config=configs/lm_bf16.py --workdir=runs/lm_bf16

Expected (an estimate, not yet measured: the run takes about 5 hours on a 2-core CPU at 0.2
steps/s, minutes on a GPU): eval loss well below the default's 1.75 nats/byte, around 1.2-1.4
nats/byte (1.7-2.0 bits per byte) at the end. `--config=configs/lm_bf16.py:tiny` is the test-sized
variant, the same as `default.py:tiny`.
"""

import os
import runpy


def get_config(arg: str | None = None):
    default = runpy.run_path(os.path.join(os.path.dirname(__file__), "default.py"))
    c = default["get_config"](arg)  # also rejects an unknown `arg`
    c.precision = "bf16-mixed"
    if arg == "tiny":
        return c
    c.num_train_steps = 4000
    c.batch_size = 32
    c.log_every_steps = 100
    c.eval_every_steps = 1000
    c.eval_steps = 16
    c.checkpoint_every_steps = 1000
    c.optimizer.learning_rate = 1e-3
    c.optimizer.warmup_steps = 200
    c.optimizer.weight_decay = 0.01
    c.model.d_model = 256
    c.model.num_layers = 4
    c.model.num_heads = 4
    c.model.d_ff = 1024
    c.model.max_len = 256
    c.data.seq_len = 256
    return c
