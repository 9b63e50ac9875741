"""The data cursor: every sample exactly once per epoch, whatever the batch sizes."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_ml.datasets import sample_order
from ps_server.data_cursor import DataCursor, ranges_size


def expand(ranges, seed, n):
    return [(e, int(i)) for e, a, b in ranges for i in sample_order(seed, e, n)[a:b]]


@settings(max_examples=50, deadline=None)
@given(n=st.integers(1, 300), sizes=st.lists(st.integers(1, 97), min_size=1, max_size=60))
def test_exactly_once_per_epoch_uneven_sizes(n, sizes):
    cur = DataCursor(n)
    seen: dict[int, list[int]] = {}
    for x in sizes:
        rs = cur.take(x)
        assert ranges_size(rs) == x
        for e, i in expand(rs, 7, n):
            seen.setdefault(e, []).append(i)
    total = sum(sizes)
    full_epochs = total // n
    for e in range(full_epochs):
        assert sorted(seen[e]) == list(range(n)), f"epoch {e} not covered exactly once"
    if total % n:
        part = seen[full_epochs]
        assert len(part) == len(set(part)) == total % n
    assert cur.state.samples_served == total


def test_ranges_follow_one_global_stream():
    cur = DataCursor(10)
    assert cur.take(4) == [[0, 0, 4]]
    assert cur.take(8) == [[0, 4, 10], [1, 0, 2]]
    assert cur.epoch == 1


def test_returned_ranges_are_served_first():
    cur = DataCursor(10)
    a = cur.take(3)
    cur.give_back(a)
    assert cur.take(2) == [[0, 0, 2]]
    assert cur.take(3) == [[0, 2, 3], [0, 3, 5]]
    assert cur.state.samples_served == 5


def test_sample_order_is_a_seeded_permutation():
    a, b = sample_order(1, 0, 100), sample_order(1, 0, 100)
    np.testing.assert_array_equal(a, b)
    assert sorted(a) == list(range(100))
    assert not np.array_equal(a, sample_order(1, 1, 100))


@pytest.mark.parametrize("bad", [
    {"offset": 130}, {"offset": -20}, {"epoch": -3}, {"samples_served": -1}, {"offset": 2.5},
    {"returned": [[0, 5]]},                       # not [epoch, start, stop]
    {"returned": [[0, 20, 30], [0, 25, 30]]},     # overlapping: samples 25-29 served twice
    {"returned": [[1, 30, 40]]},                  # past the offset of the current epoch
    {"returned": [[2, 0, 5]]},                    # an epoch not reached
    {"returned": [[0, 40, 30]]},                  # empty or reversed
])
def test_a_damaged_cursor_state_is_refused_and_changes_nothing(bad):
    """A checkpoint's cursor that would serve a sample twice or one outside the dataset raises
    instead of breaking exactly-once sampling; the cursor keeps its state."""
    cur = DataCursor(100)
    cur.take(130)                                 # epoch 1, offset 30
    cur.give_back([[0, 10, 20]])
    good = cur.state_dict()
    assert good == {"epoch": 1, "offset": 30, "samples_served": 120, "returned": [[0, 10, 20]]}
    DataCursor(100).load_state_dict(good)         # the live state passes
    with pytest.raises(ValueError, match="data cursor"):
        cur.load_state_dict({**good, **bad})
    assert cur.state_dict() == good
