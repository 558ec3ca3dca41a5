"""Supervised fine-tuning data: `data.name="sft"`, examples packed into rows, loss on the answers.

`data.files` globs `.jsonl` files (an example a line) and `.json` files (a list of examples);
None is the embedded set (`examples.embedded`). An example is a conversation
(`{"messages": [{"role", "content"}, ...]}`) or a pair (`{"prompt", "completion"}`), under the
field names `data.messages_field`, `data.prompt_field` and `data.completion_field`. Each is
encoded by `chat.encode`: the conversation rendered by its chat template, the loss on the
assistant's turns (and a pair's completion) unless `data.train_on_prompt`.

  * Tokenizer: `data.tokenizer` is a HuggingFace `tokenizer.json` (or the folder holding it:
    its `tokenizer_config.json` gives the `chat_template`, `bos_token` and `eos_token`), or
    `"bytes"`: a byte-level tokenizer with Llama 3's five markers as tokens 256-260
    (`BYTE_SPECIALS`), so the built-in `"llama3"` template works on it.
  * Template: `data.chat_template` None takes the folder's (the built-in `"llama3"` under
    `"bytes"`); or a name of `chat.BUILTIN`, `"folder"`, or a template's own Jinja2 text.
    Each render is bounded (`mptrain.data.template`): `data.template_max_seconds` and
    `data.template_max_chars` (the text and every value the template makes).
  * Rows: the last `data.eval_fraction` of the examples are held out (0: none, and the run
    does not evaluate), or the eval examples are those of `data.eval_files` (globbed as
    `data.files`, none of them among its files; `data.eval_fraction` is then not read); each
    side is packed into rows of `data.seq_len` (`packing.pack`: first-fit decreasing,
    `data.packing=False` for one example a row); an example longer than a row is cut to it or
    left out (`data.too_long`), and a warning counts them.
  * Cache: the rows are built once into `data.cache_dir` (`token_cache.load`: a lock, a
    staged file renamed into place, a CRC-32 record checked before each read), named by a
    hash of the files, the tokenizer, the template and every setting here.
  * Batches: training batch `i` takes rows `i * batch_size ...` of a shuffle of the rows drawn
    from `(seed, epoch)`, a fresh one each epoch: a pure function of `(seed, i)`, so a resumed
    run continues the data exactly. Eval batches take the held-out rows in order.
  * Each batch is `{"inputs", "targets", "segment_ids", "positions"}`, int32 `[batch,
    seq_len]`: targets -1 where no loss falls, segment ids 0 in padding and 1, 2, ... for a
    row's examples, positions from 0 in each example; and `"segment_lengths"`, int32 `[batch,
    data.max_segments]`: each example's tokens, which cuDNN's packed layout reads on a GPU (a
    row takes at most `data.max_segments` examples: None is 64, or `data.seq_len` where that
    is less). The models attend within a segment.

A bad example is a `ConfigError` naming the file, the line and what is wrong; nothing is
written until every example has encoded.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from typing import Any

import numpy as np
from absl import logging

from mptrain import errors
from mptrain.data import chat, packing, template, text, token_cache, tokenize
from mptrain.data import examples as sources

FORMAT_VERSION = 2  # bump when the rows' layout, the encoding or the embedded set's rule changes
SUFFIXES = sources.SUFFIXES  # jsonl, json and the tables (`examples.TABLES`)
BYTES = tokenize.BYTES
# The markers Llama 3's template writes, as tokens of the byte tokenizer (ids 256 on).
BYTE_SPECIALS = (
    "<|end_of_text|>",
    "<|begin_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
)
BYTE_VOCAB = 256 + len(BYTE_SPECIALS)
MAX_SEGMENTS = 64  # examples a row takes at most by default
CONFIG_FILE = "tokenizer_config.json"  # beside a tokenizer.json: its template and tokens
# The keys this source reads under `config.data`, with their defaults (the module doc).
CONFIG_KEYS = {
    "files": None,
    "eval_files": None,  # None: the eval examples are the last data.eval_fraction of files
    "tokenizer": BYTES,
    "chat_template": None,
    "seq_len": 512,
    "eval_fraction": 0.05,
    "train_on_prompt": False,
    "too_long": "truncate",
    "packing": True,
    "max_segments": None,  # None: MAX_SEGMENTS, or seq_len where a row is shorter
    "messages_field": "messages",
    "prompt_field": "prompt",
    "completion_field": "completion",
    "eos_token": None,
    "cache_dir": None,
    "template_max_chars": template.MAX_CHARS,
    "template_max_seconds": template.MAX_SECONDS,
}


# ---- settings ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Settings:
    """`config.data` of an SFT run, checked; what the rows depend on."""

    files: tuple[str, ...]  # empty: the embedded set
    eval_files: tuple[str, ...]  # empty: the last eval_fraction of files is the eval side
    tokenizer: str  # "bytes" or a tokenizer.json's path
    template: template.Template | None  # the chat template, its source and its bounds
    tokens: dict  # bos_token / eos_token for the template
    eos_id: int  # what ends a pair
    seq_len: int
    eval_fraction: float
    train_on_prompt: bool
    too_long: str
    packing: bool
    max_segments: int  # examples a row holds at most (cuDNN's packed layout is built for it)
    fields: tuple[str, str, str]  # messages, prompt, completion
    cache_dir: str
    vocab: int
    digest: str  # of the tokenizer file ("bytes" for the byte tokenizer)

    def key(self) -> str:
        """The cache file's name: a hash of everything the rows depend on."""
        stat = lambda files: [(p, s.st_size, s.st_mtime_ns) for p in files for s in [os.stat(p)]]
        stats = stat(self.files)
        if not self.files:  # the embedded set: this Python's standard library
            stats = [sys.version, text.stdlib_root()]
        what = dataclasses.asdict(self) | {"files": stats, "cache_dir": None}
        what["eval_files"] = stat(self.eval_files) if self.eval_files else None
        what["template"] = self.template and self.template.text  # not its bounds or its name
        what["version"] = FORMAT_VERSION
        return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:32]

    def path(self) -> str:
        return os.path.join(self.cache_dir, f"sft-{self.key()}.npy")


