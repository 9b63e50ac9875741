"""Kernel CPU quotas per worker: a cgroup whose CFS quota is a fraction of one core.

Why: an emulated slowdown (sleeping) does not slow what a real small VM slows (collectives,
serialization, the predictors' exogenous signals). A CFS quota does: the kernel lets the group run
``quota`` microseconds per ``period`` and then throttles every thread in it.

Supports the cgroup v1 ``cpu`` controller (``cpu.cfs_quota_us``; usage from ``cpuacct``, mounted
with it or separately, in which case a mirror group is made there) and cgroup v2 (``cpu.max``).
Every group is named ``lbps-<runid>-<name>`` and recorded with its owner's pid (see
:mod:`ps_launcher.lab.ownership`), so :func:`cleanup_stale` can remove the groups of killed runs.
"""

from __future__ import annotations

import atexit
import errno
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from ps_common.cgroup_cpu import Throttling, read_stat, read_throttling

from . import ownership
from .errors import LabError, LabUnavailable

log = logging.getLogger(__name__)

PERIOD_US = 100_000
MIN_QUOTA_US = 1_000


@dataclass(frozen=True)
class CpuController:
    """Where groups are made: ``cpu_base`` holds the quota files, ``acct_base`` (v1 only, when
    ``cpuacct`` is mounted apart from ``cpu``) holds the usage counter."""

    version: int
    cpu_base: Path
    acct_base: Path | None = None


def _mounts() -> list[tuple[str, str, set[str]]]:
    out: list[tuple[str, str, set[str]]] = []
    try:
        text = Path("/proc/self/mounts").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 4:
            out.append((parts[2], parts[1].replace("\\040", " "), set(parts[3].split(","))))
    return out


def _own_cgroup(match: str) -> str:
    """This process's path in the v1 hierarchy that has controller ``match`` ('' for v2)."""
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            hid, ctrls, path = line.split(":", 2)
            if (match == "" and hid == "0") or match in ctrls.split(","):
                return path
    except OSError:
        pass
    return "/"


def detect_controller() -> CpuController:
    """Find a writable cpu controller, preferring v1 ``cpu`` when both exist (hybrid hosts bind
    the cpu controller to v1, and then v2 cannot use it).

    Groups go under this process's own cgroup in v1 (so quotas nest inside a container's limits)
    and under the v2 root (v2 forbids processes in inner nodes of the tree).
    """
    mounts = _mounts()
    for fstype, mnt, opts in mounts:
        if fstype == "cgroup" and "cpu" in opts:
            if "ro" in opts:
                raise LabUnavailable(f"the cgroup v1 cpu controller at {mnt} is mounted read-only")
            base = Path(mnt) / _own_cgroup("cpu").lstrip("/")
            if not (base / "cpu.cfs_quota_us").exists():
                base = Path(mnt)
            acct = None
            if "cpuacct" not in opts:
                for fstype2, mnt2, opts2 in mounts:
                    if fstype2 == "cgroup" and "cpuacct" in opts2 and "ro" not in opts2:
                        acct = Path(mnt2) / _own_cgroup("cpuacct").lstrip("/")
                        if not (acct / "cpuacct.usage").exists():
                            acct = Path(mnt2)
                        break
            return CpuController(1, base, acct)
    for fstype, mnt, opts in mounts:
        if fstype == "cgroup2":
            root = Path(mnt)
            try:
                ctrls = (root / "cgroup.controllers").read_text().split()
            except OSError:
                continue
            if "cpu" not in ctrls:
                continue
            if "ro" in opts:
                raise LabUnavailable(f"the cgroup v2 hierarchy at {mnt} is mounted read-only")
            return CpuController(2, root)
    raise LabUnavailable(
        "no cgroup cpu controller: neither a cgroup v1 'cpu' mount nor a cgroup v2 hierarchy "
        "offering 'cpu' was found in /proc/self/mounts"
    )


def cpu_quota_available() -> str | None:
    """None if CPU quota groups can be made here, else the reason (for skips and error messages).

    Probes for real (creates and removes an empty group) because a writable-looking mount can
    still refuse (containers, delegated subtrees).
    """
    if os.geteuid() != 0:
        return "CPU quotas need root (cgroup directories are owned by root)"
    try:
        ctl = detect_controller()
    except LabUnavailable as e:
        return e.reason
    probe = ctl.cpu_base / f"{ownership.PREFIX}probe-{os.getpid()}-{time.monotonic_ns() % 10**6}"
    try:
        if ctl.version == 2:
            _enable_v2_cpu(ctl.cpu_base)
        probe.mkdir()
    except (OSError, LabError) as e:
        return f"cannot create a cgroup under {ctl.cpu_base}: {e}"
    try:
        quota_file = probe / ("cpu.max" if ctl.version == 2 else "cpu.cfs_quota_us")
        if not quota_file.exists():
            return f"{probe} has no {quota_file.name}: the cpu controller is not enabled there"
    finally:
        try:
            probe.rmdir()
        except OSError:
            pass
    return None


