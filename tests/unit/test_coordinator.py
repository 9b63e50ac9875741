"""The coordinator's commit rule with no sockets: a gradient counts only once every shard holds
it, whatever process dies between which two sends; samples of what is not applied go back to
the cursor exactly once. Also the elastic learning-rate rule, rejoin, stop and checkpoints."""

from __future__ import annotations

import pytest

from batchsize_manager import WorkerReport
from batchsize_manager.manager import BatchSizeManager
from batchsize_manager.policies import UniformPolicy
from ps_common.config import validate
from ps_common.report import Telemetry
from ps_server.coordinator import Coordinator
from ps_server.sync import BSP, sync_policy_for

S = 3  # shards


def coordinator(sync="bsp", workers=3, start=True, **sections):
    mode = {"sync": sync, **({"backup_workers": 1} if sync == "backup" else {})}
    cfg = validate({"training": {"global_batch": 60, "max_iterations": 100}, "cluster": {"num_workers": workers},
                    "mode": mode, **sections})
    c = Coordinator(cfg, 1000, BatchSizeManager("uniform", 60), sync_policy_for(cfg),
                    num_shards=S)
    for i in range(workers):
        c.join(f"w{i}", f"instance-{i}")
    if start:
        c.try_start()
    return c


def push(c, w, shards=range(S), it=None):
    it = c.iteration if it is None else it
    for k in shards:
        c.on_gradient(k, w, it, c.expected(w, it))


def sizes(c):
    return {w: a.batch_size for w, a in c.plan.items()}


def samples_of(ranges):
    return sum(b - a for _, a, b in ranges)


def test_bsp_commits_only_when_every_member_is_on_every_shard():
    c = coordinator()
    push(c, 0)
    push(c, 1)
    push(c, 2, shards=[0, 1])
    assert c.decide() == [], "worker 2's gradient is not on shard 2 yet"
    push(c, 2, shards=[2])
    (d,) = c.decide()
    assert d.version == 1 and d.iteration == 0 and d.entries == [[0, 20], [1, 20], [2, 20]]
    assert d.lr_scale == 1.0 and d.next_plan is not None and d.next_plan.iteration == 1
    assert d.next_plan.workers == [0, 1, 2] and d.next_plan.batch_sizes == [20, 20, 20]


@pytest.mark.parametrize("reached", [[0], [1], [1, 2], [0, 2]],
                         ids=["shard0-only", "follower-only", "followers-only", "between-followers"])
def test_a_gradient_that_reached_some_shards_is_applied_nowhere_and_its_samples_return_once(reached):
    c = coordinator()
    lost_ranges = c.plan[2].ranges
    served = c.cursor.state.samples_served
    push(c, 0)
    push(c, 1)
    push(c, 2, shards=reached)
    assert c.decide() == []
    c.leave(2, "lost")
    assert c.cursor.state.samples_served == served - 20, "the lost share goes back exactly once"
    (d,) = c.decide()
    assert d.entries == [[0, 20], [1, 20]], "iteration 0 is what survivors completed"
    assert [2, 0] in d.drops, "every shard drops what it holds of worker 2"
    assert d.next_plan.workers == [0, 1] and d.next_plan.batch_sizes == [30, 30]
    taken = [r for w in (0, 1) for r in c.plan[w].ranges]
    assert lost_ranges[0] in taken, "the lost worker's samples are served again first"
    # A Have that arrives late for the lost gradient changes nothing.
    c.on_gradient(2, 2, 0, 20)
    assert c.decide() == []


def test_a_shard_that_started_again_empty_holds_nothing_and_names_whose_gradients_it_lost():
    c = coordinator()
    push(c, 0)                       # complete: on every shard, shard 2 included
    push(c, 1, shards=[0, 2])
    push(c, 2, shards=[0, 1])
    assert c.shard_started_empty(2) == [0, 1]
    for w in (0, 1):                 # what the server then does with them
        c.leave(w, "its gradient was on shard 2, which started again empty")
    assert c.decide() == []
    push(c, 2, shards=[2])
    (d,) = c.decide()
    assert d.entries == [[2, 20]] and [0, 0] in d.drops and [1, 0] in d.drops, \
        "nothing of the old shard 2's gradients is committed; they are dropped everywhere"


