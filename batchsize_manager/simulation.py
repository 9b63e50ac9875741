"""A pure timing model of workers, for tests and benchmarks: no sockets, no sleeps, seeded noise.

A simulated worker takes ``overhead + compute`` seconds for a batch of x samples, where compute
is ``x / speed`` on a CPU-like worker and ``max(x, saturation_batch) / speed`` on a GPU-like one
(flat below saturation), times a multiplicative noise factor. Batches above ``memory_cap`` fail
with an out-of-memory report. Under a ``cpu_quota`` (a fraction of a core, :class:`CpuQuota`)
the busy time runs on a clock that stalls when the period's share is spent; the stall shows in
the finish time the servers see, not in compute. :class:`Simulation` drives a
:class:`BatchSizeManager` exactly like the coordinator does (observe every report of
iteration t, then assign t+1) and builds the reports exactly like ``ps_worker`` does (this
iteration's data and compute times, the previous iteration's push/wait/pull, and the finish
time the coordinator adds), so policies see the same fields in simulation as in a real run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Mapping, Sequence

from batchsize_manager.manager import BatchSizeManager
from batchsize_manager.reports import WorkerReport
from ps_common.report import Telemetry


@dataclass
class SimulatedWorker:
    """Timing model of one worker.

    ``schedule`` holds step changes ``(from_iteration, speed)``; ``noise`` is the standard
    deviation of a Gaussian multiplicative factor on compute time (clipped to ±3σ). The overhead
    is split into data loading (``data_fraction``) and equal push and pull parts.
    ``quota_schedule`` holds changes ``(from_iteration, fraction)`` of ``cpu_quota``, as the
    lab's rotating quotas move a share from one worker to another.
    """

    speed: float
    overhead: float = 0.0
    saturation_batch: int = 0
    memory_cap: int | None = None
    noise: float = 0.0
    seed: int = 0
    schedule: Sequence[tuple[int, float]] = ()
    data_fraction: float = 0.2
    cpu_quota: float | None = None
    quota_period_s: float = 0.1
    quota_schedule: Sequence[tuple[int, float]] = ()
    _rng: random.Random = field(init=False, repr=False)
    _quota: CpuQuota | None = field(init=False, repr=False, default=None)

    def __post_init__(self) -> None:
        if not (self.speed > 0 and math.isfinite(self.speed)):
            raise ValueError(f"speed must be finite and > 0, got {self.speed}")
        if self.overhead < 0 or self.noise < 0 or self.saturation_batch < 0:
            raise ValueError("overhead, noise and saturation_batch must be >= 0")
        if any(s <= 0 for _, s in self.schedule):
            raise ValueError(f"scheduled speeds must be > 0: {list(self.schedule)}")
        self.schedule = sorted((int(i), float(s)) for i, s in self.schedule)
        self._rng = random.Random(self.seed)
        self.quota_schedule = sorted((int(i), float(f)) for i, f in self.quota_schedule)
        if self.quota_schedule and self.cpu_quota is None:
            raise ValueError("quota_schedule needs cpu_quota (the fraction before the first change)")
        if self.cpu_quota is not None:
            self._quota = CpuQuota(self.cpu_quota, self.quota_period_s)
            for _, f in self.quota_schedule:
                CpuQuota(f, self.quota_period_s)            # clear errors now, not mid-run

    def quota_at(self, iteration: int) -> float | None:
        """The CPU quota at ``iteration`` (the latest scheduled change at or before it)."""
        q = self.cpu_quota
        for start, f in self.quota_schedule:
            if iteration >= start:
                q = f
        return q

    def busy_until(self, start_s: float, busy_s: float, iteration: int = 0) -> float:
        """When ``busy_s`` of work begun at ``start_s`` (simulated clock) is done: at once
        without a quota, later under one if the period's share runs out on the way."""
        if self._quota is None:
            return start_s + busy_s
        q = self.quota_at(iteration)
        assert q is not None
        self._quota.fraction = q
        return self._quota.run(start_s, busy_s)

    def speed_at(self, iteration: int) -> float:
        """Samples/s at ``iteration`` (the latest scheduled step at or before it)."""
        v = self.speed
        for start, s in self.schedule:
            if iteration >= start:
                v = s
        return v

    def compute_time(self, x: int, iteration: int = 0, eps: float = 0.0) -> float:
        """Compute seconds for ``x`` samples (flat below saturation), with noise factor 1 + eps."""
        return max(x, self.saturation_batch) / self.speed_at(iteration) * (1.0 + eps)

    def time(self, x: int, iteration: int = 0, eps: float = 0.0) -> float:
        """Whole busy time (overhead + compute) for ``x`` samples; ``MemoryError`` above the cap."""
        if self.oom(x):
            raise MemoryError(f"simulated out of memory: batch {x} > cap {self.memory_cap}")
        return self.overhead + self.compute_time(x, iteration, eps)

    def oom(self, x: int) -> bool:
        return self.memory_cap is not None and x > self.memory_cap

    def draw_noise(self) -> float:
        if self.noise <= 0:
            return 0.0
        return max(-3 * self.noise, min(3 * self.noise, self._rng.gauss(0.0, self.noise)))


