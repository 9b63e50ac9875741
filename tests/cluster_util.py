"""Helpers for system tests: start real ps-server / ps-worker processes and read results."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import yaml
import zmq

from ps_common import protocol as P
from ps_common.config import JobConfig, load_config
from ps_common.transport import Connection
from ps_launcher.processes import ProcessGroup
from ps_worker.client import ShardClients


def write_config(tmp_path: Path, data: dict) -> tuple[Path, JobConfig]:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, load_config(path, env={})


def start_servers(procs: ProcessGroup, cfg_path: Path, num_shards: int, run_dir: Path) -> list[str]:
    common = ["--config", str(cfg_path), "--run-dir", str(run_dir), "--port", "0"]
    s0 = procs.start("shard-0", "ps_server.cli", [*common, "--shard", "0"])
    ep0 = procs.wait_endpoint(s0, 60)
    eps = [ep0]
    for k in range(1, num_shards):
        ch = procs.start(f"shard-{k}", "ps_server.cli", [*common, "--shard", str(k), "--coordinator", ep0])
        eps.append(procs.wait_endpoint(ch, 60))
    return eps


def start_workers(procs: ProcessGroup, cfg_path: Path, endpoint: str, n: int, run_dir: Path,
                  extra: list[str] = ()) -> list:
    return [procs.start(f"worker-{i}", "ps_worker.cli",
                        ["--config", str(cfg_path), "--server", endpoint, "--run-dir", str(run_dir),
                         "--name", f"worker-{i}", *extra]) for i in range(n)]


def wait_exit(children: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for ch in children:
        ch.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        assert ch.proc.returncode == 0, f"{ch.role} exited with {ch.proc.returncode}:\n{ch.tail()}"


def status(endpoint: str) -> P.Status:
    conn = Connection(zmq.Context.instance(), endpoint, timeout_s=10)
    try:
        st = conn.request(P.StatusRequest(), P.Status)
        assert isinstance(st, P.Status)
        return st
    finally:
        conn.close()


def pull_params(cfg: JobConfig, endpoint: str) -> tuple[np.ndarray, int]:
    """The servers' current parameters (one consistent version) and that version."""
    client = ShardClients(zmq.Context.instance(), endpoint, timeout_s=30, connect_timeout_s=30)
    try:
        welcome = client.join("test-observer", cfg.job_digest(), "cpu", role="observer")
        params = np.empty(welcome.num_params, dtype=np.float32)
        st = client.send_to_coordinator(P.StatusRequest(), P.Status)
        res = client.pull(params, worker_id=-1, min_version=st.version, honor_stop=False)
        return params, res.version
    finally:
        client.close()
