"""What the real mechanisms should be at time t: pure functions of the scenario config.

The lab driver asks these every tenth of a second and changes a cgroup's quota or a link's rate
and delay only when the answer changes. Times are seconds since the scenario's origin (the
moment training starts), and random schedules depend only on their seed, so every mode of a
comparison meets the same quotas at the same times.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ps_common.scenario import CpuQuota, Link, Rotation, ScenarioConfig
from ps_worker.scenario_runtime import OnOffSchedule, TraceTable, read_trace


def _min(a: float | None, b: float | None) -> float | None:
    """The tighter of two quotas (None is unlimited)."""
    if a is None:
        return b
    if b is None:
        return a
    return min(a, b)


class QuotaSchedule:
    """One worker's CPU quota over time (None: unlimited)."""

    def __init__(self, spec: CpuQuota | None, worker_index: int, rotation: Rotation | None = None,
                 base_dir: str | Path | None = None) -> None:
        self.spec = spec
        self.worker_index = worker_index
        self.rotation = rotation
        self._randoms = [] if spec is None else [
            (OnOffSchedule(r.seed, r.mean_on_s, r.mean_off_s, r.start_on), r.fraction) for r in spec.random]
        self._trace = None
        if spec is not None and spec.trace is not None:
            path = Path(spec.trace.path)
            if not path.is_absolute() and base_dir is not None:
                path = Path(base_dir) / path
            keys, vals = read_trace(path, spec.trace.key_column, spec.trace.column,
                                    f"scenario.workers.{worker_index}.cpu_quota.trace", blank=True)
            # <= 0 or an empty cell: unlimited (None), as before the first row
            self._trace = TraceTable(keys, [None if v is None or v <= 0 else v for v in vals],
                                     spec.trace.loop, before=None)

    def at(self, t: float) -> float | None:
        f: float | None = None
        spec = self.spec
        if spec is not None:
            f = spec.fraction
            for st in spec.steps:
                if t >= st.at_seconds:
                    f = st.fraction
            for b in spec.bursts:
                x = t - b.phase_s
                if x >= 0 and math.fmod(x, b.period_s) < b.duration_s:
                    f = _min(f, b.fraction)
            for sched, frac in self._randoms:
                if sched.is_on(t):
                    f = _min(f, frac)
            if self._trace is not None:
                f = _min(f, self._trace.at(t))
        if self.rotation is not None:
            k = int(max(0.0, t) // self.rotation.period_s)
            fr = self.rotation.fractions
            f = _min(f, fr[(self.worker_index + k) % len(fr)])
        return f


@dataclass(frozen=True)
class LinkState:
    rate_mbit: float | None
    delay_ms: float


class LinkSchedule:
    """One worker's link over time."""

    def __init__(self, spec: Link) -> None:
        self.spec = spec

    def at(self, t: float) -> LinkState:
        rate, delay = self.spec.rate_mbit, self.spec.delay_ms
        for st in self.spec.steps:
            if t >= st.at_seconds:
                if st.unlimited:
                    rate = None
                elif st.rate_mbit is not None:
                    rate = st.rate_mbit
                if st.delay_ms is not None:
                    delay = st.delay_ms
        return LinkState(rate, delay)


def quota_schedules(scenario: ScenarioConfig, num_workers: int,
                    base_dir: str | Path | None = None) -> dict[int, QuotaSchedule]:
    """The workers that get a CPU quota group, with their schedules."""
    out = {}
    for i in range(num_workers):
        spec = scenario.for_worker(i).cpu_quota
        if spec is not None or scenario.rotation is not None:
            out[i] = QuotaSchedule(spec, i, scenario.rotation, base_dir)
    return out


def link_schedules(scenario: ScenarioConfig, num_workers: int) -> dict[int, LinkSchedule]:
    links = {i: scenario.for_worker(i).link for i in range(num_workers)}
    return {i: LinkSchedule(link) for i, link in links.items() if link is not None}
