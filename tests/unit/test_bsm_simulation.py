"""The simulated timing model and the reports it builds (the same fields ps_worker sends)."""

from __future__ import annotations

import pytest

from batchsize_manager import BatchSizeManager
from batchsize_manager.simulation import CpuQuota, SimulatedWorker, Simulation, ideal_iteration_time, simulate
from ps_common.report import Telemetry


def test_cpu_and_gpu_like_timing():
    cpu = SimulatedWorker(speed=100.0, overhead=0.5)
    assert cpu.time(50) == pytest.approx(1.0)
    assert cpu.time(10) == pytest.approx(0.6)                 # linear all the way down
    gpu = SimulatedWorker(speed=100.0, overhead=0.5, saturation_batch=40, memory_cap=80)
    assert gpu.time(10) == gpu.time(40) == pytest.approx(0.9)  # flat below saturation
    assert gpu.time(80) == pytest.approx(1.3)
    with pytest.raises(MemoryError, match="batch 81 > cap 80"):
        gpu.time(81)


def test_speed_schedule_steps():
    w = SimulatedWorker(100.0, schedule=[(20, 25.0), (10, 50.0)])
    assert [w.speed_at(i) for i in (0, 9, 10, 19, 20, 99)] == [100, 100, 50, 50, 25, 25]
    assert w.time(100, iteration=15) == pytest.approx(2.0)


def test_noise_is_seeded_and_bounded():
    a = [SimulatedWorker(1.0, noise=0.05, seed=3).draw_noise() for _ in range(2)]
    assert a[0] == a[1] != 0.0
    w = SimulatedWorker(1.0, noise=0.05, seed=4)
    draws = [w.draw_noise() for _ in range(2000)]
    assert max(abs(d) for d in draws) <= 0.15 + 1e-12
    assert 0.04 < (sum(d * d for d in draws) / len(draws)) ** 0.5 < 0.06


def spied_manager() -> tuple[BatchSizeManager, list]:
    """A uniform manager (X = 100) that keeps every report it observes, in order."""
    seen: list = []

    class Spy(BatchSizeManager):
        def observe_many(self, reports):
            seen.extend(reports)
            super().observe_many(reports)

    return Spy("uniform", 100), seen


def test_reports_look_like_the_real_workers():
    m, seen = spied_manager()
    workers = {0: SimulatedWorker(100.0, overhead=0.1), 1: SimulatedWorker(50.0, overhead=0.1)}
    recs = simulate(m, workers, 2)
    assert recs[0].sizes == {0: 50, 1: 50}
    assert recs[0].times == {0: pytest.approx(0.6), 1: pytest.approx(1.1)}
    assert recs[0].iteration_s == pytest.approx(1.1)
    r0, r1 = seen[0], seen[2]                                  # worker 0, iterations 0 and 1
    t0, t1 = r0.telemetry, r1.telemetry
    assert (t0.proc_cpu, t0.host_cpu, t0.cotenant_cpu, t0.rss_mb, t0.host_mem_pct) == (100.0, 50.0, 0.0, 500.0, 40.0)
    assert t0.compute_s == pytest.approx(0.5)
    assert r0.speed() == pytest.approx(100.0)
    assert t0.data_s == pytest.approx(0.02)
    # First report: previous comm is the initial pull; then the previous iteration's push/wait/pull.
    assert (t0.prev_push_s, t0.prev_wait_s, t0.iteration_s) == (0.0, 0.0, 0.0)
    assert t0.prev_pull_s == pytest.approx(0.04)
    assert t1.prev_push_s == pytest.approx(0.04)
    assert t1.prev_wait_s == pytest.approx(0.5)   # waited for worker 1 at the barrier
    assert t1.iteration_s == pytest.approx(1.1)
    assert t0.oom is False and t0.finish_s == pytest.approx(0.6)   # as the coordinator adds it
    assert t0.row == Telemetry(**t0.to_dict()).packed()             # as received: with its row


def test_a_cpu_quota_stalls_work_until_the_next_period():
    """0.2 of a core in 100 ms periods: 20 ms of CPU per period, then nothing until the next."""
    q = CpuQuota(0.2, 0.1)
    assert q.run(0.0, 0.010) == pytest.approx(0.010)          # within the share
    assert q.run(0.010, 0.030) == pytest.approx(0.120)        # 10 ms now, 20 ms next period
    assert q.run(0.150, 0.005) == pytest.approx(0.205)        # that period's share is spent
    assert q.run(0.3, 0.001) == pytest.approx(0.301)          # float-safe period boundary
    w = SimulatedWorker(100.0, overhead=0.01, cpu_quota=0.2)
    assert w.busy_until(1.0, 0.05) == pytest.approx(1.21)     # 20 + 20 + 10 ms over three periods
    assert SimulatedWorker(100.0).busy_until(1.0, 0.05) == pytest.approx(1.05)
    with pytest.raises(ValueError, match="cpu_quota"):
        CpuQuota(0.0)


def test_oom_is_reported_with_the_failed_size():
    m, seen = spied_manager()
    rec = Simulation(m, [SimulatedWorker(10.0, memory_cap=40), SimulatedWorker(10.0)]).step()
    assert rec.oom == [0]
    bad = next(r for r in seen if r.worker_id == 0)
    assert bad.telemetry.oom is True and bad.batch_size == 50
    assert m.memory_caps == {0: 25}                 # binary search: half the failed size


def test_ideal_time_is_the_balanced_bound():
    ws = [SimulatedWorker(v, overhead=0.01) for v in (4.0, 4.0, 2.0, 1.0)]
    assert ideal_iteration_time(ws, 110) == pytest.approx(0.01 + 110 / 11, rel=1e-9)
    capped = [SimulatedWorker(10.0, memory_cap=20), SimulatedWorker(10.0)]
    assert ideal_iteration_time(capped, 100) == pytest.approx(8.0, rel=1e-9)   # 20 + 80 at 10/s
    flat = [SimulatedWorker(10.0, saturation_batch=50), SimulatedWorker(100.0)]
    assert ideal_iteration_time(flat, 100) == pytest.approx(5.0, rel=1e-9)     # slow one is flat
    with pytest.raises(ValueError, match="memory caps"):
        ideal_iteration_time([SimulatedWorker(1.0, memory_cap=5)], 10)


def _first_reaction(plan_ahead: bool) -> int:
    """The first iteration whose split gives worker 0 less, after it slows at iteration 10."""
    m = BatchSizeManager("lbbsp-cpu", 200, policy_args={"predictor": "last"})
    workers = [SimulatedWorker(1000.0, schedule=[(10, 250.0)]), SimulatedWorker(1000.0)]
    recs = Simulation(m, workers, plan_ahead=plan_ahead).run(20)
    return next(r.iteration for r in recs if r.iteration >= 10 and r.sizes[0] < 90)


def test_planning_ahead_reacts_one_iteration_later():
    """plan_ahead: the split of t+1 knows the reports of t-1 and earlier, as the coordinator's
    does when it decides while t computes; otherwise t's as well."""
    assert _first_reaction(False) == 11
    assert _first_reaction(True) == 12