def token_text(value: Any) -> str | None:
    """A `tokenizer_config.json`'s token: a string, or `{"content": ...}`."""
    return value.get("content") if isinstance(value, dict) else value


def folder_config(path: str) -> dict:
    """The `tokenizer_config.json` beside the tokenizer.json `path` ({} where none)."""
    config = os.path.join(os.path.dirname(path), CONFIG_FILE)
    if not os.path.isfile(config):
        return {}
    try:
        with open(config, encoding="utf-8") as f:
            found = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(
            f"data.tokenizer: {config} does not read ({errors.first_line(e)})"
        ) from None
    return found if isinstance(found, dict) else {}


def folder_template(folder: dict, tokenizer: str, **bounds) -> template.Template | None:
    """The chat template in `folder` (the content of the `tokenizer_config.json` beside the
    tokenizer.json `tokenizer`), named by its file; None where it has none."""
    found = folder.get("chat_template")
    if not found:
        return None
    where = f"the chat_template of {os.path.join(os.path.dirname(tokenizer), CONFIG_FILE)}"
    if not isinstance(found, str | list):  # a template's text, or named templates
        raise ValueError(
            f"{where} is {found!r}, a {type(found).__name__}: not a template's text (a string, "
            'or a list of {"name", "template"})'
        )
    return template.Template(chat.template_of("folder", folder), where, **bounds)


def _template(spec: Any, folder: dict, tokenizer: str, bounds: dict) -> template.Template | None:
    """The chat template `data.chat_template=spec` names (the module doc), named as its errors
    name it, under the bounds `data.template_max_*`."""
    if spec is None:
        if tokenizer != BYTES:
            return folder_template(folder, tokenizer, **bounds)
        spec = "llama3"
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"data.chat_template={spec!r}: a template's name or its text, or None")
    if "{{" in spec or "{%" in spec:
        return template.Template(spec, "the text of data.chat_template", **bounds)
    if spec == "folder":
        return folder_template(folder, tokenizer, **bounds) or template.Template(
            chat.template_of(spec, folder)  # raises: the folder has none
        )
    return template.Template(chat.template_of(spec, folder), f"the built-in {spec!r}", **bounds)


