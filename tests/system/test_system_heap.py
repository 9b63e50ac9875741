"""The real ps-server and ps-worker processes keep their heap (ps_common.heap), seen from outside:
with a 40 MB model on one shard every push and every reply is a frame over glibc's 32 MB mmap
ceiling, so a process that did not keep its heap would fault that frame's pages in on every
iteration (about 9,800 page faults for each 40 MB frame; tests/unit/test_heap.py has the same
measure under both policies in one process)."""

from __future__ import annotations

import platform
import time
from pathlib import Path

import psutil
import pytest

from tests.cluster_util import start_job, status, wait_exit, write_config

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


def _rss_mb(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


@pytest.mark.timeout(240)
def test_shard_and_worker_receive_40_mb_frames_without_faulting_them_in(procs, tmp_path):
    cfg_path, _ = write_config(tmp_path, JOB)
    run_dir = tmp_path / "run"
    (ep,), (worker,) = start_job(procs, cfg_path, 1, 1, run_dir)
    shard = next(c for c in procs.children if c.role == "shard-0")
    counts, rss = {}, {}
    deadline = time.monotonic() + 180
    for mark in (10, 30):
        while status(ep).version < mark:
            assert time.monotonic() < deadline, f"version {mark} not reached"
            time.sleep(0.01)
        counts[mark] = (status(ep).version, _minor_faults(shard.proc.pid), _minor_faults(worker.proc.pid))
        rss[mark] = (_rss_mb(shard.proc.pid), _rss_mb(worker.proc.pid))
    wait_exit([worker, shard], timeout_s=120)
    (v0, s0, w0), (v1, s1, w1) = counts[10], counts[30]
    per_iteration = {"shard": (s1 - s0) / (v1 - v0), "worker": (w1 - w0) / (v1 - v0)}
    print(f"\nminor page faults per iteration, versions {v0}-{v1}: {per_iteration}; RSS MB {rss}")
    # A 40 MB frame faulted in is about 9,800 faults (measured with the call taken out of either
    # process: 9,783 and 19,395 per iteration). Kept: 0-1 per iteration, and in two of 15
    # runs about 490 in one of the two processes (2 MB of other memory mapped afresh; not a frame).
    assert per_iteration["shard"] < 2000 and per_iteration["worker"] < 2000, per_iteration