@pytest.mark.parametrize("sync", ["bsp", "asp"])
def test_a_worker_gone_before_a_shard_started_again_empty_is_not_waited_for(sync):
    """Worker 2's gradient was complete (so it stayed in the round when it was lost), then shard 2
    started again empty: the gradient is no longer complete, and nobody will push it again. Its
    samples go back once and the others' round commits without it (before, leave() ignored a
    worker that was not a member any more, and the round waited for it for good)."""
    c = coordinator(sync)
    ranges = c.plan[2].ranges if sync == "bsp" else c.assignment(2, 0).ranges
    push(c, 2, it=0)
    assert c.leave(2, "lost") and (2 in c.plan if sync == "bsp" else 2 in c.outstanding)
    served = c.cursor.state.samples_served
    assert c.shard_started_empty(2) == [2]
    assert c.leave(2, "its gradient was on shard 2, which started again empty") is False
    assert 2 not in c.plan and 2 not in c.outstanding
    assert c.cursor.state.samples_served == served - samples_of(ranges), "given back once"
    assert c.leave(2, "again") is False and c.cursor.state.samples_served == served - samples_of(ranges)
    if sync == "bsp":
        push(c, 0)
        push(c, 1)
        (d,) = c.decide()
        assert d.entries == [[0, 20], [1, 20]] and [2, 0] in d.drops


def test_a_worker_lost_after_pushing_everywhere_still_counts():
    c = coordinator()
    push(c, 0)
    push(c, 2)
    served = c.cursor.state.samples_served
    c.leave(2, "lost")
    assert c.cursor.state.samples_served == served, "a complete gradient keeps its samples"
    push(c, 1)
    (d,) = c.decide()
    assert d.entries == [[0, 20], [1, 20], [2, 20]]
    assert d.next_plan.workers == [0, 1]


def test_every_member_lost_replans_for_whoever_joins():
    c = coordinator(workers=1)
    push(c, 0, shards=[0])
    c.leave(0, "lost")
    assert c.decide() == [] and c.plan == {}
    wid = c.join("new", "instance-new")
    plan = c.try_start()
    assert plan is not None and plan.iteration == 0 and plan.workers == [wid] and plan.batch_sizes == [60]


def test_backup_commits_the_first_n_complete_and_serves_the_late_share_again():
    c = coordinator("backup", workers=3)  # N = 2 of 3
    assert sizes(c) == {0: 30, 1: 30, 2: 30}
    late_ranges = c.plan[1].ranges
    push(c, 2)
    push(c, 1, shards=[0, 1])  # worker 1 arrived second on shard 0 but is not complete
    push(c, 0)
    (d,) = c.decide()
    assert d.entries == [[0, 30], [2, 30]]
    assert [1, 0] in d.drops
    taken = [r for a in c.plan.values() for r in a.ranges]
    assert late_ranges[0] in taken


def test_backup_a_late_share_that_ran_out_of_memory_still_caps_the_worker():
    """Backup mode: a round commits without worker 1, whose share then runs out of memory.
    Nothing is left to retry (refused ``not_planned``: the worker joins again), but the manager
    learns the cap, once per share, so that the worker is not handed a share it cannot hold,
    and does not fail and join again, every iteration."""
    from ps_server.coordinator import NotReassigned

    c = coordinator("backup", workers=3)  # N = 2 of 3
    late = c.plan[1]
    push(c, 0)
    push(c, 2)
    (d,) = c.decide()
    assert [w for w, _ in d.entries] == [0, 2]
    served = c.cursor.state_dict()
    with pytest.raises(NotReassigned) as err:
        c.out_of_memory(1, late.iteration, late.batch_size)
    assert err.value.code == "not_planned" and "caps it at 15" in str(err.value)
    assert c.manager.memory_caps[1] == late.batch_size // 2
    assert c.events[-1] == {"event": "out_of_memory_late", "worker": 1, "iteration": 0, "failed": 30, "cap": 15}
    assert c.counters["out_of_memory.late"] == 1 and "out_of_memory" not in c.counters
    assert c.cursor.state_dict() == served, "its samples were given back at the commit, once"
    assert c._late == {}, "its one late share is learned: nothing left, not an empty entry"
    caps = dict(c.manager.memory_caps)
    with pytest.raises(NotReassigned):                 # the same report again: nothing more
        c.out_of_memory(1, late.iteration, late.batch_size)
    assert dict(c.manager.memory_caps) == caps and c.counters["out_of_memory.late"] == 1
    push(c, 0)                                         # iteration 1 was planned before the cap
    push(c, 2)
    (d,) = c.decide()
    assert d.next_plan is not None and d.next_plan.batch_sizes[1] <= 15, "later splits fit"