def settings(config: Any) -> Settings:
    """`config.data` checked (a `ValueError` naming the bad key), the tokenizer loaded."""
    keys = errors.settings(config.data, CONFIG_KEYS)
    seq_len = errors.check_integer("data.seq_len", keys["seq_len"], 1, errors.INT32_MAX)
    fraction = errors.check_number("data.eval_fraction", keys["eval_fraction"], 0.0, 1.0)
    too_long = errors.check_choice("data.too_long", keys["too_long"], ("truncate", "drop"))
    most = keys["max_segments"]
    most = min(MAX_SEGMENTS, seq_len) if most is None else most
    most = errors.check_integer("data.max_segments", most, 1)
    if most > seq_len:
        raise ValueError(
            f"data.seq_len={seq_len} with data.max_segments={most}: a row of {seq_len} tokens "
            f"holds at most {seq_len} examples; set data.max_segments={seq_len} or less, or a "
            "longer data.seq_len"
        )
    bounds = {
        "max_chars": errors.check_integer(
            "data.template_max_chars", keys["template_max_chars"], 1, errors.INT32_MAX
        ),
        "max_seconds": errors.check_number(
            "data.template_max_seconds",
            keys["template_max_seconds"],
            0.0,
            template.MAX_SECONDS_AT_MOST,
            open_low=True,
        ),
    }
    for key in ("train_on_prompt", "packing"):
        if not isinstance(keys[key], bool):
            raise ValueError(f"data.{key}={keys[key]!r}: must be True or False")
    fields = tuple(keys[f"{k}_field"] for k in ("messages", "prompt", "completion"))
    for name, value in zip(("messages", "prompt", "completion"), fields, strict=True):
        if not isinstance(value, str) or not value:
            raise ValueError(f"data.{name}_field={value!r}: must be a field's name")
    files = eval_files = ()
    if keys["files"] is not None:
        files = tokenize.find_files("data.files", keys["files"], SUFFIXES)
    if keys["eval_files"] is not None:
        eval_files = tokenize.find_files("data.eval_files", keys["eval_files"], SUFFIXES)
        if both := sorted(set(files) & set(eval_files)):
            raise ValueError(
                f"data.eval_files={keys['eval_files']!r}: {both[0]} is one of data.files too: "
                "the run would evaluate on examples it trains on"
            )
        fraction = 0.0  # the eval side is the files', not a fraction of data.files
    cache_dir = keys["cache_dir"]
    if cache_dir is not None and (not isinstance(cache_dir, str) or not cache_dir.strip()):
        raise ValueError(f"data.cache_dir={cache_dir!r}: must be a folder's path or None")
    cache_dir = os.path.abspath(os.path.expanduser(cache_dir or tokenize.default_cache_dir()))
    spec, eos_token = keys["tokenizer"], keys["eos_token"]
    if spec == BYTES:
        folder, path, digest = {}, BYTES, BYTES
        tokens = {"bos_token": BYTE_SPECIALS[1], "eos_token": BYTE_SPECIALS[0]}
        loaded = tokenizer_of(BYTES)
    else:
        path = tokenize.tokenizer_file(spec)
        folder, loaded = folder_config(path), tokenizer_of(path)
        with open(path, "rb") as f:
            digest = hashlib.sha256(f.read()).hexdigest()
        tokens = {k: token_text(folder.get(k)) or "" for k in ("bos_token", "eos_token")}
    chat_template = _template(keys["chat_template"], folder, path, bounds)
    if eos_token is None and tokens["eos_token"]:  # the folder's, as its chat model ends
        eos_token = tokens["eos_token"]
    eos = tokenize.eos_id(loaded, path, eos_token)
    vocab = loaded.get_vocab_size(with_added_tokens=True)
    return Settings(
        files, eval_files, path, chat_template, tokens, eos, seq_len, fraction,
        keys["train_on_prompt"], too_long, keys["packing"], most, fields, cache_dir, vocab,
        digest,
    )  # fmt: skip


