"""Bounded splits: exact sums, floors and caps (water-filling), the equal-finish-time solve."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchsize_manager.allocation import (
    bounded_split,
    check_feasible,
    equal_finish_times,
    finish_time_split,
    round_bounded,
)

FAST = settings(max_examples=60, deadline=None)


@st.composite
def bounded_problems(draw):
    n = draw(st.integers(1, 25))
    speeds = draw(st.lists(st.floats(0.01, 1e4), min_size=n, max_size=n))
    overheads = draw(st.lists(st.floats(0.0, 2.0), min_size=n, max_size=n))
    floor = draw(st.integers(1, 6))
    caps = draw(st.lists(st.one_of(st.none(), st.integers(floor, floor + 300)), min_size=n, max_size=n))
    room = sum(c if c is not None else 10**6 for c in caps)
    total = draw(st.integers(floor * n, min(room, floor * n + 3000)))
    return speeds, overheads, floor, caps, total


@FAST
@given(bounded_problems())
def test_finish_time_split_is_exact_and_in_bounds(problem):
    speeds, overheads, floor, caps, total = problem
    ids = list(range(len(speeds)))
    cap_map = {i: c for i, c in zip(ids, caps) if c is not None}
    out = finish_time_split(dict(zip(ids, speeds)), dict(zip(ids, overheads)), total, floor, cap_map)
    assert sorted(out) == ids
    assert sum(out.values()) == total
    for i, x in out.items():
        assert x >= floor
        assert i not in cap_map or x <= cap_map[i]


@FAST
@given(bounded_problems())
def test_unclamped_workers_finish_together(problem):
    """Real-valued solution: every worker strictly inside its bounds finishes at the same T*; a
    worker held on its floor is one too slow to do even that in T* (finishes no earlier), one held
    at its cap could have done more (finishes no later)."""
    speeds, overheads, floor, caps, total = problem
    hi = [math.inf if c is None else c for c in caps]
    x, t = equal_finish_times(speeds, overheads, total, [floor] * len(speeds), hi)
    assert x.sum() == pytest.approx(total, rel=1e-9, abs=1e-6)
    for xi, v, c, h in zip(x, speeds, overheads, hi):
        fin = c + xi / v
        tol = 1e-7 * max(1.0, abs(t)) + 1e-6 / v
        if h == floor:
            continue                              # pinned (floor == cap): no freedom, any T fits
        if floor + 1e-9 < xi < h - 1e-9:
            assert fin == pytest.approx(t, rel=1e-7, abs=tol)
        elif xi >= h - 1e-9:
            assert fin <= t + tol
        else:
            assert fin >= t - tol


def test_equal_overheads_give_proportional_split():
    out = finish_time_split({0: 4.0, 1: 2.0, 2: 1.0, 3: 1.0}, {w: 0.3 for w in range(4)}, 800)
    assert out == {0: 400, 1: 200, 2: 100, 3: 100}


def test_caps_force_water_filling():
    # Worker 0 would take 10/12 of 120 = 100 but is capped at 50; the rest is re-split evenly.
    assert bounded_split({0: 10.0, 1: 1.0, 2: 1.0}, 120, 1, {0: 50}) == {0: 50, 1: 35, 2: 35}
    # Caps on two workers push the excess onto the only uncapped one.
    assert bounded_split({0: 5.0, 1: 5.0, 2: 1.0}, 100, 1, {0: 30, 1: 20}) == {0: 30, 1: 20, 2: 50}


def test_floor_forces_water_filling():
    out = finish_time_split({0: 1000.0, 1: 1.0, 2: 1.0}, None, 100, min_batch=10)
    assert out == {0: 80, 1: 10, 2: 10}


def test_rounding_breaks_ties_by_id_and_respects_bounds():
    assert round_bounded({0: 1.5, 1: 1.5, 2: 1.0}, 4, {0: 1, 1: 1, 2: 1}, {}) == {0: 2, 1: 1, 2: 1}
    # Float dust above a cap must not push a worker past it.
    out = round_bounded({0: 3.0000000001, 1: 0.9999999999}, 4, {0: 0, 1: 0}, {0: 3})
    assert out == {0: 3, 1: 1}


@pytest.mark.parametrize("workers,total,floor,caps,match", [
    ([], 10, 1, {}, "no workers"),
    ([0, 1], 3, 2, {}, "cannot give 2 workers at least 2"),
    ([0, 1], 100, 1, {0: 40, 1: 50}, "exceeds the sum of the workers' batch caps"),
    ([0, 1], 10, 4, {0: 3}, r"workers \[0\] have a batch cap below min_batch=4"),
])
def test_infeasible_bounds_are_explained(workers, total, floor, caps, match):
    with pytest.raises(ValueError, match=match):
        check_feasible(workers, total, floor, {w: caps.get(w) for w in workers})
    if workers:
        with pytest.raises(ValueError, match=match):
            bounded_split({w: 1.0 for w in workers}, total, floor, caps)


def test_zero_speed_worker_gets_only_its_floor():
    assert finish_time_split({0: 0.0, 1: 5.0}, None, 50, min_batch=2) == {0: 2, 1: 48}
