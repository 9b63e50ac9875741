"""BatchSizeManager: bounds, errors, decision-time measurement, checkpoints, old-style policies."""

from __future__ import annotations

import json
from typing import Sequence

import pytest

from batchsize_manager import BatchPolicy, BatchSizeManager, WorkerReport, get_policy
from batchsize_manager.simulation import Simulation, SimulatedWorker


class FakeClock:
    """Advances by 1.0 on every reading, so elapsed times count clock readings."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        self.t += 1.0
        return self.t


def rep(w: int, x: int, compute: float = 0.1, **tel: float) -> WorkerReport:
    return WorkerReport(worker_id=w, iteration=0, batch_size=x, compute_s=compute, iteration_s=0.0,
                        telemetry={"compute_s": compute, **tel})


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
    m.observe(rep(1, 50, oom=1.0))                             # OOM at 50: cap 47 (5% margin)
    assert m.memory_caps == {0: 20, 1: 47}
    assert m.assign() == {0: 20, 1: 47, 2: 53}


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


class OldStylePolicy(BatchPolicy):
    """A policy written before caps existed (old assign signature); gives everything to one id."""

    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1) -> dict[int, int]:
        ws = sorted(workers)
        return {w: (global_batch - min_batch * (len(ws) - 1) if w == ws[0] else min_batch) for w in ws}


def test_old_style_policies_still_work_and_are_checked():
    m = BatchSizeManager(OldStylePolicy(), 100)
    m.join(0)
    m.join(1)
    assert m.assign() == {0: 99, 1: 1}
    capped = BatchSizeManager(OldStylePolicy(), 100, max_batch=60)
    capped.join(0)
    capped.join(1)
    with pytest.raises(RuntimeError, match="gave worker 0 batch 99, outside \\[1, 60\\]"):
        capped.assign()
    # The old three-argument call still works on every built-in policy.
    assert get_policy("lbbsp-gpu").assign([0, 1], 10, 1) == {0: 5, 1: 5}


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

    def observe(self, r: WorkerReport) -> None:
        self.a.observe(r)
        self.b.observe(r)

    def assign(self) -> dict[int, int]:
        x, y = self.a.assign(), self.b.assign()
        assert x == y
        return x

    @property
    def last_decision_s(self) -> float:
        return self.a.last_decision_s


@pytest.mark.parametrize("name,args", [
    ("static", {}), ("lbbsp-cpu", {"predictor": "last"}), ("lbbsp-cpu", {"predictor": "ema", "history": 64}),
    ("lbbsp-gpu", {"memory_caps": {"0": 150}}),
])
def test_state_dict_round_trips_through_json(name, args):
    workers = [SimulatedWorker(v, 0.004, saturation_batch=16, noise=0.03, seed=i,
                               schedule=[(30, v / 3)] if i == 2 else [])
               for i, v in enumerate([3000.0, 2000.0, 1500.0, 700.0])]
    a = BatchSizeManager(name, 512, min_batch=2, policy_args=args)
    sim = Simulation(a, workers)
    sim.run(25)
    state = json.loads(json.dumps(a.state_dict()))
    b = BatchSizeManager(name, 512, min_batch=2, policy_args=args)
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
