"""The embedded default: a byte-level transformer LM on the Python standard library, bf16-mixed.

No download: the data are the `*.py` files of the interpreter's own standard library, in a stable
order, with the last 1% held out for eval.

    python -m mptrain.main --config=configs/default.py --workdir=runs/default

Expected on a 2-core CPU: eval loss about 1.5 nats/byte on the whole held-out split (target
<= 1.75, about 2.5 bits/byte; chance is ln 256 = 5.55) after 800 steps, about 5-7 minutes.
`--config=configs/default.py:tiny` is the test-sized variant.
"""

from ml_collections import config_dict

from mptrain import config as config_lib


def get_config(arg: str | None = None):
    c = config_lib.base_config()
    c.precision = "bf16-mixed"
    c.num_train_steps = 800
    c.batch_size = 32
    c.log_every_steps = 100
    c.eval_every_steps = 400
    c.eval_steps = 30  # the whole held-out split (30 batches of 32 windows of 128 bytes)
    c.checkpoint_every_steps = 400
    c.optimizer.learning_rate = 3e-3
    c.optimizer.warmup_steps = 50
    c.optimizer.b2 = 0.99
    c.optimizer.weight_decay = 0.01

    c.model.name = "transformer_lm"
    c.model.d_model = 128  # width of the residual stream
    c.model.num_layers = 2  # transformer blocks
    c.model.num_heads = 4  # attention heads (d_model must divide evenly)
    c.model.d_ff = 512  # hidden width of each MLP
    c.model.max_len = 128  # longest sequence the position table covers
    c.model.dropout_rate = 0.0
    # "auto": cuDNN's fused flash attention on a CUDA GPU with 16-bit compute and no dropout,
    # else materialized | "cudnn" (an error where it cannot run) | "materialized" (fp32 scores)
    c.model.attention = "auto"

    c.data.name = "text"
    c.data.seq_len = 128  # bytes per training window
    c.data.max_bytes = config_dict.placeholder(int)  # truncate the corpus (None: all of it)
    c.data.eval_fraction = 0.01  # the last 1% of bytes is held out for eval

    if arg == "tiny":
        c.num_train_steps = 8
        c.batch_size = 8
        c.log_every_steps = 2
        c.eval_every_steps = 4
        c.eval_steps = 2
        c.checkpoint_every_steps = 4
        c.optimizer.warmup_steps = 2
        c.model.d_model = 32
        c.model.num_layers = 1
        c.model.num_heads = 2
        c.model.d_ff = 64
        c.model.max_len = 32
        c.data.seq_len = 32
        c.data.max_bytes = 2_000_000
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; valid: 'tiny' or none")
    return c
