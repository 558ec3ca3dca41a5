"""Llama 3-shaped models, bf16-mixed: fp32 master params and moments, bf16 compute, the layers
scanned, the loss chunked (`loss.chunk_tokens` automatic).

    python -m mptrain.main --config=configs/llama3.py:tiny --workdir=runs/llama3_tiny
    python -m mptrain.plan --config=configs/llama3.py:8b --target=h100 --devices=8

Arguments:
- `8b`: Llama 3.1 8B (8.03B params: width 4,096, 32 layers, 32 heads over 8 kv heads of 128,
  MLP 14,336, vocabulary 128,256, untied; RoPE theta 500,000 with Llama 3 scaling 8 / 1 / 4 /
  8,192), sequences of 8,192. Planned for 8 H100s (80 GB): FSDP 8, global batch 16 (2 a
  device), remat `minimal` (the projections' outputs kept, attention recomputed): 62.6 GiB a
  device in the plan, above the 59.3 GiB that JAX takes of an 80 GB GPU by default (75%), so
  the config sets `memory_fraction=0.85` (67.2 GiB), which the run gives JAX before it starts
  and the plan plans against. `minimal_with_context` plans 66.4 GiB, 99% of that share and
  above the 60.7 GiB XLA compiles for (its own rematerialisation recomputes 1.9 TFLOP a step),
  for a floor no lower (942.8 ms against 940.8).
  torchtitan's published run of this model, batch and mesh (8 H100s, FSDP 8, selective
  activation checkpointing, torch.compile) peaks at 77.0 GiB. On one H100, `python -m
  mptrain.plan --config=configs/llama3.py:8b --target=h100 --devices=1 --fit
  --config.batch_size=8 --config.data.seq_len=4096` finds bf16 params with stochastic rounding,
  8-bit moments and remat `full`: 64.4 GiB, 4.0 bytes of state a param (docs/make-it-fit.md).
  Those overrides on one H200 (2026-11-27; its 75% share needs no remat from XLA): 10,853
  tokens/s, MFU 52.9%, peak 82.8 GiB, the plan's figure for an H200 to 0.01%.
- `70b`: Llama 3.1 70B (width 8,192, 80 layers, 64 heads over 8 kv heads, MLP 28,672).
  Planned for 64 H100s: FSDP 64, global batch 64 (1 a device), sequences of 8,192, remat
  `full` (only each block's input kept), as torchtitan's 70B runs do.
- `70b_node`: the 70B's full fine-tune on one node of 8 H100s, what the full-bf16 work
  mptrain grew from set out to do: sequences of 8,192 split over context groups of 4 (fsdp 2
  x context 4: params and state over all 8), a global batch of 2 sequences (16,384 tokens a
  step), remat `full`, and what costs quality: bf16-pure params with stochastic rounding and
  8-bit moments (docs/optimizer-state.md and docs/precision.md measure both). Planned: 69.5
  GiB a device (`memory_fraction=0.93`: 73.6), floor 1,364 ms a step (docs/make-it-fit.md).
- `70b_2nodes`: the same recipe on two nodes of 8 H100s, 16 sequences a step: tensor 8 within
  each node (heads, MLP and vocabulary split, the norms on each device's tokens) and fsdp 2
  across the nodes. Planned: 48.0 GiB a device, floor 4.71 s a step, compute-bound, against
  FSDP 16's 10.5 s bound by the network (docs/make-it-fit.md#when-a-tensor-axis-pays).
- `1b`: Llama 3.2 1B (width 2,048, 16 layers, 32 heads over 8 kv heads of 64, MLP 8,192, tied
  embeddings; RoPE scaling 32 / 1 / 4 / 8,192). Planned for one H100: batch 8 of 8,192, remat
  `minimal`, `memory_fraction=0.92` (72.8 GiB of the H100's 79.1; the plan needs 69.5).
  Measured on one H200 (2026-11-27): 49,516 tokens/s, MFU 45.2%, peak 68.9 GiB against the
  plan's 69.5 GiB.
- `tiny`: a byte-level Llama (vocabulary 256) on the embedded text (the Python standard
  library), scanned, with remat `full`, that trains on a 2-core CPU in a few minutes.
- `hf=DIR`: fine-tuning the HuggingFace Llama in folder DIR (config.json, *.safetensors, and
  tokenizer.json if it has one). The model section is DIR's (`mptrain.hf.read_config`), the
  step-0 params are DIR's (`init_from=DIR`: fp32 masters from its weights, exactly), the text
  is tokenized by DIR's tokenizer.json (bytes without one), and the recipe is a fine-tune's:
  AdamW at 2e-5 after 20 warmup updates, cosine decay, no weight decay, clipping at 1.0,
  bf16-mixed, global batch 8 of 1,024 tokens (fewer if the model's context is shorter), a
  checkpoint every 200 steps. Your text is `--config.data.files=GLOB` (.txt, .md, .py, .jsonl
  with a "text" field; default: the embedded text); any key can be overridden. One command:

      python -m mptrain.main --config=configs/llama3.py:hf=/models/Llama-3.2-1B \
          --workdir=runs/ft --config.data.files='notes/**/*.md' --config.num_train_steps=500

  Then `python -m mptrain.export --workdir=runs/ft --format=hf --out=exports/ft` writes a
  folder transformers loads, DIR's tokenizer files copied in (docs/fine-tuning.md).

- `sft=DIR`: supervised fine-tuning of the Llama in DIR (docs/sft.md): `hf=DIR` with
  `data.name="sft"`: `--config.data.files=chats.jsonl` (conversations or prompt/completion
  pairs), DIR's tokenizer and chat template, the loss on the answers, examples packed into rows.
- `sft_tiny`: a byte-level Llama (vocabulary 264: the bytes and Llama 3's five markers) on the
  embedded SFT set (the standard library's signatures and docstrings), packed into rows of 512;
  400 steps on a 2-core CPU.
- `dpo=DIR`: DPO of the Llama in DIR on preference pairs (docs/dpo.md): `hf=DIR` with
  `data.name="dpo"` (`--config.data.files=pairs.jsonl`: prompt, chosen, rejected), AdamW at
  5e-7 (TRL's), beta 0.1, the sigmoid loss; the reference a frozen copy of DIR's weights, or
  DIR itself with the adapters off under `--config.lora.rank=16`.
- `grpo=DIR`: GRPO of the Llama in DIR on prompts (docs/rl.md): `hf=DIR` with
  `data.name="grpo"` (`--config.data.files=prompts.jsonl`: a `prompt` a line and the columns
  the rewards read; `--config.grpo.reward_funcs=...`), TRL's defaults (AdamW at 1e-6 decaying
  linearly, 8 completions a prompt of at most 512 tokens, the `dapo` loss, no KL), rows of
  256 prompt tokens and the completion; `--config.lora.rank=16` for adapters.
- `dpo_tiny`: `sft_tiny`'s Llama, from its own init, on the embedded pairs (a docstring chosen
  over the same words shuffled) in rows of 256; 300 steps on a 2-core CPU.
- `grpo_tiny`: `sft_tiny`'s Llama, from its own init, learning sums of two digits by GRPO
  (docs/rl.md): the embedded prompts `a+b=` (`data.grpo.embedded`), 4 completions of at most
  4 tokens a prompt, 16 a step, rewarded by `answer_match_reward` and the share of digits
  (`examples/grpo_rewards.py`); AdamW at 1e-3 (constant after 10 warmup steps), fp16-mixed
  with dynamic loss scaling (the sampler and the trainer in fp16: docs/rl.md#precision).
- `moe_tiny`: `tiny` with a mixture of experts in each layer (8 experts of 128, 2 a token,
  renormalised, Mixtral's routing; the load-balancing loss at 0.01): `--config.mesh.expert=4`
  splits the experts over 4 devices (docs/mixture-of-experts.md).
- `8b_sft`: `8b` on packed SFT rows of 8,192 tokens, for `mptrain.plan` (the attention of a
  packed row keeps to its examples).
- `8b_lora`, `8b_qlora`: `8b` with rank-16 adapters on every projection (alpha 32) over a frozen
  base, in bf16 or with its projections and token table in 8 bits (`lora.base_dtype="q8"`), on
  one 24 GB card: batch 2 of 2,048, remat `full_offloaded` (each block's input in the host's
  pinned memory). `python -m mptrain.plan --config=configs/llama3.py:8b_lora --target=rtx4090`:
  16.5 GiB (torchtune's LoRA on a 4090: 16.2 GiB, adapters and moments in bf16); `8b_qlora`:
  9.6 GiB (torchtune's QLoRA, NF4: 7.4 GiB). A LoRA fine-tune of a folder is `hf=DIR` with
  `--config.lora.rank=16` (docs/fine-tuning.md#lora).

The data of the big ones here is the embedded byte-level text (vocabulary 256 is what it
tokenizes to): they are for `mptrain.plan`, whose step is the same whatever the tokens mean.
Expected: `8b` fits 8 H100s with at most 72 GiB a device (the plan's figure); `tiny`, 800
steps: eval loss below 2.0 nats/byte, bf16-mixed within 1% of fp32 on the mean of seeds 0-4
(`scripts/precision_band.py`; one seed's pair differs by up to 3% either way, as fp32 itself does
from seed to seed).
"""

