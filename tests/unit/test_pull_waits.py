"""The shard's explanation of a member's long-waiting pull: each pull reported once, with the
coordinator's reason (a diagnostic that leaves a trace of a stall in shard 0's log)."""

from __future__ import annotations

from ps_server.pulls import PendingPull, PendingPulls
from tests.unit.test_coordinator import coordinator


def test_a_long_wait_is_reported_once_and_a_fresh_one_not_at_all():
    pulls = PendingPulls(per_peer=4, total=16)
    old = PendingPull(b"a", 0, 5, since=100.0)
    pulls.add(old)
    pulls.add(PendingPull(b"b", 1, 5, since=129.0))
    assert pulls.waiting_longer_than(20.0, now=130.0) == [old]
    assert pulls.waiting_longer_than(20.0, now=130.0) == []  # once
    assert len(pulls) == 2  # reporting answers nothing


def test_the_reason_names_what_the_assignment_waits_for():
    c = coordinator(workers=3, start=False)
    assert "has not started (3 of 3 workers joined)" in c.waiting_reason(0, 0, 0)
    c.try_start()
    assert "is due" in c.waiting_reason(0, 0, 0)
    assert "not the planned iteration 0" in c.waiting_reason(0, 3, 3)
    assert c.waiting_reason(7, 0, 0) == "not a member"
    c.plan.pop(1)
    assert "not in iteration 0's plan" in c.waiting_reason(1, 0, 0)
