"""Files at the bottom of the imports: JSON written atomically, the leftovers of interrupted
writes, and what a failed write ran into.

Checkpoint metadata, `config.json`, the numerics tables and the scripts' results all go through
`write_json`, so a reader never sees half a file, whatever process writes it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import secrets
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np

from mptrain import errors

# `.<name>.<random>.tmp` beside the file `write_json` is writing; `mkstemp`, used before, also
# made names of this shape, so its leftovers are recognised too.
_TEMPORARY = re.compile(r"\..+\.[A-Za-z0-9_]+\.tmp")

# The storage failures a user can act on, by errno, in the words the one-line error uses.
_CAUSES = {
    errno.ENOSPC: "disk full",
    errno.EDQUOT: "disk quota exceeded",
    errno.EROFS: "read-only filesystem",
    errno.EACCES: "permission denied",
    errno.EPERM: "permission denied",
}
# tensorstore raises ValueError/RuntimeError, not OSError, and puts the errno in the text.
_OS_ERROR_CODE = re.compile(r"os_error_code='?(\d+)")


def storage_cause(error: BaseException | str | None) -> str | None:
    """What a failed write ran into, in a few words (`disk full (No space left on device)`), or
    None when `error` is no storage failure.

    Every `OSError` is one, but a timeout or a lost connection (a multi-host barrier's, say):
    those are not the disk's. Other exceptions (and log messages) are when their text holds an
    errno, as tensorstore writes it, or the system's wording of a full disk, a read-only
    filesystem or a denied permission: orbax passes tensorstore's errors on unchanged.
    """
    if error is None or isinstance(error, TimeoutError | ConnectionError):
        return None
    text, code = str(error), getattr(error, "errno", None)
    if isinstance(error, OSError) and not isinstance(code, int):
        return text or type(error).__name__
    if not isinstance(error, OSError):
        found = _OS_ERROR_CODE.search(text)
        worded = [c for c in _CAUSES if os.strerror(c) in text]
        code = int(found.group(1)) if found else (worded[0] if worded else None)
    if code is None:
        return None
    words = os.strerror(code)
    if isinstance(error, OSError) and error.filename:
        words += f": {error.filename}"
    return f"{_CAUSES[code]} ({words})" if code in _CAUSES else words


def storage_error(error: BaseException, what: str, then: str = "") -> errors.StorageError | None:
    """`could not write <what>: <cause><then>` as one `StorageError` line when `error` is a
    storage failure (see `storage_cause`), else None. A `StorageError` raised inside (by
    `writing`, say, around a file of the job) is told again as the caller's `what`: a reader
    wants the export or the checkpoint that failed, not its staging file."""
    if isinstance(error, errors.StorageError):
        error = error.__cause__
    if not isinstance(error, Exception):
        return None
    cause = storage_cause(error)
    return cause and errors.StorageError(f"could not write {what}: {cause}{then}")


@contextlib.contextmanager
def writing(what: str | os.PathLike):
    """Within the block, a storage failure (`storage_cause`) is one `StorageError` line naming
    `what` (exit 1); other errors pass unchanged."""
    try:
        yield
    except Exception as e:
        error = storage_error(e, str(what))
        if error is None:
            raise
        raise error from e


# What a run keeps in its workdir, as files and as folders: something else of the same name
# (a folder where a file goes, or the reverse) stops it at start, before anything compiles.
WORKDIR_FILES = ("config.json", "history.jsonl", "curves.png", "precision_report.txt", ".lock")
WORKDIR_FOLDERS = ("checkpoints", "numerics")


_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def cache_dir(*parts: str) -> Path:
    """`$MPTRAIN_CACHE/<parts>`, else `~/.cache/mptrain/<parts>`: what mptrain keeps on local
    disk between runs (token caches, the stages of workdirs on object storage)."""
    root = os.environ.get("MPTRAIN_CACHE") or os.path.join("~", ".cache", "mptrain")
    return Path(os.path.expanduser(root), *parts)


def check_local(flag: str, path: str | os.PathLike) -> None:
    """A `ConfigError` (exit 2) where `path` is a URL (`s3://BUCKET/RUN`, `gs://...`): exports,
    outputs and a `Trainer`'s workdir are folders of a local or shared POSIX filesystem (a run
    started by `mptrain.run` or the CLI stages an s3:// or gs:// workdir: `mptrain.mirror`), and
    a URL taken as one would be written, with everything in it, to a local folder named `s3:`."""
    found = _URL.match(os.fspath(path))
    if found:
        raise errors.ConfigError(
            f"{flag}={os.fspath(path)}: a {found.group(1)}:// URL; this writes to a local or "
            "shared POSIX folder only (a run's --workdir may be s3:// or gs://): give its path"
        )


def check_workdir(workdir: str | os.PathLike) -> None:
    """A `WorkdirError` (exit 2) when the workdir is a folder this process cannot write in (a
    finished run's made read-only: its `.lock` may still be writable, and is left untouched), or
    naming the first path of the workdir that has the wrong kind."""
    if os.path.isdir(workdir) and not _writable(workdir):
        raise errors.WorkdirError(
            f"workdir {workdir} is not writable (permission denied, or a read-only filesystem): "
            "a run writes its record and checkpoints there; use another --workdir"
        )
    for name in (*WORKDIR_FILES, *WORKDIR_FOLDERS):
        path = os.path.join(workdir, name)
        folder = name in WORKDIR_FOLDERS
        if os.path.lexists(path) and os.path.isdir(path) != folder:
            have, want = ("a folder", "a file") if not folder else ("not a folder", "a folder")
            raise errors.WorkdirError(
                f"{path} is {have} where a run keeps {want} of that name: move it away, or "
                "use another --workdir"
            )


def check_output(flag: str, path: str | os.PathLike, folder: bool = False) -> None:
    """Refuses, before any work, an output `path` that cannot be made: a `ConfigError` (exit 2)
    naming `flag` where the nearest existing folder above it is a file, or where a file is
    asked for and `path` is a folder; a `StorageError` (exit 1) where that folder cannot be
    written in (read-only, no permission), as a failed write would be told. (Whether an
    existing folder may be written into is its command's rule.)"""
    check_local(flag, path)
    path = Path(path).absolute()
    if not folder and path.is_dir():
        raise errors.ConfigError(f"{flag}={path}: is a folder; give the path of a file")
    above = path.parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise errors.ConfigError(f"{flag}={path}: {above} is a file, not a folder")
    if (failed := _probe(above)) is not None:
        raise storage_error(failed, str(path)) or errors.StorageError(
            f"could not write {path}: {failed}"
        )


def _writable(directory: str | os.PathLike) -> bool:
    """Whether a file can be made in `directory` (`_probe`)."""
    return _probe(directory) is None


def _probe(directory: str | os.PathLike) -> OSError | None:
    """Why a file cannot be made in `directory`, or None: tried, not `os.access`'d, which says
    yes to root in a folder without write permission only to fail on a read-only filesystem."""
    probe = os.path.join(directory, f".mptrain-probe.{secrets.token_hex(4)}.tmp")
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        os.remove(probe)
    except OSError as e:
        return e
    return None


def quiet_storage_failures(library: str) -> None:
    """Leaves a storage failure in `library` (a part of its path, such as "/orbax/") to be told
    in one line by whoever raises it. Drops what the library says of it besides: the error
    records it logs through absl's logger, tracebacks included, and the tracebacks its other
    writes, abandoned when one fails, print from the background once their event loop has
    closed ("Event loop is closed", through `sys.unraisablehook`). Once per process is enough.
    """
    logger = logging.getLogger("absl")
    if not any(getattr(f, "part", None) == library for f in logger.filters):
        logger.addFilter(StorageFailureFilter(library))
    if not getattr(sys.unraisablehook, "closed_loops_dropped", False):
        sys.unraisablehook = _dropping_closed_loops(sys.unraisablehook)


def _dropping_closed_loops(hook):
    def quieter(unraisable) -> None:
        error = unraisable.exc_value
        if not (isinstance(error, RuntimeError) and str(error) == "Event loop is closed"):
            hook(unraisable)

    quieter.closed_loops_dropped = True
    return quieter


class StorageFailureFilter(logging.Filter):
    """Drops the error records (tracebacks included) that a library whose path holds `part`
    logs about a storage failure it then raises (see `quiet_storage_failures`)."""

    def __init__(self, part: str):
        super().__init__()
        self.part = part

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or self.part not in record.pathname.replace("\\", "/"):
            return True
        error = record.exc_info[1] if record.exc_info else None
        return storage_cause(error) is None and storage_cause(record.getMessage()) is None


def is_temporary(name: str) -> bool:
    """Whether `name` is a temporary file of `write_json`."""
    return _TEMPORARY.fullmatch(name) is not None


def remove_temporaries(*directories: str | os.PathLike) -> list[str]:
    """Deletes the temporaries that interrupted `write_json`s left in `directories`; returns
    their paths.

    Only the one writer of those files may call it (the run that holds the workdir): another
    writer's temporary may be in use.
    """
    removed = []
    for directory in directories:
        for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
            if is_temporary(name):
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, name))
                    removed.append(os.path.join(directory, name))
    return removed


def _json_default(obj: Any) -> Any:
    """Lenient JSON: ConfigDicts, dtypes and numpy values as themselves, the rest as str()."""
    if hasattr(obj, "to_dict"):  # ml_collections.ConfigDict / FrozenConfigDict
        return obj.to_dict()
    if isinstance(obj, np.dtype) or (isinstance(obj, type) and hasattr(obj, "dtype")):
        return np.dtype(obj).name  # np.float32, jnp.bfloat16, np.dtype("int8") -> "int8"
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray | jax.Array):
        return np.asarray(obj).tolist()
    return str(obj)


def to_jsonable(obj: Any) -> Any:
    """`obj` turned into plain JSON types (dict, list, str, numbers, bool, None)."""
    return json.loads(json.dumps(obj, default=_json_default))


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Writes `obj` as indented JSON, atomically (`write_text`). Values JSON cannot hold are
    written as their `str()`."""
    write_text(path, json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def write_text(path: str | os.PathLike, text: str | bytes) -> None:
    """Writes `text` (or bytes) to `path` atomically: a reader sees the old file or the new one.

    The text goes to a temporary file in the same directory, is flushed to disk, and replaces
    `path` with `os.replace`. A write that a kill interrupts leaves its temporary behind
    (`is_temporary`); the owner of the folder removes those (`remove_temporaries`: a run, at
    start-up). The file gets the mode any new file gets (0666 less the umask), not `mkstemp`'s
    private 0600.
    """
    path = os.fspath(path)
    directory, name = os.path.split(os.path.abspath(path))
    with writing(path):
        _write_text(directory, name, path, text)


def _write_text(directory: str, name: str, path: str, text: str | bytes) -> None:
    os.makedirs(directory, exist_ok=True)
    while True:
        tmp = os.path.join(directory, f".{name}.{secrets.token_hex(4)}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:  # another name, then
            continue
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