def test_backup_shares_dropped_up_to_late_rounds_ago_still_teach_the_cap():
    """Rounds go on committing while a slow worker fails and reports (the first real-process run
    in CI reported after later rounds had dropped its newer shares): its report of any share of
    the last LATE_ROUNDS rounds still counts; an older one does not."""
    from ps_server.coordinator import LATE_ROUNDS, NotReassigned

    c = coordinator("backup", workers=3)
    shares = []
    for _ in range(LATE_ROUNDS + 1):
        shares.append((c.iteration, c.plan[1].batch_size))
        push(c, 0)
        push(c, 2)
        c.decide()
    (old_it, old_x), (it, x) = shares[0], shares[1]
    with pytest.raises(NotReassigned) as err:
        c.out_of_memory(1, old_it, old_x)              # LATE_ROUNDS + 1 rounds ago: forgotten
    assert "caps it" not in str(err.value) and 1 not in c.manager.memory_caps
    with pytest.raises(NotReassigned) as err:
        c.out_of_memory(1, it, x)                      # LATE_ROUNDS rounds ago: still known
    assert f"caps it at {x // 2}" in str(err.value) and c.manager.memory_caps[1] == x // 2
    assert sum(len(v) for v in c._late.values()) == LATE_ROUNDS - 1, "expired and learned ones are gone"


def test_a_restore_forgets_the_late_shares_of_the_members_it_clears():
    c = coordinator("backup", workers=3)
    push(c, 0)
    push(c, 2)
    c.decide()
    assert c._late == {1: {0: 30}}
    c.load_state_dict(c.state_dict())
    assert c._late == {} and len(c.members) == 0


@pytest.mark.parametrize("case", ["wrong_size", "wrong_iteration", "partly_pushed", "accepted_later", "left"])
def test_backup_late_out_of_memory_reports_that_do_not_match_a_dropped_share_learn_nothing(case):
    from ps_server.coordinator import NotReassigned

    c = coordinator("backup", workers=3)
    late = c.plan[1]
    it, x = late.iteration, late.batch_size
    if case == "partly_pushed":
        push(c, 1, shards=[0])                         # a shard holds some of it: it computed it
    push(c, 0)
    push(c, 2)
    c.decide()
    if case == "wrong_size":
        x -= 1
    elif case == "wrong_iteration":                    # (iteration 1 is its current share)
        it += 2
    elif case == "accepted_later":                     # a later round committed its gradient
        for w in range(3):
            push(c, w)
        c.decide()
    elif case == "left":
        c.leave(1, "lost")
    with pytest.raises(NotReassigned) as err:
        c.out_of_memory(1, it, x)
    assert err.value.code == "not_planned"
    assert 1 not in c.manager.memory_caps and "out_of_memory.late" not in c.counters


def test_async_commits_each_complete_gradient_that_matches_its_assignment():
    c = coordinator("asp", workers=2)
    a0 = c.assignment(0, 0)
    a1 = c.assignment(1, 0)
    assert a0.batch_size == a1.batch_size == 30
    push(c, 1, it=0)
    push(c, 0, it=0, shards=[0, 1])
    (d,) = c.decide()
    assert d.entries == [[1, 30]] and d.lr_scale == pytest.approx(30 / 60) and d.version == 1
    push(c, 0, it=0, shards=[2])
    (d,) = c.decide()
    assert d.entries == [[0, 30]] and d.version == 2
    # A report for a batch size other than assigned is never committed.
    c.assignment(0, 1)
    for k in range(S):
        c.on_gradient(k, 0, 1, 7)
    assert c.decide() == [] and c.counters["have.unexpected"] >= 1


@pytest.mark.parametrize("have_first", [True, False], ids=["drop-queued-first", "conflict"])
def test_async_a_push_at_an_unassigned_size_is_dropped_where_held_and_the_assigned_one_survives(have_first):
    """A member pushes its gradient to shard 1 at a size nobody assigned, then at the assigned
    size to shard 0, while another worker's commit carries the drop of the first. Every shard
    must end up applying the same commits: the drop names the wrong size, so shard 0 keeps the
    assigned gradient (an unsized drop took it, and shard 0 then failed on the commit that named
    it after the followers had applied it)."""
    import numpy as np

    from ps_common.config import OptimizerConfig
    from ps_server.shard import ShardState

    c = coordinator("asp", workers=2)
    states = [ShardState(k, np.zeros(4, np.float32), OptimizerConfig(lr=0.1, momentum=0.9)) for k in range(S)]
    g = np.ones(4, np.float32)

    def hold(k, w, it, x):
        states[k].receive(w, it, x, g)
        c.on_gradient(k, w, it, x)

    def commit_everywhere():
        for d in c.decide():
            for st in states:
                st.apply(d.iteration, d.entries, d.lr_scale)
                st.drop(d.drops)

    a0, a1 = c.assignment(0, 0), c.assignment(1, 0)
    if have_first:                                  # shard 1's Have arrives before shard 0's
        hold(1, 0, 0, a0.batch_size - 1)
        hold(0, 0, 0, a0.batch_size)
    else:                                           # after it: the ledger has the assigned size
        hold(0, 0, 0, a0.batch_size)
        hold(1, 0, 0, a0.batch_size - 1)
    for k in range(S):                              # worker 1's commit carries the drop
        hold(k, 1, 0, a1.batch_size)
    commit_everywhere()
    assert (0, 0) in states[0].held and (0, 0) not in states[1].held
    for k in (1, 2):                                # worker 0 completes at the assigned size
        hold(k, 0, 0, a0.batch_size)
    commit_everywhere()
    assert [st.version for st in states] == [2, 2, 2]
    assert len({st.log_hash for st in states}) == 1 and all(not st.held for st in states)
    assert c.counters["have.unexpected" if have_first else "have.conflict"] == 1


