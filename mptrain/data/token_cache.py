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

import contextlib
import fcntl
import glob
import json
import os
import time
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
from absl import logging

from mptrain import errors, files
from mptrain.data import tokenize
from mptrain.data.tokenize import Corpus

PROGRESS_EVERY_S = 10.0  # a long build logs how far it is this often
_COPY_TOKENS = 1 << 24  # tokens copied (and checksummed) at a time into the final file
_OPENED: dict[str, tuple] = {}  # (array, record) of the cache files opened here, by path


def _write(corpus: Corpus, path: str) -> int:
    """Tokenizes the corpus into the `.npy` file `path` (through temporary files beside it, the
    last renamed into place after its record); returns its token count."""
    raw, staged = f"{path}.{os.getpid()}.tmp.bin", f"{path}.{os.getpid()}.tmp.npy"
    separator = np.asarray(corpus.separator, corpus.dtype).tobytes()
    try:
        count, read, start = 0, [0, 0, 0], time.perf_counter()
        shown = start
        with open(raw, "wb") as out:  # the length is known at the end: ids first, then .npy
            for n, ids in enumerate(tokenize.encoded(corpus, read)):
                if n:
                    out.write(separator)
                    count += len(corpus.separator)
                out.write(ids.tobytes())
                count += len(ids)
                if (now := time.perf_counter()) - shown >= PROGRESS_EVERY_S:
                    _progress(corpus, read, count, now - start)
                    shown = now
        if count == 0:
            first = corpus.files[0] + (", ..." if len(corpus.files) > 1 else "")
            raise errors.ConfigError(f"config.data.files: no text in {first}")
        source = np.memmap(raw, corpus.dtype, "r", shape=(count,))
        _commit(source, path, staged, {})
        del source
        return count
    finally:
        for leftover in (raw, staged):
            if os.path.exists(leftover):
                os.remove(leftover)


def _progress(corpus: Corpus, read: list[int], tokens: int, seconds: float) -> None:
    files, documents, size = read
    logging.info(
        "data: tokenizing: file %d of %d, %s documents, %.1f MB of text, %s tokens, %.1f MB/s",
        files, len(corpus.files), f"{documents:,}", size / 1e6, f"{tokens:,}",
        size / 1e6 / seconds,
    )  # fmt: skip


def write_array(array: np.ndarray, path: str, extra: dict) -> None:
    """Writes `array` as the cache file `path` (a `.npy`), its record holding `extra` too:
    staged beside it and renamed into place after the record (what `load` reads)."""
    staged = f"{path}.{os.getpid()}.tmp.npy"
    try:
        _commit(array, path, staged, extra)
    finally:
        if os.path.exists(staged):
            os.remove(staged)


def _commit(source: np.ndarray, path: str, staged: str, extra: dict) -> None:
    """`source` copied into the `.npy` file `staged` a chunk at a time (checksummed), synced,
    its record written, then renamed to `path`."""
    target = np.lib.format.open_memmap(staged, "w+", source.dtype, source.shape)
    flat_in, flat_out = source.reshape(-1), target.reshape(-1)
    crc = 0
    for start in range(0, len(flat_in), _COPY_TOKENS):
        chunk = np.ascontiguousarray(flat_in[start : start + _COPY_TOKENS])
        flat_out[start : start + _COPY_TOKENS] = chunk
        crc = zlib.crc32(chunk, crc)
    target.flush()
    del target, flat_out
    with open(staged, "rb+") as f:
        os.fsync(f.fileno())
    shape = {"tokens": len(source)} if source.ndim == 1 else {"shape": list(source.shape)}
    record = shape | {"dtype": source.dtype.name, "crc32": crc} | extra
    files.write_json(_record_path(path), record)
    os.replace(staged, path)


def _record_path(path: str) -> str:
    return f"{path[:-4]}.json"


def _checksum(ids: np.ndarray) -> int:
    flat, crc = ids.reshape(-1), 0
    for start in range(0, len(flat), _COPY_TOKENS):
        crc = zlib.crc32(np.ascontiguousarray(flat[start : start + _COPY_TOKENS]), crc)
    return crc


