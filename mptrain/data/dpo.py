"""Preference pairs for DPO: `data.name="dpo"`, a prompt with a chosen and a rejected completion.

`data.files` globs `.jsonl` files (a pair a line) and `.json` files (a list of pairs); None is
the embedded set (`embedded`: a docstring chosen over its words shuffled). A pair has
`prompt`, `chosen` and `rejected` (the field names `data.prompt_field`, `data.chosen_field`,
`data.rejected_field`), each plain text, or each a
conversation: `prompt` a list of messages and `chosen`/`rejected` the assistant's reply as a
list of messages (a pair without `prompt` whose two conversations share their first turns takes
those as its prompt). The tokens are TRL's (`DPOTrainer`, 1.16): plain text is tokenized as
`prompt + chosen` (the tokenizer's own special tokens added, the end-of-text token's text
appended to a completion that does not end with it), a conversation rendered by the chat
template (the prompt alone with the generation prompt); the completion starts where the
tokens of the prompt alone and of prompt + chosen (and + rejected) first differ. Only the
completion's tokens carry the loss; chosen and rejected share the prompt's.

  * Rows: each sequence of `n` tokens is a row of `n - 1` inputs and their next tokens, right
    padded to `data.seq_len` (targets -1 on the prompt and the padding). A sequence longer than
    a row is cut to it (`data.too_long="truncate"`, TRL's `keep_start`) or the pair left out
    (`"drop"`); a warning counts them. A pair whose prompt alone fills the row is an error
    under "truncate" (it would keep no completion token) and left out, counted, under "drop".
  * The tokenizer, the chat template, the eval side (the last `data.eval_fraction` of the
    pairs, or those of `data.eval_files`) and the cache are `data.sft`'s (the same keys); the
    pairs are built once into `data.cache_dir`, named by a hash of the files and every setting.
  * Batches: batch `i` takes pairs `i * batch_size ...` of a shuffle drawn from
    `(seed, epoch)`: a pure function of `(seed, i)`. `batch_size` counts pairs. Each batch is
    `{"inputs", "targets"}`, int32 `[batch, 2, seq_len]` (chosen, then rejected), and
    `"reference_logps"`, float32 `[batch, 2]`, where the reference's log-probabilities were
    computed ahead (`dpo.reference="precomputed"`, `mptrain.train.dpo`).

A bad pair (a field missing, chosen equal to rejected, an empty completion, a prompt that fills
the row, a token the model's vocabulary lacks) is a `ConfigError` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import types
from typing import Any

import numpy as np
from absl import logging

from mptrain import errors
from mptrain.data import chat, packing, sft, token_cache, tokenize
from mptrain.data import examples as sources
from mptrain.models import dpo_loss
from mptrain.models import lora as lora_lib

TRAINER = "mptrain.train.dpo:DPOTrainer"  # the Trainer of a DPO run
FORMAT_VERSION = 1  # bump when the rows' layout or the encoding changes
PLANES = ("inputs", "targets")
REFERENCE = "reference_logps"  # the batch key of precomputed reference log-probabilities
# The keys this source reads under `config.data`, with their defaults (the module doc).
CONFIG_KEYS = {
    "files": None,
    "eval_files": None,
    "tokenizer": sft.BYTES,
    "chat_template": None,
    "seq_len": 512,
    "eval_fraction": 0.05,
    "too_long": "truncate",
    "prompt_field": "prompt",
    "chosen_field": "chosen",
    "rejected_field": "rejected",
    "eos_token": None,
    "cache_dir": None,
    "template_max_chars": sft.CONFIG_KEYS["template_max_chars"],
    "template_max_seconds": sft.CONFIG_KEYS["template_max_seconds"],
}
_SHARED = (
    "files",
    "eval_files",
    "tokenizer",
    "chat_template",
    "seq_len",
    "eval_fraction",
    "too_long",
)
_SHARED += ("eos_token", "cache_dir", "template_max_chars", "template_max_seconds")


@dataclasses.dataclass(frozen=True)
class Settings:
    """`config.data` of a DPO run, checked: `data.sft`'s settings and the three fields."""

    base: sft.Settings
    fields: tuple[str, str, str]  # prompt, chosen, rejected

    def path(self) -> str:
        key = hashlib.sha256(f"{self.base.key()}{self.fields}{FORMAT_VERSION}".encode())
        return os.path.join(self.base.cache_dir, f"dpo-{key.hexdigest()[:32]}.npy")


