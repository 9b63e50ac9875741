"""BatchSizeManager: bounds, errors, decision-time measurement, checkpoints, old-style policies."""

from __future__ import annotations

import json
import time
from typing import Sequence

import numpy as np
import pytest

from batchsize_manager import BatchPolicy, BatchSizeManager, WorkerReport, get_policy
from batchsize_manager.allocation import CapsArg
from batchsize_manager.membership import Member, Membership
from batchsize_manager.simulation import SimulatedWorker, Simulation
from ps_common.report import Telemetry


class FakeClock:
    """Advances by 1.0 on every reading, so elapsed times count clock readings."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def rep(w: int, x: int, compute: float = 0.1, **tel: float | bool) -> WorkerReport:
    return WorkerReport(worker_id=w, iteration=0, batch_size=x, telemetry=Telemetry(compute_s=compute, **tel))


def test_decision_time_is_measured_with_the_injected_clock():
    m = BatchSizeManager("uniform", 64, clock=FakeClock())
    for w in range(4):
        m.join(w)
    assert m.decisions == 0
    assert m.assign() == {0: 16, 1: 16, 2: 16, 3: 16}
    assert m.last_decision_s == 1.0 and m.decisions == 1     # one assign: 1 tick
    for w in range(4):
        m.observe(rep(w, 16))                                  # 4 observes: 1 tick each
    m.assign()
    assert m.last_decision_s == 5.0
    assert m.decisions == 2 and m.mean_decision_s == 3.0


def test_real_clock_decision_time_is_positive():
    m = BatchSizeManager("lbbsp-cpu", 256)
    Simulation(m, [SimulatedWorker(1000.0 * (i + 1), 0.01) for i in range(4)]).run(5)
    assert m.decisions == 5 and 0 < m.last_decision_s < 1.0 and 0 < m.mean_decision_s < 1.0


class _TimedPolicy(BatchPolicy):
    """Uniform, after ``seconds`` spent sleeping (``burn=False``) or computing (``burn=True``)
    in observe_batch and again in assign. Computing runs until this thread's CPU clock (the
    manager's) has advanced by ``seconds``: spinning on the wall clock instead got 0.078 s of CPU
    for 0.1 s on a loaded host, so the bounds below would test the host's load."""

    def __init__(self, seconds: float, burn: bool) -> None:
        self.seconds, self.burn = seconds, burn

    def _spend(self) -> None:
        if not self.burn:
            time.sleep(self.seconds)
            return
        end = time.thread_time() + self.seconds
        while time.thread_time() < end:
            pass

    def observe_batch(self, batch) -> None:
        self._spend()

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        self._spend()
        return get_policy("uniform").assign(workers, global_batch, min_batch, max_batch=max_batch)


@pytest.mark.parametrize("burn", [True, False])
def test_decision_cpu_time_counts_this_threads_cpu_and_each_flush_once(burn):
    """A decision that waits (preempted, or blocked) costs the host no CPU; one that computes
    does. The reports flushed inside assign() count once; a flush by an earlier read of the
    policy counts into the next decision."""
    m = BatchSizeManager(_TimedPolicy(0.05, burn), 64)
    for w in range(2):
        m.join(w)
        m.observe(rep(w, 32))
    m.assign()                                   # flush (0.05 s) + assign (0.05 s)
    assert m.last_decision_s >= 0.1
    if burn:
        assert 0.1 <= m.last_decision_cpu_s <= m.last_decision_s + 0.01
    else:
        assert m.last_decision_cpu_s < 0.03
    m.observe(rep(0, 32))
    assert m.policy is not None                  # reading it flushes now (0.05 s), outside assign()
    m.assign()
    if burn:   # 0.1 s: the earlier flush and this assign; 0.05 uncounted, 0.15 counted twice
        assert 0.1 <= m.last_decision_cpu_s < 0.13, "the earlier flush counts, once"
    assert m.decisions == 2
    assert m.mean_decision_cpu_s == pytest.approx(m.total_decision_cpu_s / 2)


