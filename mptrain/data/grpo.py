"""Prompts for RL with verifiable rewards: `data.name="grpo"`, the rows a GRPO run samples from.

`data.files` globs `.jsonl` files (a row a line) and `.json` files (a list of rows). A row has a
prompt under `data.prompt_field` ("prompt"): plain text, or a conversation (a list of
`{"role", "content"}` messages) rendered by the chat template with its generation prompt, as
TRL's `GRPOTrainer` (1.16) renders it; every other field of the row is a column the reward
functions receive (`answer=[...]`, `mptrain.data.rewards`). Plain text is tokenized with the
tokenizer's own special tokens (its BOS), a rendered conversation as it is (its template wrote
them), as TRL tokenizes both.

  * `data.files` unset: the embedded prompts (`embedded`), sums of two digits, for
    `configs/llama3.py:grpo_tiny`.
  * The tokenizer, the chat template, the end token, the cache and its folder are
    `data.sft`'s (the same keys). The eval prompts are the last `data.eval_fraction` (0 by
    default, TRL's: no eval) or those of `data.eval_files`.
  * A prompt holds at most `data.seq_len - grpo.max_completion_length` tokens, so that each
    completion fits the row; a longer one is a `ConfigError` naming its file and line.
  * Rows: int32 `[prompts, 1 + P]`, each prompt's length and then its ids, right-padded with 0
    to `P`, the longest prompt (train, then eval), built once into `data.cache_dir` (named by a
    hash of the files and every setting). The columns are read from the files at start-up
    (`PromptSource.columns`).
  * Batches: batch `i` takes prompts `i * prompts_per_step ...` of a shuffle drawn from
    `(seed, epoch)`, a pure function of `(seed, i)`, so a resumed run samples the same prompts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import types
from typing import Any

import numpy as np
from absl import logging

from mptrain import errors
from mptrain.data import codec as codec_lib
from mptrain.data import examples as sources
from mptrain.data import packing, sft, token_cache, tokenize

TRAINER = "mptrain.train.grpo:GRPOTrainer"  # the Trainer of a GRPO run
FORMAT_VERSION = 1  # bump when the rows' layout or the encoding changes
CONFIG_KEYS = {
    "files": None,
    "eval_files": None,
    "tokenizer": sft.BYTES,
    "chat_template": None,
    "seq_len": 512,
    "eval_fraction": 0.0,
    "prompt_field": "prompt",
    "eos_token": None,
    "cache_dir": None,
    "template_max_chars": sft.CONFIG_KEYS["template_max_chars"],
    "template_max_seconds": sft.CONFIG_KEYS["template_max_seconds"],
}
_SHARED = ("files", "eval_files", "tokenizer", "chat_template", "seq_len", "eval_fraction")
_SHARED += ("eos_token", "cache_dir", "template_max_chars", "template_max_seconds")


@dataclasses.dataclass(frozen=True)
class Settings:
    """`config.data` of a GRPO run, checked: `data.sft`'s settings, the prompt's field and the
    longest prompt a row takes."""

    base: sft.Settings
    field: str
    max_prompt: int

    def path(self) -> str:
        what = f"{self.base.key()}{self.field}{self.max_prompt}{FORMAT_VERSION}"
        key = hashlib.sha256(what.encode()).hexdigest()[:32]
        return os.path.join(self.base.cache_dir, f"grpo-{key}.npy")


def settings(config: Any, max_completion_length: int) -> Settings:
    """`config.data` checked (a `ValueError` naming the bad key), the tokenizer loaded; the
    longest prompt is `data.seq_len - max_completion_length` tokens."""
    keys = errors.settings(config.data, CONFIG_KEYS)
    field = keys["prompt_field"]
    if not isinstance(field, str) or not field:
        raise ValueError(f"data.prompt_field={field!r}: must be a field's name")
    base = sft.settings(types.SimpleNamespace(data={k: keys[k] for k in _SHARED}))
    if base.seq_len <= max_completion_length:
        raise ValueError(
            f"data.seq_len={base.seq_len} with grpo.max_completion_length="
            f"{max_completion_length}: a row holds the prompt and its completion; give "
            "data.seq_len more than the completion"
        )
    return Settings(base, field, base.seq_len - max_completion_length)


def codec_of(s: Settings) -> codec_lib.Codec:
    """The text of the run: its tokenizer, template and tokens (`codec.of_tokenizer`)."""
    spec = codec_lib.SFT_BYTES if s.base.tokenizer == sft.BYTES else s.base.tokenizer
    return codec_lib.of_tokenizer(spec, s.base.template, s.base.tokens)


def rows_in(s: Settings, side: str) -> list[tuple[str, Any, dict]]:
    """`(where, prompt, columns)` of every row of `data.files` (`side="train"`) or of
    `data.eval_files` ("eval"); a `ConfigError` names a row without a prompt."""
    files = s.base.eval_files if side == "eval" else s.base.files
    key = "config.data.eval_files" if side == "eval" else "config.data.files"
    if not files and side == "train":
        return embedded()
    out = []
    for where, row in sources.in_files(files, key):
        prompt = row.get(s.field) if isinstance(row, dict) else None
        plain = isinstance(prompt, str) and prompt != ""
        if not plain and not (isinstance(prompt, list) and prompt):
            found = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise errors.ConfigError(
                f"{key}: {where}: no {s.field!r} (a text, or a list of messages) among {found}"
            )
        out.append((where, prompt, {k: v for k, v in row.items() if k != s.field}))
    return out


def embedded() -> list[tuple[str, Any, dict]]:
    """The embedded prompts (`data.files` unset): the 100 sums `a+b=` of digits `a` and `b`, in
    order, each with its `answer` (`a + b` in digits), for `answer_match_reward`."""
    return [
        (f"the embedded sum {a}+{b}", f"{a}+{b}=", {"answer": str(a + b)})
        for a in range(10)
        for b in range(10)
    ]


def build(s: Settings) -> tuple[np.ndarray, dict]:
    """The rows (`[prompts, 1 + P]`: the module doc; train, then eval) and their record."""
    codec = codec_of(s)
    sides = [rows_in(s, "train")]
    if s.base.eval_files:
        sides.append(rows_in(s, "eval"))
    encoded, key = [], "config.data.files"
    for k, rows in enumerate(sides):
        key = "config.data.eval_files" if k else key
        for where, prompt, _ in rows:
            try:
                ids = codec.encode(codec.prompt(prompt), isinstance(prompt, str))
            except ValueError as e:
                raise errors.ConfigError(f"{key}: {where}: {e}") from None
            if not ids or len(ids) > s.max_prompt:
                raise errors.ConfigError(
                    f"{key}: {where}: the prompt's {len(ids)} tokens leave no room for its "
                    f"completion: a prompt holds at most data.seq_len - "
                    f"grpo.max_completion_length = {s.max_prompt} tokens"
                )
            top = max(ids)
            if top >= s.base.vocab:
                raise errors.ConfigError(f"{key}: {where}: token id {top} >= {s.base.vocab}")
            encoded.append(ids)
    held_out = sft.held_out(s.base, len(encoded), len(encoded) - len(sides[0]), "prompts")
    longest = max(len(ids) for ids in encoded)
    rows = np.zeros((len(encoded), 1 + longest), np.int32)
    for i, ids in enumerate(encoded):
        rows[i, 0], rows[i, 1 : 1 + len(ids)] = len(ids), ids
    return rows, {"prompts": len(encoded), "train": len(encoded) - held_out, "eval": held_out}


def rows_of(s: Settings) -> tuple[np.ndarray, dict]:
    """`(rows, record)`: `build`'s rows from the cache, built there first where no run has."""

    def write(path: str) -> str:
        rows, stats = build(s)
        token_cache.write_array(rows, path, {"grpo": stats})
        return f"encoded {stats['prompts']:,} prompts"

    return token_cache.load(s.path(), np.dtype(np.int32), s.base.cache_dir, write, "GRPO prompts")


