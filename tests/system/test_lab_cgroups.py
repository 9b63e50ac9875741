"""CPU quota groups on the real kernel: a busy child is throttled to its quota, changes apply at
run time, groups always go away (also after a raise, and after their owner was SIGKILLed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from ps_launcher.lab import cgroups
from ps_launcher.lab.cgroups import CpuQuotaGroup, cleanup_stale, cpu_quota_available
from ps_launcher.lab.errors import LabError
from tests.cluster_util import read_line

_WHY = cpu_quota_available()
pytestmark = pytest.mark.skipif(_WHY is not None, reason=f"CPU quotas unavailable: {_WHY}")

BURN = "import time\nwhile True: pass\n"


@pytest.fixture
def burner():
    """A CPU-burning child, always killed (by pid)."""
    p = subprocess.Popen([sys.executable, "-c", BURN])
    yield p
    p.kill()
    p.wait(timeout=10)


def cpu_fraction(pid: int, wall_s: float = 1.5) -> float:
    """CPU seconds the process used per wall second over ``wall_s``."""
    proc = psutil.Process(pid)
    c0, t0 = sum(proc.cpu_times()[:2]), time.monotonic()
    time.sleep(wall_s)
    c1, t1 = sum(proc.cpu_times()[:2]), time.monotonic()
    return (c1 - c0) / (t1 - t0)


def cpu_cgroup_of(pid: int) -> str:
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, ctrls, path = line.split(":", 2)
        if "cpu" in ctrls.split(","):
            return path
    return "?"


@pytest.mark.timeout(60)
def test_quota_throttles_and_changes_at_run_time(burner):
    with CpuQuotaGroup("test-quota", fraction=0.25) as g:
        assert g.name.startswith("lbps-") and g.name.endswith("-test-quota")
        path = g.path
        assert path is not None and path.is_dir()
        g.add(burner.pid)
        assert burner.pid in g.pids()
        time.sleep(0.2)  # let the first period settle
        u0 = g.usage_s()
        low = cpu_fraction(burner.pid)
        assert 0.15 <= low <= 0.35, f"at quota 0.25 the burner got {low:.3f} of a core"
        th = g.throttled()
        assert th.nr_throttled > 0 and th.throttled_s > 0
        if u0 is not None:
            assert g.usage_s() > u0

        g.set_fraction(0.75)
        assert g.fraction == 0.75
        time.sleep(0.2)
        high = cpu_fraction(burner.pid)
        assert high >= 0.5 and high > low + 0.2, f"quota 0.75 gave {high:.3f} (0.25 gave {low:.3f})"
    assert not path.exists(), "the group directory must be removed"
    assert burner.poll() is None, "members are moved out, not killed"
    assert cpu_cgroup_of(burner.pid) == "/"


@pytest.mark.timeout(30)
def test_group_removed_when_body_raises(burner):
    with pytest.raises(RuntimeError, match="boom"):
        with CpuQuotaGroup("test-raise", fraction=0.5) as g:
            g.add(burner.pid)
            path, acct = g.path, g.acct_path
            raise RuntimeError("boom")
    assert path is not None and not path.exists()
    assert acct is None or not acct.exists()
    assert burner.poll() is None
    g.remove()  # idempotent


@pytest.mark.timeout(30)
def test_unlimited_and_bad_values():
    with CpuQuotaGroup("test-limits") as g:
        assert g.fraction is None
        if g._ctl is not None and g._ctl.version == 1:
            assert (g.path / "cpu.cfs_quota_us").read_text().strip() == "-1"
        g.set_fraction(1.5)
        if g._ctl is not None and g._ctl.version == 1:
            assert (g.path / "cpu.cfs_period_us").read_text().strip() == "100000"
            assert (g.path / "cpu.cfs_quota_us").read_text().strip() == "150000"
        g.set_fraction(float(os.cpu_count() or 1))  # all cores = unlimited
        assert g.fraction is None
        with pytest.raises(ValueError):
            g.set_fraction(0)
        with pytest.raises(LabError, match="no such process"):
            g.add(2**22 + 12345)
    with pytest.raises(ValueError):
        CpuQuotaGroup("bad/name")
    with pytest.raises(LabError, match="not created"):
        CpuQuotaGroup("never").set_fraction(0.5)


OWNER = """
import subprocess, sys, time
from ps_launcher.lab.cgroups import CpuQuotaGroup
g = CpuQuotaGroup("stale", fraction=0.3).create()
child = subprocess.Popen([sys.executable, "-c", "import time\\nwhile True: time.sleep(0.1)"])
g.add(child.pid)
print(g.path, child.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.timeout(60)
def test_cleanup_stale_removes_groups_of_killed_owner():
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    owner = subprocess.Popen(
        [sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True, env=env
    )
    leftover_pid = None
    try:
        with CpuQuotaGroup("alive") as mine:  # a live owner's group must survive
            line = read_line(owner.stdout, 30.0).split()
            assert line, "owner did not start"
            path, leftover_pid = Path(line[0]), int(line[1])
            assert path.is_dir() and leftover_pid in cgroups._read_pids(path)
            owner.send_signal(signal.SIGKILL)
            owner.wait(timeout=10)
            assert path.is_dir(), "a SIGKILLed owner leaves its group behind"

            removed = cleanup_stale()
            assert str(path) in removed
            assert not path.exists()
            assert mine.path is not None and mine.path.exists()
            assert str(mine.path) not in removed
            assert psutil.pid_exists(leftover_pid), "stale members are moved out, not killed"
            assert cpu_cgroup_of(leftover_pid) == "/"
    finally:
        if owner.poll() is None:
            owner.kill()
        if leftover_pid is not None:
            try:
                os.kill(leftover_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        owner.stdout.close()
