"""Examples packed into rows of `seq_len` tokens, each with the ids that keep them apart.

An example is `(ids, loss)` (`chat.encode`'s): its inputs are `ids[:-1]` and its targets
`ids[1:]`, each target -1 where it carries no loss, so one example takes `len(ids) - 1`
positions. `pack` places the examples into rows by first-fit decreasing: the longest first,
each into the first row with room for it, a new row where none has (ties broken by the
example's index, so the rows are a pure function of the examples). It fills rows better than
plain first-fit in the examples' order: the short ones fill the gaps the long ones leave.
A row gets per-token `segment_ids` (1, 2, ... for its examples in order, 0 for padding) and
`positions` that start again at 0 for each example, which attention and RoPE read so that no
example sees another. An example longer than the row is cut to it (`too_long="truncate"`) or
left out (`"drop"`); `Packed` counts both, and the share of real tokens.
"""

from __future__ import annotations

import dataclasses
import threading

import numpy as np


@dataclasses.dataclass(frozen=True)
class Packed:
    inputs: np.ndarray  # [rows, seq_len] int32, 0 in padding
    targets: np.ndarray  # [rows, seq_len] int32, -1 where no loss (padding included)
    segment_ids: np.ndarray  # [rows, seq_len] int32, 0 in padding
    positions: np.ndarray  # [rows, seq_len] int32, from 0 in each example
    examples: int  # examples placed
    truncated: int  # of those, cut to the row
    dropped: int  # examples left out, longer than the row
    real_tokens: int  # positions that hold an example's token

    @property
    def real_rate(self) -> float:
        """The share of the rows' positions that hold a real token, not padding."""
        return self.real_tokens / max(1, self.inputs.size)


