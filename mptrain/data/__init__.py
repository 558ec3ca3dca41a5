"""Deterministic batch sources: batch ``i`` is a pure function of ``(seed, i)``.

Each module here (`text`, `tfds`, `synthetic`, ...) provides `create_sources(config) -> (train,
eval)`; both sources have `get_batch(i) -> dict of numpy arrays` holding the global batch. A
resumed run needs nothing but the step number to continue the data exactly.
"""

import importlib


def create_sources(config):
    """Host-side: the `(train, eval)` sources of `mptrain.data.<config.data.name>`."""
    module = importlib.import_module(f"mptrain.data.{config.data.name}")
    return module.create_sources(config)
