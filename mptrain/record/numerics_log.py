"""Per-layer numerics across steps: the device-side log of skipped steps and the host report.

`numerics` measures one step's table; this module keeps, between two log steps and on the
device, where each skipped step first went non-finite and the whole tables of the newest
skipped steps (`Log`, carried in `log_totals.LogTotals`), and turns them, on a log step, into
log lines, `<workdir>/numerics/<step>.json` files and TensorBoard series (`report`).
"""

from __future__ import annotations

import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from absl import logging
from flax import struct

from mptrain import files
from mptrain.recipe.numerics import COL, COLUMNS, DIRECTIONS, Calls


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
        for side in ("in", "out", "grad_out", "grad_in"):
            nonzero = row[f"{side}_nonzero"]
            row[f"{side}_underflow_fraction"] = (
                row[f"{side}_underflow"] / nonzero if nonzero else 0.0
            )
        rows.append(row)
    return rows


KEPT_TABLES = 20  # per-layer tables of the newest skipped steps kept on the device and on disk


@struct.dataclass
class Log:
    """What the device keeps between two log steps (inside `log_totals.LogTotals`): for every step
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
    the newest skipped step, if any (for the message when training stops). Only `<step>.json`
    files count as tables (the temporaries an interrupted write left there are removed when the
    run starts)."""
    origins = sorted(tuple(row) for row in np.asarray(log.origins).tolist())
    lines = [describe(s, i, d, calls) for s, i, d in origins if s >= 0]
    for line in lines:
        logging.warning("mptrain: skipped %s", line)
    if jax.process_index() == 0:
        folder = os.path.join(workdir, "numerics")
        for tab, tab_step in zip(np.asarray(log.tables), np.asarray(log.table_steps), strict=True):
            path = os.path.join(folder, f"{int(tab_step)}.json")
            if tab_step >= 0 and not os.path.exists(path):
                files.write_json(path, {"step": int(tab_step), "layers": as_rows(tab, calls)})
        names = os.listdir(folder) if os.path.isdir(folder) else []
        kept = sorted((int(name[:-5]), name) for name in names if re.fullmatch(r"\d+\.json", name))
        for _, name in kept[:-KEPT_TABLES]:
            os.remove(os.path.join(folder, name))
    seen: dict[str, int] = {}
    scalars = {}
    for path, row in zip(calls.paths, np.asarray(table), strict=True):
        seen[path] = seen.get(path, 0) + 1
        name = path if seen[path] == 1 else f"{path}#{seen[path]}"
        scalars[f"numerics/forward/{name}"] = float(row[COL["out_amax"]])
        scalars[f"numerics/backward/{name}"] = float(row[COL["grad_out_amax"]])
    writer.write_scalars(step, scalars)
    return lines[-1] if lines else None
