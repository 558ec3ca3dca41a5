"""Fine-tuning a HuggingFace folder of any family mptrain's decoder reads (Llama, Mistral,
Qwen2, Qwen3, Qwen3-MoE, Mixtral, ...: `mptrain.hf.families`), with the recipe of
`configs/llama3.py:hf=DIR`.

    python -m mptrain.main --config=configs/hf.py:/models/Qwen3-0.6B --workdir=runs/ft \
        --config.data.files='notes/**/*.md'
    python -m mptrain.main --config=configs/hf.py:sft=/models/Qwen3-0.6B --workdir=runs/sft \
        --config.data.files=chats.jsonl
    python -m mptrain.main --config=configs/hf.py:Qwen/Qwen3-0.6B --workdir=runs/ft \
        --config.data.files='notes/**/*.md'
    python -m mptrain.main --config=configs/hf.py:dpo=/models/Qwen3-0.6B --workdir=runs/dpo \
        --config.data.files=pairs.jsonl --config.lora.rank=16
    python -m mptrain.main --config=configs/hf.py:grpo=/models/Qwen3-0.6B --workdir=runs/rl \
        --config.data.files=prompts.jsonl --config.grpo.reward_funcs=answer_match_reward

Arguments: `DIR` (a causal LM on text: the folder's model, weights and tokenizer; or its Hub
id, `ORG/NAME[@REVISION]`, resolved through the Hub's cache: `mptrain.hub`),
`sft=DIR` (supervised fine-tuning on chats with the folder's chat template, docs/sft.md),
`dpo=DIR` (DPO on prompt/chosen/rejected pairs, docs/dpo.md), `grpo=DIR` (GRPO on prompts
and the rewards `grpo.reward_funcs` names, docs/rl.md), or `tiny` (the repository's
own test folder, `tests/hf/fixture`: a Llama of 2 layers and 300 tokens, on the embedded
text, 8 steps). The
model section is the folder's own (`mptrain.hf.read_config`: its family and that family's
switches); everything else is `configs/llama3.py`'s and may be overridden.
"""

import os
import runpy


def get_config(arg: str | None = None):
    if not arg:
        raise ValueError(
            "configs/hf.py needs a folder: --config=configs/hf.py:DIR (or sft=DIR, dpo=DIR, "
            "grpo=DIR)"
        )
    llama3 = runpy.run_path(os.path.join(os.path.dirname(__file__), "llama3.py"))
    if arg == "tiny":  # the contract's variant for tests (docs/design.md)
        folder = os.path.join(os.path.dirname(__file__), os.pardir, "tests", "hf", "fixture")
        c = llama3["get_config"](f"hf={os.path.normpath(folder)}")
        c.num_train_steps = c.checkpoint_every_steps = c.eval_every_steps = 8
        c.log_every_steps, c.eval_steps, c.optimizer.warmup_steps = 4, 2, 2
        return c
    kinds = ("sft=", "dpo=", "grpo=")
    return llama3["get_config"](arg if arg.startswith(kinds) else f"hf={arg}")