def test_bounds_and_clear_errors():
    m = BatchSizeManager("uniform", 10, min_batch=4)
    with pytest.raises(ValueError, match="no workers"):
        m.assign()
    for w in range(3):
        m.join(w)
    with pytest.raises(ValueError, match="cannot give 3 workers at least 4"):
        m.assign()
    m = BatchSizeManager("uniform", 100, max_batch=30)
    for w in range(3):
        m.join(w)
    with pytest.raises(ValueError, match="exceeds the sum of the workers' batch caps"):
        m.assign()
    m.join(3)
    assert m.assign() == {0: 25, 1: 25, 2: 25, 3: 25}
    with pytest.raises(ValueError, match="max_batch=2 is below min_batch=3"):
        BatchSizeManager("uniform", 100, min_batch=3, max_batch=2)
    with pytest.raises(ValueError, match="global_batch"):
        BatchSizeManager("uniform", 0)
    with pytest.raises(ValueError, match="unknown batch policy"):
        BatchSizeManager("nope", 10)
    with pytest.raises(ValueError, match="policy_args only apply"):
        BatchSizeManager(get_policy("uniform"), 10, policy_args={"x": 1})


def test_memory_caps_and_oom_apply_to_every_policy():
    m = BatchSizeManager("uniform", 120, memory_caps={0: 20})
    for w in range(3):
        m.join(w)
    assert m.assign() == {0: 20, 1: 50, 2: 50}
    m.observe(rep(1, 50, oom=True))              # OOM at 50, nothing known to fit: try the middle
    assert m.memory_caps == {0: 20, 1: 25}
    assert m.assign() == {0: 20, 1: 25, 2: 75}
    for fitted, cap in ((25, 37), (37, 43), (43, 46), (46, 47), (47, 47)):
        m.observe(rep(1, fitted))               # binary search up to 5% below the failure
        assert m.memory_caps[1] == cap
    assert m.assign() == {0: 20, 1: 47, 2: 53}


def test_memory_caps_follow_the_worker_name_across_rejoin_and_checkpoint():
    m = BatchSizeManager("uniform", 100, memory_caps={"gpu-b": 30})
    m.join(0, name="gpu-a")
    m.join(1, name="gpu-b")
    assert m.assign() == {0: 70, 1: 30}
    assert m.out_of_memory(0, 70) == 35             # the retry size is the new cap
    m.leave(0)
    m.join(7, name="gpu-a")                         # back under a new id: the cap is its own
    assert m.memory_caps == {1: 30, 7: 35}
    m.join(8, name="gpu-c")                         # a newcomer with id 0's old slot gets nothing
    assert 8 not in m.memory_caps
    state = json.loads(json.dumps(m.state_dict()))
    fresh = BatchSizeManager("uniform", 100)
    fresh.load_state_dict(state)
    fresh.join(3, name="gpu-a")
    assert fresh.memory_caps == {3: 35}


def test_an_out_of_memory_at_one_sample_cannot_be_retried():
    from batchsize_manager.memory import CannotFit

    m = BatchSizeManager("uniform", 10)
    m.join(0, name="tiny")
    with pytest.raises(CannotFit, match="single sample"):
        m.out_of_memory(0, 1)
    with pytest.raises(KeyError):
        m.out_of_memory(5, 10)


def test_reported_headroom_caps_a_worker_before_it_fails():
    m = BatchSizeManager("uniform", 200)
    m.join(0, name="a")
    m.join(1, name="b")
    assert m.assign() == {0: 100, 1: 100}
    # 100 samples fit with 20 MB to spare at 1 MB per sample: about 119 would (5% margin)
    m.observe(rep(0, 100, mem_headroom_mb=20.0, mem_per_sample_mb=1.0))
    m.observe(rep(1, 100))
    assert m.memory_caps == {0: 119}
    m.observe(rep(0, 100, mem_headroom_mb=0.0, mem_per_sample_mb=1.0))   # full: no room above 100
    assert m.memory_caps == {0: 100}


def test_membership_and_late_reports():
    m = BatchSizeManager("uniform", 30)
    m.join(3)
    m.join(3)
    m.join(1)
    assert m.live_workers == [1, 3]
    m.leave(3)
    m.leave(42)
    assert m.live_workers == [1]
    m.observe(rep(3, 10))                                      # from a departed worker: dropped
    assert m.ignored_reports == 1
    assert m.assign() == {1: 30}


class CapBlindPolicy(BatchPolicy):
    """Takes the one assign signature but ignores the caps; gives everything to one id."""

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        ws = sorted(workers)
        return {w: (global_batch - min_batch * (len(ws) - 1) if w == ws[0] else min_batch) for w in ws}


