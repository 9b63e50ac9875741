"""Reading a CPU cgroup: its CFS quota and how long the kernel held it back (v1 and v2).

A kernel-enforced share of a core (a container's CPU limit, a small VM, the lab's ``cpu_quota``)
slows a worker in a way host-wide CPU percentages cannot show: the worker runs at full speed
until its share of the period is spent, then not at all until the next one. The lab writes
quotas (``ps_launcher.lab.cgroups``); a worker reads its own group here, to report the quota in
force and the time it was throttled (:class:`CpuQuotaProbe`, used by ``ps_worker`` and the DDP
plug-in). A shard asks how many cores it may use at all (:func:`usable_cores`) before it runs its
update on several threads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable


@dataclass(frozen=True)
class Throttling:
    """From ``cpu.stat``: CFS periods seen, periods in which the group hit its quota, time held."""

    nr_periods: int
    nr_throttled: int
    throttled_s: float


def read_stat(group: Path) -> dict[str, int]:
    """``cpu.stat`` of a group as integers (lines that are not ``key integer`` are skipped)."""
    out: dict[str, int] = {}
    for line in (group / "cpu.stat").read_text().splitlines():
        k, _, v = line.partition(" ")
        try:
            out[k] = int(v)
        except ValueError:
            pass
    return out


def read_throttling(group: Path, version: int) -> Throttling:
    """How often and how long the kernel held the group back for exceeding its quota."""
    st = read_stat(group)
    held = st.get("throttled_usec", 0) / 1e6 if version == 2 else st.get("throttled_time", 0) / 1e9
    return Throttling(st.get("nr_periods", 0), st.get("nr_throttled", 0), held)


def read_quota_cores(group: Path, version: int) -> float | None:
    """The group's own quota in cores (quota / period); None when unlimited."""
    if version == 2:
        quota, _, period = (group / "cpu.max").read_text().partition(" ")
        return None if quota == "max" else int(quota) / int(period)
    quota_us = int((group / "cpu.cfs_quota_us").read_text())
    return None if quota_us < 0 else quota_us / int((group / "cpu.cfs_period_us").read_text())


def own_cpu_group(proc_cgroup: Path = Path("/proc/self/cgroup"),
                  mounts: Path = Path("/proc/self/mounts")) -> tuple[int, Path] | None:
    """(cgroup version, directory) of the cpu controller's group this process is in, or None
    when there is no readable cpu controller."""
    try:
        lines = proc_cgroup.read_text().splitlines()
        mount_lines = mounts.read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        hid, ctrls, path = line.split(":", 2)
        if "cpu" in ctrls.split(","):
            v1 = path
        elif hid == "0":
            v2 = path
    for line in mount_lines:
        parts = line.split()
        if len(parts) < 4:
            continue
        fstype, mnt, opts = parts[2], parts[1].replace("\\040", " "), parts[3].split(",")
        if v1 is not None and fstype == "cgroup" and "cpu" in opts:
            return 1, Path(mnt) / v1.lstrip("/")
        if v1 is None and v2 is not None and fstype == "cgroup2":
            return 2, Path(mnt) / v2.lstrip("/")
    return None


def usable_cores(find: Callable[[], tuple[int, Path] | None] = own_cpu_group) -> float:
    """How many cores this process may keep busy: the CPUs it may run on, or its own cgroup's
    quota where that is less (a container's CPU limit). The group's parents' quotas are not
    read: the lab and container runtimes put the limit on the process's own group."""
    affinity = getattr(os, "sched_getaffinity", None)   # Linux; elsewhere every CPU counts
    cores = float(len(affinity(0)) if affinity is not None else os.cpu_count() or 1)
    found = find()
    if found is not None:
        try:
            quota = read_quota_cores(found[1], found[0])
        except (OSError, ValueError):
            quota = None
        if quota is not None:
            cores = min(cores, quota)
    return cores


class CpuQuotaProbe:
    """The CFS quota of the worker's own CPU cgroup and the time the kernel held it back since
    the previous reading: what a container's CPU limit (or the lab's ``cpu_quota``) does to the
    worker, which host-wide CPU percentages do not show. Read at each report, on the critical
    path: three small files, tens of microseconds."""

    def __init__(self, find: Callable[[], tuple[int, Path] | None] = own_cpu_group,
                 membership: Path = Path("/proc/self/cgroup")) -> None:
        self._find = find
        self._membership = membership
        self._found: tuple[str, tuple[int, Path] | None] | None = None
        self._last: tuple[Path, float] | None = None

    def _group(self) -> tuple[int, Path] | None:
        """The group, looked up again only when the process has moved (the lab moves a worker
        into its group after it starts)."""
        try:
            now = self._membership.read_text()
        except OSError:
            return None
        if self._found is None or self._found[0] != now:
            self._found = (now, self._find())
        return self._found[1]

    def read(self) -> tuple[float | None, float | None]:
        """(quota in cores, seconds throttled since the last reading); None where not known."""
        found = self._group()
        if found is None:
            return None, None
        version, group = found
        try:
            quota = read_quota_cores(group, version)
            held = read_throttling(group, version).throttled_s
        except (OSError, ValueError):
            return None, None
        last, self._last = self._last, (group, held)
        if quota is None:
            return None, None
        if last is None or last[0] != group:  # the first reading in this group: no interval yet
            return quota, None
        return quota, max(0.0, held - last[1])