def settings(config: Any) -> Settings:
    """`config.data` checked (a `ValueError` naming the bad key), the tokenizer loaded."""
    keys = errors.settings(config.data, CONFIG_KEYS)
    fields = tuple(keys[f"{k}_field"] for k in ("prompt", "chosen", "rejected"))
    for name, value in zip(("prompt", "chosen", "rejected"), fields, strict=True):
        if not isinstance(value, str) or not value:
            raise ValueError(f"data.{name}_field={value!r}: must be a field's name")
    shared = types.SimpleNamespace(data={k: keys[k] for k in _SHARED})
    return Settings(sft.settings(shared), fields)


# ---- the embedded set ------------------------------------------------------------------------


def embedded(count: int = 1200) -> list[tuple[str, dict]]:
    """The first `count` pairs of the SFT set (`examples.embedded`: a standard-library
    function's name and signature; its docstring's first paragraph): chosen is the docstring,
    rejected its words in an order drawn from the pair's index (fluent text over the same
    words shuffled, which a model can learn to prefer on pairs it has not seen). The same on
    every machine with the same Python build."""
    out = []
    for k, (where, pair) in enumerate(sources.embedded()):
        if len(out) == count:
            break
        words = pair["completion"].split()
        shuffled = random.Random(k).sample(words, len(words))
        if shuffled == words:  # one word, or the draw kept the order
            shuffled = words[1:] + words[:1] if len(words) > 1 else [words[0][::-1]]
        if " ".join(shuffled) != pair["completion"]:
            out.append((where, {"prompt": pair["prompt"], "chosen": pair["completion"],
                                "rejected": " ".join(shuffled)}))  # fmt: skip
    return out


# ---- encoding ------------------------------------------------------------------------------


def _conversation(value: Any, name: str) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{name!r} must be a string or a non-empty list of messages")
    return chat.check_messages(value, need_assistant=False)


def _prefix_length(a: list, b: list) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _texts(pair: Any, fields: tuple[str, str, str]) -> tuple[Any, Any, Any]:
    """`(prompt, chosen, rejected)` of a line, checked: three strings or three conversations."""
    if not isinstance(pair, dict):
        raise ValueError("not a JSON object")
    prompt, chosen, rejected = fields
    for field in (chosen, rejected):
        if field not in pair:
            raise ValueError(f"no {field!r}: a pair needs {prompt!r}, {chosen!r} and {rejected!r}")
    p, c, r = pair.get(prompt), pair[chosen], pair[rejected]
    if isinstance(c, str) and isinstance(r, str):
        if not isinstance(p, str):
            raise ValueError(f"{prompt!r} must be a string beside completions that are strings")
    elif isinstance(c, list) and isinstance(r, list):
        c, r = _conversation(c, chosen), _conversation(r, rejected)
        if p is None:  # an implicit prompt: the turns both conversations begin with
            n = _prefix_length(c, r)
            if not n:
                raise ValueError(
                    f"no {prompt!r}, and {chosen!r} and {rejected!r} differ from their first "
                    "turn: the prompt is the turns both begin with, and they share none; give "
                    f"a {prompt!r} list of messages or conversations that begin alike"
                )
            p, c, r = c[:n], c[n:], r[n:]
        if p == [] or not isinstance(p, list):
            raise ValueError(f"{prompt!r} must be a non-empty list of messages")
        p = _conversation(p, prompt)
    else:
        raise ValueError(f"{chosen!r} and {rejected!r} must both be strings or both conversations")
    for field, value in ((chosen, c), (rejected, r)):
        empty = not value.strip() if isinstance(value, str) else not any(
            str(m.get("content") or "").strip() for m in value
        )  # fmt: skip
        if empty:
            raise ValueError(f"an empty completion: {field!r} has no text")
    if c == r:
        raise ValueError(f"{chosen!r} equals {rejected!r}: the pair prefers nothing")
    return p, c, r


def encode(pair: Any, s: Settings, tokenizer: Any) -> tuple[np.ndarray, np.ndarray, int]:
    """`(chosen_ids, rejected_ids, completion_start)` of a pair (the module doc), as TRL
    tokenizes it; a `ValueError` says what is wrong."""
    p, c, r = _texts(pair, s.fields)
    tokens = s.base.tokens
    if isinstance(c, str):
        eos = tokens["eos_token"] or tokenizer.id_to_token(s.base.eos_id)
        c, r = (x if x.endswith(eos) else x + eos for x in (c, r))
        ids = lambda text: tokenizer.encode(text, add_special_tokens=True).ids
        prompt, chosen, rejected = ids(p), ids(p + c), ids(p + r)
    else:
        if s.base.template is None:
            raise ValueError(chat.NO_TEMPLATE.format(names=", ".join(map(repr, chat.BUILTIN))))
        render = lambda m, g=False: chat.render(s.base.template, m, g, **tokens)
        ids = lambda text: tokenizer.encode(text, add_special_tokens=False).ids
        prompt, chosen, rejected = ids(render(p, True)), ids(render(p + c)), ids(render(p + r))
    if chosen == rejected:  # other texts, the same tokens: "x" and "x" + the eos, say
        field = s.fields[1:]
        raise ValueError(
            f"{field[0]!r} and {field[1]!r} are other texts of the same tokens: the pair "
            "prefers nothing"
        )
    start = min(_prefix_length(prompt, chosen), _prefix_length(prompt, rejected))
    if start < 1:
        raise ValueError("the prompt renders to no token before its completions")
    for name, seq in (("chosen", chosen), ("rejected", rejected)):
        if len(seq) <= start:
            raise ValueError(f"an empty completion: {name!r} adds no token to the prompt")
    return np.asarray(chosen, np.int32), np.asarray(rejected, np.int32), start