def test_async_a_leaver_leaves_no_report_behind():
    c = coordinator("asp", workers=2)
    a = c.assignment(1, 0)
    c.record_report(WorkerReport(worker_id=1, iteration=0, batch_size=a.batch_size,
                                 telemetry=Telemetry(compute_s=0.1)), loss=0.5)
    assert 1 in c.reports and 1 in c.losses
    c.leave(1, "left")
    assert 1 not in c.reports and 1 not in c.losses


def test_async_assignments_are_bounded_and_ssp_waits_for_the_slowest():
    c = coordinator("ssp", workers=2, mode={"sync": "ssp", "staleness": 1})
    for clock in range(2):
        assert c.assignment(0, clock) is not None
        push(c, 0, it=clock)
        c.decide()
    assert c.members[0].clock == 2
    assert c.assignment(0, 2) is None, "clock 2 is s + 1 ahead of worker 1 (clock 0)"
    c.assignment(1, 0)
    push(c, 1, it=0)
    c.decide()
    assert c.assignment(0, 2) is not None
    d = coordinator("asp", workers=1)
    for clock in range(3):
        assert d.assignment(0, clock) is not None
    assert d.assignment(0, 3) is None, "three uncommitted assignments: back-pressure"


def test_a_second_join_from_the_same_process_replaces_the_first():
    c = coordinator(workers=2, start=False)
    assert len(c.members) == 2
    again = c.join("w0", "instance-0")
    assert len(c.members) == 2 and again not in (0,) and 0 not in c.members
    assert c.try_start() is not None, "two processes, two members: the job starts"


def test_keep_worker_batch_scales_lr_linearly_with_a_ramp():
    c = coordinator(elastic={"keep": "worker_batch", "ramp_iterations": 4})
    for w in range(3):
        push(c, w)
    c.decide()
    c.leave(2)
    factors = []
    for _ in range(6):
        assert sizes(c) in ({0: 20, 1: 20},)
        for w in list(c.plan):
            push(c, w)
        (d,) = c.decide()
        factors.append(round(d.lr_scale, 4))
    assert factors == [1.0, 0.9167, 0.8333, 0.75, 0.6667, 0.6667]
    (ev,) = c.drain_events()
    assert ev["event"] == "global_batch_changed" and (ev["from"], ev["to"]) == (60, 40)


def test_stop_gives_the_in_flight_samples_back_and_commits_nothing_more():
    c = coordinator()
    served = c.cursor.state.samples_served
    push(c, 0)
    c.request_stop("operator")
    assert c.stop_version == 0 and c.cursor.state.samples_served == served - 60
    push(c, 1)
    push(c, 2)
    assert c.decide() == []


def test_max_iterations_stops_at_that_version():
    c = coordinator(training={"global_batch": 60, "max_iterations": 2})
    for _ in range(2):
        for w in range(3):
            push(c, w)
        (d,) = c.decide()
    assert c.stop and c.stop_version == 2 and d.next_plan is None


def test_state_dict_round_trip_resumes_at_the_next_iteration():
    c = coordinator()
    for _ in range(5):
        for w in range(3):
            push(c, w)
        c.decide()
    state = c.state_dict()
    d = coordinator(start=False)
    d.load_state_dict(state)
    assert not d.started and d.iteration == 5 and d.updates == 5 and d.version == 5
    for i in range(3):
        d.join(f"again{i}", f"again-{i}")
    assert d.try_start() is not None and d.iteration == 5
    assert [a.ranges for a in d.plan.values()] == [a.ranges for a in c.plan.values()]
    assert d.member_key != c.member_key, "tokens of the old incarnation are void"


