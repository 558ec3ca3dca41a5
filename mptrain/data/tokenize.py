"""Text files tokenized once into a cache of token ids, shared by runs and processes.

What `data.name="text"` reads when `data.files` or `data.tokenizer` is set (`text.py` keeps the
embedded byte-level corpus, the default, to itself):

  * Files: `find_files` expands `data.files` (a glob, or a list of them; `**` recurses) into
    the sorted list of matching files. A `.jsonl` file is one document a line (its `text`
    field); a `.txt`, `.md` or `.py` file is one document.
  * Tokenizer: `"bytes"` (each byte a token: vocabulary 256, documents joined by a newline, as
    the embedded corpus is), or a HuggingFace `tokenizer.json` (a file, or a folder holding one)
    read with the `tokenizers` package. Each document is encoded as the tokenizer encodes a
    text on its own, its template's special tokens included (Llama 3's adds
    `<|begin_of_text|>`); special tokens spelt out in the text stay plain text. Documents are
    joined by the end-of-text token: `data.eos_token`, else the first of `EOS_TOKENS` that
    the tokenizer knows.
  * Cache: `token_cache.py` writes the token stream once, and checks it before each read.
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import numpy as np

from mptrain import errors, files
from mptrain.data import tables

FORMAT_VERSION = 2  # bump when the layout or the encoding rule of a cache file changes
BYTES = "bytes"
# End-of-text tokens looked for, in order: Llama 3's, GPT-2's, SentencePiece's (Llama 2,
# Mistral), Gemma's.
EOS_TOKENS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")
BYTES_SEPARATOR = b"\n"  # what joins documents under the byte tokenizer
BYTES_VOCAB = 256
_BATCH_CHARS = 8 << 20  # characters of documents handed to the tokenizer at a time
_TOKENIZERS: dict[tuple, Any] = {}  # loaded tokenizers, by (path, size, mtime, specials_in_text)


def find_files(key: str, globs: Any, suffixes: tuple[str, ...]) -> tuple[str, ...]:
    """The absolute paths of the files that `globs` (a glob or a list of them; `~` and `**`
    expand; `hf://datasets/ORG/NAME[/GLOB]` in the Hub's cache: `hub.dataset_globs`) match,
    sorted, each once. A glob that matches no file, or a file whose suffix is
    not one of `suffixes`, is a `ValueError` naming `key`."""
    items = [globs] if isinstance(globs, str) else globs
    if not isinstance(items, list | tuple) or not items:
        raise ValueError(f"{key}={globs!r}: must be a glob or a list of globs")
    found = set()
    for pattern in items:
        if not isinstance(pattern, str) or not pattern.strip():
            raise ValueError(f"{key}={globs!r}: {pattern!r} is not a glob (a non-empty string)")
        local = [pattern]
        if pattern.startswith("hf://"):  # a Hub dataset's files, from the Hub's cache
            from mptrain import hub

            local = hub.dataset_globs(pattern, key)
        matched = [
            os.path.abspath(p)
            for each in local
            for p in glob.glob(os.path.expanduser(each), recursive=True)
            if os.path.isfile(p)
        ]
        if not matched:
            which = "" if isinstance(globs, str) else f" {pattern!r}"
            raise ValueError(f"{key}={globs!r}:{which} matches no file")
        found.update(matched)
    for path in found:
        if not path.endswith(suffixes):
            raise ValueError(
                f"{key}={globs!r}: {path} is not one of the files it reads "
                f"({', '.join('*' + s for s in suffixes)})"
            )
    return tuple(sorted(found))


def tokenizer_file(spec: Any) -> str:
    """The `tokenizer.json` that `data.tokenizer=spec` names (the file, or the folder holding
    it); a `ValueError` naming `data.tokenizer` when there is none."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(
            f"data.tokenizer={spec!r}: must be 'bytes' or the path of a tokenizer.json "
            "(or of a folder holding one)"
        )
    from mptrain import hub  # a Hub id: its snapshot's tokenizer files

    path = os.path.abspath(os.path.expanduser(hub.folder(spec, hub.TOKENIZER, "data.tokenizer")))
    if os.path.isdir(path):
        path = os.path.join(path, "tokenizer.json")
    if not os.path.isfile(path):
        raise ValueError(
            f"data.tokenizer={spec!r}: no such file {path}; name a tokenizer.json, a folder "
            "holding one, or 'bytes'"
        )
    return path


