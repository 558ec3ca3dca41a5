"""The token cache: a corpus's ids written once as a `.npy` file, checked before each read.

The token stream of a `tokenize.Corpus` is written once as a `.npy` file (uint8 for bytes,
uint16 where the vocabulary fits, else uint32) under `data.cache_dir` (None:
`$MPTRAIN_CACHE/tokens`, else `~/.cache/mptrain/tokens`), named by `Corpus.key`: a hash of the
files' paths, sizes and modification times, the tokenizer file's content, the separator and
`tokenize.FORMAT_VERSION`; later runs memory-map it. It is written to a temporary file and
renamed into place, under an exclusive `fcntl.flock` on a lock file beside it, so processes
that start together build it once: the others wait and then read it. (A lock on a network file
system is only as good as that file system's locking.)

A record beside it (`<name>.json`: the token count, type and CRC-32 of the ids) is written
before the rename; each process checks the file against it before its first read (about 0.1 s
a GiB). A cache that a crash cut short or emptied, whose header or any id was overwritten, or
whose record is gone is built again, with a warning naming it and why.
"""

from __future__ import annotations

import fcntl
import glob
import json
import os
import time
import zlib

import numpy as np
from absl import logging

from mptrain import errors, files
from mptrain.data import tokenize
from mptrain.data.tokenize import Corpus

_COPY_TOKENS = 1 << 24  # tokens copied (and checksummed) at a time into the final file
_OPENED: dict[str, np.ndarray] = {}  # cache files this process has opened, by path


def _write(corpus: Corpus, path: str) -> int:
    """Tokenizes the corpus into the `.npy` file `path` (through temporary files beside it, the
    last renamed into place after its record); returns its token count."""
    raw, staged = f"{path}.{os.getpid()}.tmp.bin", f"{path}.{os.getpid()}.tmp.npy"
    separator = np.asarray(corpus.separator, corpus.dtype).tobytes()
    try:
        count = 0
        with open(raw, "wb") as out:  # the length is known at the end: ids first, then .npy
            for n, ids in enumerate(tokenize.encoded(corpus)):
                if n:
                    out.write(separator)
                    count += len(corpus.separator)
                out.write(ids.tobytes())
                count += len(ids)
        if count == 0:
            first = corpus.files[0] + (", ..." if len(corpus.files) > 1 else "")
            raise errors.ConfigError(f"config.data.files: no text in {first}")
        source = np.memmap(raw, corpus.dtype, "r", shape=(count,))
        target = np.lib.format.open_memmap(staged, "w+", corpus.dtype, (count,))
        crc = 0
        for start in range(0, count, _COPY_TOKENS):
            chunk = source[start : start + _COPY_TOKENS]
            target[start : start + _COPY_TOKENS] = chunk
            crc = zlib.crc32(chunk, crc)
        target.flush()
        del source, target, chunk
        with open(staged, "rb+") as f:
            os.fsync(f.fileno())
        record = {"tokens": count, "dtype": corpus.dtype.name, "crc32": crc}
        files.write_json(_record_path(path), record)
        os.replace(staged, path)
        return count
    finally:
        for leftover in (raw, staged):
            if os.path.exists(leftover):
                os.remove(leftover)


def _record_path(path: str) -> str:
    return f"{path[:-4]}.json"


def _checksum(ids: np.ndarray) -> int:
    crc = 0
    for start in range(0, len(ids), _COPY_TOKENS):
        crc = zlib.crc32(ids[start : start + _COPY_TOKENS], crc)
    return crc


def _verified(path: str, dtype: np.dtype) -> tuple[np.ndarray | None, str]:
    """The cache file `path` memory-mapped, if it is whole: its `.npy` header reads, and its
    length, type and CRC-32 are those of the record beside it; else None and why not."""
    try:
        with open(_record_path(path), "rb") as f:
            record = json.load(f)
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError as e:
        return None, f"no {e.filename}"
    except (OSError, ValueError, EOFError) as e:
        return None, errors.first_line(e)
    if not isinstance(record, dict) or set(record) != {"tokens", "dtype", "crc32"}:
        return None, f"{_record_path(path)} is not a token cache's record"
    if ids.shape != (record["tokens"],) or ids.dtype.name != record["dtype"] != dtype.name:
        return None, (
            f"it holds {ids.shape} {ids.dtype.name} where its record says "
            f"({record['tokens']},) {record['dtype']}"
        )
    if ids.dtype != dtype:
        return None, f"it holds {ids.dtype.name} ids where this vocabulary takes {dtype.name}"
    if _checksum(ids) != record["crc32"]:
        return None, "its ids do not match their CRC-32: the file was changed after it was written"
    return np.asarray(ids), ""


def tokens(corpus: Corpus) -> np.ndarray:
    """The corpus's token ids, a read-only memory-mapped 1-D array, built into the cache first
    where no run has, or where the file there does not verify (one log line says which)."""
    path = corpus.path()
    if path in _OPENED:
        return _OPENED[path]
    ids, broken = None, None
    if os.path.exists(path):
        ids, why = _verified(path, corpus.dtype)
        if ids is None:
            logging.warning(
                "data: the token cache %s does not verify (%s): building it again", path, why
            )
            broken = _identity(path)
    if ids is None:
        built = _build(corpus, path, broken)
        ids, why = _verified(path, corpus.dtype)
        if ids is None:
            raise errors.StorageError(f"the token cache {path} does not verify once written: {why}")
    else:
        built = None
    if built is None:
        count = f"{len(ids):,}"
        logging.info("data: reusing %s tokens of %d files: %s", count, len(corpus.files), path)
    _OPENED[path] = ids
    return ids


def _identity(path: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _build(corpus: Corpus, path: str, broken: tuple[int, int, int] | None = None) -> int | None:
    """Writes the cache file `path` under the lock beside it, unless another process has by the
    time the lock is ours (a file other than the `broken` one, an `_identity`); its token count,
    or None. A cache folder that cannot be written is a `ConfigError` naming `data.cache_dir`;
    a failed write a `StorageError` naming the file."""
    try:
        os.makedirs(corpus.cache_dir, exist_ok=True)
        lock = open(f"{path[:-4]}.lock", "a")  # noqa: SIM115 (held across the build)
    except OSError as e:
        raise errors.ConfigError(
            f"config.data.cache_dir={corpus.cache_dir!r}: cannot write there ({e.strerror or e})"
        ) from None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # another process building it: wait for it
        if os.path.exists(path) and (broken is None or _identity(path) != broken):
            return None
        folder, name = os.path.split(_record_path(path))
        killed = glob.glob(glob.escape(path) + ".*.tmp.*")  # of a build killed part-way
        killed += glob.glob(os.path.join(glob.escape(folder), f".{name}.*.tmp"))
        for leftover in killed:
            os.remove(leftover)  # only the lock's holder builds, so none is in use
        start = time.perf_counter()
        try:
            count = _write(corpus, path)
        except OSError as e:
            raise errors.StorageError(
                f"could not write the token cache {path}: {e.strerror or e}"
            ) from None
    seconds = time.perf_counter() - start
    logging.info(
        "data: tokenized %d files into %s tokens in %.1f s: %s",
        len(corpus.files),
        f"{count:,}",
        seconds,
        path,
    )
    return count