def first_fit_decreasing(lengths: list[int], room: int, most_examples: int | None = None):
    """Rows of example indices, each row's lengths summing to at most `room` (every length is
    at most `room`), at most `most_examples` in a row: the longest first, each into the first
    row it fits. The first row with room is found in a tree of the rows' free space (its nodes
    the most any row below has; a row holding `most_examples` has none), so packing `n`
    examples takes O(n log n), not the O(n x rows) of a scan."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    size = 1
    while size < max(1, len(lengths)):
        size *= 2
    most = [0] * (2 * size)  # leaves: the rows' free space (0: no row yet, or full)
    rows: list[list[int]] = []
    for i in order:
        need = lengths[i]
        if most[1] >= need:  # some row has room: go down to the leftmost one that has
            node = 1
            while node < size:
                node = 2 * node if most[2 * node] >= need else 2 * node + 1
            slot = node - size
            rows[slot].append(i)
        else:
            slot, node = len(rows), len(rows) + size
            rows.append([i])
            most[node] = room
        most[node] -= need
        if most_examples is not None and len(rows[slot]) >= most_examples:
            most[node] = 0  # full: it takes no more examples, whatever room it has
        node //= 2
        while node:
            most[node] = max(most[2 * node], most[2 * node + 1])
            node //= 2
    return [sorted(row) for row in rows]  # a row's examples in the file's order


def pack(
    examples: list,
    seq_len: int,
    too_long: str = "truncate",
    packed: bool = True,
    most_examples: int | None = None,
) -> Packed:
    """The examples (`(ids, loss)` pairs) packed into rows of `seq_len` (see the module doc),
    at most `most_examples` a row; `packed=False`: one example a row, the rest of it padding
    (what packing is measured against)."""
    if too_long not in ("truncate", "drop"):
        raise ValueError(f"data.too_long={too_long!r}: 'truncate' or 'drop'")
    kept, truncated, dropped = [], 0, 0
    for ids, loss in examples:
        inputs = np.asarray(ids[:-1], np.int32)
        targets = np.where(np.asarray(loss[1:], bool), np.asarray(ids[1:], np.int32), -1)
        if len(inputs) > seq_len:
            if too_long == "drop":
                dropped += 1
                continue
            inputs, targets, truncated = inputs[:seq_len], targets[:seq_len], truncated + 1
        if len(inputs):
            kept.append((inputs, targets.astype(np.int32)))
    lengths = [len(x) for x, _ in kept]
    if packed:
        rows = first_fit_decreasing(lengths, seq_len, most_examples)
    else:
        rows = [[i] for i in range(len(kept))]
    shape = (len(rows), seq_len)
    out = {name: np.zeros(shape, np.int32) for name in ("inputs", "segment_ids", "positions")}
    out["targets"] = np.full(shape, -1, np.int32)
    for r, row in enumerate(rows):
        at = 0
        for segment, i in enumerate(row, 1):
            inputs, targets = kept[i]
            end = at + len(inputs)
            out["inputs"][r, at:end], out["targets"][r, at:end] = inputs, targets
            out["segment_ids"][r, at:end] = segment
            out["positions"][r, at:end] = np.arange(len(inputs))
            at = end
    real = sum(len(x) for x, _ in kept)
    return Packed(**out, examples=len(kept), truncated=truncated, dropped=dropped, real_tokens=real)


PLANES = ("inputs", "targets", "segment_ids", "positions")  # a stored row's planes, in order


class PackedSource:
    """Batches of packed rows (the module doc): `random=True` draws each epoch's order from
    `(seed, epoch)`; `random=False` takes the rows in order, the last batch wrapping round."""

    def __init__(
        self,
        rows: np.ndarray,
        batch_size: int,
        seed: int = 0,
        *,
        random: bool = True,
        max_segments: int = 64,
    ):
        self.rows, self.batch_size, self.seed, self.random = rows, batch_size, seed, random
        self.max_segments = max_segments
        self.real = self._real()
        self._orders: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()

    def _real(self) -> np.ndarray:
        """The real tokens of each row (what tokens/s counts): those of a segment."""
        return (self.rows[:, 2] > 0).sum(axis=1)

    @property
    def num_batches(self) -> int:
        return -(-len(self.rows) // self.batch_size)

    def _order(self, epoch: int) -> np.ndarray:
        with self._lock:  # the prefetch thread and the meter's count both ask
            if epoch not in self._orders:
                if len(self._orders) > 2:
                    self._orders.clear()
                rng = np.random.default_rng([self.seed, epoch])
                self._orders[epoch] = rng.permutation(len(self.rows))
            return self._orders[epoch]

    def indices(self, index: int) -> np.ndarray:
        """The rows of batch `index`."""
        if not isinstance(index, int | np.integer) or index < 0:
            raise ValueError(f"batch index must be a non-negative int, got {index!r}")
        at = int(index) * self.batch_size + np.arange(self.batch_size)
        n = len(self.rows)
        if not self.random:
            return at % n
        epochs, out = at // n, np.empty(self.batch_size, np.int64)
        for epoch in np.unique(epochs):  # one or two epochs a batch: no loop over its rows
            where = epochs == epoch
            out[where] = self._order(int(epoch))[at[where] % n]
        return out

    def get_batch(self, index: int, rows: slice = slice(None)) -> dict[str, np.ndarray]:
        """Batch `index` (only its `rows`: a process builds its own)."""
        picked = np.asarray(self.rows[self.indices(index)[rows]])
        batch = {plane: picked[:, k] for k, plane in enumerate(PLANES)}
        batch["segment_lengths"] = segment_lengths(batch["segment_ids"], self.max_segments)
        return batch

    def real_tokens(self, start: int, stop: int) -> int:
        """The real (not padding) tokens of batches `start .. stop - 1`: what tokens/s counts."""
        return int(sum(self.real[self.indices(i)].sum() for i in range(start, stop)))

    def __repr__(self) -> str:
        rows, batch = len(self.rows), self.batch_size
        return f"PackedSource(rows={rows}, batch_size={batch}, random={self.random})"


def segment_lengths(segment_ids: np.ndarray, most: int) -> np.ndarray:
    """`[rows, most]` tokens of each row's segments 1 .. `most` (0 where a row has fewer):
    what cuDNN's packed layout reads (`segments.Segments`). One count over the rows' tokens
    (each row's ids offset into bins of its own), not a `[rows, L, most]` comparison."""
    rows = len(segment_ids)
    ids = np.minimum(segment_ids, most + 1) + (most + 2) * np.arange(rows)[:, None]
    counts = np.bincount(ids.ravel(), minlength=rows * (most + 2)).reshape(rows, most + 2)
    return counts[:, 1 : most + 1].astype(np.int32)