def _row(ids: np.ndarray, start: int, length: int) -> np.ndarray:
    """`[2, length]`: inputs and targets of a sequence whose completion starts at `start`."""
    ids = ids[: length + 1]
    out = np.zeros((2, length), np.int32)
    out[1] = -1
    out[0, : len(ids) - 1] = ids[:-1]
    targets = ids[1:].copy()
    targets[: start - 1] = -1  # the prompt's tokens predict the prompt: no loss
    out[1, : len(ids) - 1] = targets
    return out


def _rows(s: Settings, side: str, tokenizer: Any, stats: dict) -> list[np.ndarray]:
    """The rows of `data.files`' pairs (`side="train"`; the embedded set where it is unset) or
    of `data.eval_files'` ("eval"), `stats` counted; a bad pair is a `ConfigError`."""
    files = s.base.eval_files if side == "eval" else s.base.files
    key = "config.data.eval_files" if side == "eval" else sources.key(files)
    pairs = embedded() if not files else list(sources.in_files(files, key))
    length, rows = s.base.seq_len, []
    for where, pair in pairs:
        try:
            chosen, rejected, start = encode(pair, s, tokenizer)
        except ValueError as e:
            raise errors.ConfigError(f"{key}: {where}: {e}") from None
        completions = _texts(pair, s.fields)[1:]  # a conversation's turns past the prompt
        stats["other_turns"] += isinstance(completions[0], list) and any(
            m.get("role") != "assistant" for turns in completions for m in turns
        )
        top = int(max(chosen.max(), rejected.max()))
        if top >= s.base.vocab:
            raise errors.ConfigError(f"{key}: {where}: token id {top} >= {s.base.vocab}")
        longer = max(len(chosen), len(rejected)) > length + 1
        if longer and (s.base.too_long == "drop" or start >= length + 1):
            if s.base.too_long == "truncate":
                raise errors.ConfigError(
                    f"{key}: {where}: the prompt's {start} tokens fill "
                    f"data.seq_len={length}: no completion token would be left; use a longer "
                    "data.seq_len, or data.too_long='drop' to leave such pairs out"
                )
            stats["dropped"] += 1
            continue
        stats["truncated"] += longer
        stats["pairs"] += 1
        rows.append(np.stack([_row(chosen, start, length), _row(rejected, start, length)], 1))
    if stats["dropped"] and len(rows) < 1 + bool(s.base.eval_fraction) * (side == "train"):
        raise errors.ConfigError(
            f"config.data.too_long='drop': {stats['dropped']} of {len(pairs)} pairs of {key} "
            f"are longer than data.seq_len={length} and left out, {len(rows)} left; a run needs "
            "a pair to train on and one to evaluate: use a longer data.seq_len"
        )
    return rows


def build(s: Settings) -> tuple[np.ndarray, dict]:
    """The pairs' rows (int32 `[pairs, 2 planes, 2 (chosen, rejected), seq_len]`; train, then
    eval) and their record."""
    tokenizer = sft.tokenizer_of(s.base.tokenizer)
    stats = {"pairs": 0, "truncated": 0, "dropped": 0, "other_turns": 0}
    rows = _rows(s, "train", tokenizer, stats)
    evals = _rows(s, "eval", tokenizer, stats) if s.base.eval_files else []  # theirs, whole
    rows += evals
    held_out = sft.held_out(s.base, len(rows), len(evals), "pairs")
    stats["train"], stats["eval"] = len(rows) - held_out, held_out
    return np.stack(rows), stats


def rows_of(s: Settings) -> tuple[np.ndarray, dict]:
    """`(rows, record)`: `build`'s rows from the cache, built there first where no run has."""

    def write(path: str) -> str:
        rows, stats = build(s)
        token_cache.write_array(rows, path, {"dpo": stats})
        return f"encoded {stats['pairs']:,} pairs"

    return token_cache.load(s.path(), np.dtype(np.int32), s.base.cache_dir, write, "DPO pairs")


