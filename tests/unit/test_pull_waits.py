"""Waiting pulls: the bounds that keep a flood from crowding out the members, and the shard's
explanation of a member's long-waiting pull: each pull reported once, with the coordinator's
reason (a diagnostic that leaves a trace of a stall in shard 0's log)."""

from __future__ import annotations

import pytest

from ps_server.pulls import PendingPull, PendingPulls
from ps_server.router import Refused
from tests.unit.test_coordinator import coordinator


def test_a_long_wait_is_reported_once_and_a_fresh_one_not_at_all():
    pulls = PendingPulls(per_peer=4, others=16)
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


def test_pulls_without_a_worker_id_cannot_take_the_room_of_the_members():
    pulls = PendingPulls(per_peer=2, others=4)
    for k in range(4):                              # a flood over many connections, never due
        pulls.add(PendingPull(f"flood-{k}".encode(), -1, 2**62))
    with pytest.raises(Refused, match="without a worker id"):
        pulls.add(PendingPull(b"flood-9", -1, 2**62))
    for w in range(50):                             # every member still gets its pulls in
        pulls.add(PendingPull(f"member-{w}".encode(), w, 1))
        pulls.add(PendingPull(f"member-{w}-again".encode(), w, 1))
    with pytest.raises(Refused, match="per worker"):  # but no more than per_peer per worker id
        pulls.add(PendingPull(b"member-0-third", 0, 1))
    pulls.add(PendingPull(b"member-1", 99, 1))
    with pytest.raises(Refused, match="per connection"):
        pulls.add(PendingPull(b"member-1", 98, 1))
    answered = pulls.take_ready(lambda p: "params" if p.worker_id == 0 or p.worker_id < 0 else None)
    assert len(answered) == 6 and len(pulls) == 99
    pulls.add(PendingPull(b"flood-0", -1, 2**62))   # answered ones free their room
    pulls.add(PendingPull(b"member-0", 0, 1))
    pulls.clear()
    pulls.check_room(b"flood-0", -1)
    pulls.check_room(b"member-0", 0)
