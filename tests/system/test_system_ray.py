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

from ps_common import protocol as P  # noqa: E402
from ps_common.config import load_config  # noqa: E402
from tests.cluster_util import operator_request  # noqa: E402

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


def wait_for_commits(run_dir, n: int, timeout_s: float = 120.0) -> None:
    """Until shard 0's records, streamed to the driver, show ``n`` commits: the job has started,
    however long Ray and the processes took to come up on a loaded host."""
    path = run_dir / "metrics" / "coordinator.jsonl"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists() and sum('"event"' not in ln for ln in path.read_text().splitlines()) >= n:
            return
        time.sleep(0.2)
    raise AssertionError(f"fewer than {n} commits streamed to the driver within {timeout_s:.0f}s")


def run_showing_logs(job, run_dir):
    """``job.run()``; when it fails, the last lines of every role's log, not only the failed
    one's (a shard that cannot register needs the coordinator's side to be understood)."""
    from ps_launcher.launcher import RunFailed

    try:
        return job.run()
    except RunFailed as exc:
        tails = [f"----- {log.name} -----\n" + "\n".join(log.read_text(errors="replace").splitlines()[-40:])
                 for log in sorted((run_dir / "logs").glob("*.log"))]
        pytest.fail(f"{exc}\n" + "\n".join(tails))


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
        "training.max_iterations=null", "training.max_seconds=12", "training.global_batch=96",
        "cluster.num_shards=2", "cluster.num_workers=3", "evaluator.enabled=true",
        "heartbeat.interval_s=0.2", "heartbeat.timeout_s=2",
        "ray.shard_resources={server: 1}", "ray.shard_cpus=0.5", "ray.worker_cpus=0.5",
        "ray.worker_resources={trainer: 1}", "ray.evaluator_cpus=0", "ray.evaluator_resources={server: 1}"],
        env={})
    run_dir = tmp_path / "run"
    job = RayCluster(cfg, run_dir, address=cluster.address, progress=False)
    removed_at: list[float] = []

    def remove_later() -> None:
        wait_for_commits(run_dir, 30)      # training has started (records stream to the driver)
        time.sleep(2)
        removed_at.append(time.time())
        cluster.remove_node(nodes[1])      # the node holding exactly one worker

    killer = threading.Thread(target=remove_later, daemon=True)
    killer.start()
    summary = run_showing_logs(job, run_dir)
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
    # Streamed while it ran: the lost worker's log and its iterations up to about its node's
    # removal are on the driver, although its node-local files went with the node.
    lost_log = (run_dir / "logs" / f"{job.group.lost[0]}.log").read_text()
    assert lost_log.strip(), "nothing of the lost worker's log reached the driver"
    lost_id = removed[0]["worker"]
    lost_its = [json.loads(ln) for ln in (run_dir / "metrics" / f"worker-{lost_id}.jsonl").read_text().splitlines()]
    assert lost_its and max(r["wall_time"] for r in lost_its if "wall_time" in r) > t_removed - 5, lost_its[-1:]
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
        wait_for_commits(run_dir, 5)  # mid-run, however long a loaded host took to start it
        evaluated = run_dir / "metrics" / "evaluator.jsonl"  # and every process is up: the evaluator last
        deadline = time.monotonic() + 120
        while not (evaluated.exists() and evaluated.read_text().strip()) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate(timeout=30)[0][-3000:]
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    assert proc.returncode == 130, out[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] > 0 and summary["stop_reason"].startswith("interrupted"), summary["stop_reason"]
    assert len(summary["workers"]) == 2 and (run_dir / "logs" / "evaluator.log").exists()
    pids = subprocess.run(["pgrep", "-f", str(run_dir)], capture_output=True, text=True, timeout=30).stdout.split()
    assert not pids, f"processes of the run outlived it: {pids}"


