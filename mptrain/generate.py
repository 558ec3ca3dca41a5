"""Read what a model says: `python -m mptrain.generate`, a KV-cache decoder for the zoo's Llama.

    python -m mptrain.generate --workdir=runs/sft --prompt="json.dumps(obj)" --max_new_tokens=64
    python -m mptrain.generate --hf=exports/sft-hf --chat --prompt="Capital of France?"

The model is the one training runs (`models.create`: the same modules and params, so nothing
can drift), read from a workdir (its newest complete checkpoint, read only: a live run goes
on) or a HuggingFace Llama folder (`--hf`). Prompts come from `--prompt` (repeatable) or a
`.jsonl` file (`--prompts`: a `"prompt"` field, or `"messages"` for `--chat`); `--chat`
renders each through the chat template as `data.sft` does, with the generation prompt, within
`--template_max_seconds` and `--template_max_chars` (default: the run's `data.template_max_*`,
or the bounds training has by default: `mptrain.data.template`).

How it decodes (`mptrain.models.decoder.decode`):
  * The prompts are one batch, right-padded to the longest; each row has its own positions.
    The prompt is read in one pass (prefill) whose attention is training's (cuDNN on a GPU),
    filling the cache; then one token a row a step, in a compiled `lax.while_loop` (Python is
    not in the token loop) that ends when every row has stopped or `--max_new_tokens` are out.
  * The cache (`decode.KVCache`, one a layer, the layers unrolled): keys and values `[B, kv
    heads, S, head_dim]`, grouped as trained (never repeated to the query heads), in the
    compute dtype (bf16 under bf16-mixed; `--cache_dtype` to choose), slot j holding position
    j. A step attends over the cache up to each row's position: no `[S, S]` array, no prompt
    recomputed.
  * RoPE's angles are fp32 as in training; the logits are fp32, and so is sampling: greedy
    (`--temperature=0`, the default) or temperature, top-k and top-p from `--seed` (step t
    draws from `fold_in(key(seed), t)`: the same tokens for the same seed, every time).
  * A row stops at the tokenizer's end-of-text or end-of-turn token (`stop_ids`).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from mptrain import buckets, errors, files, mirror
from mptrain.models.decoder import decode as decoding

# ---- the command ---------------------------------------------------------------------------


@dataclasses.dataclass
class Speaker:
    """A model ready to answer: the zoo Llama, its params in the compute dtypes, and its text
    (`codec.Codec`: encode, decode, the stop tokens and the chat template)."""

    model: Any
    params: Any
    codec: Any
    where: str  # what was read, for the log


def load(workdir: str | None = None, hf_folder: str | None = None, step: int | None = None,
         precision: str | None = None) -> Speaker:  # fmt: skip
    """The `Speaker` of a run's workdir (its checkpoint `step`, None: the newest complete one,
    read without the run's lock) or of a HuggingFace Llama folder; `precision` (None: the
    run's, bf16-mixed for a folder). A `WorkdirError` or `ConfigError` says what is wrong."""
    import jax
    import ml_collections

    from mptrain import config as config_lib
    from mptrain import export, hf, hub, models
    from mptrain.data import codec

    if (workdir is None) == (hf_folder is None):
        raise errors.ConfigError("give --workdir=RUN or --hf=FOLDER (one of them)")
    if workdir is not None:
        if buckets.scheme(workdir) is not None:  # s3:// or gs://: read from a local copy
            workdir = mirror.read_copy(workdir)
        config, (state, _) = export.read_run(Path(workdir), step)
        if not getattr(models.record_of(config), "decodes", False):
            raise errors.ConfigError(
                f"--workdir={workdir}: the run trains model.name={config.model.name!r}; "
                f"mptrain.generate decodes {models.able('decodes')}"
            )
        params, where = state.model_params, f"{workdir} step {int(state.step)}"
        with errors.config_errors():
            text = codec.of_run(config)
    else:
        folder = Path(hub.folder(hf_folder, hub.EVERYTHING, "--hf"))
        if not hf.is_hf_folder(folder):
            raise errors.ConfigError(
                f"--hf={hf_folder}: not a HuggingFace folder (config.json and *.safetensors)"
            )
        model_config, params = hf.load(folder)
        config = config_lib.base_config()
        config.model = ml_collections.ConfigDict(model_config)
        config.precision = "bf16-mixed"
        tokenizer = folder / "tokenizer.json"
        if not tokenizer.is_file():
            raise errors.ConfigError(f"--hf={hf_folder}: has no tokenizer.json to read text with")
        with errors.config_errors():
            text, where = codec.of_tokenizer(str(tokenizer)), str(folder)
    if precision is not None:
        config.precision = precision
    with errors.config_errors():
        policy = config_lib.policy_of(config)
        model = models.create(config.model, policy, lora=config.get("lora"))
    if policy.fp8:  # its dense layers read their fp8 scales from state the decoder lacks
        raise errors.ConfigError(
            f"precision={config.precision!r}: mptrain.generate does not decode fp8 layers yet; "
            "give --precision=bf16-mixed"
        )
    params = jax.device_put(policy.cast_params(params))
    return Speaker(model, params, text, where)