class PromptSource(packing.PackedSource):
    """Batches of prompts (the module doc): `random=True` draws each epoch's order from
    `(seed, epoch)`; `random=False` takes them in order, the last batch wrapping round.
    `prompts` and `columns` are each row's prompt as the data gave it and its other fields,
    what the reward functions receive."""

    def __init__(self, rows, prompts: list, columns: list[dict], batch_size: int, seed=0, *,
                 random=True):  # fmt: skip
        super().__init__(rows, batch_size, seed, random=random)
        self.prompts, self.columns = prompts, columns

    def _real(self) -> np.ndarray:
        return np.asarray(self.rows[:, 0])  # a prompt's tokens

    def get_batch(self, index: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Batch `index`'s prompts: `prompt_ids` `[B, P]`, `prompt_lengths` `[B]` and `index`
        `[B]` (each prompt's row, for its text and columns)."""
        picked = self.indices(index)[rows]
        taken = np.asarray(self.rows[picked])
        return {"prompt_ids": taken[:, 1:], "prompt_lengths": taken[:, 0], "index": picked}

    def __repr__(self) -> str:
        return f"PromptSource(prompts={len(self.rows)}, batch_size={self.batch_size})"


def check_run(config: Any) -> dict[str, Any]:
    """`config.grpo` (`grpo_loss.settings`) and what a GRPO run needs of the rest; a
    `ValueError` names the key."""
    from mptrain import models
    from mptrain.models import grpo_loss

    g = grpo_loss.settings(config.get("grpo"), config.batch_size)
    if config.trainer != TRAINER:
        raise ValueError(
            f"trainer={config.trainer!r}: data.name='grpo' trains with config.trainer={TRAINER!r}"
        )
    for axis in ("context", "tensor"):
        if config.mesh.get(axis, 1) != 1:
            raise ValueError(
                f"mesh.{axis}={config.mesh[axis]}: a GRPO run samples and scores whole "
                f"sequences on whole layers; use mesh.{axis}=1 (data and fsdp split the batch)"
            )
    processes = (config.get("distributed") or {}).get("num_processes") or 1
    if processes > 1:
        raise ValueError(
            f"distributed.num_processes={processes}: a GRPO run samples and scores on one "
            "process yet; use one process (its devices split the batch over data and fsdp)"
        )
    if config.get("steps_per_call", 1) != 1:
        raise ValueError(
            f"steps_per_call={config.steps_per_call}: each GRPO step samples with the params "
            "the step before it made; use steps_per_call=1"
        )
    if config.data.get("eval_fraction") or config.data.get("eval_files"):
        raise ValueError(
            "data.eval_fraction / data.eval_files: a GRPO run does not evaluate on held-out "
            "prompts yet; leave them unset (TRL's default: no evaluation)"
        )
    if not getattr(models.record_of(config), "decodes", False):
        raise ValueError(
            f"model.name={config.model.name!r}: a GRPO run samples its completions with the "
            f"KV-cache decoder, which decodes {models.able('decodes')}"
        )
    if "fp8" in str(config.precision):
        raise ValueError(
            f"precision={config.precision!r}: the sampler does not decode fp8 layers yet; give "
            "bf16-mixed, fp16-mixed or fp32"
        )
    return g


def check_config(config: Any) -> dict[str, Any]:
    """What `config.validate` calls: the keys checked (`check_run` too), the tokenizer and
    template loaded; returns one completion row's abstract shapes (the prompt and its
    completion in `data.seq_len` tokens)."""
    import jax

    g = check_run(config)
    s = settings(config, g["max_completion_length"])
    tokenize.check_vocab(config, s.base.vocab, s.base.tokenizer)
    row = jax.ShapeDtypeStruct((1, s.base.seq_len), np.int32)
    return {"inputs": row, "targets": row}


def create_sources(config: Any) -> tuple[PromptSource, PromptSource | None]:
    """Host-side: `(train, eval)` `PromptSource`s (eval None where there are no eval prompts),
    `batch_size / grpo.num_generations` prompts a batch."""
    from mptrain.models import grpo_loss

    with errors.config_errors():
        g = grpo_loss.settings(config.get("grpo"), config.batch_size)
        s = settings(config, g["max_completion_length"])
        tokenize.check_vocab(config, s.base.vocab, s.base.tokenizer)
    rows, record = rows_of(s)
    st = record["grpo"]
    logging.info(
        "data: grpo: %s prompts (%s train, %s eval) of at most %d tokens",
        f"{st['prompts']:,}", f"{st['train']:,}", f"{st['eval']:,}", s.max_prompt,
    )  # fmt: skip
    read = rows_in(s, "train") + (rows_in(s, "eval") if s.base.eval_files else [])
    prompts, columns = [p for _, p, _ in read], [c for _, _, c in read]
    train, per_step = st["train"], config.batch_size // g["num_generations"]
    cut = lambda part: (rows[part], prompts[part], columns[part])
    return (
        PromptSource(*cut(slice(None, train)), per_step, config.seed),
        PromptSource(*cut(slice(train, None)), per_step, config.seed, random=False)
        if st["eval"]
        else None,
    )
