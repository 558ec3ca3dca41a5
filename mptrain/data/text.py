"""Text as windows of tokens: by default the bytes of the Python standard library (offline).

The default corpus (`data.files` None, `data.tokenizer="bytes"`) is described below; with
`data.files` (globs of `.txt`, `.md`, `.py` and `.jsonl` files, and tables: `.parquet`,
`.arrow`, `.csv`, their `text` column) or a `data.tokenizer` (a
HuggingFace `tokenizer.json`), the corpus is tokenized once into a cache file that later runs
memory-map (`tokenize.py` says how). Either way the windows are cut as `TextSource` says.

The corpus is the source of the standard library that ships with the running interpreter, so it
needs no download and is the same on every machine with the same Python build. Files are read in
the order of their POSIX path relative to the stdlib root, which makes the byte stream stable.

Left out, and why:
  * ``site-packages`` / ``dist-packages``: third-party packages differ between machines, and the
    corpus must not.
  * ``__pycache__``: compiled files, not text.
  * test directories (``test``, ``tests``, ``idle_test``): they are more than half of the stdlib's
    bytes (about 18 of 31 MB on CPython 3.11), full of fixtures, and would double the load time
    for no gain; what remains (about 12 MB) loads in well under a second and is already far more
    text than a short run can see.

Batches are pure functions of ``(seed, index)``, so a resumed run only needs its step number.
"""

from __future__ import annotations

import bisect
import os
import sysconfig
from typing import Any

import numpy as np

from mptrain import errors
from mptrain.data import tables, token_cache, tokenize

# Directory names never entered when walking the stdlib (see the module docstring).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
SEPARATOR = tokenize.BYTES_SEPARATOR
DEFAULT_EVAL_FRACTION = 0.01
# the files `data.files` may name: text, jsonl lines' and tables' `text` (`tables`)
TEXT_SUFFIXES = (".txt", ".md", ".py", ".jsonl", *tables.SUFFIXES)
# The keys this source reads under `config.data` (besides `name` and `prefetch`), with their
# defaults: tokens per window, the corpus cut to its first max_bytes tokens (bytes under the
# byte tokenizer; None: all of it), the fraction of it held out at the end for eval, the files
# (None: the standard library), the tokenizer ("bytes" or a tokenizer.json or a folder holding
# one), the token that joins documents (None: the tokenizer's own end-of-text token) and the
# folder of token caches (None: $MPTRAIN_CACHE/tokens, else ~/.cache/mptrain/tokens).
CONFIG_KEYS = {
    "seq_len": 128,
    "max_bytes": None,
    "eval_fraction": DEFAULT_EVAL_FRACTION,
    "files": None,
    "tokenizer": tokenize.BYTES,
    "eos_token": None,
    "cache_dir": None,
}

# Full concatenated corpus per root directory; slices of it are handed out (read-only).
_CORPUS_CACHE: dict[str, np.ndarray] = {}


def stdlib_root() -> str:
    """The directory holding the running interpreter's standard library."""
    return sysconfig.get_paths()["stdlib"]


def list_files(root: str | os.PathLike[str]) -> list[str]:
    """POSIX paths, relative to ``root``, of the corpus's ``*.py`` files in corpus order."""
    root = os.fspath(root)
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # Prune in place so that excluded trees are never walked (that is most of the cost).
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        rel_dir = os.path.relpath(dirpath, root)
        for name in filenames:
            if name.endswith(".py"):
                rel = name if rel_dir == "." else os.path.join(rel_dir, name)
                found.append(rel.replace(os.sep, "/"))
    return sorted(found)


def load_corpus(max_bytes: int | None = None, *, root: str | None = None) -> np.ndarray:
    """Returns the corpus as a read-only ``uint8`` array.

    Args:
      max_bytes: keep only the first ``max_bytes`` bytes (``None``: everything).
      root: directory to read instead of the stdlib (for tests); same rules apply.
    """
    if max_bytes is not None and (not isinstance(max_bytes, int) or max_bytes <= 0):
        raise ValueError(f"max_bytes must be a positive int or None, got {max_bytes!r}")
    root = os.path.abspath(root if root is not None else stdlib_root())
    corpus = _CORPUS_CACHE.get(root)
    if corpus is None:
        files = list_files(root)
        if not files:
            raise ValueError(f"no *.py files found under {root!r}")
        chunks = []
        for rel in files:
            with open(os.path.join(root, rel), "rb") as f:
                chunks.append(f.read())
        corpus = np.frombuffer(SEPARATOR.join(chunks), dtype=np.uint8)
        _CORPUS_CACHE[root] = corpus
    return corpus if max_bytes is None else corpus[:max_bytes]


