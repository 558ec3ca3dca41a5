"""Byte-level text from the Python standard library: the offline default dataset.

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

import os
import sysconfig
from typing import Any

import numpy as np

# Directory names never entered when walking the stdlib (see the module docstring).
EXCLUDED_DIRS = frozenset(
    {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}
)
SEPARATOR = b"\n"
DEFAULT_EVAL_FRACTION = 0.01

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
    """Splits ``data`` into ``(train, eval)``; eval is the last ``eval_fraction`` of the bytes."""
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be in (0, 1), got {eval_fraction!r}")
    num_eval = round(len(data) * eval_fraction)
    if num_eval < 2 or num_eval > len(data) - 2:
        raise ValueError(
            f"eval_fraction={eval_fraction!r} of {len(data)} bytes leaves {num_eval} eval bytes "
            f"and {len(data) - num_eval} train bytes; each side needs at least 2"
        )
    split = len(data) - num_eval
    return data[:split], data[split:]


class TextSource:
    """Batches of byte windows: ``{"inputs", "targets"}``, both ``int32[batch_size, seq_len]``.

    ``targets`` is ``inputs`` shifted left by one byte (next-byte prediction).

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
        data = np.asarray(data)
        if data.ndim != 1 or data.dtype != np.uint8:
            raise ValueError(
                f"data must be a 1-D uint8 array, got shape {data.shape} dtype {data.dtype}"
            )
        for name, value in (("seq_len", seq_len), ("batch_size", batch_size)):
            if not isinstance(value, int | np.integer) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(seed, int | np.integer) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if len(data) < seq_len + 1:
            raise ValueError(
                f"data has {len(data)} bytes, fewer than seq_len + 1 = {seq_len + 1} needed for "
                "one window; lower seq_len or use more data"
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
            f"TextSource(bytes={len(self.data)}, seq_len={self.seq_len}, "
            f"batch_size={self.batch_size}, seed={self.seed}, random={self.random})"
        )


def build_text_sources(
    data_config: Any, *, batch_size: int, seed: int, eval_batch_size: int | None = None
) -> tuple[TextSource, TextSource]:
    """Host-side: ``(train, eval)`` sources from a config with the keys below.

    ``data_config`` keys (an ``ml_collections.ConfigDict`` or anything with attributes):
      seq_len:       bytes per window (the model's ``max_len`` must be at least this).
      max_bytes:     truncate the corpus first (``None``: whole corpus).
      eval_fraction: fraction held out at the end of the corpus for eval (default 0.01).
    """
    corpus = load_corpus(getattr(data_config, "max_bytes", None))
    train, evaluation = split_corpus(
        corpus, getattr(data_config, "eval_fraction", DEFAULT_EVAL_FRACTION)
    )
    seq_len = data_config.seq_len
    eval_batch_size = batch_size if eval_batch_size is None else eval_batch_size
    return (
        TextSource(train, seq_len, batch_size, seed),
        TextSource(evaluation, seq_len, eval_batch_size, seed, random=False),
    )


def create_sources(config: Any) -> tuple[TextSource, TextSource]:
    """Host-side: the sources for a full mptrain config (keys under `config.data`)."""
    return build_text_sources(config.data, batch_size=config.batch_size, seed=config.seed)
