"""The data cursor: every sample exactly once per epoch, whatever the batch sizes."""

from __future__ import annotations

import numpy as np
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
