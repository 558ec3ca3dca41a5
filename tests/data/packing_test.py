"""Packing SFT examples into rows (issue 44, second part): deterministic first-fit decreasing,
segment ids and positions that keep the examples apart, too-long examples counted."""

import numpy as np
import pytest

from mptrain.data import packing


def _examples(lengths, seed=0):
    """`(ids, loss)` pairs of those lengths; the loss on the second half of each."""
    rng = np.random.default_rng(seed)
    found = []
    for n in lengths:
        ids = rng.integers(1, 1000, n).astype(np.int32)
        found.append((ids, np.arange(n) >= n // 2))
    return found


def test_each_example_is_whole_in_one_row_with_its_own_segment_and_positions():
    examples = _examples([5, 9, 3, 7, 2, 8, 4])
    packed = packing.pack(examples, seq_len=12)
    assert packed.examples == 7 and packed.truncated == packed.dropped == 0
    seen = []
    for r in range(len(packed.inputs)):
        segments = packed.segment_ids[r]
        for s in range(1, segments.max() + 1):
            where = np.flatnonzero(segments == s)
            assert (np.diff(where) == 1).all()  # contiguous
            np.testing.assert_array_equal(packed.positions[r, where], np.arange(len(where)))
            seen.append((len(where), tuple(packed.inputs[r, where])))
        pad = segments == 0
        assert (packed.inputs[r, pad] == 0).all() and (packed.targets[r, pad] == -1).all()
    # every example, inputs ids[:-1]; targets its next tokens where they carry loss, else -1
    want = sorted((len(ids) - 1, tuple(ids[:-1])) for ids, _ in examples)
    assert sorted(seen) == want
    ids, loss = examples[1]
    r, where = next(
        (r, np.flatnonzero(packed.segment_ids[r] == s))
        for r in range(len(packed.inputs))
        for s in range(1, 9)
        if tuple(packed.inputs[r, packed.segment_ids[r] == s]) == tuple(ids[:-1])
    )
    np.testing.assert_array_equal(packed.targets[r, where], np.where(loss[1:], ids[1:], -1))


def test_packing_is_a_pure_function_of_the_examples_and_fills_rows():
    lengths = list(np.random.default_rng(1).integers(20, 400, 500))
    a = packing.pack(_examples(lengths), seq_len=512)
    b = packing.pack(_examples(lengths), seq_len=512)
    for name in ("inputs", "targets", "segment_ids", "positions"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.real_rate >= 0.95, a.real_rate  # first-fit decreasing on lengths 20-400 in 512
    # plain order, one example a row, would fill a quarter of it
    assert a.real_tokens == sum(n - 1 for n in lengths)


@pytest.mark.parametrize(
    "too_long, kept, truncated, dropped", [("truncate", 3, 1, 0), ("drop", 2, 0, 1)]
)
def test_an_example_longer_than_the_row_is_cut_or_left_out_and_counted(
    too_long, kept, truncated, dropped
):
    packed = packing.pack(_examples([5, 30, 6]), seq_len=10, too_long=too_long)
    assert (packed.examples, packed.truncated, packed.dropped) == (kept, truncated, dropped)
    assert packed.inputs.shape[1] == 10


def test_a_bad_too_long_setting_names_the_key():
    with pytest.raises(ValueError, match="^data.too_long='cut': 'truncate' or 'drop'"):
        packing.pack(_examples([3]), seq_len=4, too_long="cut")


def test_a_row_takes_at_most_the_examples_it_is_allowed():
    """`most_examples` (`data.max_segments`: cuDNN's packed layout is built for that many):
    a row that holds it takes no more, whatever room it has; the rest still fit first."""
    rows = packing.first_fit_decreasing([1] * 10 + [8], room=10, most_examples=3)
    assert all(len(row) <= 3 for row in rows)
    assert sorted(i for row in rows for i in row) == list(range(11))
    assert rows == [[0, 1, 10], [2, 3, 4], [5, 6, 7], [8, 9]]
    assert len(packing.first_fit_decreasing([1] * 10 + [8], room=10)) == 2  # uncapped