def tokenizer_of(path: str):
    """The tokenizer that `Settings.tokenizer` names, its markers read as tokens."""
    if path == BYTES:
        return tokenize.byte_level(BYTE_SPECIALS)
    return tokenize.load_tokenizer(path, specials_in_text=True)


# ---- reading and encoding ------------------------------------------------------------------


def _standard(example: Any, fields: tuple[str, str, str]) -> Any:
    """The example under `chat.encode`'s field names (a line's `tools` as they are)."""
    messages, prompt, completion = fields
    if not isinstance(example, dict):
        return example
    tools = {"tools": example["tools"]} if "tools" in example else {}
    pair = prompt in example or completion in example
    if messages in example and pair:
        raise ValueError(
            f"both {messages!r} and {prompt!r}/{completion!r}: a line is a conversation or a "
            "pair, not both"
        )
    if messages in example:
        return {"messages": example[messages], **tools}
    if pair:
        return {"prompt": example.get(prompt), "completion": example.get(completion), **tools}
    raise ValueError(f"neither {messages!r} nor {prompt!r} and {completion!r}")


def encoded(s: Settings, side: str = "train") -> list[tuple[np.ndarray, np.ndarray]]:
    """Every example's `(ids, loss)`, in the files' order: `data.files`' (`side="train"`) or
    `data.eval_files'` ("eval"); a `ConfigError` names the first bad one (its file, line and
    what is wrong)."""
    tokenizer = tokenizer_of(s.tokenizer)
    files = s.eval_files if side == "eval" else s.files
    key = "config.data.eval_files" if side == "eval" else sources.key(files)
    examples = sources.embedded() if not files else sources.in_files(files, key)
    out = []
    for where, example in examples:
        try:
            ids, loss = chat.encode(
                _standard(example, s.fields), tokenizer, s.template, s.eos_id,
                s.train_on_prompt, **s.tokens,
            )  # fmt: skip
        except ValueError as e:
            raise errors.ConfigError(f"{key}: {where}: {e}") from None
        top = int(ids.max(initial=0))
        if top >= s.vocab:  # a template's marker that is no token of this tokenizer's, say
            raise errors.ConfigError(f"{key}: {where}: token id {top} >= {s.vocab}")
        out.append((ids, loss))
    return out


# ---- the rows --------------------------------------------------------------------------------


def _stats(packed: packing.Packed) -> dict:
    return {
        "rows": len(packed.inputs),
        "examples": packed.examples,
        "truncated": packed.truncated,
        "dropped": packed.dropped,
        "real_tokens": packed.real_tokens,
        "loss_tokens": int((packed.targets >= 0).sum()),
    }


def held_out(s: Settings, total: int, evals: int, unit: str) -> int:
    """How many of the last of `total` items (`unit`: examples, pairs, prompts) the eval side
    holds: the `evals` of `data.eval_files` where it is set, else the last `data.eval_fraction`;
    a `ConfigError` where a fraction leaves a side empty."""
    count = evals if s.eval_files else round(total * s.eval_fraction)
    if s.eval_fraction and not 1 <= count < total:
        raise errors.ConfigError(
            f"config.data.eval_fraction={s.eval_fraction:g}: of {total} {unit} it holds out "
            f"{count}; each side needs at least one (0: no eval, all train; or "
            f"data.eval_files: the eval {unit}' own files)"
        )
    return count


