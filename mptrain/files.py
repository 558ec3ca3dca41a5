"""Files at the bottom of the imports: JSON written atomically, with lenient value types.

Checkpoint metadata, `config.json`, the numerics tables and the scripts' results all go through
`write_json`, so a reader never sees half a file, whatever process writes it.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

import jax
import numpy as np


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
    """Writes `obj` as indented JSON, atomically: a reader sees the old file or the new one.

    The text goes to a temporary file in the same directory, is flushed to disk, and replaces
    `path` with `os.replace`. Values JSON cannot hold are written as their `str()`.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    text = json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{os.path.basename(path)}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