class CpuQuota:
    """The kernel's CFS bandwidth control as a clock: at most ``fraction * period_s`` seconds of
    CPU in each period [k P, (k + 1) P); a worker whose share is spent stalls until the next one.
    Its stalls therefore grow with the work it is given (``docs/lab.md``)."""

    def __init__(self, fraction: float, period_s: float = 0.1) -> None:
        if not (0.0 < fraction <= 1.0) or not period_s > 0:
            raise ValueError(f"cpu_quota must be in (0, 1] and the period > 0, got {fraction}, {period_s}")
        self.fraction, self.period_s = float(fraction), float(period_s)
        self._period, self._used = 0, 0.0

    def run(self, start_s: float, busy_s: float) -> float:
        t, need, share = start_s, busy_s, self.fraction * self.period_s
        while True:
            k = int(math.floor(t / self.period_s + 1e-9))   # float-safe: 0.3 // 0.1 is 2.0
            if k != self._period:
                self._period, self._used = k, 0.0
            use = min(need, share - self._used, (k + 1) * self.period_s - t)
            if use > 0:
                self._used += use
                t += use
                need -= use
                if need <= 1e-12:
                    return t
            t = max(t, (k + 1) * self.period_s)             # share spent or period over


@dataclass
class SimRecord:
    """One simulated iteration: sizes, each worker's busy time, the barrier time (= max)."""

    iteration: int
    sizes: dict[int, int]
    times: dict[int, float]
    iteration_s: float
    oom: list[int]
    decision_s: float


@dataclass
class _Prev:
    push_s: float = 0.0
    wait_s: float = 0.0
    pull_s: float = 0.0
    iteration_s: float = 0.0


