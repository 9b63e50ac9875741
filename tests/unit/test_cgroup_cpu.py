"""Reading a CPU cgroup's quota and throttled time, v1 and v2, from files laid out as the kernel
does (the real kernel's groups are exercised in tests/system/test_lab_cgroups.py)."""

from __future__ import annotations

import os
from pathlib import Path

from ps_common.cgroup_cpu import CpuQuotaProbe, own_cpu_group, read_quota_cores, read_throttling, usable_cores


def v1_group(root: Path, quota_us: int, throttled_ns: int) -> Path:
    g = root / "cpu" / "lbps-1-w0"
    g.mkdir(parents=True, exist_ok=True)
    (g / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
    (g / "cpu.cfs_period_us").write_text("100000\n")
    (g / "cpu.stat").write_text(f"nr_periods 40\nnr_throttled 7\nthrottled_time {throttled_ns}\n")
    return g


def test_v1_and_v2_quota_and_throttling(tmp_path):
    g = v1_group(tmp_path, 20000, 1_500_000_000)
    assert read_quota_cores(g, 1) == 0.2
    t = read_throttling(g, 1)
    assert (t.nr_periods, t.nr_throttled, t.throttled_s) == (40, 7, 1.5)
    (g / "cpu.cfs_quota_us").write_text("-1\n")
    assert read_quota_cores(g, 1) is None
    g2 = tmp_path / "v2"
    g2.mkdir()
    (g2 / "cpu.max").write_text("70000 100000\n")
    (g2 / "cpu.stat").write_text("usage_usec 9\nnr_periods 3\nnr_throttled 1\nthrottled_usec 250000\n")
    assert read_quota_cores(g2, 2) == 0.7 and read_throttling(g2, 2).throttled_s == 0.25
    (g2 / "cpu.max").write_text("max 100000\n")
    assert read_quota_cores(g2, 2) is None


def test_own_group_from_proc_files(tmp_path):
    cg, mounts = tmp_path / "cgroup", tmp_path / "mounts"
    cg.write_text("4:memory:/x\n2:cpuacct:/\n1:cpu:/lbps-1-w0\n0::/\n")
    mounts.write_text("cgroup /sys/fs/cgroup/cpu cgroup rw,relatime,cpu 0 0\n"
                      "cgroup2 /sys/fs/cgroup/unified cgroup2 rw 0 0\n")
    assert own_cpu_group(cg, mounts) == (1, Path("/sys/fs/cgroup/cpu/lbps-1-w0"))
    cg.write_text("0::/job/w1\n")
    mounts.write_text("cgroup2 /sys/fs/cgroup cgroup2 rw,nosuid 0 0\n")
    assert own_cpu_group(cg, mounts) == (2, Path("/sys/fs/cgroup/job/w1"))
    assert own_cpu_group(tmp_path / "missing", mounts) is None


def test_the_probe_reports_throttled_time_per_interval_and_follows_a_move(tmp_path):
    g = v1_group(tmp_path, 20000, 1_000_000_000)
    membership = tmp_path / "proc-cgroup"
    membership.write_text("1:cpu:/\n")
    where: list[tuple[int, Path] | None] = [None]
    probe = CpuQuotaProbe(find=lambda: where[0], membership=membership)
    assert probe.read() == (None, None), "no cpu controller: nothing known"
    membership.write_text("1:cpu:/lbps-1-w0\n")  # the lab moved the worker into its group
    where[0] = (1, g)
    assert probe.read() == (0.2, None), "the first reading in a group has no interval"
    v1_group(tmp_path, 20000, 1_300_000_000)
    quota, held = probe.read()
    assert quota == 0.2 and abs(held - 0.3) < 1e-9
    v1_group(tmp_path, -1, 1_300_000_000)
    assert probe.read() == (None, None), "no quota: no throttling to speak of"


def test_usable_cores_is_the_cpus_or_the_own_quota_whichever_is_less(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    assert usable_cores(lambda: None) == cpus
    g = v1_group(tmp_path, 50000, 0)                       # half a core
    assert usable_cores(lambda: (1, g)) == 0.5
    (g / "cpu.cfs_quota_us").write_text(f"{(cpus + 3) * 100000}\n")
    assert usable_cores(lambda: (1, g)) == cpus            # a quota above the CPUs limits nothing
    (g / "cpu.cfs_quota_us").write_text("-1\n")
    assert usable_cores(lambda: (1, g)) == cpus
    assert usable_cores(lambda: (1, tmp_path / "gone")) == cpus   # unreadable: the CPUs