def build(s: Settings) -> tuple[np.ndarray, dict]:
    """The rows (int32 `[rows, 4, seq_len]`: `packing.PLANES`; the train rows, then the eval
    rows) and their record's `{"train": stats, "eval": stats}`."""
    examples = encoded(s)
    evals = encoded(s, "eval") if s.eval_files else []  # the eval side is theirs, whole
    examples += evals
    held = held_out(s, len(examples), len(evals), "examples")
    sides = examples[: len(examples) - held], examples[len(examples) - held :]
    packed = [
        packing.pack(side, s.seq_len, s.too_long, s.packing, s.max_segments)
        for side in sides[: 2 if held else 1]
    ]
    for name, side in zip(("train", "eval"), packed, strict=False):
        if not len(side.inputs):
            raise errors.ConfigError(
                f"config.data.too_long='drop': every {name} example is longer than "
                f"data.seq_len={s.seq_len}"
            )
        if not (side.targets >= 0).any():  # each cut to its prompt: nothing to learn from
            raise errors.ConfigError(
                f"config.data.seq_len={s.seq_len}: no {name} token carries the loss"
                + (
                    f"; every {name} example was cut to data.seq_len before its answer began. "
                    "Use a longer data.seq_len, or data.too_long='drop' to leave such examples out"
                    if side.truncated
                    else f" (the chat template renders no {name} answer)"
                )
            )
    rows = np.concatenate(
        [np.stack([getattr(p, plane) for plane in packing.PLANES], axis=1) for p in packed]
    )
    return rows, {"train": _stats(packed[0]), "eval": _stats(packed[1]) if held else None}


def rows_of(s: Settings) -> tuple[np.ndarray, dict]:
    """`(rows, record)`: `build`'s rows from the cache, built there first where no run has."""

    def write(path: str) -> str:
        rows, stats = build(s)
        token_cache.write_array(rows, path, {"sft": stats})
        where = f"{len(s.files)} files" if s.files else "the embedded set"
        where += f" and {len(s.eval_files)} eval files" if s.eval_files else ""
        count = sum(side["examples"] for side in stats.values() if side)
        return f"packed {count:,} examples of {where}"

    return token_cache.load(s.path(), np.dtype(np.int32), s.cache_dir, write, "packed SFT rows")


def check_config(config: Any) -> dict[str, Any]:
    """What `config.validate` calls: the keys checked, the files found, the tokenizer and the
    template loaded (the vocabulary must fit `model.vocab_size`); no example is read. Returns
    one example's abstract shapes (the four planes)."""
    import jax

    s = settings(config)
    tokenize.check_vocab(config, s.vocab, s.tokenizer)
    example = jax.ShapeDtypeStruct((1, s.seq_len), np.int32)
    lengths = jax.ShapeDtypeStruct((1, s.max_segments), np.int32)
    return dict.fromkeys(packing.PLANES, example) | {"segment_lengths": lengths}


def report(s: Settings, record: dict) -> None:
    """Start-up's lines: the rows, the real-token rate, what was cut or left out."""
    for name in ("train", "eval"):
        st = record["sft"][name]
        if st is None:
            logging.info("data: sft eval: none (data.eval_fraction=0): no evaluation")
            continue
        rate = st["real_tokens"] / max(1, st["rows"] * s.seq_len)
        logging.info(
            "data: sft %s: %s examples in %s rows of %d tokens (%s), real-token rate %.1f%%, "
            "%s tokens carry the loss",
            f"{name} (data.eval_files)" if name == "eval" and s.eval_files else name,
            f"{st['examples']:,}", f"{st['rows']:,}", s.seq_len,
            "packed" if s.packing else "one a row", 100 * rate, f"{st['loss_tokens']:,}",
        )  # fmt: skip
        if st["truncated"] or st["dropped"]:
            logging.warning(
                "data: sft %s: %d examples longer than data.seq_len=%d were %s",
                name, st["truncated"] or st["dropped"], s.seq_len,
                "cut to it (data.too_long='truncate')" if st["truncated"]
                else "left out (data.too_long='drop')",
            )  # fmt: skip


def create_sources(config: Any) -> tuple[packing.PackedSource, packing.PackedSource | None]:
    """Host-side: `(train, eval)` sources of packed rows (the module doc); eval None where
    `data.eval_fraction` is 0."""
    with errors.config_errors():
        s = settings(config)
        tokenize.check_vocab(config, s.vocab, s.tokenizer)
    rows, record = rows_of(s)
    report(s, record)
    train = record["sft"]["train"]["rows"]
    most = s.max_segments
    return (
        packing.PackedSource(rows[:train], config.batch_size, config.seed, max_segments=most),
        packing.PackedSource(
            rows[train:], config.batch_size, config.seed, random=False, max_segments=most
        )
        if record["sft"]["eval"]
        else None,
    )
