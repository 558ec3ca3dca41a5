"""The GPU benchmark: the byte-level LM in GPT-2-small's shape, bf16-mixed.

12 blocks of width 768 (12 heads, MLP width 3,072) over 1,024-byte windows of the offline
stdlib text (as `configs/default.py`), 16 windows a step, vocabulary 256 (bytes): 85M
parameters. The optimizer is the one of the PyTorch peer it is measured against (AdamW at a
constant 6e-4, betas 0.9 and 0.99, weight decay 0.01, eps 1e-8, no warmup, the global gradient
norm clipped to 1.0), so that both sides do the same work a step.

    python -m mptrain.main --config=configs/lm_gpt2s.py --workdir=runs/lm_gpt2s
    python scripts/bench.py --lm_config=configs/lm_gpt2s.py --models=lm   # on a GPU

Expected on one H100 or H200: a bf16-mixed step at least as fast as PyTorch AMP with
torch.compile and flash attention on the same GPU, and at least 3x faster than fp32; about 10
TFLOP of model FLOPs a step. Measured on one H200 (2026-11-27, jax 0.11.2,
`scripts/gpu_check.py`): 25.98 ms against PyTorch's 25.63 ms (1.4% above), 9.8x faster than the
fp32 preset (254.9 ms). The 2,000 steps (2.7 passes over the 12 MB corpus) take about a
minute there; an estimate, not measured: eval loss around 1.0-1.3 nats/byte at the end. On a
CPU a step takes minutes: `--config=configs/lm_gpt2s.py:tiny` is the test-sized variant.
"""

from ml_collections import config_dict

from mptrain import config as config_lib


def get_config(arg: str | None = None):
    c = config_lib.base_config()
    c.precision = "bf16-mixed"
    c.num_train_steps = 2000
    c.batch_size = 16
    c.log_every_steps = 100
    c.eval_every_steps = 1000
    c.eval_steps = 8  # the whole held-out split: 118 windows of 1,024 bytes (the last wraps)
    c.checkpoint_every_steps = 1000

    # torch_peer.py's torch.optim.AdamW(lr=6e-4, betas=(0.9, 0.99), weight_decay=0.01), with no
    # scheduler and clip_grad_norm_(1.0); eps is torch's default.
    c.optimizer.name = "adamw"
    c.optimizer.learning_rate = 6e-4
    c.optimizer.schedule = "constant"
    c.optimizer.warmup_steps = 0
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.99
    c.optimizer.eps = 1e-8
    c.optimizer.weight_decay = 0.01
    c.optimizer.grad_clip_norm = 1.0

    c.model.name = "transformer_lm"
    c.model.vocab_size = 256  # bytes
    c.model.d_model = 768  # width of the residual stream
    c.model.num_layers = 12  # transformer blocks
    c.model.num_heads = 12  # attention heads (head width 64)
    c.model.d_ff = 3072  # hidden width of each MLP
    c.model.max_len = 1024  # longest sequence the position table covers
    c.model.dropout_rate = 0.0
    # "auto": cuDNN's fused flash attention on a CUDA GPU with 16-bit compute (the peer's
    # F.scaled_dot_product_attention), the materialised fp32 scores elsewhere
    c.model.attention = "auto"

    c.data.name = "text"
    c.data.seq_len = 1024  # bytes per training window
    c.data.max_bytes = config_dict.placeholder(int)  # truncate the corpus (None: all of it)
    c.data.eval_fraction = 0.01  # the last 1% of bytes is held out for eval

    if arg == "tiny":  # the same recipe at a size whose step takes milliseconds on a CPU
        c.num_train_steps = 8
        c.batch_size = 8
        c.log_every_steps = 2
        c.eval_every_steps = 4
        c.eval_steps = 2
        c.checkpoint_every_steps = 4
        c.model.d_model = 32
        c.model.num_layers = 2
        c.model.num_heads = 2
        c.model.d_ff = 128
        c.model.max_len = 64
        c.data.seq_len = 64
        c.data.max_bytes = 2_000_000
    elif arg:
        raise ValueError(f"unknown config argument {arg!r}; valid: 'tiny' or none")
    return c