class Simulation:
    """Drive a manager over simulated workers; workers may be added or removed between steps.

    ``plan_ahead`` models the coordinator's ``mode.plan_ahead``: the split of iteration t+1 is
    decided while t computes, so it has seen the reports of t-1 and earlier, one iteration
    older than when it is decided after t's last report (the default here)."""

    def __init__(self, manager: BatchSizeManager,
                 workers: Mapping[int, SimulatedWorker] | Sequence[SimulatedWorker],
                 start_iteration: int = 0, plan_ahead: bool = False) -> None:
        self.manager = manager
        self.plan_ahead = plan_ahead
        self._held: list[WorkerReport] = []   # plan_ahead: the reports the next split cannot know
        self.workers: dict[int, SimulatedWorker] = {}
        self._prev: dict[int, _Prev] = {}
        self.iteration = start_iteration
        self.clock_s = 0.0                 # simulated wall clock, for CPU quota periods
        items = workers.items() if isinstance(workers, Mapping) else enumerate(workers)
        for wid, w in items:
            self.add_worker(int(wid), w)

    def add_worker(self, worker_id: int, worker: SimulatedWorker) -> None:
        self.workers[worker_id] = worker
        # A fresh worker's first report carries its initial pull (no push, no wait yet).
        pull = worker.overhead * (1 - worker.data_fraction) / 2
        self._prev[worker_id] = _Prev(pull_s=pull)
        self.manager.join(worker_id)

    def remove_worker(self, worker_id: int) -> None:
        self.workers.pop(worker_id, None)
        self._prev.pop(worker_id, None)
        self.manager.leave(worker_id)

    def step(self) -> SimRecord:
        """Assign, "run" every worker, then feed the reports back (as the coordinator does)."""
        t = self.iteration
        sizes = self.manager.assign()
        decision_s = self.manager.last_decision_s
        times: dict[int, float] = {}
        parts: dict[int, tuple[float, float, float, float]] = {}
        oom: list[int] = []
        for wid, x in sizes.items():
            w = self.workers[wid]
            comm = w.overhead * (1 - w.data_fraction) / 2
            data = w.overhead * w.data_fraction
            if w.oom(x):
                oom.append(wid)
                compute = 0.0
            else:
                compute = w.compute_time(x, t, w.draw_noise())
            parts[wid] = (data, compute, comm, comm)
            busy = data + compute + 2 * comm
            times[wid] = w.busy_until(self.clock_s, busy, t) - self.clock_s
        it_s = max(times.values())
        reports: list[WorkerReport] = []
        for wid, x in sizes.items():
            w = self.workers[wid]
            data, compute, push, pull = parts[wid]
            p = self._prev[wid]
            base = w.speed_at(0)
            tel = Telemetry(
                data_s=data, compute_s=compute, iteration_s=p.iteration_s,
                prev_push_s=p.push_s, prev_wait_s=p.wait_s, prev_pull_s=p.pull_s,
                proc_cpu=100.0, host_cpu=50.0,
                cotenant_cpu=max(0.0, 100.0 * (1.0 - w.speed_at(t) / base)),
                rss_mb=500.0, host_mem_pct=40.0, oom=wid in oom,
                finish_s=None if wid in oom else times[wid],
                # under a quota, what a worker reads from its cgroup and its CPU clock: the whole
                # busy time is CPU (data, compute, push and pull alike)
                cpu_quota=w.quota_at(t), cpu_s=None if w.cpu_quota is None else data + compute + push + pull,
                compute_cpu_s=None if w.cpu_quota is None else data + compute,
            )
            tel.packed()        # as received: the coordinator's decoder keeps every report's row
            reports.append(WorkerReport.received(wid, t, x, tel))
            self._prev[wid] = _Prev(push_s=push, wait_s=it_s - times[wid], pull_s=pull, iteration_s=it_s)
        if self.plan_ahead:
            reports, self._held = self._held, reports
        self.manager.observe_many(reports)
        self.iteration += 1
        self.clock_s += it_s
        return SimRecord(t, dict(sizes), times, it_s, oom, decision_s)

    def run(self, iterations: int) -> list[SimRecord]:
        return [self.step() for _ in range(iterations)]


def simulate(manager: BatchSizeManager,
             workers: Mapping[int, SimulatedWorker] | Sequence[SimulatedWorker],
             iterations: int) -> list[SimRecord]:
    """Run ``iterations`` simulated iterations; a list of per-iteration records."""
    return Simulation(manager, workers).run(iterations)


def ideal_iteration_time(workers: Mapping[int, SimulatedWorker] | Sequence[SimulatedWorker],
                         total: int, iteration: int = 0, min_batch: int = 1) -> float:
    """The balanced lower bound: the least T at which the workers can process ``total`` samples.

    Real-valued (no rounding), noise-free; for CPU-like workers with equal overhead c it is
    c + X / Σ v_i. Found by bisection on T over each worker's capacity within T (its cap included).
    """
    ws = list(workers.values()) if isinstance(workers, Mapping) else list(workers)
    if not ws:
        raise ValueError("no workers")

    def capacity(w: SimulatedWorker, t: float) -> float:
        v = w.speed_at(iteration)
        if t < w.overhead + max(min_batch, w.saturation_batch) / v:
            return 0.0                  # cannot even finish its smallest batch by t
        x = v * (t - w.overhead)        # max(x, sat) / v <= t - c  <=>  x <= v (t - c)
        return min(x, w.memory_cap) if w.memory_cap is not None else x

    if sum(w.memory_cap if w.memory_cap is not None else math.inf for w in ws) < total:
        raise ValueError("the workers' memory caps cannot hold the global batch")
    lo = max(w.overhead + max(min_batch, w.saturation_batch) / w.speed_at(iteration) for w in ws)
    hi = lo + total / min(w.speed_at(iteration) for w in ws) + 1.0
    if sum(capacity(w, lo) for w in ws) >= total:
        return lo
    for _ in range(200):
        mid = (lo + hi) / 2
        if sum(capacity(w, mid) for w in ws) >= total:
            hi = mid
        else:
            lo = mid
    return hi