@pytest.mark.parametrize("ahead", [True, False])
def test_plan_ahead_decides_the_split_off_the_critical_path_one_iteration_older(ahead):
    """With plan_ahead the split of iteration t+1 comes from reports up to t-1 (decided while t
    computes); without it, from the reports of t, decided inside the commit."""
    cfg = validate({"training": {"global_batch": 60, "max_iterations": 100}, "cluster": {"num_workers": 2},
                    "mode": {"batch_policy": "lbbsp-cpu", "batch_policy_args": {"predictor": "last", "warmup": 0},
                             "plan_ahead": ahead}})
    c = Coordinator(cfg, 1000, BatchSizeManager("lbbsp-cpu", 60, policy_args={"predictor": "last", "warmup": 0}),
                    BSP(), num_shards=1)
    c.join("fast", "a")
    c.join("slow", "b")
    c.try_start()
    c.background_work()
    plans = [sizes(c)]
    for it in range(3):
        for w, speed in ((0, 3000.0), (1, 1000.0)):  # samples per second
            x = c.plan[w].batch_size
            c.record_report(WorkerReport(worker_id=w, iteration=it, batch_size=x,
                                         telemetry=Telemetry(compute_s=x / speed, iteration_s=x / speed)), 0.0)
            c.on_gradient(0, w, it, x)
        (d,) = c.decide()
        plans.append(sizes(c))
        c.background_work()
    assert plans[0] == {0: 30, 1: 30}
    if ahead:
        assert plans[1] == {0: 30, 1: 30}, "plan 1 was decided before iteration 0's reports"
        assert plans[2][0] > plans[2][1]
    else:
        assert plans[1][0] > plans[1][1], "plan 1 already uses iteration 0's reports"


def answered_on(now: list[float]) -> Coordinator:
    """A coordinator on the clock ``now[0]`` whose three workers were answered just now."""
    c = coordinator()
    c.clock = lambda: now[0]
    for w in range(3):
        c.assignment_answered(w, 0)
    return c


def report(c: Coordinator, w: int, **tel: float) -> None:
    """Worker ``w``'s report of iteration 0, as shard 0 records it from its push."""
    received = Telemetry.from_checked({"compute_s": 0.03, **tel})    # as the decoder makes it
    c.record_report(WorkerReport.received(w, 0, 20, received), 1.0)


def test_finish_time_is_measured_from_the_answer_to_the_gradient_being_whole_on_every_shard():
    """What the barrier waits for, as the servers see it: a gradient that sits on shards 0 and 1
    but crosses a slow link to shard 2 finishes when shard 2 has it, not when the worker sent it."""
    now = [100.0]
    c = answered_on(now)
    now[0] = 100.05
    for w in range(3):
        report(c, w)
        push(c, w, shards=[0, 1])
    now[0] = 100.08
    push(c, 0, shards=[2])
    push(c, 1, shards=[2])
    now[0] = 100.20
    push(c, 2, shards=[2])
    fin = {w: c.reports[w].telemetry.finish_s for w in range(3)}
    assert fin[0] == pytest.approx(0.08) and fin[1] == pytest.approx(0.08)
    assert fin[2] == pytest.approx(0.20)
    # A gradient of an iteration the worker was never answered for gets no finish time.
    c2 = coordinator()
    report(c2, 0)
    push(c2, 0)
    assert c2.reports[0].telemetry.finish_s is None


def test_a_finish_time_a_worker_made_up_never_reaches_the_policy():
    """finish_s is measured by the coordinator; a (buggy or hostile) worker that puts its own in
    its push telemetry is ignored, also for a gradient the coordinator cannot time itself."""
    c = coordinator()
    report(c, 0, finish_s=1000.0)
    push(c, 0)  # never answered with an assignment here: nothing to time it by
    assert c.reports[0].telemetry.finish_s is None
    c.assignment_answered(1, 0)
    report(c, 1, finish_s=1e-9)
    push(c, 1)
    assert c.reports[1].telemetry.finish_s != 1e-9   # the coordinator's own measurement


def test_a_report_reaches_the_policy_with_its_finish_time():
    """The policy gets a report only once its gradient is whole on every shard (or a split is
    decided now): work done while a gradient is still on its way does not feed it untimed."""
    now = [100.0]
    c = answered_on(now)
    seen = []
    c.manager.observe_many = seen.extend
    now[0] = 100.05
    for w in range(3):
        report(c, w)
        push(c, w, shards=[0, 1] if w == 2 else range(S))
    c.background_work()
    assert [r.worker_id for r in seen] == [0, 1], "worker 2's gradient is not whole yet"
    now[0] = 100.25
    push(c, 2, shards=[2])
    c.background_work()
    assert [(r.worker_id, r.telemetry.finish_s) for r in seen] == [
        (0, pytest.approx(0.05)), (1, pytest.approx(0.05)), (2, pytest.approx(0.25))]
    for r in seen:    # the rows the policy reads say what the fields say, finish time included
        fields = Telemetry.from_checked(r.telemetry.to_dict())
        assert r.row is not None and r.row == WorkerReport.received(r.worker_id, 0, 20, fields).row


