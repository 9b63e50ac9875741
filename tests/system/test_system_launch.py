"""End to end through ``ps-launch``: real MNIST, real processes, a run directory to read."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import zmq

from ps_common import protocol as P
from ps_common.transport import Connection, recv_frames
from tests.cluster_util import start_servers, status, write_config

pytestmark = pytest.mark.system


def test_launch_mnist_lenet_reaches_accuracy(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ps_launcher.cli", "configs/mnist_bsp.yaml", "--run-dir", str(run_dir),
           "--no-progress", "--set", "training.epochs=1.5", "--set", "training.target_accuracy=0.975",
           "--set", "evaluator.every_iterations=60"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["final_accuracy"] >= 0.95, summary
    # Every shard ended at one version with one history, and that version is what was measured.
    assert summary["final"]["agree"], summary["final"]
    assert summary["final_accuracy_version"] == summary["final"]["version"]
    assert summary["iterations"] > 100
    for name in ("config.yaml", "summary.md", "accuracy.png", "workers.png", "metrics/coordinator.jsonl"):
        assert (run_dir / name).stat().st_size > 0, name
    assert "final test accuracy" in out.stdout
    assert len(summary["workers"]) == 2
    hit = summary["time_to_accuracy"]["0.95"]
    assert hit is not None and 0 < hit["seconds"] < summary["training_s"] + 1
    # The batch policy's decision time, wall and CPU (one thread's CPU never exceeds its wall).
    dec = summary["decision"]
    assert dec is not None and 0 < dec["cpu_mean_s"] <= dec["mean_s"] + 1e-4, dec
    assert 0 < dec["mean_share"] < 1 and 0 < dec["cpu_mean_share"] <= dec["mean_share"] + 1e-3, dec
    assert "batch-size decision (ms): median / mean / p95, CPU" in (run_dir / "summary.md").read_text()


def test_a_run_directory_holds_one_run_unless_overwritten(tmp_path):
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "ps_launcher.cli", "configs/quick_synthetic.yaml", "--run-dir", str(run_dir),
           "--no-progress", "--set", "training.max_iterations=30", "--set", "evaluator.enabled=false",
           "--set", "cluster.num_shards=1", "--set", "cluster.num_workers=1"]  # what is tested is the directory
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stdout + first.stderr
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and "already holds a run" in again.stderr and "--overwrite" in again.stderr
    replaced = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, timeout=300)
    assert replaced.returncode == 0, replaced.stdout + replaced.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    coordinator = [r for r in map(json.loads, (run_dir / "metrics" / "coordinator.jsonl").read_text().splitlines())
                   if "event" not in r]
    assert summary["iterations"] == len(coordinator) == 30, "the summary counts one run, not two"
    (run_dir / "notes.txt").write_text("mine")
    foreign = subprocess.run([*cmd, "--overwrite"], capture_output=True, text=True, timeout=60)
    assert foreign.returncode == 2 and "notes.txt" in foreign.stderr
    assert (run_dir / "notes.txt").exists() and (run_dir / "summary.json").exists(), "nothing removed"


def test_launch_rejects_bad_config_naming_the_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("training: {global_batch: 64, max_iterations: 5, lr: 0.1}\n")
    out = subprocess.run([sys.executable, "-m", "ps_launcher.cli", str(bad)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2
    assert "training.lr: unknown key" in out.stderr


def raw_reply(conn: Connection) -> P.Message:
    """The next reply as it came, an Error included (``Connection.recv`` raises those), polled
    for the connection's timeout."""
    frames = recv_frames(conn.sock, conn.timeout_s)
    assert frames is not None, f"no reply within {conn.timeout_s:.0f} s"
    return P.decode(frames)


def test_server_survives_malformed_messages(procs, tmp_path):
    cfg_path, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic"},
        "training": {"global_batch": 8, "max_iterations": 5}, "cluster": {"num_shards": 1, "num_workers": 1}})
    (ep,) = start_servers(procs, cfg_path, 1, tmp_path / "run")
    ctx = zmq.Context.instance()
    conn = Connection(ctx, ep, role="worker", timeout_s=10, security=cfg.security)
    try:
        junk = [[b"garbage"], [P.HEADER_PREFIX + b"\xff"], [b"LBPS\x07"],
                [P.encode(P.Hello())[0], b"extra frame"]]
        for frames in junk:
            conn.sock.send_multipart(frames)
            reply = raw_reply(conn)
            assert isinstance(reply, P.Error) and reply.code == "malformed"
        conn.send(P.Push(worker_id=99, arrays=[__import__("numpy").zeros(3, "float32")]))
        reply = raw_reply(conn)
        assert isinstance(reply, P.Error) and reply.code == "unauthorized"
    finally:
        conn.close()
    assert status(ep).version == 0


def test_a_shard_on_every_interface_must_say_where_it_is_reached(tmp_path):
    """Binding 0.0.0.0 without --advertise would tell workers to dial tcp://0.0.0.0:PORT, and
    they would retry forever: the shard refuses to start and says what to pass."""
    from ps_common.transport import undialable

    cfg_path, _ = write_config(tmp_path, {"data": {"dataset": "synthetic"}})
    out = subprocess.run([sys.executable, "-m", "ps_server.cli", "--config", str(cfg_path), "--shard", "0",
                          "--host", "0.0.0.0", "--port", "0"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "--advertise HOST" in out.stderr, out.stderr
    assert undialable("tcp://0.0.0.0:5555") and undialable("tcp://*:1") and undialable("tcp://[::]:7")
    assert not undialable("tcp://10.0.0.2:5555") and not undialable("ipc:///tmp/x")


def test_shard_zeros_run_directory_alone_summarizes_a_hand_started_job(procs, tmp_path):
    """Processes on different hosts write different run directories: the workers' and the
    evaluator's are elsewhere, yet ps-summary on shard 0's gives the whole summary (the
    evaluator's reports and the workers' telemetry reach shard 0)."""
    from tests.cluster_util import start_workers, wait_exit

    cfg_path, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 512},
        "training": {"global_batch": 64, "max_iterations": 30, "finish_timeout_s": 20},
        "cluster": {"num_shards": 2, "num_workers": 2}, "evaluator": {"every_iterations": 10, "nice": 0}})
    shard0_dir, elsewhere = tmp_path / "host-a", tmp_path / "host-c"
    eps = start_servers(procs, cfg_path, 2, shard0_dir)
    workers = start_workers(procs, cfg_path, eps[0], 2, elsewhere)
    evaluator = procs.start("evaluator", "ps_worker.evaluator_cli",
                            ["--config", str(cfg_path), "--server", eps[0], "--run-dir", str(elsewhere)])
    wait_exit([*workers, evaluator, *[c for c in procs.children if c.role.startswith("shard")]], timeout_s=120)
    assert not list((shard0_dir / "metrics").glob("worker-*.jsonl"))
    out = subprocess.run([sys.executable, "-m", "ps_launcher.summary", str(shard0_dir)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads((shard0_dir / "summary.json").read_text())
    assert summary["iterations"] == 30 and summary["final"]["agree"]
    assert summary["workers_from"] == "shard 0's records" and len(summary["workers"]) == 2
    assert sum(w["iterations"] for w in summary["workers"].values()) == 60
    own = [json.loads(ln) for ln in (elsewhere / "metrics" / "evaluator.jsonl").read_text().splitlines()]
    assert [p["version"] for p in summary["accuracy_curve"]] == [e["version"] for e in own]
    assert summary["final_accuracy"] == own[-1]["accuracy"] and summary["final_accuracy_version"] == 30
    assert summary["time_to_accuracy"]["0.9"] is not None
