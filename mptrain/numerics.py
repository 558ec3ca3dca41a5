"""Per-layer numerics, recorded on the device inside the train step: which layer went non-finite
first, forward or backward, and how close each layer's values and gradients are to the edges of
the compute dtype.

For every module call (flax's method interception; `__call__` only) the recorder taps the
call's floating inputs and outputs with an identity whose custom VJP reports back:

- forward, on the output: the largest finite magnitude (amax), the count of non-finite values,
  and of the non-zero values the count that underflow (below the compute dtype's smallest
  normal number: subnormal there, or flushed to zero); on the inputs: the non-finite count;
- backward, the same for the gradient flowing into the output (incoming) and the non-finite
  count of the gradient flowing out to the inputs (outgoing).

Each tap writes its numbers into the cotangent of a small zero "taps" array, one row per call,
so one `jax.grad` of the loss with respect to the taps returns the whole table: no host round
trip, no re-running. The first non-finite value is then located on the device too: forward, the
innermost call whose inputs were finite and whose output was not; backward (looked at only when
the forward was finite), the innermost call whose incoming gradient was finite and whose
outgoing gradient, or its own parameters' gradient, was not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
from collections.abc import Callable, Iterator
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct

from mptrain import checkpoint

COLUMNS = (
    "in_nonfinite",  # forward: non-finite values among the call's floating inputs
    "out_amax",  # forward: the output's largest finite magnitude
    "out_nonfinite",
    "out_underflow",  # non-zero values below the compute dtype's smallest normal number
    "out_nonzero",
    "grad_out_amax",  # backward: the gradient flowing into the output
    "grad_out_nonfinite",
    "grad_out_underflow",
    "grad_out_nonzero",
    "grad_in_nonfinite",  # backward: the gradient flowing out to the inputs
    "param_grad_nonfinite",  # the gradient of the call's module's parameters
)
_COL = {name: i for i, name in enumerate(COLUMNS)}
_MAX = np.array(["amax" in name for name in COLUMNS])  # combined over devices by max, else sum
DIRECTIONS = ("forward", "backward")


@dataclasses.dataclass(frozen=True)
class Calls:
    """The module calls of one trace of the loss, in the order they start: each call's module
    scope (its path in the params tree), a readable path, and the index of the call it runs
    inside (-1 at the top)."""

    scopes: tuple[tuple[str, ...], ...]
    paths: tuple[str, ...]
    parents: tuple[int, ...]

    def descendants(self) -> np.ndarray:
        """`d[i, j]`: call j runs inside call i (at any depth)."""
        d = np.zeros((len(self.paths),) * 2, bool)
        for j, parent in enumerate(self.parents):
            while parent >= 0:
                d[parent, j] = True
                parent = self.parents[parent]
        return d


def _stats(leaves: list, tiny: float) -> jax.Array:
    """float32[4]: amax of the finite values, non-finite count, underflow count, non-zeros."""
    parts = jnp.zeros((4,), jnp.float32)
    for x in leaves:
        x = jnp.abs(x.astype(jnp.float32))
        finite = jnp.isfinite(x)
        nonzero = finite & (x > 0)
        parts = parts + jnp.stack(
            [
                0.0,
                jnp.sum(~finite, dtype=jnp.float32),
                jnp.sum(nonzero & (x < tiny), dtype=jnp.float32),
                jnp.sum(nonzero, dtype=jnp.float32),
            ]
        )
        parts = parts.at[0].max(jnp.max(jnp.where(finite, x, 0.0), initial=0.0))
    return parts


def _row(taps: jax.Array, index: int, values: dict[str, jax.Array]) -> jax.Array:
    row = jnp.zeros((len(COLUMNS),), jnp.float32)
    for name, value in values.items():
        row = row.at[_COL[name]].set(value)
    return jnp.zeros_like(taps).at[index].set(row)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _tap(leaves: list, taps: jax.Array, index: int, side: str, tiny: float) -> list:
    """The identity on `leaves`; its VJP reports their statistics (see the module doc)."""
    del taps, index, side, tiny
    return leaves


def _tap_forward(leaves, taps, index, side, tiny):
    return leaves, (_stats(leaves, tiny), taps)


def _tap_backward(index, side, tiny, residuals, grads):
    forward, taps = residuals
    backward = _stats([g for g in grads if g.dtype != jax.dtypes.float0], tiny)
    if side == "in":
        row = {"in_nonfinite": forward[1], "grad_in_nonfinite": backward[1]}
    else:
        names = ("amax", "nonfinite", "underflow", "nonzero")
        row = {f"out_{n}": forward[k] for k, n in enumerate(names)}
        row |= {f"grad_out_{n}": backward[k] for k, n in enumerate(names)}
    # the taps' cotangent: zeros, with this call's row filled in
    return grads, _row(taps, index, row)


_tap.defvjp(_tap_forward, _tap_backward)


class _Recording:
    def __init__(self, taps: jax.Array | None, tiny: float):
        self.taps, self.tiny = taps, tiny
        self.scopes: list[tuple[str, ...]] = []
        self.paths: list[str] = []
        self.parents: list[int] = []
        self._open: list[int] = []

    def _tapped(self, tree: Any, index: int, side: str) -> Any:
        leaves, treedef = jax.tree.flatten(tree)
        floating = [
            i
            for i, x in enumerate(leaves)
            if isinstance(x, jax.Array | np.ndarray) and jnp.issubdtype(x.dtype, jnp.floating)
        ]
        if self.taps is None:
            return tree
        tapped = _tap([leaves[i] for i in floating], self.taps, index, side, self.tiny)
        for i, x in zip(floating, tapped, strict=True):
            leaves[i] = x
        return jax.tree.unflatten(treedef, leaves)

    def intercept(self, next_fun: Callable, args, kwargs, context) -> Any:
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        index = len(self.paths)
        module = context.module
        scope = tuple(module.scope.path) if module.scope is not None else ()
        self.scopes.append(scope)
        self.paths.append("/".join(scope) or type(module).__name__)
        self.parents.append(self._open[-1] if self._open else -1)
        self._open.append(index)
        try:
            args, kwargs = self._tapped((args, kwargs), index, "in")
            return self._tapped(next_fun(*args, **kwargs), index, "out")
        finally:
            self._open.pop()

    def calls(self) -> Calls:
        return Calls(tuple(self.scopes), tuple(self.paths), tuple(self.parents))


@contextlib.contextmanager
def recording(taps: jax.Array | None, compute_dtype: Any) -> Iterator[_Recording]:
    """Records every flax module call made inside the block; with `taps` (a zero float32
    `[calls, len(COLUMNS)]` array), differentiating with respect to `taps` gives the table."""
    rec = _Recording(taps, float(jnp.finfo(compute_dtype).tiny))
    with nn.intercept_methods(rec.intercept):
        yield rec


def loss_calls(loss_fn: Callable, state: Any, batch: Any) -> Calls:
    """The module calls of `loss_fn(params, model_state, batch, rng)` as the train step makes
    them (params and batch in the state's compute dtype)."""
    policy = state.policy

    def loss(params, batch):
        return loss_fn(params, state.model_state, batch, jax.random.key(0))

    return discover(loss, policy.cast_to_compute(state.params), policy.cast_to_compute(batch))


def discover(fn: Callable, *args: Any) -> Calls:
    """The module calls `fn(*args)` makes, found by tracing it abstractly (nothing runs)."""
    found = []

    def traced(*args):
        with recording(None, jnp.float32) as rec:
            out = fn(*args)
        found.append(rec.calls())
        return out

    jax.eval_shape(traced, *args)
    return found[-1]


def combine(table: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """The table of the whole batch from each device's: amax by max, counts by sum."""
    return jnp.where(_MAX, jax.lax.pmax(table, axes), jax.lax.psum(table, axes))


def with_param_grads(table: jax.Array, calls: Calls, grads: Any) -> jax.Array:
    """The table with `param_grad_nonfinite` filled: each call's module's parameter gradients
    (its subtree of `grads`, found by path)."""
    counts = []
    for scope in calls.scopes:
        subtree = grads
        for name in scope:
            subtree = subtree.get(name, {}) if isinstance(subtree, dict) else {}
        leaves = [x for x in jax.tree.leaves(subtree) if jnp.issubdtype(x.dtype, jnp.floating)]
        counts.append(sum((jnp.sum(~jnp.isfinite(x), dtype=jnp.float32) for x in leaves), 0.0))
    return table.at[:, _COL["param_grad_nonfinite"]].set(jnp.stack(counts))


def origin(table: jax.Array, calls: Calls) -> jax.Array:
    """int32[2]: `(call index, direction)` of the first non-finite value, `(-1, -1)` if none.

    Candidates, forward: finite inputs, non-finite output; backward (only when the whole forward
    was finite): finite incoming gradient, non-finite outgoing or parameter gradient. Of these,
    the innermost: a candidate with no candidate inside it. Forward, the first such call to run;
    backward, the last (the backward pass runs them in reverse).
    """
    inside = jnp.asarray(calls.descendants())
    col = lambda name: table[:, _COL[name]]
    forward = (col("in_nonfinite") == 0) & (col("out_nonfinite") > 0)
    backward = (col("grad_out_nonfinite") == 0) & (
        (col("grad_in_nonfinite") > 0) | (col("param_grad_nonfinite") > 0)
    )
    innermost = lambda c: c & ~jnp.any(inside & c[None, :], axis=1)
    order = jnp.arange(len(calls.paths))
    first = jnp.min(jnp.where(innermost(forward), order, len(order)))
    last = jnp.max(jnp.where(innermost(backward), order, -1))
    forward_bad = jnp.any(col("out_nonfinite") > 0)
    index = jnp.where(forward_bad, jnp.where(first < len(order), first, -1), last)
    direction = jnp.where(index < 0, -1, jnp.where(forward_bad, 0, 1))
    return jnp.stack([index, direction]).astype(jnp.int32)


def describe(step: int, index: int, direction: int, calls: Calls) -> str:
    """`step 12: the first non-finite value appeared in block_0/mlp/fc_out (backward)`."""
    if index < 0:
        return f"step {step}: no module produced the non-finite value (the loss or the update)"
    return (
        f"step {step}: the first non-finite value appeared in {calls.paths[index]} "
        f"({DIRECTIONS[direction]})"
    )


def as_rows(table: np.ndarray, calls: Calls) -> list[dict[str, Any]]:
    """The table as JSON-ready rows, one per call, with the underflow shares worked out."""
    rows = []
    for path, values in zip(calls.paths, np.asarray(table, np.float64), strict=True):
        row = {"module": path, **{name: float(v) for name, v in zip(COLUMNS, values, strict=True)}}
        for side in ("out", "grad_out"):
            nonzero = row[f"{side}_nonzero"]
            row[f"{side}_underflow_fraction"] = (
                row[f"{side}_underflow"] / nonzero if nonzero else 0.0
            )
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- across steps

KEPT_TABLES = 20  # per-layer tables of the newest skipped steps kept on the device and on disk


@struct.dataclass
class Log:
    """What the device keeps between two log steps (inside `metrics.LogTotals`): for every step
    of the interval that was skipped, `(step, call, direction)` of its first non-finite value;
    and the whole tables of the newest `KEPT_TABLES` skipped steps, across intervals."""

    origins: jax.Array  # int32[log_every, 3], rows of -1 for steps that were applied
    tables: jax.Array  # float32[KEPT_TABLES, calls, len(COLUMNS)]
    table_steps: jax.Array  # int32[KEPT_TABLES], -1 where empty
    skipped: jax.Array  # int32[]: skipped steps recorded so far

    @classmethod
    def zeros(cls, calls: int, log_every: int) -> Log:
        return cls(
            origins=np.full((log_every, 3), -1, np.int32),
            tables=np.zeros((KEPT_TABLES, calls, len(COLUMNS)), np.float32),
            table_steps=np.full((KEPT_TABLES,), -1, np.int32),
            skipped=np.int32(0),
        )

    def record(self, step: jax.Array, applied: jax.Array, table: jax.Array, where) -> Log:
        """Adds step `step`, whose update was `applied` or not, its table and its origin."""
        skipped = ~applied
        row = step % self.origins.shape[0]
        entry = jnp.concatenate([step[None], where]).astype(jnp.int32)
        slot = self.skipped % KEPT_TABLES
        return Log(
            origins=self.origins.at[row].set(jnp.where(skipped, entry, self.origins[row])),
            tables=self.tables.at[slot].set(jnp.where(skipped, table, self.tables[slot])),
            table_steps=self.table_steps.at[slot].set(
                jnp.where(skipped, step, self.table_steps[slot])
            ),
            skipped=self.skipped + skipped.astype(jnp.int32),
        )

    def reset(self) -> Log:
        """A new log interval: the origins restart, the tables stay."""
        return self.replace(origins=jnp.full_like(self.origins, -1))


def report(log: Log, table: np.ndarray, step: int, calls: Calls, writer, workdir) -> str | None:
    """Host-side, on a log step, with `log` and the step's `table` fetched: logs a line for every
    skipped step of the interval naming where its first non-finite value appeared, writes
    `<workdir>/numerics/<step>.json` for the newest skipped steps (keeping `KEPT_TABLES`), and
    the per-layer forward and backward amax under `numerics/` to `writer`. Returns the line of
    the newest skipped step, if any (for the message when training stops)."""
    origins = sorted(tuple(row) for row in np.asarray(log.origins).tolist())
    lines = [describe(s, i, d, calls) for s, i, d in origins if s >= 0]
    for line in lines:
        logging.warning("mptrain: skipped %s", line)
    if jax.process_index() == 0:
        folder = os.path.join(workdir, "numerics")
        for tab, tab_step in zip(np.asarray(log.tables), np.asarray(log.table_steps), strict=True):
            path = os.path.join(folder, f"{int(tab_step)}.json")
            if tab_step >= 0 and not os.path.exists(path):
                checkpoint.write_json(path, {"step": int(tab_step), "layers": as_rows(tab, calls)})
        kept = sorted(int(f[:-5]) for f in os.listdir(folder)) if os.path.isdir(folder) else []
        for old in kept[:-KEPT_TABLES]:
            os.remove(os.path.join(folder, f"{old}.json"))
    seen: dict[str, int] = {}
    scalars = {}
    for path, row in zip(calls.paths, np.asarray(table), strict=True):
        seen[path] = seen.get(path, 0) + 1
        name = path if seen[path] == 1 else f"{path}#{seen[path]}"
        scalars[f"numerics/forward/{name}"] = float(row[_COL["out_amax"]])
        scalars[f"numerics/backward/{name}"] = float(row[_COL["grad_out_amax"]])
    writer.write_scalars(step, scalars)
    return lines[-1] if lines else None