class PairSource(packing.PackedSource):
    """Batches of pairs (the module doc): `random=True` draws each epoch's order from
    `(seed, epoch)`; `random=False` takes the pairs in order, the last batch wrapping round.
    `reference`: float32 `[pairs, 2]` log-probabilities of a reference, handed out with each
    batch (None: none)."""

    def __init__(self, rows: np.ndarray, batch_size: int, seed: int = 0, *, random=True):
        super().__init__(rows, batch_size, seed, random=random)
        self.reference: np.ndarray | None = None

    def _real(self) -> np.ndarray:
        """Tokens a pair's two rows hold (what tokens/s counts): through the last target."""
        valid = np.asarray(self.rows[:, 1]) >= 0
        last = np.where(valid.any(-1), valid.shape[-1] - np.argmax(valid[..., ::-1], -1), 0)
        return last.sum(-1)

    def batch_of(self, indices: np.ndarray) -> dict[str, np.ndarray]:
        picked = np.asarray(self.rows[indices])
        batch = {plane: picked[:, k] for k, plane in enumerate(PLANES)}
        if self.reference is not None:
            batch[REFERENCE] = self.reference[indices]
        return batch

    def get_batch(self, index: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Batch `index` (only its `rows`: a process builds its own)."""
        return self.batch_of(self.indices(index)[rows])

    def __repr__(self) -> str:
        return f"PairSource(pairs={len(self.rows)}, batch_size={self.batch_size})"


def check_run(config: Any) -> dict[str, Any]:
    """`config.dpo` (`dpo_loss.settings`) and what a DPO run needs of the rest; a
    `ValueError` names the key."""
    s = dpo_loss.settings(config.get("dpo"), lora_lib.enabled(config))
    if config.trainer != TRAINER:
        raise ValueError(
            f"trainer={config.trainer!r}: data.name='dpo' trains with config.trainer={TRAINER!r}"
        )
    if config.mesh.get("context", 1) != 1:
        raise ValueError(
            f"mesh.context={config.mesh.context}: a DPO run does not split its sequences yet; "
            "use mesh.context=1 (data and fsdp split the pairs)"
        )
    if config.mesh.get("tensor", 1) != 1:
        raise ValueError(
            f"mesh.tensor={config.mesh.tensor}: a DPO run does not split its layers yet; use "
            "mesh.tensor=1 (data and fsdp split the pairs)"
        )
    return s


def check_config(config: Any) -> dict[str, Any]:
    """What `config.validate` calls: the keys checked (`check_run` too), the tokenizer and
    template loaded; returns one pair's abstract shapes."""
    import jax

    check_run(config)
    s = settings(config)
    tokenize.check_vocab(config, s.base.vocab, s.base.tokenizer)
    return dict.fromkeys(PLANES, jax.ShapeDtypeStruct((1, 2, s.base.seq_len), np.int32))


def create_sources(config: Any) -> tuple[PairSource, PairSource | None]:
    """Host-side: `(train, eval)` sources of pairs (the module doc); eval None where
    `data.eval_fraction` is 0."""
    with errors.config_errors():
        s = settings(config)
        tokenize.check_vocab(config, s.base.vocab, s.base.tokenizer)
    rows, record = rows_of(s)
    st = record["dpo"]
    logging.info(
        "data: dpo: %s pairs (%s train, %s %s) in rows of %d tokens",
        f"{st['pairs']:,}", f"{st['train']:,}", f"{st['eval']:,}",
        "eval of data.eval_files" if s.base.eval_files else "held out", s.base.seq_len,
    )  # fmt: skip
    if st["truncated"] or st["dropped"]:
        logging.warning(
            "data: dpo: %d pairs longer than data.seq_len=%d were %s", st["truncated"] or
            st["dropped"], s.base.seq_len, "cut to it (data.too_long='truncate')"
            if st["truncated"] else "left out (data.too_long='drop')",
        )  # fmt: skip
    if st.get("other_turns"):  # D07, D08, D13 of sweep 2026-12-06
        logging.warning(
            "data: dpo: %d pairs' completions hold turns other than the assistant's (a user's or "
            "the system's, where the two conversations part before them): each is trained on as "
            "part of the completion, as TRL does; put the turns both share in 'prompt' to keep "
            "them out", st["other_turns"],
        )  # fmt: skip
    train = st["train"]
    return (
        PairSource(rows[:train], config.batch_size, config.seed),
        PairSource(rows[train:], config.batch_size, config.seed, random=False)
        if st["eval"]
        else None,
    )
