"""benchmarks/profile_decision.py: the decision's share of a py-spy profile, read right."""

from __future__ import annotations

from benchmarks.profile_decision import shares

RAW = [
    "<module> (srv.py:1);loop (srv.py:9);BatchSizeManager.assign (m.py:370);f (a.py:3);g (a.py:7) 6",
    "<module> (srv.py:1);loop (srv.py:9);BatchSizeManager.assign (m.py:375);f (a.py:4);f (a.py:5) 3",
    "<module> (srv.py:1);loop (srv.py:9);BatchSizeManager.assign (m.py:371) 1",
    "<module> (srv.py:1);loop (srv.py:12);handle (h.py:2);f (a.py:3) 30",
    "",
]


def test_inclusive_shares_count_each_stack_once_and_only_under_the_root():
    total, inside, rows = shares(RAW, "BatchSizeManager.assign")
    assert (total, inside) == (40, 10)
    got = dict(rows)
    assert got["BatchSizeManager.assign (m.py)"] == 10
    assert got["f (a.py)"] == 9                 # a recursive stack counts once; handle's f not at all
    assert got["g (a.py)"] == 6
    assert "handle (h.py)" not in got and "loop (srv.py)" not in got
    assert rows[0][0] == "BatchSizeManager.assign (m.py)"