def load_tokenizer(path: str, specials_in_text: bool = False):
    """The `tokenizers.Tokenizer` in the file `path` (loaded once a process while unchanged);
    a `ValueError` naming `data.tokenizer` when the file is not one. A special token spelt out
    in a text is plain text unless `specials_in_text` (a chat template's markers are not)."""
    import tokenizers

    stat = os.stat(path)
    key = (path, stat.st_size, stat.st_mtime_ns, specials_in_text)
    if key not in _TOKENIZERS:
        try:
            tokenizer = tokenizers.Tokenizer.from_file(path)
        except Exception as e:  # the Rust side raises plain Exceptions
            raise ValueError(
                f"data.tokenizer={path!r}: not a tokenizers file ({errors.first_line(e)})"
            ) from None
        tokenizer.encode_special_tokens = not specials_in_text
        _TOKENIZERS[key] = tokenizer
    return _TOKENIZERS[key]


def byte_level(specials: tuple[str, ...]):
    """A `tokenizers.Tokenizer` whose ids are a text's UTF-8 bytes (0-255), then `specials`
    (256, 257, ...), each one token where a text spells it out; with character offsets, as a
    HuggingFace tokenizer has. Bytes are spelt as byte-level BPE spells them: printable Latin-1
    as themselves, the other bytes as the characters from U+0100 on, in order."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = {*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)}
    others = iter(range(0x100, 0x200))
    vocab = {chr(b if b in printable else next(others)): b for b in range(256)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(list(specials))
    return tokenizer


def eos_id(tokenizer: Any, path: str, eos_token: Any) -> int:
    """The id of the token that ends a document: `eos_token`'s, else that of the first of
    `EOS_TOKENS` the tokenizer knows; a `ValueError` when there is none."""
    if eos_token is not None:
        found = tokenizer.token_to_id(eos_token) if isinstance(eos_token, str) else None
        if found is None:
            raise ValueError(f"data.eos_token={eos_token!r}: not a token of {path}")
        return found
    for token in EOS_TOKENS:
        found = tokenizer.token_to_id(token)
        if found is not None:
            return found
    raise ValueError(
        f"data.tokenizer={path!r}: has no end-of-text token (none of {', '.join(EOS_TOKENS)}); "
        "set data.eos_token to the token that ends a document"
    )


def token_dtype(vocab: int) -> np.dtype:
    """The narrowest of uint8 (bytes), uint16 and uint32 that holds ids below `vocab`."""
    for dtype in (np.uint8, np.uint16, np.uint32):
        if vocab <= np.iinfo(dtype).max + 1:
            return np.dtype(dtype)
    raise ValueError(f"a vocabulary of {vocab:,} does not fit 32-bit token ids")


def default_cache_dir() -> str:
    """`$MPTRAIN_CACHE/tokens`, else `~/.cache/mptrain/tokens`."""
    return os.fspath(files.cache_dir("tokens"))


def model_vocab(config: Any) -> int | None:
    """`model.vocab_size` as the model of `config.model.name` reads it (its default where
    unset); None for a model without a vocabulary, or one that is not of the zoo."""
    from mptrain import models

    try:
        keys = models.import_model(config.model.name).CONFIG_KEYS
    except (ValueError, AttributeError):
        return None
    if "vocab_size" not in keys:
        return None
    vocab = errors.setting(config.model, "vocab_size", keys["vocab_size"])
    return vocab if isinstance(vocab, int) and not isinstance(vocab, bool) else None


@dataclasses.dataclass(frozen=True)
class Corpus:
    """What a token cache holds: `files` (absolute paths, in order) encoded by `tokenizer`
    (`"bytes"` or the tokenizer.json path), joined by `separator` (token ids)."""

    files: tuple[str, ...]
    tokenizer: str
    separator: tuple[int, ...]
    vocab: int
    digest: str  # of the tokenizer file's content ("bytes" for the byte tokenizer)
    cache_dir: str

    @property
    def dtype(self) -> np.dtype:
        return token_dtype(self.vocab)

    def key(self) -> str:
        """The cache file's name: a hash of everything its tokens depend on."""
        stats = [(p, s.st_size, s.st_mtime_ns) for p in self.files for s in [os.stat(p)]]
        what = [FORMAT_VERSION, self.digest, list(self.separator), stats]
        return hashlib.sha256(json.dumps(what).encode()).hexdigest()[:32]

    def path(self) -> str:
        return os.path.join(self.cache_dir, f"{self.key()}.npy")


