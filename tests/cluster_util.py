"""Helpers for system tests: start real ps-server / ps-worker processes and read results."""

from __future__ import annotations

import select
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Callable, Iterator

import numpy as np
import yaml
import zmq

from ps_common import protocol as P
from ps_common.config import JobConfig, load_config
from ps_common.metrics import read_jsonl
from ps_common.rendezvous import ENDPOINT_FILE, FILE_PREFIX
from ps_common.security.credentials import generate_master
from ps_common.transport import Connection
from ps_launcher.processes import ProcessGroup
from ps_worker.client import ShardClients
from ps_worker.heartbeat import Heartbeat


def write_config(tmp_path: Path, data: dict) -> tuple[Path, JobConfig]:
    """The job's YAML, with a job secret (a master every test process may use) unless the
    test configured credentials itself."""
    data = {**data}
    sec = dict(data.get("security") or {})
    if not sec.get("curve") and not sec.get("secret_file"):
        secret = tmp_path / "job.secret"
        if not secret.exists():
            generate_master(secret)
        sec["secret_file"] = str(secret)
    data["security"] = sec
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return path, load_config(path, env={})


_CFG: dict[str, JobConfig] = {}


def _security_for(endpoint: str):
    cfg = _CFG.get(endpoint)
    return cfg.security if cfg is not None else None


def _start_shards(procs: ProcessGroup, cfg_path: Path, num_shards: int, run_dir: Path,
                  env: dict[str, str] | None) -> tuple[list, str]:
    """Every shard at once, shard 0's endpoint handed over by a file in the run directory
    (:mod:`ps_common.rendezvous`, as ps-launch does): the followers import torch while shard 0
    does. Returns the shards and ``file:PATH`` for shard 0's endpoint."""
    run_dir.mkdir(parents=True, exist_ok=True)
    ep_file = run_dir / ENDPOINT_FILE
    ep_file.unlink(missing_ok=True)
    common = ["--config", str(cfg_path), "--run-dir", str(run_dir), "--port", "0"]
    spec = FILE_PREFIX + str(ep_file)
    shards = [procs.start("shard-0", "ps_server.cli", [*common, "--shard", "0", "--endpoint-file", str(ep_file)],
                          env=env)]
    shards += [procs.start(f"shard-{k}", "ps_server.cli", [*common, "--shard", str(k), "--coordinator", spec], env=env)
               for k in range(1, num_shards)]
    return shards, spec


def _endpoints(procs: ProcessGroup, shards: list, cfg_path: Path) -> list[str]:
    eps = [procs.wait_endpoint(ch, 60) for ch in shards]
    cfg = load_config(cfg_path, env={})
    for ep in eps:
        _CFG[ep] = cfg
    return eps


def start_servers(procs: ProcessGroup, cfg_path: Path, num_shards: int, run_dir: Path,
                  env: dict[str, str] | None = None) -> list[str]:
    """The job's shards, up: their endpoints, shard 0's first."""
    shards, _ = _start_shards(procs, cfg_path, num_shards, run_dir, env)
    return _endpoints(procs, shards, cfg_path)


def start_job(procs: ProcessGroup, cfg_path: Path, num_shards: int, num_workers: int, run_dir: Path,
              env: dict[str, str] | None = None, worker_env: dict[str, str] | None = None,
              start: Callable[..., list] | None = None, evaluator: bool = False) -> tuple[list[str], list]:
    """Shards and workers started at once, as ps-launch starts them (each process's 1.5-2 s of
    start-up overlaps the others'); ``start``: how to start the workers, given shard 0's
    endpoint (default :func:`start_workers`); ``evaluator``: an evaluator too (role
    "evaluator" in ``procs``). Returns the shards' endpoints and the workers."""
    shards, spec = _start_shards(procs, cfg_path, num_shards, run_dir, env)
    if evaluator:
        procs.start("evaluator", "ps_worker.evaluator_cli",
                    ["--config", str(cfg_path), "--server", spec, "--run-dir", str(run_dir)])
    kw = {} if worker_env is None else {"env": worker_env}
    workers = (start or start_workers)(procs, cfg_path, spec, num_workers, run_dir, **kw)
    return _endpoints(procs, shards, cfg_path), workers


def start_workers(procs: ProcessGroup, cfg_path: Path, endpoint: str, n: int, run_dir: Path,
                  extra: list[str] = (), env: dict[str, str] | None = None, scenario_index: bool = False) -> list:
    """worker-0 .. worker-(n-1); with ``scenario_index`` worker-i gets scenario entry i (not the
    join order's id), as under ps-launch."""
    return [procs.start(f"worker-{i}", "ps_worker.cli",
                        ["--config", str(cfg_path), "--server", endpoint, "--run-dir", str(run_dir),
                         "--name", f"worker-{i}", *extra,
                         *(["--scenario-index", str(i)] if scenario_index else [])], env=env) for i in range(n)]


