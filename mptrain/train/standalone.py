"""A run's params written alone, for `python -m mptrain.export --format=orbax`: a plain orbax
checkpoint (`params/`, restored into numpy without mptrain) and its `export.json` sidecar."""

from __future__ import annotations

import os
import secrets
import shutil
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from mptrain import files


def save_standalone(directory: str | os.PathLike, params: Any, sidecar: dict) -> None:
    """Writes `params` (numpy arrays) as a plain orbax checkpoint in `directory/params`, and
    `sidecar` as `directory/export.json`; all or nothing (written beside, then renamed), with
    the modes the umask gives. A storage failure is one `errors.StorageError` line."""
    directory = os.path.abspath(directory)
    parent = os.path.dirname(directory)
    staging = os.path.join(parent, f".export-{secrets.token_hex(4)}")
    try:
        os.makedirs(parent, exist_ok=True)
        os.mkdir(staging)  # 0777 less the umask: mkdtemp's 0700 would hide the export
        checkpointer = ocp.PyTreeCheckpointer()
        checkpointer.save(os.path.join(staging, "params"), params)
        checkpointer.close()
        files.write_json(os.path.join(staging, "export.json"), sidecar)
        if os.path.isdir(directory):  # an empty folder the user made for it
            os.rmdir(directory)
        os.rename(staging, directory)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)
        error = files.storage_error(e, f"the export at {directory}")
        if error is None:
            raise
        raise error from e


def load_standalone(directory: str | os.PathLike) -> Any:
    """An exported `params` tree as numpy arrays (what plain orbax gives)."""
    path = os.path.join(os.path.abspath(directory), "params")
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
