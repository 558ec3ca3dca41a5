"""Pre-tokenized token ids: `data.name="tokens"`, memory-mapped `.npy` or raw `.bin` files.

The format nanoGPT's `prepare.py` writes (`train.bin`: raw uint16 ids) and Levanter's and
`np.save`'s (`.npy`, 1-D uint16 or uint32): no tokenizer is needed, the ids are used as they
are. `data.files` globs them; they are memory-mapped and concatenated in sorted order without a
copy (`Concatenated`), so a corpus larger than memory trains. The last `data.eval_fraction` is
held out for eval and windows of `data.seq_len + 1` ids are cut as `text.TextSource` cuts them:
batch i is a pure function of (seed, i).

A file that is not a 1-D uint16/uint32 `.npy`, or a `.bin` whose size is not a whole number of
`data.dtype` ids, is a `ConfigError` naming it, raised by `config.validate` (which reads only
the headers). When the sources are built, the first `CHECK_BYTES` of each file are scanned for
an id at or above `model.vocab_size` (a `ConfigError` naming the file and the id).
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from mptrain import errors
from mptrain.data import text, tokenize

SUFFIXES = (".npy", ".bin")
DTYPES = ("uint16", "uint32")
CHECK_BYTES = 1 << 30  # of each file scanned for ids >= model.vocab_size (about 0.3 s a GiB)
_CHUNK = 1 << 24  # ids scanned at a time
# The keys this source reads under `config.data`: the files (globs, required), the id type of
# the `.bin` ones (a `.npy` carries its own), ids per window and the fraction held out for eval.
CONFIG_KEYS = {
    "files": None,
    "dtype": "uint16",
    "seq_len": 128,
    "eval_fraction": text.DEFAULT_EVAL_FRACTION,
}


class Concatenated:
    """Several 1-D arrays read as one (without copying): `len`, `dtype` (the widest of theirs),
    slices with step 1 and integer-array indexing, as `text.TextSource` uses them."""

    ndim = 1

    def __init__(self, parts: list[np.ndarray]):
        self.parts = [p for p in parts if len(p)]
        self.dtype = np.result_type(*parts)
        self.starts = np.cumsum([0] + [len(p) for p in self.parts])
        self.shape = (int(self.starts[-1]),)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise IndexError("Concatenated takes slices with step 1")
            parts = [
                part[max(start - s, 0) : max(stop - s, 0)]
                for part, s in zip(self.parts, self.starts[:-1], strict=True)
            ]
            return Concatenated([p for p in parts if len(p)] or [np.zeros(0, self.dtype)])
        index = np.asarray(index)
        which = np.searchsorted(self.starts, index, side="right") - 1
        out = np.empty(index.shape, self.dtype)
        for k in np.unique(which):
            at = which == k
            out[at] = self.parts[k][index[at] - self.starts[k]]
        return out


def open_file(path: str, dtype: str) -> np.ndarray:
    """One file's ids, memory-mapped: a `.npy` of its own 1-D uint16/uint32, a `.bin` of raw
    `dtype` ids. Else a `ConfigError` naming the file."""
    if path.endswith(".npy"):
        try:
            ids = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise errors.ConfigError(
                f"config.data.files: {path} is not a .npy file ({errors.first_line(e)})"
            ) from None
        if ids.ndim != 1 or ids.dtype.name not in DTYPES or not ids.dtype.isnative:
            raise errors.ConfigError(
                f"config.data.files: {path} holds {ids.dtype.str}{list(ids.shape)}; token files "
                "must be 1-D uint16 or uint32"
            )
        return np.asarray(ids)
    size, itemsize = os.path.getsize(path), np.dtype(dtype).itemsize
    if size % itemsize:
        raise errors.ConfigError(
            f"config.data.files: {path} has {size} bytes, not a whole number of "
            f"data.dtype={dtype!r} ids ({itemsize} bytes each)"
        )
    return np.asarray(np.memmap(path, dtype, "r")) if size else np.zeros(0, dtype)


def _open(config: Any) -> tuple[list[str], list[np.ndarray]]:
    keys = errors.settings(config.data, CONFIG_KEYS)
    if keys["files"] is None:
        raise ValueError("data.files=None: name the token files, e.g. 'data/*.bin'")
    dtype = errors.check_choice("data.dtype", keys["dtype"], DTYPES)
    paths = tokenize.find_files("data.files", keys["files"], SUFFIXES)
    return list(paths), [open_file(path, dtype) for path in paths]


def _settings(config: Any) -> tuple[int, float]:
    keys = errors.settings(config.data, CONFIG_KEYS)
    seq_len = errors.check_integer("data.seq_len", keys["seq_len"], 1, errors.INT32_MAX)
    fraction = errors.check_number(
        "data.eval_fraction", keys["eval_fraction"], 0.0, 1.0, open_low=True
    )
    return seq_len, fraction


def check_config(config: Any) -> dict[str, Any]:
    """What `config.validate` calls: the keys checked, the files found and their headers read
    (dtype and shape; no ids), the split sized. Returns one example's abstract shapes."""
    import jax

    seq_len, fraction = _settings(config)
    _, parts = _open(config)
    text.check_sizes(sum(len(p) for p in parts), seq_len, fraction, None, "tokens")
    example = jax.ShapeDtypeStruct((1, seq_len), np.int32)
    return {"inputs": example, "targets": example}


def check_ids(path: str, ids: np.ndarray, vocab: int | None) -> None:
    """The first `CHECK_BYTES` of a file's ids must lie below `vocab` (`model.vocab_size`)."""
    if vocab is None:
        return
    head = ids[: CHECK_BYTES // ids.dtype.itemsize]
    for start in range(0, len(head), _CHUNK):
        top = int(head[start : start + _CHUNK].max())
        if top >= vocab:
            raise errors.ConfigError(
                f"config.data.files: {path} holds token id {top} >= model.vocab_size={vocab}"
            )


def create_sources(config: Any) -> tuple[text.TextSource, text.TextSource]:
    """Host-side: `(train, eval)` sources over the files' ids (see the module docstring)."""
    with errors.config_errors():
        seq_len, fraction = _settings(config)
        paths, parts = _open(config)
        vocab = tokenize.model_vocab(config)
        for path, ids in zip(paths, parts, strict=True):
            check_ids(path, ids, vocab)
        data = parts[0] if len(parts) == 1 else Concatenated(parts)
        text.check_sizes(len(data), seq_len, fraction, None, "tokens")
    return text.sources(data, seq_len, fraction, config.batch_size, config.seed)
