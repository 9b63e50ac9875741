"""The decisions of scenarios at run time, without real load: the contention driver following
its schedule on an injected clock, emulated slowdowns and message delays with a fake sleep.
(Real CPU burners and the driver's own thread are in tests/system/test_contention.py.)"""

from __future__ import annotations

import time

import pytest

from ps_common.scenario import WorkerScenario
from ps_worker.contention import CommDelay, ContentionDriver, EmulatedSlowdown
from ps_worker.scenario_runtime import ScenarioRuntime


def rt(**spec):
    return ScenarioRuntime(WorkerScenario.model_validate(spec), 0)


class FakeBurners:
    def __init__(self) -> None:
        self.counts: list[int] = []
        self.closed = False

    def set_count(self, n: int) -> int:
        self.counts.append(n)
        return n

    def close(self) -> None:
        self.closed = True


def test_driver_tick_follows_the_schedule_with_an_injected_clock():
    now = [100.0]
    fake = FakeBurners()
    r = rt(cpu_load=[{"start_s": 1.0, "stop_s": 3.0, "processes": 2}, {"start_s": 2.0, "processes": 1}])
    d = ContentionDriver(r, clock=lambda: now[0], burners=fake, interval_s=60.0)
    d.start()  # origin = 100; the thread waits 60 s between ticks, so only our ticks count
    try:
        assert d.origin == 100.0 and fake.counts == [0]
        for t in (0.5, 1.0, 2.5, 3.0, 10.0):
            now[0] = 100.0 + t
            d.tick()
        assert fake.counts == [0, 0, 2, 3, 1, 1]
        assert d.elapsed() == pytest.approx(10.0)
    finally:
        d.stop()
    assert fake.closed
    d.stop()  # idempotent


def test_driver_without_real_load_starts_nothing():
    d = ContentionDriver(rt(slowdown=2.0))
    with d:
        assert d._thread is None and d._burners is None
        assert d.elapsed() >= 0


def test_emulated_slowdown_sleeps_f_minus_one_times_compute():
    slept: list[float] = []
    now = [0.0]

    def fake_sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    r = rt(slowdown=2.0, steps=[{"at_iteration": 10, "slowdown": 2.0}])
    e = EmulatedSlowdown(r, sleep=fake_sleep, clock=lambda: now[0])
    assert e.after_compute(0, 0.0, 0.5) == pytest.approx(0.5)      # f = 2
    assert e.after_compute(10, 0.0, 0.5) == pytest.approx(1.5)     # f = 4
    assert e.last_factor == 4.0 and e.total_s == pytest.approx(2.0)
    assert slept == pytest.approx([0.5, 1.5])
    e1 = EmulatedSlowdown(rt(), sleep=fake_sleep)
    assert e1.after_compute(0, 0.0, 0.5) == 0.0 and len(slept) == 2  # f = 1: no sleep at all


def test_emulated_slowdown_real_sleep():
    e = EmulatedSlowdown(rt(slowdown=3.0))
    t0 = time.perf_counter()
    got = e.after_compute(0, 0.0, 0.05)
    took = time.perf_counter() - t0
    assert 0.095 <= got <= 1.0 and got <= took + 1e-6


def test_comm_delay_sleeps_per_message():
    slept: list[float] = []
    c = CommDelay(rt(comm_delay_ms=5.0, comm_bandwidth_mb_s=1.0), sleep=slept.append)
    assert c(0) == pytest.approx(0.005) and c(1_000_000) == pytest.approx(1.005)
    assert slept == pytest.approx([0.005, 1.005])
    none = CommDelay(rt(), sleep=slept.append)
    assert none(10**9) == 0.0 and len(slept) == 2