def _verified(path: str, dtype: np.dtype) -> tuple[np.ndarray | None, Any]:
    """The cache file `path` memory-mapped, if it is whole: its `.npy` header reads, and its
    shape, type and CRC-32 are those of the record beside it; else None. The second value is
    the record, or why the file does not verify."""
    try:
        with open(_record_path(path), "rb") as f:
            record = json.load(f)
        ids = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError as e:
        return None, f"no {e.filename}"
    except (OSError, ValueError, EOFError) as e:
        return None, errors.first_line(e)
    if not isinstance(record, dict) or not {"dtype", "crc32"} <= set(record):
        return None, f"{_record_path(path)} is not a token cache's record"
    shape = tuple(record["shape"]) if "shape" in record else (record.get("tokens"),)
    if ids.shape != shape or ids.dtype.name != record["dtype"] != dtype.name:
        return None, (
            f"it holds {ids.shape} {ids.dtype.name} where its record says {shape} {record['dtype']}"
        )
    if ids.dtype != dtype:
        return None, f"it holds {ids.dtype.name} ids where this vocabulary takes {dtype.name}"
    if _checksum(ids) != record["crc32"]:
        return None, "its ids do not match their CRC-32: the file was changed after it was written"
    return np.asarray(ids), record


def tokens(corpus: Corpus) -> np.ndarray:
    """The corpus's token ids, a read-only memory-mapped 1-D array, built into the cache first
    where no run has, or where the file there does not verify (one log line says which)."""
    path = corpus.path()

    def write(path: str) -> str:
        count = _write(corpus, path)
        return f"tokenized {len(corpus.files)} files into {count:,} tokens"

    what = f"tokens of {len(corpus.files)} files"
    return load(path, corpus.dtype, corpus.cache_dir, write, what)[0]


def load(path: str, dtype: np.dtype, cache_dir: str, write: Callable[[str], str], what: str):
    """`(array, record)` of the cache file `path`, memory-mapped read-only; built first by
    `write(path)` (which returns what it did, for the log) under the lock beside it where no
    process has, or where the file there does not verify (a warning says why). `what` names
    the contents in the log line of a reuse."""
    if path in _OPENED:
        return _OPENED[path]
    array, broken = None, None
    if os.path.exists(path):
        array, record = _verified(path, dtype)
        if array is None:
            logging.warning(
                "data: the token cache %s does not verify (%s): building it again", path, record
            )
            broken = _identity(path)
    if array is None:
        built = _build(cache_dir, path, write, broken)
        array, record = _verified(path, dtype)
        if array is None:
            raise errors.StorageError(
                f"the token cache {path} does not verify once written: {record}"
            )
    else:
        built = None
    if built is None:
        logging.info("data: reusing the %s: %s", what, path)
    _OPENED[path] = array, record
    return array, record


def _identity(path: str) -> tuple[int, int, int] | None:
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return stat.st_ino, stat.st_size, stat.st_mtime_ns


def _build(cache_dir: str, path: str, write: Callable[[str], str], broken=None) -> str | None:
    """Writes the cache file `path` (`write(path)`) under the lock beside it, unless another
    process has by the time the lock is ours (a file other than the `broken` one, an
    `_identity`); what it did, or None. A cache folder that cannot be written is a
    `ConfigError` naming `data.cache_dir`; a failed write a `StorageError` naming the file."""
    made = not os.path.isdir(cache_dir)
    try:
        os.makedirs(cache_dir, exist_ok=True)
        lock = open(lock_path := f"{path[:-4]}.lock", "a")  # noqa: SIM115 (held to the end)
    except OSError as e:
        raise errors.ConfigError(
            f"config.data.cache_dir={cache_dir!r}: cannot write there ({e.strerror or e})"
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
            done = write(path)
        except OSError as e:
            raise errors.StorageError(
                f"could not write the token cache {path}: {e.strerror or e}"
            ) from None
        except errors.ConfigError:  # bad input: nothing of this build stays behind
            _remove(lock_path, cache_dir if made else None)
            raise
    logging.info("data: %s in %.1f s: %s", done, time.perf_counter() - start, path)
    return done


def _remove(lock: str, made: str | None) -> None:
    """A refused build's lock file, and the cache folder it made if nothing else is there. The
    file's name is a hash of the input, which every process waiting on this lock is refused
    too; one that builds after all (under other template bounds, say) may build beside a newer
    process at worst, each staging its own file and renaming it into place whole."""
    with contextlib.suppress(OSError):
        os.remove(lock)
    if made:
        with contextlib.suppress(OSError):
            os.rmdir(made)