def read_line(stream: IO[str], timeout_s: float) -> str:
    """A child's next line of output, or "" when none came within ``timeout_s``: a child that
    hangs before it prints fails the test instead of hanging it."""
    ready, _, _ = select.select([stream], [], [], timeout_s)
    return stream.readline() if ready else ""


def wait_exit(children: list, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for ch in children:
        ch.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        assert ch.proc.returncode == 0, f"{ch.role} exited with {ch.proc.returncode}:\n{ch.tail()}"


def operator_request(endpoint: str, msg: P.Message, reply_type: type, *, security=None,
                     timeout_s: float = 10):
    """One request as the operator role, with the job's security as :func:`start_servers`
    recorded it for ``endpoint`` unless ``security`` is given."""
    conn = Connection(zmq.Context.instance(), endpoint, role="operator", timeout_s=timeout_s,
                      security=security if security is not None else _security_for(endpoint))
    try:
        reply = conn.request(msg, reply_type)
        assert isinstance(reply, reply_type)
        return reply
    finally:
        conn.close()


def status(endpoint: str, timeout_s: float = 10) -> P.Status:
    return operator_request(endpoint, P.StatusRequest(), P.Status, timeout_s=timeout_s)


def final_params(run_dir: Path) -> tuple[np.ndarray, list[dict]]:
    """The final parameters every shard saved at the end of the job, and each shard's metadata
    (version, log hash). The shards must agree on both."""
    from ps_server.checkpoint import list_checkpoints, load_checkpoint

    parts, metas = [], []
    k = 0
    while True:
        found = list_checkpoints(run_dir / "final", k)
        if not found:
            break
        arrays, meta = load_checkpoint(found[-1][1])
        parts.append(arrays["params"])
        metas.append(meta)
        k += 1
    assert parts, f"no final parameters in {run_dir / 'final'}"
    return np.concatenate(parts), metas


def pull_params(cfg: JobConfig, endpoint: str) -> tuple[np.ndarray, int]:
    """The servers' current parameters (one consistent version) and that version."""
    client = ShardClients(zmq.Context.instance(), endpoint, timeout_s=30, connect_timeout_s=30,
                          security=cfg.security, role="evaluator")
    try:
        welcome = client.join("test-observer", cfg.job_digest(), "cpu")
        params = np.empty(welcome.num_params, dtype=np.float32)
        st = client.send_to_coordinator(P.StatusRequest(), P.Status)
        res = client.pull(params, worker_id=-1, min_version=st.version, honor_stop=False)
        return params, res.version
    finally:
        client.close()


def applied_log(run_dir: Path, shard: int) -> list[tuple[int, int, tuple]]:
    """(version, iteration, ((worker, batch size), ...)) of every commit shard ``shard`` applied,
    from the last restore on (a rollback replays what follows it)."""
    out: list[tuple[int, int, tuple]] = []
    for r in read_jsonl(run_dir / "metrics" / f"shard-{shard}.jsonl"):
        if r.get("event") == "restored":
            out = [e for e in out if e[0] <= r["version"]]
        elif "entries" in r and "event" not in r:
            out.append((r["version"], r["iteration"], tuple(tuple(e) for e in r["entries"])))
    return out


def consistent_end(run_dir: Path, num_shards: int) -> tuple[np.ndarray, int]:
    """Check that every shard ended at the same version with the same history (log hash and
    applied log); return the final parameters and that version."""
    params, metas = final_params(run_dir)
    assert len(metas) == num_shards, f"{len(metas)} of {num_shards} shards saved final parameters"
    versions = {m["version"] for m in metas}
    hashes = {m["log_hash"] for m in metas}
    assert len(versions) == 1 and len(hashes) == 1, f"shards ended apart: {versions} {hashes}"
    logs = [applied_log(run_dir, k) for k in range(num_shards)]
    for k in range(1, num_shards):
        assert logs[k] == logs[0], f"shard {k} applied other gradient sets than shard 0"
    return params, versions.pop()


def committed_batches(recs: list[dict], seed: int, num_train: int) -> list[np.ndarray]:
    """The sample indices each commit applied, in version order; asserts that no sample was
    applied twice in an epoch and that every epoch before the last is complete."""
    from ps_ml.datasets import sample_order

    seen: dict[int, list[int]] = {}
    batches = []
    for r in sorted(recs, key=lambda r: r["version"]):
        idx: list[int] = []
        for w in r["accepted"]:
            for e, a, b in r["ranges"][str(w)]:
                got = sample_order(seed, e, num_train)[a:b].tolist()
                seen.setdefault(e, []).extend(got)
                idx.extend(got)
        batches.append(np.array(idx))
    for e, got in seen.items():
        assert len(got) == len(set(got)), f"epoch {e}: a sample was applied twice"
    for e in range(max(seen)):
        assert sorted(seen[e]) == list(range(num_train)), f"epoch {e}: samples missing"
    return batches


def reported_losses(run_dir: Path) -> dict[tuple[int, int], float]:
    """(worker id, iteration) -> the loss the worker reported for its gradient of that iteration."""
    out: dict[tuple[int, int], float] = {}
    for path in sorted((run_dir / "metrics").glob("worker-*.jsonl")):
        for r in read_jsonl(path):
            if "loss" in r and "iteration" in r and "worker" in r:
                out[(int(r["worker"]), int(r["iteration"]))] = float(r["loss"])
    return out


def reference_with_losses(run_dir: Path, recs: list[dict], seed: int, num_train: int, data, model: str,
                          lr: float, momentum: float, weight_decay: float = 0.0,
                          rtol: float = 1e-5) -> tuple[np.ndarray, list[str]]:
    """Single-process SGD over the committed samples (round modes), and every accepted
    gradient whose reported loss differs from the loss of its samples at the parameters of the
    version it was meant for: its worker computed on other parameters or other samples than
    the commit record says. The final parameters alone show that something went wrong; this
    says which worker, at which iteration. A worker killed before its metrics reached the disk
    leaves gradients unchecked, but every commit must have one checked (the tests' survivors
    are in every commit), so a check that reads no losses at all fails instead of passing."""
    import torch.nn.functional as F

    from ps_ml.datasets import sample_order
    from ps_ml.reference import train_reference_batches

    recs = sorted(recs, key=lambda r: r["version"])
    reported = reported_losses(run_dir)
    wrong: list[str] = []
    unchecked: list[int] = []                  # versions none of whose gradients was checked

    def probe(i: int, net) -> None:
        r = recs[i]
        checked = 0
        for w in r["accepted"]:
            got = reported.get((int(w), r["iteration"]))
            if got is None:
                continue
            checked += 1
            idx = np.concatenate([sample_order(seed, e, num_train)[a:b] for e, a, b in r["ranges"][str(w)]])
            x, y = data.train_batch(idx)
            want = float(F.cross_entropy(net(x), y))
            if abs(got - want) > rtol * abs(want):
                wrong.append(f"worker {w} iteration {r['iteration']} (version {r['version']}, "
                             f"{idx.size} samples): loss {got!r}, expected {want!r}")
        if not checked:
            unchecked.append(r["version"])

    batches = committed_batches(recs, seed, num_train)
    ref = train_reference_batches(model, seed, data, batches, lr=lr, momentum=momentum,
                                  weight_decay=weight_decay, probe=probe)
    assert not unchecked, f"no reported loss for any gradient of versions {unchecked}"
    return ref, wrong


@dataclass
class Member:
    """A hand-driven worker: joined, kept alive by heartbeats, with its first assignment."""

    client: ShardClients
    worker_id: int
    token: str
    params: np.ndarray
    assignment: P.Assignment | None
    heartbeat: Heartbeat
    dead: bool = False

    def die(self) -> None:
        """Go silent as a killed process would: no more heartbeats, no Leave on the way out."""
        self.heartbeat.stop()
        self.dead = True


@contextmanager
def joined_member(cfg: JobConfig, endpoint: str, name: str = "forger") -> Iterator[Member]:
    """Join as a worker (a member with a valid token) to send well-formed forged messages; it
    leaves and closes on the way out, unless it died (:meth:`Member.die`)."""
    me = ShardClients(zmq.Context.instance(), endpoint, timeout_s=30, connect_timeout_s=30, security=cfg.security)
    beat = None
    try:
        welcome = me.join(name, cfg.job_digest(), "cpu")
        wid, token = welcome.worker_id, me.token
        beat = Heartbeat(me.ctx, endpoint, wid, 0.2, security=cfg.security, token=token).start()
        params = np.zeros(welcome.num_params, np.float32)
        a = me.pull(params, worker_id=wid, min_version=welcome.version).assignment
        member = Member(me, wid, token, params, a, beat)
        yield member
        if not member.dead:
            me.send_to_coordinator(P.Leave(worker_id=wid, token=token, reason=f"{name} done"), P.Ack)
    finally:
        if beat is not None:
            beat.stop()
        me.close()


def small_checkpointing_job(tmp_path: Path, num_shards: int) -> JobConfig:
    """An MLP on synthetic data that checkpoints every iteration: for shards run in this process."""
    _, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256, "synthetic_test": 64},
        "training": {"global_batch": 32, "max_iterations": 5},
        "cluster": {"num_shards": num_shards, "num_workers": 1}, "evaluator": {"enabled": False},
        "checkpoint": {"every_iterations": 1},
    })
    return cfg


@contextmanager
def in_process_shard_0(cfg: JobConfig, run_dir: Path, **kw):
    """Shard 0 in this process, in a ZeroMQ context of its own (a closed server's ZAP handler
    leaves its inproc endpoint asynchronously, so a second server must not share it); closed
    with its authenticator afterwards."""
    from ps_common.security.authenticator import stop_authenticators
    from ps_server.server import ShardServer

    ctx = zmq.Context()
    server = ShardServer(cfg, 0, ctx=ctx, run_dir=run_dir, **kw)
    try:
        yield server
    finally:
        server.close()
        stop_authenticators(ctx)
        ctx.destroy(linger=0)