import os

from ml_collections import config_dict

from mptrain import config as config_lib
from mptrain.data import dpo, grpo, template

LLAMA3_SCALING = (8.0, 1.0, 4.0, 8192)  # factor, low_freq_factor, high_freq_factor, original
FOLDER_KINDS = ("hf", "sft", "dpo", "grpo")  # the arguments `KIND=DIR` naming a model's folder


def _llama3(c, d_model, layers, heads, kv_heads, d_ff, vocab=128_256):
    c.model.name = "llama"
    c.model.vocab_size = vocab
    c.model.d_model = d_model
    c.model.num_layers = layers
    c.model.num_heads = heads
    c.model.num_kv_heads = kv_heads
    c.model.head_dim = config_dict.placeholder(int)  # None: d_model / num_heads
    c.model.d_ff = d_ff
    c.model.max_len = 131_072
    c.model.rope_theta = 500_000.0
    c.model.rope_scaling = LLAMA3_SCALING
    c.model.norm_eps = 1e-5
    c.model.tie_embeddings = False
    c.model.attention = "auto"
    c.model.scan_layers = True
    c.model.remat = "minimal"


def _tiny(c, vocab: int, max_len: int) -> None:
    """The byte-level Llama of `tiny` and `sft_tiny`: 2 layers of width 128, scanned, remat
    `full`, batch 8, AdamW at 3e-3."""
    _llama3(c, 128, 2, 4, 2, 344, vocab=vocab)
    c.model.max_len = max_len
    c.model.rope_theta = 10_000.0
    c.model.rope_scaling = None
    c.model.remat = "full"
    c.batch_size = 8
    c.optimizer.learning_rate = 3e-3
    c.optimizer.b2 = 0.99
    c.optimizer.weight_decay = 0.01


