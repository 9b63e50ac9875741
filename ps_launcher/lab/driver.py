"""Applies a scenario's real mechanisms to a local cluster: CPU quotas and hosts with links.

``ps-launch`` makes one driver per run when the scenario asks for real mechanisms:

- ``cpu_quota`` / ``rotation``: each such worker's process is put in a cgroup of its own
  right after it starts, and a thread sets each group's quota as the schedule says;
- ``link`` (or ``hosts: true``): every process of the run (shards, workers, evaluator) runs on a
  host of its own (a network namespace on one bridge); a worker with a link sits behind a
  ``tbf`` rate limit and the delay relay, changed at run time as the schedule says.

Every change is logged to ``metrics/lab.jsonl`` (seconds since the origin, worker, quota, rate,
delay), so a report can show what each worker met. Nothing is left behind: the driver removes
its groups and namespaces on close, also after an error, and ``cleanup_stale`` at start removes
what a killed run left.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from ps_common.config import JobConfig
from ps_common.metrics import MetricsWriter
from ps_launcher.lab.cgroups import CpuQuotaGroup, cpu_quota_available
from ps_launcher.lab.errors import LabUnavailable
from ps_launcher.lab.netns import Host, NetLab, delay_available, netns_available
from ps_launcher.lab.ownership import new_run_id
from ps_launcher.lab.schedule import LinkSchedule, LinkState, QuotaSchedule, link_schedules, quota_schedules

log = logging.getLogger(__name__)

TICK_S = 0.1


class LabDriver:
    def __init__(self, cfg: JobConfig, run_dir: Path, base_dir: str | Path | None = None) -> None:
        self.cfg = cfg
        n = cfg.cluster.num_workers
        sc = cfg.scenario
        self.quotas: dict[int, QuotaSchedule] = quota_schedules(sc, n, base_dir)
        self.links: dict[int, LinkSchedule] = link_schedules(sc, n)
        self.use_hosts = sc.needs_hosts(n)
        if self.quotas and (why := cpu_quota_available()):
            raise LabUnavailable(f"scenario asks for CPU quotas (cpu_quota/rotation): {why}")
        if self.use_hosts and (why := netns_available()):
            raise LabUnavailable(f"scenario asks for hosts with links (link/hosts): {why}")
        wants_delay = any(s.spec.delay_ms or any(st.delay_ms for st in s.spec.steps) for s in self.links.values())
        if wants_delay and (why := delay_available()):
            raise LabUnavailable(f"scenario asks for link delay: {why}")
        self.run_id = new_run_id()
        self.metrics = MetricsWriter(run_dir / "metrics" / "lab.jsonl")
        self.groups: dict[int, CpuQuotaGroup] = {}
        self.lab: NetLab | None = None
        self.hosts: dict[str, Host] = {}
        self._applied_quota: dict[int, object] = {}
        self._applied_link: dict[int, LinkState] = {}
        self._origin: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ----- set up ---------------------------------------------------------------------------
    def open(self) -> "LabDriver":
        try:
            for i in self.quotas:
                g = CpuQuotaGroup(f"w{i}", self.run_id)
                g.create()
                self.groups[i] = g
            if self.use_hosts:
                self.lab = NetLab(self.run_id).open()
        except BaseException:
            self.close()
            raise
        self._apply(0.0)  # the quotas of t = 0 hold from the start (start-up is throttled too)
        return self

    def host(self, role: str) -> Host | None:
        """The host a process of ``role`` (``shard-K``, ``worker-I``, ``evaluator``) runs on."""
        if self.lab is None:
            return None
        if role not in self.hosts:
            name = role.replace("shard-", "s").replace("worker-", "w").replace("evaluator", "ev")
            rate = delay = None
            if role.startswith("worker-"):
                i = int(role.split("-")[1])
                if i in self.links:
                    st = self.links[i].at(0.0)
                    rate, delay = st.rate_mbit, st.delay_ms
                    self._applied_link[i] = st
            self.hosts[role] = self.lab.add_host(name, rate_mbit=rate, delay_ms=delay or None)
        return self.hosts[role]

    def prefix(self, role: str) -> list[str] | None:
        h = self.host(role)
        return None if h is None else h.exec([])

    def attach(self, worker_index: int, pid: int) -> None:
        """Put a worker's process in its quota group (all its threads, and what it forks)."""
        g = self.groups.get(worker_index)
        if g is not None:
            g.add(pid)

    # ----- run time ---------------------------------------------------------------------------
    def start_clock(self) -> None:
        """The scenario's time origin: training has started."""
        if self._origin is not None:
            return
        self._origin = time.monotonic()
        self.metrics.write(event="origin")
        if self.quotas or self.links:
            self._thread = threading.Thread(target=self._run, name="lab-driver", daemon=True)
            self._thread.start()

    def elapsed(self) -> float:
        return 0.0 if self._origin is None else time.monotonic() - self._origin

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            try:
                self._apply(self.elapsed())
            except Exception:  # a mechanism failing mid-run must not kill the launcher
                log.exception("lab driver: applying the schedule failed")

    def _apply(self, t: float) -> None:
        for i, sched in self.quotas.items():
            f = sched.at(t)
            if self._applied_quota.get(i, "unset") != f:
                self.groups[i].set_fraction(f)
                self._applied_quota[i] = f
                self.metrics.write(t=round(t, 3), worker=i, cpu_quota=f)
        if self.lab is None:
            return
        for i, link_sched in self.links.items():
            st = link_sched.at(t)
            old = self._applied_link.get(i)
            host = self.hosts.get(f"worker-{i}")
            if host is None or old == st:
                continue
            if old is None or old.rate_mbit != st.rate_mbit:
                host.set_rate(st.rate_mbit)
            if old is None or old.delay_ms != st.delay_ms:
                host.set_delay(st.delay_ms or None)
            self._applied_link[i] = st
            self.metrics.write(t=round(t, 3), worker=i, rate_mbit=st.rate_mbit, delay_ms=st.delay_ms)

    def throttling(self) -> dict[int, dict[str, float]]:
        """Per worker: CPU seconds used and time throttled by its quota (for reports)."""
        out = {}
        for i, g in self.groups.items():
            try:
                th = g.throttled()
                out[i] = {"cpu_s": g.usage_s() or 0.0, "throttled_s": th.throttled_s,
                          "nr_throttled": th.nr_throttled, "nr_periods": th.nr_periods}
            except Exception:  # the group may be gone already
                continue
        return out

    # ----- tear down --------------------------------------------------------------------------
    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        stats = self.throttling()
        if stats:
            self.metrics.write(event="throttling", workers={str(k): v for k, v in stats.items()})
        errors = []
        for g in self.groups.values():
            try:
                g.remove()
            except Exception as exc:
                errors.append(str(exc))
        self.groups = {}
        if self.lab is not None:
            try:
                self.lab.close()
            except Exception as exc:
                errors.append(str(exc))
            self.lab = None
        self.metrics.close()
        if errors:
            log.error("lab clean-up: %s", "; ".join(errors))
