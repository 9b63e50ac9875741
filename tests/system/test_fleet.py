"""Many workers against one real shard 0: 40 simulated workers (``benchmarks/bench_fleet.py``)
speak the real worker protocol, join, push with their reports and wait for the parameters, while
LB-BSP splits the global batch among them. Checked: nobody is lost, every iteration hands out
exactly X distinct samples, the decision's time is recorded in every commit, and workers four
times slower get far fewer samples. (Decision time against iteration time at 4, 100 and 1,000
workers is measured by the benchmark, not asserted here.) And a member whose report sits at the
edge of its fields' ranges does not stop shard 0."""

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
    _in_own_process(code, timeout_s=240)
    return pickle.loads(out.read_bytes())


def _in_own_process(code: str, timeout_s: float) -> None:
    """Run ``code`` in a Python process of its own session; it must exit 0 (killed with its
    session otherwise)."""
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, start_new_session=True)
    try:
        assert proc.wait(timeout=timeout_s) == 0, "the run failed (its error is above)"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


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


# ----- a member's report at the edges of its ranges ---------------------------------------------
EDGE_ITERATIONS = 25


def _edge_run(run_dir: str) -> None:
    """Shard 0 and two of bench_fleet's simulated workers speaking the real protocol; worker 1
    reports 1e9 MiB of memory headroom over 5e-324 MiB per sample, both within the wire's
    ranges. Shard 0 must finish the run (its commit records are read by the test)."""
    import multiprocessing as mp
    import threading

    import zmq

    from ps_worker.client import ShardClients

    cfg = bench_fleet.job(2, "ema", EDGE_ITERATIONS, Path(run_dir))
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    server = spawn.Process(target=bench_fleet._serve, args=(cfg, run_dir, q))
    server.start()
    ctx = zmq.Context()
    errors: list[str] = []
    joined: list = []
    stop = threading.Event()
    try:
        endpoint = q.get(timeout=60)
        beat = threading.Thread(target=bench_fleet._heartbeats, args=(ctx, endpoint, cfg, joined, stop),
                                daemon=True)
        beat.start()
        clients = [ShardClients(ctx, endpoint, timeout_s=30, connect_timeout_s=30, security=cfg.security)
                   for _ in range(2)]
        edges = [None, {"mem_headroom_mb": 1e9, "mem_per_sample_mb": 5e-324}]
        models = bench_fleet.simulated_workers(2)
        members = [threading.Thread(target=bench_fleet._worker,
                                    args=(cfg, clients[i], models[i], i, joined, errors, {}, edges[i]))
                   for i in range(2)]
        for t in members:
            t.start()
        for t in members:
            t.join(timeout=90)
        stop.set()
        beat.join(timeout=5)
        for c in clients:
            c.close()
        server.join(timeout=30)
        assert not errors, errors
        assert server.exitcode == 0, f"shard 0 exited with {server.exitcode}"
    finally:
        if server.is_alive():
            server.kill()
            server.join(timeout=5)
        ctx.destroy(linger=0)


def test_a_members_report_at_the_edge_of_its_ranges_does_not_stop_shard_0(tmp_path):
    """The headroom estimate of such a report overflowed to infinity, and ``math.floor`` raised
    in shard 0's loop (feeding the reports to the batch policy): shard 0 stopped, the members
    timed out. Now the run finishes by its own rule, with every iteration committed."""
    code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); import tests.system.test_fleet as t; "
            f"t._edge_run({str(tmp_path)!r})")
    _in_own_process(code, timeout_s=180)
    from ps_common.metrics import read_jsonl

    commits = [r for r in read_jsonl(tmp_path / "metrics" / "coordinator.jsonl") if "batch_sizes" in r]
    assert len(commits) == EDGE_ITERATIONS
