"""Per-layer numerics inside a scanned stack (`models.decoder.stack`): a row per call per layer.

A scanned block's module calls are traced once, inside the scan's body, so a recorder that
closed over one taps array would sum the layers' rows (and their amaxes) into one. Instead the
stack's loop asks here for its layers' rows of the table, `[layers, calls a layer, columns]`, a
slice of the taps array that the step differentiates, and hands each layer its own rows as a
per-layer input of the scan: the scan's gradient stacks the layers' rows back in place.

Discovery (`numerics.discover`, which traces the loss without running it) finds how many calls
a layer makes; `expand` then gives every layer its own rows, named as the unrolled model's
(`layers_<i>/attn/q`), each layer's parameter gradient its slice of the stacked one.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from typing import Any

from mptrain.parallel import sharding

# the recording under way (`numerics.recording`'s `_Recording`), or None
ACTIVE: contextvars.ContextVar[Any] = contextvars.ContextVar("mptrain_numerics", default=None)


@dataclasses.dataclass
class Scan:
    """One scanned run of `layers` steps of `stride` blocks each (layers `first`, `first + 1`,
    ...), whose calls start at row `start`; `rows`: their rows of the table, a step's calls a
    row of `[layers, calls, columns]` (None while discovering)."""

    rec: Any
    start: int
    layers: int
    first: int
    stride: int = 1
    rows: Any = None
    key: tuple[str, ...] = ()  # the stack's key under `sharding.STACKED`
    offset: int = 0  # the stack's first layer: a layer's row of its stacked gradients is i - it


def begin(
    layers: int, first: int, stride: int = 1, key: tuple[str, ...] = (), offset: int = 0
) -> Scan | None:
    """Before the scan: its rows, when a recording with taps is under way (else None)."""
    rec = ACTIVE.get()
    if rec is None or rec.taps is None:
        return None
    start = len(rec.paths) + rec.offset
    scan = Scan(rec, start, layers, first, stride, key=key, offset=offset)
    if rec.given is not None:  # the calls are known: the layers' rows of the taps array
        calls = rec.groups[start][1]
        rows = rec.taps[start - rec.base : start - rec.base + layers * calls]
        scan.rows = rows.reshape(layers, calls, rows.shape[-1])
    return scan


@contextlib.contextmanager
def layer(scan: Scan | None, rows: Any):
    """Inside the scan's body: the calls tap into this layer's `rows`."""
    if scan is None or rows is None:
        yield
        return
    rec, saved = scan.rec, (scan.rec.taps, scan.rec.base)
    rec.taps, rec.base = rows, scan.start
    try:
        yield
    finally:
        rec.taps, rec.base = saved


def end(scan: Scan | None) -> None:
    """After the scan: the rows of its layers past the first are taken."""
    if scan is None:
        return
    rec = scan.rec
    calls = len(rec.paths) + rec.offset - scan.start
    group = (scan.start, calls, scan.layers, scan.first, scan.stride, scan.key, scan.offset)
    rec.groups.setdefault(scan.start, group)
    rec.offset += (scan.layers - 1) * calls


def expand(rec: Any, plans: dict) -> tuple:
    """The fields of a recording's `numerics.Calls`, each scanned block's calls given a row per
    layer."""
    total = len(rec.paths) + rec.offset
    scopes, paths, parents, layers = [()] * total, [""] * total, [-1] * total, [-1] * total
    group_of = lambda index: next(
        (g for g in rec.groups.values() if g[0] <= index < g[0] + g[1]), None
    )
    for k, index in enumerate(rec.index_of):
        group = group_of(index)
        if group is None:
            scopes[index], paths[index] = rec.scopes[k], rec.paths[k]
            parents[index] = rec.parents[k]
            continue
        start, calls, count, first, stride, key, offset = group
        within = (index - start) // (calls // stride)  # the block of a step that made the call
        for i in range(count):
            at, parent, layer = index + i * calls, rec.parents[k], first + i * stride + within
            scopes[at], layers[at] = (sharding.STACKED, *key, *rec.scopes[k]), layer - offset
            paths[at] = "/".join((f"layers_{layer}", *rec.scopes[k]))
            parents[at] = parent + i * calls if group_of(parent) else parent
    expanded = {}
    for (index, side), plan in plans.items():
        group = group_of(index)
        for i in range(group[2] if group else 1):
            step = i * group[1] if group else 0
            move = lambda tap, step=step: (tap[0] + step, tap[1]) if group_of(tap[0]) else tap
            expanded[move((index, side))] = dataclasses.replace(
                plan,
                forward_from=tuple(map(move, plan.forward_from)),
                backward_from=tuple(map(move, plan.backward_from)),
            )
    plans = tuple(sorted(expanded.items()))
    return (
        tuple(scopes),
        tuple(paths),
        tuple(parents),
        plans,
        tuple(layers),
        tuple(rec.groups.values()),
    )