def _fine_tune(c, folder: str) -> None:
    """The `hf=DIR` variant (module doc): DIR's model, weights and tokenizer. DIR may be a Hub
    id (`mptrain.hub`): its config.json alone is fetched here (a plan needs no more); the
    weights when the run reads `init_from`, the tokenizer's files when it builds its data."""
    from mptrain import hf, hub

    read = hf.read_config(hub.folder(folder, hub.CONFIG, "model"))  # "llama", the weights' keys
    c.model.update(read)
    c.model.attention, c.model.remat = "auto", "minimal"
    c.model.scan_layers = read.get("scan_layers", True)
    c.init_from = folder
    c.batch_size = 8
    c.data.seq_len = min(1024, c.model.max_len)
    if hub.parse(folder) or os.path.isfile(os.path.join(folder, "tokenizer.json")):
        c.data.tokenizer = folder
    c.optimizer.learning_rate = 2e-5
    c.optimizer.warmup_steps = 20
    c.optimizer.weight_decay = 0.0
    c.checkpoint_every_steps = 200
    c.eval_every_steps = 200


def _sft(c, seq_len: int, files=None, tokenizer: str = "bytes") -> None:
    """`data.name="sft"` in place of the text (`mptrain.data.sft`): packed rows of `seq_len`,
    the loss on the answers."""
    prefetch = c.data.prefetch
    c.data = config_dict.ConfigDict()
    c.data.name = "sft"
    c.data.prefetch = prefetch
    c.data.files = config_dict.placeholder(object) if files is None else files
    c.data.tokenizer = tokenizer  # "bytes", or a tokenizer.json, or a folder holding one
    c.data.chat_template = config_dict.placeholder(str)  # None: the folder's ("bytes": llama3)
    c.data.seq_len = seq_len
    c.data.eval_fraction = 0.05
    c.data.eval_files = config_dict.placeholder(object)  # None: eval_fraction of files held out
    c.data.train_on_prompt = False
    c.data.too_long = "truncate"
    c.data.packing = True
    c.data.max_segments = config_dict.placeholder(int)  # examples a row takes (None: 64)
    c.data.messages_field = "messages"  # where a line keeps its conversation
    c.data.prompt_field = "prompt"  # ... or its pair
    c.data.completion_field = "completion"
    c.data.eos_token = config_dict.placeholder(str)
    c.data.cache_dir = config_dict.placeholder(str)
    c.data.template_max_chars = template.MAX_CHARS  # what a chat template's render may make
    c.data.template_max_seconds = template.MAX_SECONDS  # ... and how long it may run


