"""The lab's real mechanisms through ps-launch: kernel CPU quotas and hosts with shaped links.

Skipped, with the reason, where the mechanism is unavailable (not root, no cgroup cpu
controller, no ``ip``). Each run must leave no cgroup and no namespace behind.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from ps_common.config import load_config
from ps_common.metrics import read_jsonl
from ps_launcher.lab import cpu_quota_available, delay_available, netns_available
from ps_launcher.launcher import LocalCluster

pytestmark = pytest.mark.system

BASE = [
    "model.name=mlp", "data.dataset=synthetic", "data.synthetic_train=4096", "evaluator.enabled=false",
    "cluster.num_shards=1", "training.global_batch=256", "training.max_seconds=12",
    "mode.batch_policy=lbbsp-cpu", "training.finish_timeout_s=10",
]


def leftovers() -> list[str]:
    out = [p.name for p in Path("/sys/fs/cgroup/cpu").glob("lbps-*")] if Path("/sys/fs/cgroup/cpu").exists() else []
    ns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return out + [line.split()[0] for line in ns.splitlines() if line.startswith("lbps-")]


@pytest.mark.timeout(180)
def test_cpu_quota_slows_one_worker_and_lbbsp_gives_it_less(tmp_path):
    if why := cpu_quota_available():
        pytest.skip(f"CPU quotas unavailable: {why}")
    cfg = load_config(None, [*BASE, "cluster.num_workers=2",
                             'scenario.workers=[{}, {cpu_quota: 0.2}]'], env={})
    summary = LocalCluster(cfg, tmp_path / "run", progress=False).run()
    assert summary["final"]["agree"]
    lab = list(read_jsonl(tmp_path / "run" / "metrics" / "lab.jsonl"))
    assert {"t": 0.0, "worker": 1, "cpu_quota": 0.2}.items() <= lab[0].items()
    throttled = next(r for r in lab if r.get("event") == "throttling")["workers"]["1"]
    assert throttled["nr_throttled"] > 0, "the kernel never throttled the worker"
    w = summary["workers"]
    assert w["1"]["mean_batch"] < 0.7 * w["0"]["mean_batch"], f"LB-BSP did not move samples: {w}"
    # Each worker reads its own group: the throttled one reports its quota and the time held.
    reports = {p.name: [r for r in read_jsonl(p) if "iteration" in r]
               for p in (tmp_path / "run" / "metrics").glob("worker-*.jsonl")}
    quotas = {name: {r.get("cpu_quota") for r in rows} for name, rows in reports.items()}
    assert sorted(map(frozenset, quotas.values()), key=len) == [{None}, {0.2}], quotas
    slow = next(rows for name, rows in reports.items() if quotas[name] == {0.2})
    assert sum(r.get("throttled_s") or 0.0 for r in slow) > 0.1, "no throttled time reported"
    # ... and the CPU its iterations cost, which the quota model divides by the quota.
    for rows in reports.values():
        assert all(r["cpu_s"] > 0 and r["compute_cpu_s"] > 0 for r in rows[1:]), rows[1]
        assert sum(r["compute_cpu_s"] for r in rows[1:]) < sum(r["cpu_s"] for r in rows[1:])
    assert not leftovers()


@pytest.mark.timeout(180)
def test_hosts_with_a_link_that_changes_mid_run(tmp_path):
    if why := netns_available() or delay_available():
        pytest.skip(f"network namespaces unavailable: {why}")
    cfg = load_config(None, [*BASE, "cluster.num_workers=2", "mode.batch_policy=uniform",
                             "training.max_seconds=7",   # the change at 3 s, then 4 s of it
                             'scenario.workers=[{}, {link: {rate_mbit: 40, delay_ms: 5, '
                             'steps: [{at_seconds: 3, rate_mbit: 10}]}}]'], env={})
    summary = LocalCluster(cfg, tmp_path / "run", progress=False).run()
    assert summary["stop_reason"].startswith("reached max_seconds"), summary["stop_reason"]
    assert summary["final"]["agree"] and summary["final"]["version"] > 5
    lab = list(read_jsonl(tmp_path / "run" / "metrics" / "lab.jsonl"))
    changes = [r for r in lab if r.get("rate_mbit") == 10.0]
    assert changes and 2.9 < changes[0]["t"] < 4.0, lab
    # Every process ran on a host of its own: the shard bound its host's address.
    log0 = (tmp_path / "run" / "logs" / "shard-0.log").read_text()
    assert "listening on tcp://10.213." in log0
    assert not leftovers()