def split_corpus(
    data: np.ndarray, eval_fraction: float = DEFAULT_EVAL_FRACTION
) -> tuple[np.ndarray, np.ndarray]:
    """Splits ``data`` into ``(train, eval)``; eval is the last ``eval_fraction`` of the tokens."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    num_eval, unit = round(len(data) * eval_fraction), unit_of(data)
    if num_eval < 2 or num_eval > len(data) - 2:
        raise ValueError(
            f"eval_fraction={eval_fraction!r} of {len(data)} {unit} leaves {num_eval} eval "
            f"{unit} and {len(data) - num_eval} train {unit}; each side needs at least 2"
        )
    split = len(data) - num_eval
    return data[:split], data[split:]


TOKEN_DTYPES = tuple(np.dtype(t) for t in (np.uint8, np.uint16, np.uint32))


def unit_of(data: Any) -> str:
    """What one element of a token array is called in messages: "bytes" or "tokens"."""
    return "bytes" if data.dtype == np.uint8 else "tokens"


class TextSource:
    """Batches of token windows: ``{"inputs", "targets"}``, both ``int32[batch_size, seq_len]``.

    ``targets`` is ``inputs`` shifted left by one token (next-token prediction). ``data`` is a
    1-D array of uint8 (bytes), uint16 or uint32 token ids (a memory map is read in place), or
    anything with ``ndim``, ``dtype``, ``len`` and numpy indexing (`tokens.Concatenated`).

    With ``random=True`` (training) batch ``index`` holds windows at offsets drawn from
    ``np.random.default_rng([seed, index])``: a pure function of ``(seed, index)``, so any batch can
    be regenerated from the step number alone.

    With ``random=False`` (evaluation) the data is cut into ``num_windows`` contiguous,
    non-overlapping input windows; batch ``i`` holds windows ``i * batch_size ...`` in order, so
    batches ``0 .. num_batches - 1`` predict every byte (bar the first) exactly once. The last
    batch wraps around to the start to stay full; ``seed`` is unused.
    """

    def __init__(
        self,
        data: np.ndarray,
        seq_len: int,
        batch_size: int,
        seed: int = 0,
        *,
        random: bool = True,
    ):
        if not (hasattr(data, "ndim") and hasattr(data, "dtype")):
            data = np.asarray(data)
        if data.ndim != 1 or data.dtype not in TOKEN_DTYPES:
            raise ValueError(
                f"data must be a 1-D uint8, uint16 or uint32 array, got shape {data.shape} "
                f"dtype {data.dtype}"
            )
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int | np.integer) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if len(data) < seq_len + 1:
            raise ValueError(
                f"data has {len(data)} {unit_of(data)}, fewer than seq_len + 1 = {seq_len + 1} "
                "needed for one window; lower seq_len or use more data"
            )
        self.data = data
        self.seq_len = int(seq_len)
        self.batch_size = int(batch_size)
        self.seed = int(seed)
        self.random = bool(random)
        # Window k reads data[k*seq_len : k*seq_len + seq_len + 1] in eval mode.
        self.num_windows = (len(data) - 1) // self.seq_len
        self._arange = np.arange(self.seq_len + 1)

    @property
    def num_batches(self) -> int:
        """Eval mode: batches needed to cover every window once (training: same formula)."""
        return -(-self.num_windows // self.batch_size)

    def offsets(self, index: int) -> np.ndarray:
        """Start offsets of the ``batch_size`` windows of batch ``index``."""
        if not isinstance(index, int | np.integer) or index < 0:
            raise ValueError(f"batch index must be a non-negative int, got {index!r}")
        if self.random:
            rng = np.random.default_rng([self.seed, int(index)])
            # Largest valid start leaves room for seq_len inputs plus one more target byte.
            return rng.integers(0, len(self.data) - self.seq_len, size=self.batch_size)
        windows = (index * self.batch_size + np.arange(self.batch_size)) % self.num_windows
        return windows * self.seq_len

    def get_batch(self, index: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Batch number ``index``, deterministic in ``(seed, index)``; only its ``rows`` (each
        process of a multi-process run builds only its own)."""
        offsets = self.offsets(index)[rows]
        windows = self.data[offsets[:, None] + self._arange].astype(np.int32)
        return {"inputs": windows[:, :-1], "targets": windows[:, 1:]}

    def __repr__(self) -> str:
        return (
            f"TextSource({unit_of(self.data)}={len(self.data)}, seq_len={self.seq_len}, "
            f"batch_size={self.batch_size}, seed={self.seed}, random={self.random})"
        )


def _settings(data_config: Any) -> tuple[int, int | None, float]:
    """`(seq_len, max_bytes, eval_fraction)` of a `config.data`, each checked by its key."""
    keys = errors.settings(data_config, CONFIG_KEYS)
    seq_len = errors.check_integer("data.seq_len", keys["seq_len"], 1, errors.INT32_MAX)
    max_bytes = keys["max_bytes"]
    if max_bytes is not None:
        errors.check_integer("data.max_bytes", max_bytes, 1)
    fraction = errors.check_number(
        "data.eval_fraction", keys["eval_fraction"], 0.0, 1.0, open_low=True
    )
    return seq_len, max_bytes, fraction