def _dpo(c, seq_len: int, tokenizer: str = "bytes") -> None:
    """`data.name="dpo"` (`mptrain.data.dpo`): preference pairs, rows of `seq_len`, the
    Trainer `mptrain.train.dpo:DPOTrainer`, TRL's beta 0.1 and sigmoid loss."""
    _sft(c, seq_len, tokenizer=tokenizer)  # the tokenizer, template and cache keys are SFT's
    for key in [k for k in c.data if k not in (*dpo.CONFIG_KEYS, "name", "prefetch")]:
        del c.data[key]
    c.data.name, c.data.chosen_field, c.data.rejected_field = "dpo", "chosen", "rejected"
    c.trainer = dpo.TRAINER


def _grpo(c, seq_len: int, tokenizer: str = "bytes") -> None:
    """`data.name="grpo"` (`mptrain.data.grpo`): prompts, rows of `seq_len` (prompt and
    completion), the Trainer `mptrain.train.grpo:GRPOTrainer`, no evaluation."""
    _sft(c, seq_len, tokenizer=tokenizer)  # the tokenizer, template and cache keys are SFT's
    for key in [k for k in c.data if k not in (*grpo.CONFIG_KEYS, "name", "prefetch")]:
        del c.data[key]
    c.data.name, c.data.eval_fraction = "grpo", 0.0
    c.trainer = grpo.TRAINER
    c.eval_every_steps = c.num_train_steps