def _enable_v2_cpu(base: Path) -> None:
    sub = base / "cgroup.subtree_control"
    try:
        if "cpu" not in sub.read_text().split():
            sub.write_text("+cpu")
    except OSError as e:
        raise LabUnavailable(f"cannot enable the cpu controller in {sub}: {e}") from e


def _write(path: Path, value: str) -> None:
    # one value per write(2): cgroup files act on each write, and buffered writes may merge
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _read_pids(d: Path) -> list[int]:
    try:
        return [int(x) for x in (d / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _evacuate_and_rmdir(d: Path, parent: Path, attempts: int = 50) -> None:
    """Move every process of ``d`` to ``parent`` and remove ``d``; retried because a member may
    fork while we move it (its child lands in ``d``)."""
    last: OSError | None = None
    for _ in range(attempts):
        for pid in _read_pids(d):
            try:
                _write(parent / "cgroup.procs", str(pid))
            except OSError as e:
                if e.errno != errno.ESRCH:  # already gone: fine
                    last = e
        try:
            d.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError as e:
            last = e
            time.sleep(0.02)
    raise LabError(f"could not remove cgroup {d}: {last}")


_OPEN_GROUPS: set[CpuQuotaGroup] = set()  # strong refs: a dropped group is still removed at exit


@atexit.register
def _remove_open_groups() -> None:
    """Remove groups still present when the interpreter exits (only in the creating process)."""
    for g in list(_OPEN_GROUPS):
        if g._owner_pid == os.getpid():
            try:
                g.remove()
            except Exception:  # noqa: BLE001 - exiting anyway; cleanup_stale catches the rest
                log.exception("removing %s at exit", g.name)


class CpuQuotaGroup:
    """A CPU quota group ``lbps-<runid>-<name>``; a context manager that always removes it.

    >>> with CpuQuotaGroup("worker-1", fraction=0.5) as g:   # doctest: +SKIP
    ...     g.add(proc.pid)          # the whole process, all threads
    ...     g.set_fraction(0.25)     # change at run time
    """

    def __init__(
        self,
        name: str,
        run_id: str | None = None,
        fraction: float | None = None,
        *,
        controller: CpuController | None = None,
    ) -> None:
        ownership.check_name(name, "group name")
        self.run_id = ownership.check_name(run_id or ownership.default_run_id(), "run id")
        self.name = f"{ownership.PREFIX}{self.run_id}-{name}"
        self._initial = fraction
        self._ctl = controller
        self._fraction: float | None = None
        self.path: Path | None = None
        self.acct_path: Path | None = None
        self._owner_pid = os.getpid()

    # -- lifecycle -------------------------------------------------------------------------
    def create(self) -> CpuQuotaGroup:
        """Make the group directory (and the cpuacct mirror on split v1 hierarchies)."""
        if self.path is not None:
            return self
        if os.geteuid() != 0:
            raise LabUnavailable("CPU quotas need root (cgroup directories are owned by root)")
        ctl = self._ctl or detect_controller()
        self._ctl = ctl
        if ctl.version == 2:
            _enable_v2_cpu(ctl.cpu_base)
        path = ctl.cpu_base / self.name
        ownership.register(self.run_id, "cgroup", str(path))
        try:
            path.mkdir()
        except FileExistsError:
            raise LabError(f"cgroup {path} already exists (run id reused?)") from None
        except OSError as e:
            ownership.unregister(self.run_id, "cgroup", str(path))
            raise LabUnavailable(f"cannot create cgroup {path}: {e}") from e
        self.path = path
        _OPEN_GROUPS.add(self)
        if ctl.acct_base is not None:
            acct = ctl.acct_base / self.name
            ownership.register(self.run_id, "cgroup", str(acct))
            try:
                acct.mkdir()
                self.acct_path = acct
            except OSError as e:  # usage is optional; quotas still work
                ownership.unregister(self.run_id, "cgroup", str(acct))
                log.warning("no cpuacct mirror for %s: %s", self.name, e)
        self.set_fraction(self._initial)
        log.debug("created cgroup %s", path)
        return self

    def remove(self) -> None:
        """Move member processes back to the parent group and delete the group (idempotent)."""
        for attr in ("path", "acct_path"):
            d: Path | None = getattr(self, attr)
            if d is None:
                continue
            _evacuate_and_rmdir(d, d.parent)
            ownership.unregister(self.run_id, "cgroup", str(d))
            setattr(self, attr, None)
        _OPEN_GROUPS.discard(self)

    def __enter__(self) -> CpuQuotaGroup:
        return self.create()

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    # -- control ---------------------------------------------------------------------------
    def _need(self) -> Path:
        if self.path is None:
            raise LabError(f"cgroup {self.name} is not created (use it as a context manager)")
        return self.path

    @property
    def fraction(self) -> float | None:
        """The current quota as a fraction of one core; None when unlimited."""
        return self._fraction

    def set_fraction(self, fraction: float | None) -> None:
        """Allow ``fraction`` of one core per 100 ms period (0.25 = a quarter core, 1.5 = one and
        a half cores). None or at least the number of cores means unlimited."""
        path = self._need()
        if fraction is not None and not fraction > 0:
            raise ValueError(f"CPU fraction must be > 0 or None, got {fraction!r}")
        unlimited = fraction is None or fraction >= (os.cpu_count() or 1)
        quota = -1 if fraction is None or unlimited else max(MIN_QUOTA_US, round(fraction * PERIOD_US))
        assert self._ctl is not None
        if self._ctl.version == 2:
            _write(path / "cpu.max", f"{'max' if quota < 0 else quota} {PERIOD_US}")
        else:
            _write(path / "cpu.cfs_period_us", str(PERIOD_US))
            _write(path / "cpu.cfs_quota_us", str(quota))
        self._fraction = None if unlimited else fraction

    def add(self, pid: int) -> None:
        """Move process ``pid`` with all its threads into the group (its later children follow)."""
        path = self._need()
        for d in (path, self.acct_path):
            if d is None:
                continue
            try:
                _write(d / "cgroup.procs", str(pid))
            except ProcessLookupError:
                raise LabError(f"cannot move pid {pid} into {self.name}: no such process") from None
            except OSError as e:
                raise LabError(f"cannot move pid {pid} into {d}: {e}") from e

    def pids(self) -> list[int]:
        """Processes now in the group."""
        return _read_pids(self._need())

    def usage_s(self) -> float | None:
        """CPU seconds used by the group's processes since it was made; None if not measurable."""
        path = self._need()
        try:
            if self._ctl is not None and self._ctl.version == 2:
                return read_stat(path)["usage_usec"] / 1e6
            d = self.acct_path or path
            return int((d / "cpuacct.usage").read_text()) / 1e9
        except (OSError, KeyError, ValueError):
            return None

    def throttled(self) -> Throttling:
        """How often and how long the kernel held the group back for exceeding its quota."""
        return read_throttling(self._need(), self._ctl.version if self._ctl is not None else 1)

    def __repr__(self) -> str:
        return f"CpuQuotaGroup({self.name!r}, fraction={self._fraction!r}, path={self.path})"


def cleanup_stale(prefix: str = ownership.PREFIX) -> list[str]:
    """Remove ``prefix`` groups whose owning process is dead (a killed run); returns their paths.

    Member processes still alive are moved to the parent group, never killed. Groups of live
    owners, and groups whose owner cannot be determined, are left alone.
    """
    try:
        ctl = detect_controller()
    except LabUnavailable:
        return []
    removed: list[str] = []
    dead_runs: set[str] = set()
    for base in (ctl.cpu_base, ctl.acct_base):
        if base is None or not base.is_dir():
            continue
        for d in sorted(base.iterdir()):
            if not d.is_dir() or not d.name.startswith(prefix):
                continue
            rid = ownership.run_id_of(d.name, prefix)
            if rid is None and d.name.startswith(f"{ownership.PREFIX}probe-"):
                pid = d.name.split("-")[2]
                rid = f"{pid}-0000" if pid.isdigit() else None
            if rid is None or ownership.owner_alive(rid) is not False:
                continue
            try:
                _evacuate_and_rmdir(d, d.parent)
            except LabError as e:
                log.warning("stale cgroup %s: %s", d, e)
                continue
            ownership.unregister(rid, "cgroup", str(d))
            removed.append(str(d))
            dead_runs.add(rid)
    for rid in dead_runs:
        log.info("removed stale cgroups of dead run %s", rid)
    ownership.prune_records()
    return removed
