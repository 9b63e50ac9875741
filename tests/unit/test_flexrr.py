"""FlexRR-style reassignment without sockets: the chunk pool, and the coordinator that grants
chunks, completes gradients at the granted sizes, and gives back exactly what a lost worker was
granted, whoever owned it."""

from __future__ import annotations

import pytest

from ps_server.chunks import ChunkPool, chunk_ranges
from ps_server.coordinator import NotReassigned
from ps_server.data_cursor import ranges_size
from ps_server.sync import FlexRR, sync_policy_for
from tests.unit.test_coordinator import S, coordinator


def samples(ranges) -> list[tuple[int, int]]:
    return [(e, i) for e, a, b in ranges for i in range(a, b)]


def test_chunks_cut_a_share_in_order_with_sizes_that_differ_by_at_most_one():
    ranges = [[0, 90, 100], [1, 0, 13]]
    pieces = chunk_ranges(ranges, 4)
    assert [ranges_size(p) for p in pieces] == [6, 6, 6, 5]
    assert samples([r for p in pieces for r in p]) == samples(ranges)
    assert [ranges_size(p) for p in chunk_ranges([[0, 0, 3]], 8)] == [1, 1, 1], "never an empty chunk"


def test_owners_take_their_own_chunks_first_then_help_the_one_with_most_left():
    pool = ChunkPool({0: [[0, 0, 8]], 1: [[0, 8, 16]], 2: [[0, 16, 24]]}, 4)
    assert pool.first(0) == [[0, 0, 2]] and pool.count(0) == 2
    assert pool.take(0) == (0, [[0, 2, 4]])
    assert pool.take(2) == (2, [[0, 18, 20]])
    assert pool.take(0) == (0, [[0, 4, 6]])
    assert pool.take(0) == (0, [[0, 6, 8]])
    # Worker 0 is done with its own: worker 1 has the most left (6 samples), its last chunk goes.
    assert pool.take(0) == (1, [[0, 14, 16]])
    assert pool.helped_chunks == 1 and pool.helped_samples == 2
    assert pool.count(0) == 10 and pool.count(1) == 2
    while pool.take(0) is not None:
        pass
    assert pool.take(1) is None and pool.take(2) is None, "once one hears none left, all do"
    every = sorted(samples(pool.granted(0) + pool.granted(1) + pool.granted(2)))
    assert every == [(0, i) for i in range(24)], "each sample granted exactly once"


def test_a_lost_worker_gives_back_what_it_was_granted_and_leaves_its_unclaimed_chunks():
    pool = ChunkPool({0: [[0, 0, 8]], 1: [[0, 8, 16]]}, 4)
    for _ in range(3):
        pool.take(0)
    assert pool.take(0) == (1, [[0, 14, 16]])
    assert pool.release(0) == [[0, 0, 2], [0, 2, 4], [0, 4, 6], [0, 6, 8], [0, 14, 16]]
    assert pool.take(1) == (1, [[0, 10, 12]]), "worker 1 goes on with its own"
    assert sorted(samples(pool.everything())) == [(0, i) for i in range(8, 14)]


def flexrr(workers=3, chunks=4):
    return coordinator("flexrr", workers, mode={"sync": "flexrr", "reassign_chunks": chunks})


def finish(c, w):
    """Worker ``w`` claims until none is left; returns what it was granted, in samples."""
    while c.take_chunk(w, c.iteration).ranges:
        pass
    return c.expected(w, c.iteration)


def test_flexrr_policy_from_config_and_its_bounds():
    c = flexrr()
    assert isinstance(c.policy, FlexRR) and c.policy.reassign_chunks == 4
    assert c.policy.largest_push(20, 60) == 60
    assert sync_policy_for(c.cfg).accept([0, 1], [1]) is None, "flexrr waits for every member, as bsp"