@pytest.mark.timeout(420)
def test_shards_lost_with_their_nodes_start_again_from_their_checkpoints(tmp_path):
    """CURVE on, keys shipped by the driver (the key directory is moved away while shard 1 is
    lost, so it starts again with only what travelled with its actor); each shard on a node of its own,
    two spare nodes. The node of shard 1 is removed: shard 1 starts again on a spare node from
    the shared checkpoints and every shard rolls back to their common checkpoint. Later the node
    of shard 0, the coordinator, is removed: it starts again from its checkpoint, moves the
    follower back and to its new address, and the workers and the evaluator start again pointed
    at it. Once training has gone on, an operator's Shutdown ends the run (max_seconds is only a
    cap). The run ends with one history; what each lost process wrote before its node went is on
    the driver."""
    from ray.cluster_utils import Cluster

    from ps_common.security.settings import init_local_keys
    from ps_launcher.ray_backend import RayCluster

    keys = init_local_keys(tmp_path / "keys")
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"trainer": 4}})
    shard_nodes = [cluster.add_node(num_cpus=1, resources={"server": 1}) for _ in range(4)]
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    run_dir = tmp_path / "run"
    removed_at: dict[str, float] = {}
    before: dict[str, list[str]] = {}
    try:
        cfg = load_config("configs/quick_synthetic.yaml", [
            "training.max_iterations=null", "training.max_seconds=120", "training.global_batch=64",
            "cluster.num_shards=2", "cluster.num_workers=2", "evaluator.enabled=true",
            "heartbeat.interval_s=0.2", "heartbeat.timeout_s=3", "transport.timeout_s=15",
            f"checkpoint.dir={tmp_path / 'shared-checkpoints'}", "checkpoint.every_iterations=20",
            "security.curve=true", f"security.server_secret_key={keys.server_secret_key}",
            f"security.server_public_key={keys.server_public_key}",
            f"security.allowed_clients_dir={keys.allowed_clients_dir}",
            f"security.client_keys_dir={keys.client_keys_dir}",
            "ray.shard_resources={server: 1}", "ray.shard_cpus=0.5", "ray.worker_cpus=0.5",
            "ray.worker_resources={trainer: 1}", "ray.evaluator_cpus=0", "ray.evaluator_resources={trainer: 1}",
            "ray.records_every_s=1"], env={})
        job = RayCluster(cfg, run_dir, address=cluster.address, progress=False)

        def remove(role: str, record: str) -> None:
            node_id = job.group.node_of(role)
            node = next(n for n in shard_nodes if n.node_id == node_id)
            before[role] = (run_dir / "metrics" / record).read_text().splitlines()
            removed_at[role] = time.time()
            cluster.remove_node(node)

        def remove_later() -> None:
            wait_for_commits(run_dir, 60)  # past the first checkpoints (every 20 iterations)
            deadline = time.monotonic() + 120  # and every process started, the driver's monitor dialled
            while not any(c.role == "evaluator" for c in job.group.children) and time.monotonic() < deadline:
                time.sleep(0.2)
            time.sleep(1.0)
            (tmp_path / "keys").rename(tmp_path / "keys-gone")  # only the shipped copies remain
            remove("shard-1", "shard-1.jsonl")
            deadline = time.monotonic() + 120
            while job.restarts.get("shard-1") != 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            commits = sum('"event"' not in ln for ln in (run_dir / "metrics" / "coordinator.jsonl").read_text()
                          .splitlines())
            wait_for_commits(run_dir, commits + 40)  # training again, well after the rollback
            # The driver dials shard 0's new address with its own operator key, which a real
            # driver host keeps: give the keys back before that.
            (tmp_path / "keys-gone").rename(tmp_path / "keys")
            remove("shard-0", "coordinator.jsonl")
            deadline = time.monotonic() + 120
            while job.restarts.get("shard-0") != 1 and time.monotonic() < deadline:
                time.sleep(0.2)
            commits = sum('"event"' not in ln for ln in (run_dir / "metrics" / "coordinator.jsonl").read_text()
                          .splitlines())
            wait_for_commits(run_dir, commits + 40)  # training again after shard 0 came back
            # End the job the normal way, as an operator (ps-launch's own path when interrupted):
            # one final version on every shard. max_seconds is only the cap.
            operator_request(job.shard_endpoints[0], P.Shutdown(reason="the test saw training go on"), P.Ack,
                             security=job.cfg.security, timeout_s=15.0)

        killer = threading.Thread(target=remove_later, daemon=True)
        killer.start()
        summary = run_showing_logs(job, run_dir)
        killer.join(30)
    finally:
        ray.shutdown()
        cluster.shutdown()
    assert set(removed_at) == {"shard-0", "shard-1"}, f"not every node was removed: {removed_at}"
    assert summary["stop_reason"].startswith("operator shutdown"), summary["stop_reason"]
    assert job.restarts == {"shard-1": 1, "shard-0": 1}, job.restarts
    assert summary["final"]["agree"] and len(summary["final"]["shards"]) == 2, summary["final"]
    for k in (0, 1):
        shard = [json.loads(ln) for ln in (run_dir / "metrics" / f"shard-{k}.jsonl").read_text().splitlines()]
        assert any(r.get("event") == "restored" for r in shard), f"shard {k} was never restored"
        assert "listening on" in (run_dir / "logs" / f"shard-{k}.restart-1.log").read_text()
    for role in ("worker-0", "worker-1", "evaluator"):  # pointed at shard 0's new address
        assert (run_dir / "logs" / f"{role}.restart-1.log").read_text().strip(), role
    # Streamed while they ran: what each shard wrote before its node went reached the driver.
    final = {"shard-1": (run_dir / "metrics" / "shard-1.jsonl").read_text().splitlines(),
             "shard-0": (run_dir / "metrics" / "coordinator.jsonl").read_text().splitlines()}
    for role, lines in before.items():
        assert any("event" not in json.loads(ln) for ln in lines), f"nothing of {role} was streamed in time"
        assert final[role][:len(lines)] == lines
    coord = [json.loads(ln) for ln in final["shard-0"]]
    t0 = removed_at["shard-0"]
    after = [r for r in coord if "event" not in r and r["wall_time"] > t0]
    assert after, "training did not go on after shard 0 came back"
    print(f"\nshard 1's node removed, shard 0's {t0 - removed_at['shard-1']:.1f} s later; first commit "
          f"{after[0]['wall_time'] - t0:.1f} s after shard 0's removal (clients started again); "
          f"{len(after)} commits after it; final version {summary['final']['shards']}")
