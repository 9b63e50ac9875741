"""Many workers against one real shard 0: 40 simulated workers (``benchmarks/bench_fleet.py``)
speak the real worker protocol, join, push with their reports and wait for the parameters, while
LB-BSP splits the global batch among them. Checked: nobody is lost, every iteration hands out
exactly X distinct samples, the decision's time is recorded in every commit, and workers four
times slower get far fewer samples. (Decision time against iteration time at 4, 100 and 1,000
workers is measured by the benchmark, not asserted here.)"""

from __future__ import annotations

import os
import pickle
import signal
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_fleet  # noqa: E402

pytestmark = pytest.mark.system

N = 40


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> bench_fleet.FleetRun:
    """The run, in a process of its own: multiprocessing's spawn start leaves a resource-tracker
    child behind for the life of the process that spawned, and this test process must end with
    no children (other tests check that)."""
    out = tmp_path_factory.mktemp("fleet") / "run.pickle"
    code = (f"import pickle, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import bench_fleet; "
            f"r = bench_fleet.run({N}, 'ema', iterations=60, client_procs=2); "
            f"open({str(out)!r}, 'wb').write(pickle.dumps(r))")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True)
    try:
        assert proc.wait(timeout=240) == 0, "the fleet run failed (its error is above)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return pickle.loads(out.read_bytes())


def test_every_worker_stays_and_every_iteration_covers_x_distinct_samples(fleet):
    x = bench_fleet.PER_WORKER * N
    assert sorted(fleet.index_of.values()) == list(range(N))
    assert len(fleet.records) == 60
    for r in fleet.records:
        assert len(r["batch_sizes"]) == N, f"iteration {r['iteration']}: a worker is missing"
        assert sum(r["batch_sizes"].values()) == x
        samples = [(e, i) for spans in r["ranges"].values() for e, a, b in spans for i in range(a, b)]
        assert len(samples) == len(set(samples)) == x, f"iteration {r['iteration']}: overlapping ranges"
        assert r["decision_s"] >= 0 and r["decision_cpu_s"] >= 0
    # the decision is timed: LB-BSP's takes CPU in every run (a record of 0 would be a stub)
    assert statistics.fmean(r["decision_cpu_s"] for r in fleet.records[20:]) > 0


def test_lbbsp_gives_the_slow_workers_fewer_samples(fleet):
    by_slowdown: dict[float, list[int]] = {}
    for r in fleet.records[-20:]:
        for wid, size in r["batch_sizes"].items():
            f = bench_fleet.SLOWDOWNS[fleet.index_of[int(wid)] % 4]
            by_slowdown.setdefault(f, []).append(size)
    fast, slow = statistics.mean(by_slowdown[1.0]), statistics.mean(by_slowdown[4.0])
    # Per-sample speed ratio 1/4, plus the same 5 ms fixed time for all: equal finish times need
    # a share near 1/4 (the uniform split would be 1).
    assert slow / fast < 0.45, f"slow/fast batch {slow:.1f}/{fast:.1f}"
    assert statistics.mean(by_slowdown[2.0]) > slow