def test_flexrr_assignment_is_the_first_chunk_and_the_push_carries_what_was_granted():
    c = flexrr()
    a = c.assignment(0, c.iteration)
    assert a.chunked and a.batch_size == 5 and a.ranges == chunk_ranges(c.plan[0].ranges, 4)[0]
    assert c.expected(0, 0) == 5
    for _ in range(3):
        assert c.take_chunk(0, 0).owner == 0
    assert c.take_chunk(1, 0).owner == 1
    got = c.take_chunk(0, 0)  # worker 0 helps worker 2, who has the most left (15 samples)
    assert got.owner == 2 and got.ranges == chunk_ranges(c.plan[2].ranges, 4)[3] and got.batch_size == 25
    assert finish(c, 1) == 30  # its own two remaining chunks, then worker 2's other two
    assert finish(c, 2) == 5   # none left: worker 2 computed only its first chunk
    assert finish(c, 0) == 25
    sizes = {w: c.expected(w, 0) for w in range(3)}
    for w in range(3):
        for k in range(S):
            c.on_gradient(k, w, 0, sizes[w])
    (d,) = c.decide()
    assert d.entries == [[0, 25], [1, 30], [2, 5]]
    assert d.record.batch_sizes == {0: 25, 1: 30, 2: 5}
    assert d.record.helped_samples == 15 and c.counters["chunks.helped"] == 3


def test_flexrr_iteration_covers_every_planned_sample_exactly_once():
    c = flexrr()
    planned = sorted(samples([r for a in c.plan.values() for r in a.ranges]))
    c.take_chunk(2, 0)
    finish(c, 0)
    finish(c, 1)
    finish(c, 2)
    sizes = {w: c.expected(w, 0) for w in range(3)}
    for w in range(3):
        for k in range(S):
            c.on_gradient(k, w, 0, sizes[w])
    (d,) = c.decide()
    granted = sorted(samples([r for w in range(3) for r in d.record.ranges[w]]))
    assert granted == planned
    assert sum(x for _, x in d.entries) == 60


def test_a_push_at_another_size_than_granted_is_never_complete():
    c = flexrr()
    finish(c, 0)
    granted = c.expected(0, 0)
    for k in range(S):
        c.on_gradient(k, 0, 0, 20)  # the planned size, not the granted one
    assert c.counters.get("have.unexpected", 0) == S
    assert (0, 0) not in c.ledger
    for k in range(S):
        c.on_gradient(k, 0, 0, granted)
    assert c.ledger[(0, 0)].complete


@pytest.mark.parametrize("case, code", [
    ("other_iteration", "not_planned"), ("after_push", "already_pushed"), ("stopped", "stopped"),
    ("not_a_member", "not_planned")])
def test_chunk_claims_that_do_not_match_what_is_due_change_nothing(case, code):
    c = flexrr()
    it, w = 0, 0
    if case == "other_iteration":
        it = 1
    elif case == "after_push":
        finish(c, 0)
        c.on_gradient(0, 0, 0, c.expected(0, 0))
    elif case == "stopped":
        c.request_stop("test")
    elif case == "not_a_member":
        w = 7
    before = {v: c.expected(v, 0) for v in range(3)}
    with pytest.raises(NotReassigned) as err:
        c.take_chunk(w, it)
    assert err.value.code == code
    assert {v: c.expected(v, 0) for v in range(3)} == before


def test_chunk_claims_and_out_of_memory_reports_are_refused_where_they_do_not_apply():
    bsp = coordinator()
    with pytest.raises(NotReassigned) as err:
        bsp.take_chunk(0, 0)
    assert err.value.code == "not_supported"
    c = flexrr()
    with pytest.raises(NotReassigned) as err:
        c.out_of_memory(0, 0, 5)
    assert err.value.code == "not_supported"


def test_a_worker_lost_mid_iteration_gives_back_its_grants_and_the_others_take_its_chunks():
    c = flexrr()
    served = c.cursor.state.samples_served
    c.take_chunk(0, 0)
    c.take_chunk(0, 0)
    c.take_chunk(0, 0)                       # worker 0's own four chunks are all granted
    assert c.take_chunk(0, 0).owner == 2     # and it helps worker 2 with one
    c.take_chunk(2, 0)                       # worker 2 computes its second chunk
    c.leave(2, "lost")
    assert c.cursor.state.samples_served == served - 10, "worker 2's two chunks go back once"
    finish(c, 1)                             # worker 1 takes worker 2's last unclaimed chunk
    finish(c, 0)
    sizes = {w: c.expected(w, 0) for w in (0, 1)}
    assert sizes == {0: 25, 1: 25}
    for w in (0, 1):
        for k in range(S):
            c.on_gradient(k, w, 0, sizes[w])
    (d,) = c.decide()
    assert d.entries == [[0, 25], [1, 25]]
    assert c.cursor.state.samples_served == served - 10 + 60, "the next plan took 60 more"