def create_corpus(files: tuple[str, ...], tokenizer: Any, eos_token: Any, cache_dir: Any):
    """The `Corpus` of `files` under `data.tokenizer=tokenizer`, `data.eos_token` and
    `data.cache_dir` (None: `default_cache_dir()`), each checked (a `ValueError` naming the
    key). Cheap: the tokenizer file is read and hashed, no document is."""
    if cache_dir is not None and (not isinstance(cache_dir, str) or not cache_dir.strip()):
        raise ValueError(f"data.cache_dir={cache_dir!r}: must be a folder's path or None")
    if cache_dir is not None and "://" in cache_dir:  # a run's workdir may be a bucket, not this
        raise ValueError(f"data.cache_dir={cache_dir!r}: token caches stay on local disk")
    folder = os.path.abspath(os.path.expanduser(cache_dir or default_cache_dir()))
    if tokenizer == BYTES:
        if eos_token is not None:
            raise ValueError(
                f"data.eos_token={eos_token!r}: data.tokenizer='bytes' joins documents with a "
                "newline and has no end-of-text token; name a tokenizer.json to use one"
            )
        return Corpus(files, BYTES, tuple(BYTES_SEPARATOR), BYTES_VOCAB, BYTES, folder)
    path = tokenizer_file(tokenizer)
    loaded = load_tokenizer(path)
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    vocab = loaded.get_vocab_size(with_added_tokens=True)
    return Corpus(files, path, (eos_id(loaded, path, eos_token),), vocab, digest, folder)


def check_vocab(config: Any, vocab: int, tokenizer: str) -> None:
    """A vocabulary of `vocab` tokens (`data.tokenizer=tokenizer`'s) must fit the model's
    `model.vocab_size`: else a `ValueError` naming both."""
    size = model_vocab(config)
    if size is not None and vocab > size:
        pretrained = config.get("init_from")
        fix = (  # a pretrained embedding has its rows: the tokenizer must be of that model
            f"the weights of init_from={pretrained!r} have {size:,} rows; use the tokenizer "
            "made for them (the folder's tokenizer.json)"
            if pretrained
            else f"set model.vocab_size to at least {vocab:,}"
        )
        raise ValueError(
            f"data.tokenizer={tokenizer!r}: its vocabulary of {vocab:,} tokens exceeds "
            f"model.vocab_size={size:,}; {fix}"
        )


def documents(path: str, as_text: bool) -> Iterator[str | bytes]:
    """The documents of one file: `str`s with `as_text`, else the bytes as they are (a `.jsonl`
    line's `text` field in UTF-8). A file that cannot be read, one read `as_text` (for a
    tokenizer.json) that is not UTF-8 text, or a line that is not JSON with a string `text`, is
    a `ConfigError` naming the file (and the line); the byte tokenizer takes any bytes. A
    table's documents: its `text` column, a record batch at a time (`tables.texts`)."""
    if path.endswith(tables.SUFFIXES):
        for text in tables.texts(path):
            yield text if as_text else text.encode("utf-8")
        return
    try:
        file = open(path, "rb")  # noqa: SIM115 (closed by the `with` below)
    except OSError as e:
        raise errors.ConfigError(f"config.data.files: cannot read {path} ({e.strerror})") from None
    with file:
        if not path.endswith(".jsonl"):
            content = file.read()
            try:
                yield content.decode("utf-8") if as_text else content
            except UnicodeDecodeError as e:
                raise errors.ConfigError(
                    f"config.data.files: {path} is not UTF-8 text (byte {e.start}: {e.reason})"
                ) from None
            return
        for number, line in enumerate(file, 1):  # a line at a time: a .jsonl may be large
            if not line.strip():
                continue
            try:
                text = json.loads(line).get("text")
            except (ValueError, AttributeError) as e:
                why = errors.first_line(e) if isinstance(e, ValueError) else "not an object"
                text, problem = None, f"not a JSON object ({why})"
            else:
                problem = "no string 'text' field"
            if not isinstance(text, str):
                raise errors.ConfigError(f"config.data.files: {path} line {number}: {problem}")
            yield text if as_text else text.encode("utf-8")


def encoded(corpus: Corpus, read: list[int] | None = None) -> Iterator[np.ndarray]:
    """The token ids of the corpus's documents, one array each, in order. `read`, a list of
    three, counts as it goes: the files begun, the documents and their bytes read (UTF-8)."""
    read = [0, 0, 0] if read is None else read
    if corpus.tokenizer == BYTES:
        for path in corpus.files:
            read[0] += 1
            for document in documents(path, as_text=False):
                read[1:] = read[1] + 1, read[2] + len(document)
                yield np.frombuffer(document, np.uint8)
        return
    tokenizer = load_tokenizer(corpus.tokenizer)
    batch, chars = [], 0

    def encode(batch):
        for encoding in tokenizer.encode_batch_fast(batch):
            yield np.asarray(encoding.ids, corpus.dtype)

    for path in corpus.files:
        read[0] += 1
        for document in documents(path, as_text=True):
            read[1:] = read[1] + 1, read[2] + len(document.encode("utf-8", "surrogatepass"))
            batch.append(document)
            chars += len(document)
            if chars >= _BATCH_CHARS:
                yield from encode(batch)
                batch, chars = [], 0
    yield from encode(batch)
