"""Batch policies and integer allocation: exact sums, floors, determinism."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchsize_manager import get_policy, policy_names
from batchsize_manager.allocation import largest_remainder, proportional_split


def test_uniform_split():
    p = get_policy("uniform")
    assert p.assign([0, 1, 2], 10) == {0: 4, 1: 3, 2: 3}
    assert p.assign([5, 2], 128) == {2: 64, 5: 64}


def test_fixed_weights_split():
    p = get_policy("fixed", weights=[1, 2, 5])
    assert p.assign([0, 1, 2], 96) == {0: 12, 1: 24, 2: 60}
    assert p.assign([0, 1, 7], 12) == {0: 3, 1: 6, 7: 3}  # unknown id -> weight 1


def test_unknown_policy_lists_names():
    with pytest.raises(ValueError, match="known: .*uniform"):
        get_policy("nope")
    with pytest.raises(ValueError, match="bad arguments"):
        get_policy("uniform", foo=1)
    assert {"uniform", "fixed"} <= set(policy_names())


@given(weights=st.lists(st.floats(0.01, 100), min_size=1, max_size=40), total=st.integers(0, 5000))
def test_largest_remainder_sums_exactly(weights, total):
    out = largest_remainder(dict(enumerate(weights)), total)
    assert sum(out.values()) == total
    s = sum(weights)
    for i, w in enumerate(weights):
        assert abs(out[i] - w * total / s) < 1.0 + 1e-9


@given(weights=st.lists(st.floats(0.001, 1000), min_size=1, max_size=30), floor=st.integers(1, 8),
       extra=st.integers(0, 4000))
def test_proportional_split_respects_floor(weights, floor, extra):
    total = floor * len(weights) + extra
    out = proportional_split(dict(enumerate(weights)), total, floor)
    assert sum(out.values()) == total
    assert min(out.values()) >= floor


def test_proportional_split_impossible_floor():
    with pytest.raises(ValueError, match="cannot give"):
        proportional_split({0: 1, 1: 1}, 3, 2)