def answer(speaker: Speaker, prompts: list, max_new_tokens: int, sampling: decoding.Sampling,
           seed: int = 0, cache_dtype: Any = None) -> list[dict]:  # fmt: skip
    """Each prompt's completion (`codec.complete`), all in one batch; a `ConfigError` names a
    prompt that cannot be read or is too long."""
    from mptrain.data import codec

    try:
        return codec.complete(
            speaker.codec, speaker.model, speaker.params, prompts, max_new_tokens, sampling,
            seed, cache_dtype,
        )  # fmt: skip
    except ValueError as e:
        raise errors.ConfigError(str(e)) from None


def read_prompts(path: str, chat: bool) -> list:
    """The prompts of a `.jsonl` file (`examples.read_examples`): each line's `"prompt"` (a
    string), or with `chat` its `"messages"` (or a `"prompt"`, as one user turn). A
    `ConfigError` names the line."""
    from mptrain.data import examples

    prompts = []
    for where, item in examples.read_examples(path, "--prompts"):
        item = item if isinstance(item, dict) else {}
        if chat and isinstance(item.get("messages"), list):
            prompts.append(item["messages"])
        elif isinstance(item.get("prompt"), str):
            prompt = item["prompt"]
            prompts.append([{"role": "user", "content": prompt}] if chat else prompt)
        else:
            want = "'messages' or a string 'prompt'" if chat else "a string 'prompt'"
            raise errors.ConfigError(f"--prompts: {where}: no {want}")
    return prompts


def template_bounds(seconds: float | None, chars: int | None) -> dict:
    """`Template` fields of the flags given (a `ConfigError` names a bad one)."""
    from mptrain.data import template

    bounds = {}
    try:
        if seconds is not None:
            most = template.MAX_SECONDS_AT_MOST
            check = errors.check_number("--template_max_seconds", seconds, 0, most, open_low=True)
            bounds["max_seconds"] = check
        if chars is not None:
            bounds["max_chars"] = errors.check_integer("--template_max_chars", chars, 1)
    except ValueError as e:
        raise errors.ConfigError(str(e)) from None
    return bounds


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import sys

    from absl import logging

    class OneLine(argparse.ArgumentParser):
        def error(self, message: str):  # one line, as mptrain's other commands
            sys.stderr.write(f"mptrain.generate: error: {message} (--help lists the flags)\n")
            sys.exit(errors.EXIT_USAGE)

    parser = OneLine(prog="python -m mptrain.generate", description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", help="a run's workdir: its newest complete checkpoint")
    parser.add_argument("--hf", help="a HuggingFace Llama folder instead")
    parser.add_argument("--step", type=int, default=None, help="the workdir's checkpoint")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts", help="a .jsonl file of prompts ('prompt' or 'messages')")
    parser.add_argument("--chat", action="store_true", help="through the chat template")
    parser.add_argument("--template_max_seconds", type=float, help="a render's time at most")
    parser.add_argument("--template_max_chars", type=int, help="what a render makes at most")
    parser.add_argument("--max_new_tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top_k", type=int, default=0, help="0: every token")
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--precision", default=None, help="default: the run's (bf16-mixed)")
    parser.add_argument("--cache_dtype", default=None, help="default: the compute dtype")
    parser.add_argument("--out", help="also write the answers as .jsonl here")
    args = parser.parse_args(argv)
    logging.set_verbosity(logging.WARNING)
    try:
        if not 0 <= args.seed < 2**31:
            raise errors.ConfigError(f"--seed={args.seed}: from 0 to 2**31 - 1")
        if args.max_new_tokens < 1:
            raise errors.ConfigError(f"--max_new_tokens={args.max_new_tokens}: must be 1 or more")
        try:
            sampling = decoding.Sampling(args.temperature, args.top_k, args.top_p)
        except ValueError as e:
            raise errors.ConfigError(str(e)) from None
        prompts = list(args.prompt)
        if args.chat:
            prompts = [[{"role": "user", "content": p}] for p in prompts]
        if args.prompts:
            prompts += read_prompts(args.prompts, args.chat)
        if not prompts:
            raise errors.ConfigError("no prompt: give --prompt=TEXT or --prompts=FILE.jsonl")
        cache_dtype = None
        if args.cache_dtype is not None:
            if args.cache_dtype not in ("bfloat16", "float16", "float32"):
                raise errors.ConfigError(
                    f"--cache_dtype={args.cache_dtype!r}: bfloat16, float16 or float32"
                )
            cache_dtype = args.cache_dtype
        if args.out:
            files.check_output("--out", args.out)
        bounds = template_bounds(args.template_max_seconds, args.template_max_chars)
        speaker = load(args.workdir, args.hf, args.step, args.precision)
        if speaker.codec.template is not None:  # its errors name these flags (X11c)
            chat = dataclasses.replace(speaker.codec.template, bounds="--template_max_", **bounds)
            speaker.codec = dataclasses.replace(speaker.codec, template=chat)
        answers = answer(speaker, prompts, args.max_new_tokens, sampling, args.seed, cache_dtype)
    except (errors.ConfigError, errors.WorkdirError, errors.StorageError) as e:
        sys.stderr.write(f"mptrain.generate: error: {e}\n")
        return e.exit_code
    for i, row in enumerate(answers):
        print(f"[{i}] {row['prompt']}\n{row['completion']}\n")
    if args.out:
        try:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in answers))
        except OSError as e:
            sys.stderr.write(f"mptrain.generate: error: --out={args.out}: {e.strerror or e}\n")
            return errors.StorageError.exit_code
    sys.stderr.write(f"mptrain.generate: {len(answers)} answers from {speaker.where}\n")
    return errors.EXIT_OK


if __name__ == "__main__":
    import sys

    sys.exit(main())
