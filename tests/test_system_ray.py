"""``ps-launch --backend ray`` on a multi-node Ray cluster simulated on this host
(``ray.cluster_utils.Cluster``): shards on the head, workers on two other nodes, one of which is
removed mid-run. The job treats its worker as lost and finishes on the others; the driver writes
one run directory with every process's records and the summary."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'lbbsp-ps[ray]')")

from ps_common.config import load_config  # noqa: E402

pytestmark = pytest.mark.system


@pytest.fixture(autouse=True)
def no_leftover_node_dirs():
    """A removed node's processes leave their node-local directories (on a real cluster they go
    with the node; here every node is this host): remove what the test made."""
    import glob
    import shutil
    import tempfile

    pattern = f"{tempfile.gettempdir()}/lbbsp-ray-*"
    before = set(glob.glob(pattern))
    yield
    for d in set(glob.glob(pattern)) - before:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def ray_cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"server": 4}})
    nodes = [cluster.add_node(num_cpus=2, resources={"trainer": 2}),
             cluster.add_node(num_cpus=2, resources={"trainer": 1})]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster, nodes
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.mark.timeout(300)
def test_a_ray_job_survives_losing_a_workers_node(ray_cluster, tmp_path):
    from ps_launcher.ray_backend import RayCluster

    cluster, nodes = ray_cluster
    cfg = load_config("configs/quick_synthetic.yaml", [
        "training.max_iterations=null", "training.max_seconds=18", "training.global_batch=96",
        "cluster.num_shards=2", "cluster.num_workers=3", "evaluator.enabled=true",
        "heartbeat.interval_s=0.2", "heartbeat.timeout_s=2",
        "ray.shard_resources={server: 1}", "ray.shard_cpus=0.5", "ray.worker_cpus=0.5",
        "ray.worker_resources={trainer: 1}", "ray.evaluator_cpus=0", "ray.evaluator_resources={server: 1}"],
        env={})
    run_dir = tmp_path / "run"
    job = RayCluster(cfg, run_dir, address=cluster.address, progress=False)
    removed_at: list[float] = []

    def remove_later() -> None:
        time.sleep(9)                      # well after the start (Ray and the processes: ~5 s)
        removed_at.append(time.time())
        cluster.remove_node(nodes[1])      # the node holding exactly one worker

    killer = threading.Thread(target=remove_later, daemon=True)
    killer.start()
    summary = job.run()
    killer.join(30)
    assert removed_at, "the node was never removed"
    assert summary["final"]["agree"] and len(summary["final"]["shards"]) == 2, summary["final"]
    # The node's processes die with it. A worker's process gets SIGTERM from the kernel when its
    # actor dies (parent-death signal) and says goodbye; one killed outright is declared lost
    # after the heartbeat timeout. Either way the job removes exactly that one worker.
    removed = [e for e in summary["membership_events"] if e.get("event") == "worker_removed"]
    assert len(removed) == 1, summary["membership_events"]
    coord = [json.loads(ln) for ln in (run_dir / "metrics" / "coordinator.jsonl").read_text().splitlines()]
    commits = [r for r in coord if "event" not in r]
    t_removed = removed_at[0]
    after = [r["wall_time"] for r in commits if r["wall_time"] > t_removed]
    assert after, "training went on after the node was removed"
    detected = next(e["wall_time"] for e in coord if e.get("event") == "worker_removed")
    print(f"\nnode removed; worker removed ({removed[0]['reason']}) after {detected - t_removed:.1f} s; "
          f"first commit after the removal {after[0] - t_removed:.2f} s later; "
          f"{len(after)} commits after it, {len(commits)} in all")
    assert len(job.group.lost) == 1, job.group.lost
    assert (run_dir / "summary.json").exists() and (run_dir / "logs" / "shard-0.log").exists()
    assert summary["final_accuracy"] is not None


@pytest.mark.timeout(180)
def test_sigterm_to_ps_launch_on_ray_stops_everything_and_keeps_the_records(tmp_path):
    """The CLI starts a Ray of its own for the run; SIGTERM mid-run stops every process, gathers
    their records, writes the summary and ends the Ray it started."""
    import signal
    import subprocess
    import sys

    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "ps_launcher.cli", "configs/quick_synthetic.yaml", "--backend",
                             "ray", "--run-dir", str(run_dir), "--no-progress", "--set", "training.max_iterations=null",
                             "--set", "training.max_seconds=120"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        time.sleep(25)
        assert proc.poll() is None, proc.communicate()[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] > 0 and summary["stop_reason"].startswith("interrupted"), summary["stop_reason"]
    assert len(summary["workers"]) == 2 and (run_dir / "logs" / "evaluator.log").exists()
    pids = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True).stdout.split()
    assert not pids, f"processes of the run outlived it: {pids}"