def test_a_policy_that_ignores_the_caps_is_checked():
    m = BatchSizeManager(CapBlindPolicy(), 100)
    m.join(0)
    m.join(1)
    assert m.assign() == {0: 99, 1: 1}
    capped = BatchSizeManager(CapBlindPolicy(), 100, max_batch=60)
    capped.join(0)
    capped.join(1)
    with pytest.raises(RuntimeError, match="gave worker 0 batch 99, outside \\[1, 60\\]"):
        capped.assign()
    # The three-argument call (no caps) works on every built-in policy.
    assert get_policy("lbbsp-gpu").assign([0, 1], 10, 1) == {0: 5, 1: 5}


class FixedArrayPolicy(BatchPolicy):
    """A native (array) policy that answers a fixed split, right or wrong."""

    native_arrays = True

    def __init__(self, answer: list[int]) -> None:
        self.answer = answer

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        return dict(zip(sorted(workers), self.answer))

    def assign_arrays(self, ids: np.ndarray, global_batch: int, min_batch: int, caps: np.ndarray, *,
                      checked: bool = False) -> np.ndarray:
        return np.array(self.answer, dtype=np.int64)


@pytest.mark.parametrize("n", [4, 40], ids=["few-workers-on-lists", "many-workers-in-numpy"])
def test_an_array_policy_split_is_checked_for_its_sum_and_every_bound(n):
    """The manager checks a native policy's answer as it checks a dict policy's: the sum, then
    the first worker outside [min_batch, cap] (few workers on Python lists, many in numpy)."""
    def manager(answer: list[int]) -> BatchSizeManager:
        m = BatchSizeManager(FixedArrayPolicy(answer), 10 * n, min_batch=2, max_batch=30)
        for w in range(n):
            m.join(w)
        return m

    good = [10] * n
    assert manager(good).assign() == dict.fromkeys(range(n), 10)
    with pytest.raises(RuntimeError, match=f"split sums to {10 * n + 1}, not X={10 * n}"):
        manager([11] + [10] * (n - 1)).assign()
    low = [10] * n
    low[1], low[2] = 1, 19                          # the sum holds, worker 1 is below the floor
    with pytest.raises(RuntimeError, match="gave worker 1 batch 1, outside \\[2, 30\\]"):
        manager(low).assign()
    high = [10] * n
    high[:3] = [2, 2, 5]                            # 21 fewer samples here ...
    high[-1] = 31                                   # ... and worker n-1 above the cap of 30
    with pytest.raises(RuntimeError, match=f"gave worker {n - 1} batch 31, outside \\[2, 30\\]"):
        manager(high).assign()
    with pytest.raises(RuntimeError, match=f"answered {n - 1} sizes for {n} workers"):
        manager([10] * (n - 1)).assign()


class Tee:
    """Drives two managers with identical reports and checks they agree at every decision."""

    def __init__(self, a: BatchSizeManager, b: BatchSizeManager) -> None:
        self.a, self.b = a, b

    def join(self, w: int) -> None:
        self.a.join(w)
        self.b.join(w)

    def leave(self, w: int) -> None:
        self.a.leave(w)
        self.b.leave(w)

    def observe_many(self, reports: list[WorkerReport]) -> None:
        self.a.observe_many(reports)
        self.b.observe_many(reports)

    def assign(self) -> dict[int, int]:
        x, y = self.a.assign(), self.b.assign()
        assert x == y
        return x

    @property
    def last_decision_s(self) -> float:
        return self.a.last_decision_s


@pytest.mark.parametrize("name,args,caps", [
    ("static", {}, None), ("lbbsp-cpu", {"predictor": "last"}, None),
    ("lbbsp-cpu", {"predictor": "ema", "history": 64}, None),
    ("lbbsp-gpu", {}, {"0": 150}),
])
def test_state_dict_round_trips_through_json(name, args, caps):
    workers = [SimulatedWorker(v, 0.004, saturation_batch=16, noise=0.03, seed=i,
                               schedule=[(30, v / 3)] if i == 2 else [])
               for i, v in enumerate([3000.0, 2000.0, 1500.0, 700.0])]
    a = BatchSizeManager(name, 512, min_batch=2, policy_args=args, memory_caps=caps)
    sim = Simulation(a, workers)
    sim.run(25)
    state = json.loads(json.dumps(a.state_dict()))
    b = BatchSizeManager(name, 512, min_batch=2, policy_args=args, memory_caps=caps)
    b.load_state_dict(state)
    assert b.live_workers == a.live_workers and b.decisions == a.decisions
    sim.manager = Tee(a, b)  # type: ignore[assignment]
    recs = sim.run(25)                                         # same answers, step change included
    assert len({tuple(sorted(r.sizes.items())) for r in recs}) > 1 or name == "static"