def test_every_member_lost_gives_back_the_unclaimed_chunks_too():
    c = flexrr(workers=2)
    served = c.cursor.state.samples_served
    c.take_chunk(0, 0)
    c.leave(0, "lost")
    c.leave(1, "lost")
    assert c.cursor.state.samples_served == served - 60 and c.chunks is None and c.replan_pending


def test_stop_and_checkpoint_count_every_chunk_of_the_iteration_as_unused():
    c = flexrr()
    finish(c, 0)
    state = c.state_dict()
    assert state["cursor"]["samples_served"] == 0
    served = c.cursor.state.samples_served
    c.request_stop("test")
    assert c.cursor.state.samples_served == served - 60


def test_a_helper_takes_a_chunk_only_if_it_would_finish_it_before_the_owner():
    def pool():
        p = ChunkPool({0: [[0, 0, 8]], 1: [[0, 8, 16]]}, 4)
        for _ in range(3):
            p.take(0)  # worker 0 is done with its own; worker 1 has 3 chunks (6 samples) left
        return p

    assert pool().take(0, {0: 1.0, 1: 10.0}) is None, "2 samples take the helper 2 s, the owner 0.6 s for all 6"
    assert pool().take(0, {0: 10.0, 1: 1.0}) == (1, [[0, 14, 16]])
    p = pool()
    for _ in range(2):
        p.take(1)
    assert p.take(0, {0: 5.0, 1: 5.0}) is None, "one chunk left and no faster helper: the owner does it"
    assert pool().take(0, {0: 1.0}) == (1, [[0, 14, 16]]), "the owner's speed unknown: greedy"


def test_the_coordinator_times_each_chunk_and_holds_back_slower_helpers():
    c = flexrr(workers=2)                    # 30 samples each, in chunks of 8, 8, 7, 7
    now = [0.0]
    c.clock = lambda: now[0]
    for w in (0, 1):
        c.assignment_answered(w, 0)
    for t, w in [(1.0, 0), (2.0, 0), (3.0, 0), (4.0, 1)]:
        now[0] = t
        assert c.take_chunk(w, 0).owner == w
    assert c.chunk_speeds[0] == pytest.approx(8.0 + 0.2 * (7.0 - 8.0))  # 8, 8 and then 7 samples per s
    assert c.chunk_speeds[1] == pytest.approx(2.0)  # 8 samples in 4 s
    now[0] = 4.0
    got = c.take_chunk(0, 0)                 # 7 samples at ~7.6/s against 14 left at 2/s: helps
    assert got.owner == 1 and got.batch_size == 37
    now[0] = 10.0
    assert c.take_chunk(1, 0).owner == 1     # its third chunk: the second took it 6 s
    now[0] = 10.5
    assert c.take_chunk(0, 0).ranges == [], "worker 1 has nothing unclaimed left"
    c.leave(1, "lost")
    assert 1 not in c.chunk_speeds


def test_unclaimed_chunks_of_a_lost_worker_nobody_took_go_back_with_the_commit():
    c = flexrr(workers=2)
    served = c.cursor.state.samples_served
    c.chunk_speeds.update({0: 1.0, 1: 1.0})
    c.leave(1, "lost")                       # its three unclaimed chunks stay in the pool
    assert c.cursor.state.samples_served == served - 8
    finish(c, 0)                             # the lost owner's speed is gone: anyone helps
    assert c.expected(0, 0) == 52
    for k in range(S):
        c.on_gradient(k, 0, 0, 52)
    (d,) = c.decide()
    assert d.entries == [[0, 52]] and c.cursor.state.samples_served == served - 8 + 60