def corpus_of(data_config: Any) -> tokenize.Corpus | None:
    """The token cache's `tokenize.Corpus` that `data.files`, `data.tokenizer`, `data.eos_token`
    and `data.cache_dir` describe (each checked: a `ValueError` naming the key), or None for
    the default: the standard library's bytes, read as they are."""
    keys = errors.settings(data_config, CONFIG_KEYS)
    files, tokenizer = keys["files"], keys["tokenizer"]
    if files is None and tokenizer == tokenize.BYTES and keys["eos_token"] is None:
        return None
    if files is None:
        root = stdlib_root()
        files = tuple(os.path.join(root, rel) for rel in list_files(root))
    else:
        files = tokenize.find_files("data.files", files, TEXT_SUFFIXES)
    return tokenize.create_corpus(files, tokenizer, keys["eos_token"], keys["cache_dir"])


def check_sizes(
    total: int, seq_len: int, fraction: float, max_bytes: int | None, unit: str = "bytes"
) -> None:
    """Both sides of the split of `total` tokens hold at least one window (seq_len + 1 tokens:
    the inputs and the one after them); else a `ValueError` naming the key to change."""

    def sides(n: int) -> tuple[int, int]:
        held_out = round(n * fraction)  # as `split_corpus` cuts
        return n - held_out, held_out

    need = seq_len + 1
    if min(sides(total)) >= need:
        return
    train, held_out = sides(total)
    split = f"{train} train and {held_out} eval {unit} (data.eval_fraction={fraction:g})"
    if max_bytes is None:
        raise ValueError(
            f"data.seq_len={seq_len}: the corpus's {total} {unit} split into {split}; each side "
            f"needs one window of seq_len + 1 = {need} {unit}"
        )

    # Both sides only grow with n, so the n that work are all those from the least one on: find
    # it by doubling past it from 2 * need (the least that could work), then bisecting.
    def enough(n: int) -> bool:
        return min(sides(n)) >= need

    high = 2 * need
    while not enough(high):
        high *= 2
    least = bisect.bisect_left(range(high // 2, high + 1), True, key=enough) + high // 2
    raise ValueError(
        f"data.max_bytes={max_bytes}: splits into {split}; each side needs one window of "
        f"data.seq_len + 1 = {need} {unit}, so max_bytes must be at least {least}"
    )


def check_config(config: Any) -> dict[str, Any]:
    """What `config.validate` calls: the keys of `config.data` checked as `create_sources` reads
    them, without reading the corpus (a `max_bytes` too small for one window on either side of
    the split is caught here; the corpus itself is 12 MB), the files' globs expanded and the
    tokenizer loaded: its vocabulary must fit `model.vocab_size` (the byte tokenizer's 256
    too). Returns the abstract shapes of one example, `{"inputs", "targets"}: int32[1,
    seq_len]`, for the model to be tried on."""
    import jax

    seq_len, max_bytes, fraction = _settings(config.data)
    if max_bytes is not None:
        check_sizes(max_bytes, seq_len, fraction, max_bytes)
    corpus = corpus_of(config.data)
    tokenize.check_vocab(
        config,
        *((corpus.vocab, corpus.tokenizer) if corpus else (tokenize.BYTES_VOCAB, tokenize.BYTES)),
    )
    example = jax.ShapeDtypeStruct((1, seq_len), np.int32)
    return {"inputs": example, "targets": example}


def build_text_sources(
    data_config: Any, *, batch_size: int, seed: int, eval_batch_size: int | None = None
) -> tuple[TextSource, TextSource]:
    """Host-side: ``(train, eval)`` sources from a config with the keys of `CONFIG_KEYS`.

    ``data_config`` keys (an ``ml_collections.ConfigDict`` or anything with attributes):
      seq_len:       tokens per window (the model's ``max_len`` must be at least this).
      max_bytes:     truncate the corpus first (``None``: whole corpus), in tokens.
      eval_fraction: fraction held out at the end of the corpus for eval (default 0.01).
      files, tokenizer, eos_token, cache_dir: the corpus (`corpus_of`), tokenized into the
                     cache by `token_cache.tokens` unless it is the default.
    A bad value is a `ValueError` naming its key (``data.seq_len=0: ...``); a corpus too small
    for the split an `errors.ConfigError`, raised before anything touches the workdir.
    """
    seq_len, max_bytes, fraction = _settings(data_config)
    with errors.config_errors():
        corpus = corpus_of(data_config)
    data = load_corpus(max_bytes) if corpus is None else token_cache.tokens(corpus)[:max_bytes]
    with errors.config_errors():
        check_sizes(len(data), seq_len, fraction, max_bytes, unit_of(data))
    return sources(data, seq_len, fraction, batch_size, seed, eval_batch_size)


def sources(
    data: Any,
    seq_len: int,
    fraction: float,
    batch_size: int,
    seed: int,
    eval_batch_size: int | None = None,
) -> tuple[TextSource, TextSource]:
    """``(train, eval)`` sources of ``data`` split as `split_corpus` cuts it (`tokens.py`'s too)."""
    train, evaluation = split_corpus(data, fraction)
    eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
    return (
        TextSource(train, seq_len, batch_size, seed),
        TextSource(evaluation, seq_len, eval_batch_size, seed, random=False),
    )


def create_sources(config: Any) -> tuple[TextSource, TextSource]:
    """Host-side: the sources for a full mptrain config (keys under `config.data`)."""
    return build_text_sources(config.data, batch_size=config.batch_size, seed=config.seed)
