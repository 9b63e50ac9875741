"""The real ps-server and ps-worker processes keep their heap (ps_common.heap), seen from outside:
with a 40 MB model on one shard every push and every reply is a frame over glibc's 32 MB mmap
ceiling, so a process that did not keep its heap would fault that frame's pages in on every
iteration (hundreds of faults each even where transparent huge pages serve most of it; see
tests/unit/test_heap.py for the same measure under both policies)."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import pytest

from tests.cluster_util import start_servers, start_workers, status, wait_exit, write_config

pytestmark = [pytest.mark.system,
              pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")]

ITERATIONS = 40
JOB = {
    "run": {"name": "heap", "seed": 3},
    "model": {"name": "mlp10m"},
    "data": {"dataset": "synthetic", "synthetic_train": 64, "synthetic_test": 16},
    "training": {"global_batch": 4, "max_iterations": ITERATIONS},
    "optimizer": {"lr": 0.01, "momentum": 0.9},
    "cluster": {"num_shards": 1, "num_workers": 1},
    "evaluator": {"enabled": False},
}


def _minor_faults(pid: int) -> int:
    """Minor page faults of ``pid`` so far (/proc/PID/stat, field 10)."""
    after_name = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(after_name[7])


@pytest.mark.timeout(240)
def test_shard_and_worker_receive_40_mb_frames_without_faulting_them_in(procs, tmp_path):
    cfg_path, _ = write_config(tmp_path, JOB)
    run_dir = tmp_path / "run"
    (ep,) = start_servers(procs, cfg_path, 1, run_dir)
    (worker,) = start_workers(procs, cfg_path, ep, 1, run_dir)
    shard = next(c for c in procs.children if c.role == "shard-0")
    counts = {}
    deadline = time.monotonic() + 180
    for mark in (10, 30):
        while status(ep).version < mark:
            assert time.monotonic() < deadline, f"version {mark} not reached"
            time.sleep(0.01)
        counts[mark] = (status(ep).version, _minor_faults(shard.proc.pid), _minor_faults(worker.proc.pid))
    wait_exit([worker, shard], timeout_s=120)
    (v0, s0, w0), (v1, s1, w1) = counts[10], counts[30]
    per_iteration = {"shard": (s1 - s0) / (v1 - v0), "worker": (w1 - w0) / (v1 - v0)}
    print(f"\nminor page faults per iteration, versions {v0}-{v1}: {per_iteration}")
    assert per_iteration["shard"] < 100 and per_iteration["worker"] < 100, per_iteration