# ----- out of memory: a smaller share of the same samples, the rest back to the cursor ---------
@pytest.mark.parametrize("sync", ["bsp", "backup", "asp"])
def test_out_of_memory_shrinks_the_assignment_and_gives_the_rest_back_once(sync):
    from ps_server.data_cursor import ranges_size

    c = coordinator(sync)
    if sync == "asp":
        a = c.assignment(1, 0)
    else:
        a = c.plan[1]
    served = c.cursor.state.samples_served
    new = c.out_of_memory(1, a.iteration, a.batch_size)
    assert new.batch_size == a.batch_size // 2 and ranges_size(new.ranges) == new.batch_size
    assert new.ranges[0][:2] == a.ranges[0][:2], "a prefix of the same samples"
    assert c.cursor.state.samples_served == served - (a.batch_size - new.batch_size)
    assert c.expected(1, a.iteration) == new.batch_size, "every push is checked against the new size"
    assert c.manager.memory_caps[1] == new.batch_size
    assert c.events[-1]["event"] == "out_of_memory" and c.events[-1]["failed"] == a.batch_size
    # The samples dropped from worker 1 are served first to whoever asks next.
    nxt = c.cursor.take(1)
    assert nxt[0][1] == new.ranges[-1][2]


def test_out_of_memory_commits_the_smaller_gradient_and_caps_the_next_plans():
    c = coordinator()
    c.out_of_memory(1, 0, 20)
    for w in range(3):
        push(c, w)
    (d,) = c.decide()
    assert d.entries == [[0, 20], [1, 10], [2, 20]], "the iteration commits the retry's size"
    assert d.record.applied_samples == 50
    assert d.next_plan.batch_sizes[1] <= 10, "the next split respects the learned cap"
    assert sum(d.next_plan.batch_sizes) == 60


@pytest.mark.parametrize("case, code", [
    ("wrong_iteration", "not_planned"), ("wrong_size", "bad_batch"), ("already_pushed", "already_pushed"),
    ("one_sample", "cannot_fit"), ("stopped", "stopped"), ("not_in_plan", "not_planned")])
def test_out_of_memory_reports_that_do_not_match_what_is_due_change_nothing(case, code):
    from ps_server.coordinator import NotReassigned

    c = coordinator()
    it, x = 0, 20
    if case == "wrong_iteration":
        it = 1
    elif case == "wrong_size":
        x = 19
    elif case == "already_pushed":
        push(c, 1, shards=[2])           # a shard holds some of it: it did not run out of memory
    elif case == "one_sample":
        c.plan[1].batch_size = 1
        x = 1
    elif case == "stopped":
        c.request_stop("test")
    elif case == "not_in_plan":
        c.leave(1, "lost")
    before = (sizes(c), c.cursor.state_dict(), c.manager.memory_caps)
    with pytest.raises(NotReassigned) as err:
        c.out_of_memory(1, it, x)
    assert err.value.code == code
    assert (sizes(c), c.cursor.state_dict(), c.manager.memory_caps) == before


def test_out_of_memory_below_min_batch_refuses_the_worker_and_the_job_goes_on():
    """A worker (any holder of the worker credential) that reports out-of-memory again and again
    would cap itself below min_batch, and the next split would stop the job: it is refused
    ``cannot_fit`` instead (the worker leaves), and nothing is learned."""
    from ps_server.coordinator import NotReassigned

    cfg = validate({"training": {"global_batch": 16, "min_batch": 4, "max_iterations": 10},
                    "cluster": {"num_workers": 2}})
    c = Coordinator(cfg, 1000, BatchSizeManager("uniform", 16, min_batch=4), BSP(), num_shards=S)
    c.join("honest", "i0")
    c.join("evil", "i1")
    c.try_start()
    x = c.plan[1].batch_size
    while True:
        try:
            x = c.out_of_memory(1, 0, x).batch_size
        except NotReassigned as err:
            assert err.code == "cannot_fit" and "below min_batch=4" in str(err)
            break
        assert x >= 4, "no cap below min_batch is ever learned"
    caps = c.manager.memory_caps
    assert caps.get(1, 4) >= 4 and not c.stop
    c.leave(1, "it cannot hold min_batch samples")
    push(c, 0)
    (d,) = c.decide()
    assert not c.stop and d.next_plan.workers == [0] and d.next_plan.batch_sizes == [16]


