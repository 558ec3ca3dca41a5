"""A run's params written alone, for `python -m mptrain.export --format=orbax`: a plain orbax
checkpoint (`params/`, restored into numpy without mptrain) in the folder the export stages."""

from __future__ import annotations

import os
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp


def save_params(folder: str | os.PathLike, params: Any) -> None:
    """Writes `params` (numpy arrays) as a plain orbax checkpoint in `folder/params`."""
    checkpointer = ocp.PyTreeCheckpointer()
    try:
        checkpointer.save(os.path.join(os.fspath(folder), "params"), params)
    finally:
        checkpointer.close()


def load_standalone(directory: str | os.PathLike) -> Any:
    """An exported `params` tree as numpy arrays (what plain orbax gives)."""
    path = os.path.join(os.path.abspath(directory), "params")
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(path).item_metadata.tree
    as_numpy = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    return checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=as_numpy))