def test_load_state_dict_rejects_another_policy():
    a = BatchSizeManager("static", 64)
    b = BatchSizeManager("lbbsp-gpu", 64)
    with pytest.raises(ValueError, match="checkpoint is for batch policy 'static'"):
        b.load_state_dict(a.state_dict())


def test_membership_tells_its_readers_in_order_and_holds_them_weakly():
    members: Membership[Member] = Membership()
    heard: list[tuple] = []

    class Reader:
        def member_joined(self, w, name):
            heard.append(("joined", w, name, w in members))

        def member_leaving(self, w, name):
            heard.append(("leaving", w, name, w in members))

    reader = Reader()
    members.subscribe(reader)
    assert members.join(2, Member("b")) and members.join(1, Member("a")) and not members.join(1, Member("x"))
    assert members.ids() == [1, 2] and members.name_of(1) == "a" and members.ids_named("a") == {1}
    assert members.leave(2) == Member("b") and members.leave(2) is None
    assert heard == [("joined", 2, "b", True), ("joined", 1, "a", True), ("leaving", 2, "b", True)], \
        "a join is told once the member is in, a leave while it still is"
    del reader
    members.clear()
    assert len(members) == 0 and len(heard) == 3, "a reader that is gone is not kept alive or called"


def test_a_manager_on_someone_elses_membership_hears_its_changes():
    members: Membership[Member] = Membership()
    m = BatchSizeManager("uniform", 30)
    m.use_membership(members)
    members.join(4, Member("w4"))
    members.join(7, Member("w7"))
    m.observe(rep(4, 10))
    assert m.live_workers == [4, 7] and m.assign() == {4: 15, 7: 15}
    members.leave(4)
    m.observe(rep(4, 10))                                      # from a departed worker: dropped
    assert m.ignored_reports == 1 and m.assign() == {7: 30}
    with pytest.raises(RuntimeError, match="someone else owns"):
        m.join(1)
    with pytest.raises(ValueError, match="must be empty"):
        BatchSizeManager("uniform", 30).use_membership(members)


@pytest.mark.parametrize("policy", ["uniform", "lbbsp-cpu"])
def test_bounds_are_checked_again_after_every_change(policy):
    """The manager and lbbsp-cpu skip re-checking bounds they checked for the very same live set
    and caps; a leave, a join or a cap learned from an out-of-memory report is checked again."""
    m = BatchSizeManager(policy, 100, max_batch=45)
    for w in range(3):
        m.join(w)
    first = m.assign()
    assert sum(first.values()) == 100 and m.assign() == first       # nothing changed
    m.leave(2)
    with pytest.raises(ValueError, match="exceeds the sum of the workers' batch caps"):
        m.assign()
    m.join(2)
    sizes = m.assign()
    for it in range(1, 8):          # equal speeds: a split away from even is predicted slower
        for w, x in sizes.items():
            m.observe(WorkerReport(worker_id=w, iteration=it, batch_size=x,
                                   telemetry=Telemetry(compute_s=x / 1000.0, finish_s=x / 1000.0 + 0.01)))
        assert m.assign() == sizes
    m.observe(WorkerReport(worker_id=0, iteration=8, batch_size=sizes[0], telemetry=Telemetry(oom=True)))
    after = m.assign()
    assert after[0] < sizes[0] and sum(after.values()) == 100 and max(after.values()) <= 45
    assert m.memory_caps[0] < sizes[0]


@pytest.mark.parametrize("bad", [float("inf"), "twelve", [1, 2]])
def test_a_damaged_checkpoint_leaves_the_manager_as_it_was(bad):
    """A hand-edited value that no save writes: refused as ValueError (the coordinator then starts
    the policy afresh), never another exception nor a half-restored manager."""
    m = BatchSizeManager("lbbsp-gpu", 60)
    for w in (0, 1):
        m.join(w)
    for t in range(6):
        sizes = m.assign()
        for w, x in sizes.items():
            m.observe(WorkerReport(worker_id=w, iteration=t, batch_size=x,
                                   telemetry=Telemetry(compute_s=x / (100.0 * (w + 1)))))
    state = m.state_dict()
    state["policy_state"]["split"] = {k: bad for k in state["policy_state"]["split"]}
    fresh = BatchSizeManager("lbbsp-gpu", 60)
    for w in (0, 1):
        fresh.join(w)
    before = fresh.state_dict()
    with pytest.raises(ValueError):
        fresh.load_state_dict(state)
    assert fresh.state_dict() == before