def test_a_probe_that_fits_min_batch_and_fails_just_above_it_is_admitted_at_min_batch():
    """fits = min_batch, fails one above it: the margin below the failure would cap the worker
    at 20, under min_batch, so before 2026-11-28 it was refused; min_batch fits, so its cap is
    min_batch. A probe that fits fewer than min_batch is refused, and nothing is learned."""
    from ps_server.coordinator import JoinRefused

    cfg = validate({"training": {"global_batch": 60, "min_batch": 21, "max_iterations": 10},
                    "cluster": {"num_workers": 2}})
    c = Coordinator(cfg, 1000, BatchSizeManager("uniform", 60, min_batch=21), BSP(), num_shards=S)
    with pytest.raises(JoinRefused) as err:
        c.join("small", "i0", memory_fits=20, memory_fails=21)
    assert err.value.code == "cannot_fit" and len(c.members) == 0 and c.manager.memory_caps == {}
    c.join("tight", "i1", memory_fits=21, memory_fails=22)   # capped at min_batch
    c.join("b", "i2")
    plan = c.try_start()
    assert plan is not None and not c.stop
    assert dict(zip(plan.workers, plan.batch_sizes)) == {0: 21, 1: 39}


def test_a_start_up_probe_caps_the_first_plan():
    cfg = validate({"training": {"global_batch": 60, "max_iterations": 10}, "cluster": {"num_workers": 2}})
    c = Coordinator(cfg, 1000, BatchSizeManager("uniform", 60), BSP(), num_shards=S)
    c.join("small", "i0", memory_fits=12, memory_fails=13)
    c.join("big", "i1")
    c.try_start()
    assert sizes(c) == {0: 12, 1: 48}


# ----- joins no split could include, and splits that stop existing ----------------------------
@pytest.mark.parametrize("sync", ["bsp", "asp"])
def test_joins_past_x_over_min_batch_are_refused_and_the_job_goes_on(sync):
    from ps_server.coordinator import JoinRefused

    c = coordinator(sync, workers=3)
    for i in range(3, 60):                       # X = 60, min_batch 1: room for 60 members
        c.join(f"w{i}", f"instance-{i}")
    with pytest.raises(JoinRefused) as err:
        c.join("one-too-many", "instance-60")
    assert err.value.code == "job_full" and "60 workers" in str(err.value)
    assert len(c.members) == 60
    c.join("w5", "instance-5")                   # the same process again replaces itself: no new seat
    assert len(c.members) == 60
    live = c.live()
    if sync == "asp":
        assert c.assignment(live[0], 0).batch_size == 1
    else:
        for w in list(c.plan):                   # iteration 0 was planned for the first 3
            push(c, w)
        (d,) = c.decide()
        assert d.next_plan.workers == live and d.next_plan.batch_sizes == [1] * 60


def test_a_name_a_live_member_of_another_process_has_is_refused_so_its_memory_cap_stays():
    """Caps are kept by name: a second member under a live worker's name could set them."""
    from ps_server.coordinator import JoinRefused

    cfg = validate({"training": {"global_batch": 60, "max_iterations": 10}, "cluster": {"num_workers": 2}})
    c = Coordinator(cfg, 1000, BatchSizeManager("uniform", 60, min_batch=4), BSP(), num_shards=S)
    w = c.join("gpu-a", "i0", memory_fits=40, memory_fails=41)
    cap = c.manager.memory_caps[w]
    with pytest.raises(JoinRefused) as err:
        c.join("gpu-a", "forger", memory_fits=4, memory_fails=5)
    assert err.value.code == "name_in_use" and len(c.members) == 1
    assert c.manager.memory_caps == {w: cap}
    again = c.join("gpu-a", "i0")                 # the same process again replaces itself
    assert len(c.members) == 1 and c.manager.memory_caps == {again: cap}
    c.leave(again, "lost")
    c.join("gpu-a", "i1")                         # a restart, once the old membership is gone
    assert len(c.members) == 1


def test_a_join_whose_memory_holds_fewer_than_min_batch_samples_is_refused():
    from ps_server.coordinator import JoinRefused

    cfg = validate({"training": {"global_batch": 60, "max_iterations": 10}, "cluster": {"num_workers": 2}})
    c = Coordinator(cfg, 1000, BatchSizeManager("uniform", 60, min_batch=4), BSP(), num_shards=S)
    with pytest.raises(JoinRefused) as err:
        c.join("tiny", "i0", memory_fits=3, memory_fails=4)
    assert err.value.code == "cannot_fit" and len(c.members) == 0
    c.join("enough", "i1", memory_fits=4, memory_fails=5)
    assert len(c.members) == 1


