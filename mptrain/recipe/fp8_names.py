"""Host-side readings of the fp8 scaling state (`mptrain.recipe.fp8`): the names of its
layers and tensors for the log, which matmuls run in fp8 for the precision report."""

from __future__ import annotations

import re
from typing import Any

from flax import traverse_util

from mptrain.parallel.sharding import STACKED  # a scanned stack's scaling state lives under it
from mptrain.recipe.fp8 import META, TENSORS


def counter_names(model_state: Any) -> list[str]:
    """Host-side, from the structure alone: `"<layer path> <tensor>"` for each entry of
    `counters`, e.g. "block_0/mlp/fc_in grad"."""
    flat = traverse_util.flatten_dict(model_state[META])
    names = []
    for path in sorted(flat):
        if path[-1] != "saturated":
            continue
        layer = [p for p in path[:-2] if p != "DotGeneral_0"]
        if STACKED not in layer:
            names.append("/".join(layer))
            continue
        # a scanned stack: (..., STACKED, "layers_<first>-<last>", ...), a layer a row
        at = layer.index(STACKED)
        first, last = map(int, layer[at + 1].removeprefix("layers_").split("-"))
        rest = "/".join(layer[at + 2 :])
        names += [f"layers_{i}/{rest}" for i in range(first, last + 1)]
    return [f"{name} {tensor}" for name in names for tensor in TENSORS]


def describe(model_state: Any) -> str:
    """Host-side: which matmuls run in fp8, from the scaling state's structure, e.g.
    "attn/o, attn/q, mlp/down, mlp/gate, mlp/up in layers 1-30 (150 matmuls)"."""
    if not isinstance(model_state, dict) or META not in model_state:
        return "none (the size and layer rules leave none)"
    by_matmul: dict[str, list[int]] = {}
    for name in counter_names(model_state)[:: len(TENSORS)]:
        path = name.split(" ")[0]
        found = re.match(r"(?:layers|block)_(\d+)/(.*)", path)
        layer, matmul = (int(found[1]), found[2]) if found else (-1, path)
        by_matmul.setdefault(matmul, []).append(layer)
    groups: dict[tuple[int, ...], list[str]] = {}
    for matmul, layers in sorted(by_matmul.items()):
        groups.setdefault(tuple(sorted(layers)), []).append(matmul)
    parts = []
    for layers, matmuls in groups.items():
        spans = _spans([n for n in layers if n >= 0])
        where = f" in layer{'s' * (len(layers) > 1)} {spans}" if spans else ""
        parts.append(f"{', '.join(matmuls)}{where} ({len(layers) * len(matmuls)} matmuls)")
    return "; ".join(parts) or "none"


def _spans(numbers: list[int]) -> str:
    """`[0, 1, 2, 5]` -> "0-2, 5"."""
    out, start = [], None
    for i, n in enumerate(numbers):
        start = n if start is None else start
        if i + 1 == len(numbers) or numbers[i + 1] != n + 1:
            out.append(f"{start}-{n}" if n > start else f"{n}")
            start = None
    return ", ".join(out)


def stack_name(start: int, stop: int) -> str:
    """The key, under `STACKED`, of the scaling state of a scanned stack's blocks
    `start..stop-1` (their layer numbers, which the log's names give)."""
    return f"layers_{start}-{stop - 1}"


def _last(values: Any, size: int) -> Any:
    import numpy as np

    return np.asarray(values).reshape(-1, size)[-1]  # of several steps per call: the last


def log_values(metrics: dict, names: list[str]) -> dict[str, float]:
    """Host-side: a log step's TensorBoard scalars, per fp8 layer and tensor: the newest amax
    and the updates clipped so far (`fp8_amax/block_0/mlp/fc_in/grad`, `fp8_clipped/...`)."""
    tags = [name.replace(" ", "/") for name in names]
    found = {}
    for tag, key in (("fp8_amax", "fp8_amax"), ("fp8_clipped", "fp8_saturated")):
        row = _last(metrics[key], len(tags))
        found |= {f"{tag}/{t}": float(v) for t, v in zip(tags, row, strict=True)}
    return found


def clipped_again(names: list[str], counts: Any, seen: Any) -> tuple[list[str], Any]:
    """Host-side: `(["<layer> <tensor> (Nx)", ...], counts)` for the tensors clipped in two or
    more updates since the counters `seen` (None: since the start); their scale lags their
    amax (a margin, a shorter history or current scaling help)."""
    counts = _last(counts, len(names))
    since = counts - (0 if seen is None else seen)
    return [f"{n} ({int(c)}x)" for n, c in zip(names, since, strict=True) if c >= 2], counts
