"""Finding the zoo's pieces by name: `config.model.name` and `config.data.name` name a module of
`mptrain.models` or `mptrain.data` that defines the package's entry point."""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterable
from typing import Any

from mptrain import errors


def modules(package: str, path: Iterable[str], entry: str) -> dict[str, Any]:
    """`{name: module}` of the modules of `package` (at `path`) that define `entry`."""
    found = {}
    for info in pkgutil.iter_modules(path):
        module = importlib.import_module(f"{package}.{info.name}")
        if hasattr(module, entry):
            found[info.name] = module
    return found


def lookup(key: str, name: Any, found: dict[str, Any], what: str) -> Any:
    """`found[name]`, in any case and without surrounding blanks (as every choice of a config
    is read); else a `ValueError` naming `key`, the closest name and all valid ones."""
    plain = name.strip().lower() if isinstance(name, str) else name
    if plain not in found:
        raise ValueError(
            f"{key}={name!r}: no such {what}; "
            f"{errors.did_you_mean(str(name), found, list_all=True)}"
        )
    return found[plain]