def test_memory_caps_that_add_up_to_less_than_x_stop_the_job_at_its_version():
    c = coordinator()
    for w in range(3):                              # each holds 10 of its 20 samples: 30 < 60
        c.out_of_memory(w, 0, 20)
    for w in range(3):
        push(c, w)
    (d,) = c.decide()
    assert d.entries == [[0, 10], [1, 10], [2, 10]], "iteration 0 still commits what was computed"
    assert d.next_plan is None and c.stop and c.stop_version == d.version
    assert "no split" in c.stop_reason and "caps" in c.stop_reason
    assert c.decide() == [] and c.assignment(0, 1) is None


# ----- membership: one owner (the coordinator), read by the manager and the batch policy -------
class _Recording(UniformPolicy):
    """Uniform splits; records what the policy hears of membership."""

    def __init__(self) -> None:
        self.heard: list[tuple[str, int]] = []

    def join(self, worker_id: int) -> None:
        self.heard.append(("join", worker_id))

    def leave(self, worker_id: int) -> None:
        self.heard.append(("leave", worker_id))


def _recorded(workers=3):
    cfg = validate({"training": {"global_batch": 60, "max_iterations": 100}, "cluster": {"num_workers": workers}})
    policy = _Recording()
    return Coordinator(cfg, 1000, BatchSizeManager(policy, 60), BSP(), num_shards=S), policy


def test_the_manager_reads_the_coordinators_membership():
    c, policy = _recorded()
    m = c.manager
    for i in range(3):
        c.join(f"w{i}", f"instance-{i}")
    assert m.membership is c.members and m.live_workers == c.live() == [0, 1, 2]
    with pytest.raises(RuntimeError, match="someone else owns"):
        m.join(9)
    with pytest.raises(RuntimeError, match="someone else owns"):
        m.leave(0)
    again = c.join("w0", "instance-0")    # the same process joins again: its old membership goes
    c.leave(1, "lost")                     # an eviction
    c.leave(1, "lost")                     # twice: nothing more happens
    assert m.live_workers == c.live() == [2, again] and m.name_of(again) == "w0"
    assert policy.heard == [("join", 0), ("join", 1), ("join", 2), ("leave", 0), ("join", again), ("leave", 1)]
    assert c.try_start() is None, "two members of three: not started"


def test_resume_leaves_the_old_members_everywhere_and_takes_the_new_ones():
    c, _ = _recorded()
    for i in range(3):
        c.join(f"w{i}", f"instance-{i}")
    c.try_start()
    for w in range(3):
        push(c, w)
    c.decide()
    state = c.state_dict()
    d, policy = _recorded()
    d.join("early", "instance-early")      # a member of this incarnation before the restore
    d.load_state_dict(state)
    assert d.manager.live_workers == d.live() == []
    assert policy.heard[:2] == [("join", 0), ("leave", 0)], "this incarnation's member has left"
    assert policy.heard[2:] == [("leave", 0), ("leave", 1), ("leave", 2)], \
        "the checkpoint's members have left the batch policy too"
    ids = [d.join(f"again{i}", f"again-{i}") for i in range(3)]
    assert ids == [3, 4, 5] and d.manager.live_workers == d.live() == ids
    assert d.try_start() is not None and sizes(d) == {3: 20, 4: 20, 5: 20}


def test_drops_of_entries_a_follower_keeps_reporting_are_kept_once_and_a_commit_carries_a_bounded_number(
        monkeypatch):
    """A follower reports what it holds at every beat; gradients nobody assigned (a peer with the
    worker credential pushing under departed workers' tokens, async modes) come back each time.
    Their drops must not pile up between commits, nor make one commit too large to decode."""
    from ps_server import coordinator as coordinator_module

    c = coordinator("asp", workers=2)
    bogus = [(1000 + i, 10**9, 1) for i in range(300)]
    for _ in range(50):                           # 50 beats of the same 300 held entries
        for w, t, x in bogus:
            c.on_gradient(1, w, t, x)
    assert len(c._pending_drops) == 300, "each drop is kept once, not once per beat"
    monkeypatch.setattr(coordinator_module, "MAX_DROPS_PER_COMMIT", 128)
    a = c.assignment(0, 0)
    for k in range(S):
        c.on_gradient(k, 0, 0, a.batch_size)
    (d,) = c.decide()
    assert len(d.drops) == 128 and d.drops[0] == [1000, 10**9, 1]
    assert len(c._pending_drops) == 300 - 128, "the rest ride on the next commits"