def get_config(arg: str | None = None):
    c = config_lib.base_config()
    c.precision = "bf16-mixed"
    c.num_train_steps = 1000
    c.log_every_steps = 10
    c.eval_every_steps = 500
    c.eval_steps = 4
    c.checkpoint_every_steps = 500
    c.optimizer.name = "adamw"
    c.optimizer.learning_rate = 3e-4
    c.optimizer.warmup_steps = 100
    c.optimizer.b1 = 0.9
    c.optimizer.b2 = 0.95
    c.optimizer.eps = 1e-8
    c.optimizer.weight_decay = 0.1
    c.optimizer.grad_clip_norm = 1.0
    c.data.name = "text"
    c.data.max_bytes = config_dict.placeholder(int)
    c.data.eval_fraction = 0.01
    c.data.files = config_dict.placeholder(object)  # a glob or a list of globs; None: embedded
    c.data.tokenizer = "bytes"  # or a tokenizer.json, or a folder holding one
    c.data.eos_token = config_dict.placeholder(str)  # None: the tokenizer's end-of-text token
    c.data.cache_dir = config_dict.placeholder(str)  # None: $MPTRAIN_CACHE/tokens or ~/.cache

    if arg in ("8b", "8b_sft", "8b_lora", "8b_qlora", None):
        _llama3(c, 4096, 32, 32, 8, 14_336)
        c.batch_size = 16
        c.mesh.data, c.mesh.fsdp = 1, 8
        c.data.seq_len = 8192
        c.memory_fraction = 0.85  # of each 80 GB H100: the plan's 62.6 GiB is above JAX's 75%
        if arg == "8b_sft":
            _sft(c, 8192)
            c.model.vocab_size = 128_256  # the plan's: a real run's folder sets its own
        if arg in ("8b_lora", "8b_qlora"):  # one 24 GB card
            c.lora.rank, c.lora.alpha = 16, 32.0
            c.lora.base_dtype = "q8" if arg == "8b_qlora" else "compute"
            c.batch_size, c.data.seq_len, c.mesh.fsdp = 2, 2048, 1
            c.model.remat = "full_offloaded"
    elif arg == "70b":
        _llama3(c, 8192, 80, 64, 8, 28_672)
        c.batch_size = 64
        c.mesh.data, c.mesh.fsdp = 1, 64
        c.data.seq_len = 8192
        c.model.remat = "full"
    elif arg in ("70b_node", "70b_2nodes"):
        _llama3(c, 8192, 80, 64, 8, 28_672)
        c.data.seq_len = 8192
        c.batch_size = 2  # 16,384 tokens a step: each sequence over a context group of 4
        c.mesh.data, c.mesh.fsdp, c.mesh.context = 1, 2, 4
        c.model.remat = "full"
        # What costs quality, and what it costs (docs/optimizer-state.md, docs/precision.md):
        # bf16 params with stochastic rounding, no fp32 master, and 8-bit moments
        c.precision, c.param_rounding = "bf16-pure", "stochastic"
        c.optimizer.mu_dtype = c.optimizer.nu_dtype = "q8"
        c.memory_fraction = 0.93  # of an 80 GB H100 (73.6 GiB): the plan needs 69.5
        if arg == "70b_2nodes":  # tensor 8 on each node's NVLink, fsdp 2 over the network
            c.batch_size = 16
            c.mesh.fsdp, c.mesh.context, c.mesh.tensor = 2, 1, 8
            c.memory_fraction = None  # JAX's 75% (59.3 GiB) holds the plan's 48.0
    elif arg == "1b":
        _llama3(c, 2048, 16, 32, 8, 8192)
        c.model.rope_scaling = (32.0, 1.0, 4.0, 8192)
        c.model.tie_embeddings = True
        c.batch_size = 8
        c.data.seq_len = 8192
        c.memory_fraction = 0.92  # of one 80 GB H100: the plan's 69.5 GiB is above JAX's 75%
    elif arg in ("tiny", "moe_tiny"):
        _tiny(c, vocab=256, max_len=256)
        c.num_train_steps = 800
        c.log_every_steps = 100
        c.eval_every_steps = 400
        c.eval_steps = 30
        c.checkpoint_every_steps = 400
        c.optimizer.warmup_steps = 50
        c.data.seq_len = 256
        if arg == "moe_tiny":
            c.model.num_experts, c.model.experts_per_token, c.model.expert_d_ff = 8, 2, 128
            c.model.router_aux_loss_coef = 0.01
    elif arg == "sft_tiny":
        _tiny(c, vocab=264, max_len=512)  # the byte tokenizer's 261 tokens, rounded up
        c.num_train_steps = 400
        c.log_every_steps = 50
        c.eval_every_steps = 100
        c.eval_steps = 7  # the embedded set's 55 held-out rows (the last batch wraps round by one)
        c.checkpoint_every_steps = 200
        c.optimizer.warmup_steps = 40
        _sft(c, 512)
    elif arg == "dpo_tiny":
        _tiny(c, vocab=264, max_len=512)
        c.num_train_steps = 300
        c.log_every_steps = 25
        c.eval_every_steps = 100
        c.eval_steps = 7  # the embedded pairs' 55 held out (the last batch wraps round by one)
        c.checkpoint_every_steps = 100
        c.optimizer.learning_rate = 1e-3
        c.optimizer.warmup_steps = 30
        _dpo(c, 256)  # 95% of the pairs fit (median 102 tokens); the rest are left out:
        c.data.too_long = "drop"  # a function's signature alone can fill a row
    elif arg == "grpo_tiny":
        _tiny(c, vocab=264, max_len=64)
        c.precision = "fp16-mixed"
        c.num_train_steps = 200
        c.batch_size = 16  # completions: 4 prompts a step, 4 completions each
        c.log_every_steps = 10
        c.checkpoint_every_steps = 100
        c.optimizer.learning_rate = 1e-3
        c.optimizer.warmup_steps = 10
        c.optimizer.schedule = "constant"  # a run's steps then do not depend on its length
        _grpo(c, 16)
        c.grpo.num_generations = 4
        c.grpo.max_completion_length = 4
        here = os.path.dirname(os.path.abspath(__file__))
        digits = os.path.join(os.path.dirname(here), "examples", "grpo_rewards.py")
        c.grpo.reward_funcs = ("answer_match_reward", f"{digits}:digits_reward")
    elif arg.partition("=")[0] in FOLDER_KINDS and not arg.partition("=")[2].strip():
        raise ValueError(f"{arg!r}: name the model's folder after '=' ({arg}DIR)")
    elif arg.startswith("hf="):
        _fine_tune(c, arg[3:])
    elif arg.startswith("sft="):
        _fine_tune(c, arg[4:])
        _sft(c, c.data.seq_len, tokenizer=arg[4:])
    elif arg.startswith("dpo="):
        _fine_tune(c, arg[4:])
        c.optimizer.learning_rate, c.optimizer.warmup_steps = 5e-7, 10  # TRL's DPO defaults
        _dpo(c, c.data.seq_len, tokenizer=arg[4:])
    elif arg.startswith("grpo="):
        _fine_tune(c, arg[5:])
        c.optimizer.learning_rate, c.optimizer.warmup_steps = 1e-6, 0  # TRL's GRPO defaults
        c.optimizer.schedule = "linear"  # TRL's (transformers') default decay
        c.batch_size = 8  # completions: one prompt's num_generations (8, TRL's)
        c.log_every_steps = 10
        _grpo(c, c.data.seq_len, tokenizer=arg[5:])
        c.data.seq_len = min(c.model.max_len, 256 + c.grpo.max_completion_length)
    else:
        raise ValueError(
            f"unknown config argument {arg!r}; valid: '8b', '8b_sft', '8b_lora', '8b_qlora', "
            "'70b', '70b_node', '1b', 'tiny', 'moe_tiny', 'sft_tiny', 'dpo_tiny', 'grpo_tiny', "
            "'hf=DIR', 'sft=DIR', 'dpo=DIR', 'grpo=DIR'"
        )
    return c
