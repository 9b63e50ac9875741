"""Hostile clients during a real, deterministic BSP run: the run ends by its own stop rule with
parameters bit-identical to a control run.

Three kinds of attacker, all during the run, all at once:

- **anonymous** clients and clients holding **another job's secret**: whatever they send,
  nothing reaches a handler (the handshake is refused), so nothing they could learn without a
  credential authorizes anything;
- an **insider with a worker's credential** but not the membership of any worker (a compromised
  or buggy worker host): a seeded generator sends well-formed forgeries of every message type
  (Hello then Shutdown and EvalReport, RegisterShard/Have/ShardSync posing as a shard, Clocks
  and Commit posing as shard 0's down link, Join with
  an empty or wrong digest, right-sized finite pushes to every shard with the ids of the real
  workers and huge batch sizes, pulls with and without worker ids, floods of pulls) plus
  malformed frames, pushes among them whose report has a field out of range, of the wrong type
  or unknown: at least 30,000 messages, every one refused by role, token, plan or bound
  checks, and answered.
"""

from __future__ import annotations

import random
import threading
import time
from collections import Counter

import msgpack
import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.metrics import read_jsonl
from ps_common.report import Telemetry
from ps_common.security.credentials import generate_master
from ps_common.security.settings import SecurityConfig
from ps_common.security.sockets import secure_client_socket
from tests.cluster_util import consistent_end, start_servers, start_workers, wait_exit, write_config

pytestmark = pytest.mark.system

INSIDER_MESSAGES = 30_000
JOB = {
    "run": {"name": "fuzz", "seed": 9},
    "model": {"name": "mlp"},
    "data": {"dataset": "synthetic", "synthetic_train": 512, "synthetic_test": 128},
    "training": {"global_batch": 64, "max_iterations": 1200, "finish_timeout_s": 10},
    "optimizer": {"lr": 0.05, "momentum": 0.9},
    "cluster": {"num_shards": 2, "num_workers": 2},
    "evaluator": {"enabled": False},
    # Generous: liveness must not depend on how fast forgeries are refused.
    "heartbeat": {"interval_s": 0.2, "timeout_s": 10.0},
}


def forgeries(rng: random.Random, sizes: list[int], digest: str):
    """A seeded stream of (kind, frames, shard) with well-formed forgeries of every type."""
    hdr = P.HEADER_PREFIX
    token = lambda: rng.randbytes(16).hex()  # noqa: E731
    while True:
        k = rng.randrange(len(sizes))
        n = sizes[k]
        kind = rng.choice(KINDS)
        if kind == "shutdown":
            msg = P.Shutdown(reason="pwned")
        elif kind == "eval_report":
            msg = P.EvalReport(version=rng.randrange(1000), accuracy=1.0, final=rng.random() < 0.5)
        elif kind == "register_shard":
            msg = P.RegisterShard(shard=rng.choice([0, 1, 5]), endpoint="tcp://10.0.0.66:1",
                                  job_digest=rng.choice(["", digest]), version=rng.randrange(5),
                                  resumed=rng.random() < 0.5, checkpoint_versions=[0, rng.randrange(400)],
                                  checkpoint_hashes=rng.choice([[], [token(), token()]]))
        elif kind == "claim_shard":
            msg = P.ClaimShard(job_digest=rng.choice(["", digest]), instance=token())
        elif kind == "have":
            msg = P.Have(shard=1, entries=[[rng.randrange(3), rng.randrange(400), 32]],
                         rollback_epoch=rng.choice([0, 2**62]))
        elif kind == "shard_sync":
            msg = P.ShardSync(shard=1, version=rng.randrange(400), entries=[[0, 1, 32]],
                              rollback_epoch=rng.choice([0, 2**62]))
        elif kind == "rollback":
            msg = P.Rollback(version=0, coordinator="tcp://10.0.0.66:1", log_hash=token(),
                             epoch=rng.choice([0, 2**62]))
        elif kind == "down_link":  # shard 0's down-link messages, posing as shard 0 to any shard's socket
            msg = rng.choice([P.Clocks(version=rng.randrange(400), slowest_clock=rng.choice([0, 2**62])),
                              P.Commit(version=rng.randrange(400), iteration=rng.randrange(400),
                                       entries=[[rng.randrange(3), 32]], slowest_clock=2**62)])
        elif kind == "join":
            msg = P.Join(name="intruder", instance=token(), job_digest=rng.choice(["", "0" * 16, digest[:-1] + "x"]))
        elif kind == "push":  # right size, finite, a real worker's id, a guessed token
            msg = P.Push(worker_id=rng.randrange(3), token=rng.choice(["", token()]),
                         iteration=rng.randrange(400), batch_size=rng.choice([1, 32, 10**9]),
                         loss=0.0, pull=rng.random() < 0.5,
                         telemetry=Telemetry(compute_s=0.01), arrays=[np.full(n, 0.5, np.float32)])
        elif kind == "out_of_memory":  # a real worker's id and iteration range, a guessed token
            msg = P.OutOfMemory(worker_id=rng.randrange(3), token=rng.choice(["", token()]),
                                iteration=rng.randrange(400), batch_size=rng.choice([1, 32, 10**9]))
        elif kind == "take_chunk":  # a real worker's id and iteration range, a guessed token
            msg = P.TakeChunk(worker_id=rng.randrange(3), token=rng.choice(["", token()]),
                              iteration=rng.randrange(400))
        elif kind == "pull":
            msg = P.Pull(worker_id=rng.choice([-1, 0, 1]), token=rng.choice(["", token()]),
                         min_version=rng.choice([0] + [10**9] * 9), exact=rng.random() < 0.3)
        elif kind == "heartbeat":
            msg = rng.choice([P.Heartbeat(worker_id=rng.randrange(3), token=token()),
                              P.Leave(worker_id=rng.randrange(3), token=token())])
        elif kind == "hello_status":
            msg = rng.choice([P.Hello(name="probe"), P.StatusRequest()])
        elif kind == "bad_report":  # a real worker's push but for one field of its report
            field, value = rng.choice(BAD_REPORT_FIELDS)
            yield kind, [hdr + msgpack.packb({"t": "push", "worker_id": rng.randrange(3), "token": token(),
                                              "iteration": rng.randrange(400), "batch_size": 32,
                                              "telemetry": {"compute_s": 0.01, field: value},
                                              "arrays": [["<f4", [n]]]}), bytes(4 * n)], k
            continue
        elif kind == "malformed":
            yield kind, rng.choice([
                [rng.randbytes(rng.randrange(0, 64))],
                [hdr + rng.randbytes(rng.randrange(0, 40))],
                [b"LBPS" + bytes([rng.randrange(3, 255)]) + msgpack.packb({"t": "pull"})],
                [hdr + msgpack.packb({"t": "push", "arrays": [["<f4", [2**40]]]}), b"\0" * 16],
                [hdr + msgpack.packb({"t": "push", "arrays": [["<f4", [n]]]})],
                [*P.encode(P.Hello()), b"x", b"y", b"z", b"w"],
                P.encode(P.Push(worker_id=0, arrays=[np.full(n + 1, np.nan, np.float32)])),
            ]), k
            continue
        yield kind, P.encode(msg), k


KINDS = ["shutdown", "eval_report", "claim_shard", "register_shard", "have", "shard_sync", "rollback", "down_link",
         "join", "push",
         "out_of_memory", "take_chunk", "pull", "heartbeat", "hello_status", "malformed", "bad_report"]
#: Report fields a forged push gets wrong: not finite, negative, out of range, wrong type, unknown.
BAD_REPORT_FIELDS = [("compute_s", float("nan")), ("data_s", -1.0), ("finish_s", float("inf")),
                     ("host_cpu", 1e9), ("mem_headroom_mb", -0.5), ("burners", 0.5), ("oom", 1),
                     ("prev_wait_s", "slow"), ("samples_per_s", 1.0), ("cpu_s", -1.0),
                     ("compute_cpu_s", float("nan")), ("cpu_quota", 1e9)]


def _dealer(ctx, endpoint: str, security: SecurityConfig | None, role: str = "worker") -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 1000)
    secure_client_socket(s, security, role)
    s.connect(endpoint)
    return s


def attack(endpoints: list[str], sizes: list[int], digest: str, insider: SecurityConfig,
           stranger: SecurityConfig, stop: threading.Event, stats: dict, alive) -> None:
    ctx = zmq.Context.instance()
    inside = [_dealer(ctx, ep, insider) for ep in endpoints for _ in range(2)]
    outside = ([_dealer(ctx, ep, None) for ep in endpoints]
               + [_dealer(ctx, ep, stranger, role) for ep in endpoints for role in ("operator", "shard")])
    gen = forgeries(random.Random(1234), sizes, digest)
    sent: Counter[str] = stats["sent"]
    codes: Counter[str] = stats["codes"]
    try:
        i = 0
        while not stop.is_set() and (sum(sent.values()) < INSIDER_MESSAGES or i < INSIDER_MESSAGES):
            kind, frames, k = next(gen)
            sock = inside[2 * k + (i & 1)]
            try:
                sock.send_multipart(frames, zmq.NOBLOCK)
                sent[kind] += 1
            except zmq.Again:
                stats["insider_backpressure"] += 1
            if i % 10 == 0:  # the outsiders try the same messages; nothing can get through
                o = outside[i % len(outside)]
                try:
                    o.send_multipart(frames, zmq.NOBLOCK)
                    stats["outsider_queued"] += 1
                except zmq.Again:
                    stats["outsider_blocked"] += 1
            for s in inside:
                while s.poll(0):
                    reply = P.decode(s.recv_multipart())
                    codes[reply.code if isinstance(reply, P.Error) else reply.TYPE] += 1
            for s in outside:
                while s.poll(0):
                    s.recv_multipart()
                    stats["outsider_answered"] += 1
            i += 1
            if i % 2000 == 0:
                if not alive():
                    break  # the job ended first: the test then fails on the count
                stop.wait(0.01)  # let the real workers breathe now and then
    finally:
        for s in inside + outside:
            s.close(linger=0)


def run_job(procs, tmp_path, name: str, hostile: bool):
    (tmp_path / name).mkdir()
    cfg_path, cfg = write_config(tmp_path / name, JOB)
    run = tmp_path / name / "run"
    eps = start_servers(procs, cfg_path, 2, run)
    from ps_server.layout import partition
    from ps_server.server import initial_parameters

    sizes = [b - a for a, b in partition(initial_parameters(cfg).size, 2)]
    stats = {"sent": Counter(), "codes": Counter(), "insider_backpressure": 0, "outsider_queued": 0,
             "outsider_blocked": 0, "outsider_answered": 0}
    stop = threading.Event()
    if hostile:
        # The insider holds a worker's role file of this job; the stranger another job's master.
        from ps_common.security.credentials import load_secret, write_role_secret

        write_role_secret(tmp_path / name / "insider.secret", load_secret(cfg.security.secret_file), "worker")
        generate_master(tmp_path / name / "stranger.secret")
        insider = SecurityConfig(secret_file=str(tmp_path / name / "insider.secret"))
        stranger = SecurityConfig(secret_file=str(tmp_path / name / "stranger.secret"))
        shard0 = [c for c in procs.children if c.role == "shard-0"][-1]  # this run's
        t = threading.Thread(target=attack, args=(eps, sizes, cfg.job_digest(), insider, stranger, stop, stats,
                                                  lambda: shard0.proc.poll() is None))
        t.start()
    workers = start_workers(procs, cfg_path, eps[0], 2, run)
    if hostile:
        # Meanwhile the operator's status requests must still be answered, promptly.
        from ps_common.transport import Connection

        op = Connection(zmq.Context.instance(), eps[0], role="operator", timeout_s=10, security=cfg.security)
        latencies = []
        try:
            while t.is_alive():
                t0 = time.monotonic()
                op.request(P.StatusRequest(), P.Status)
                latencies.append(time.monotonic() - t0)
                time.sleep(0.25)
        except Exception as exc:  # the job may end between the check and the request
            if shard0.proc.poll() is None:
                raise AssertionError(f"shard 0 stopped answering the operator under attack: {exc}") from exc
        finally:
            op.close()
        stats["status_latency_s"] = latencies
        t.join(600)
    wait_exit(workers, timeout_s=600)
    stop.set()
    wait_exit([c for c in procs.children if c.role.startswith("shard")], timeout_s=60)
    params, version = consistent_end(run, 2)
    return params, version, stats


def stall_evidence(procs, run) -> str:
    """What shard 0 and the workers said about a stalled pull: the clues to keep from a run
    that showed the stall (it has only been seen in full-suite runs)."""
    lines = []
    for child in procs.children:
        if child.role in ("shard-0", "worker-0", "worker-1"):
            text = child.log_path.read_text(errors="replace").splitlines()
            lines += [f"{child.role}: {ln[-300:]}" for ln in text
                      if any(k in ln for k in ("has waited", "joined", "no parameters", "Timeout", "rejoin"))][:12]
    ends = [r for r in read_jsonl(run / "metrics" / "shard-0.jsonl") if r.get("event") == "shutdown"]
    dropped = {k: v for k, v in (ends[-1]["counters"] if ends else {}).items() if "dropped" in k or "pull" in k}
    return f"shard-0 counters {dropped}; log lines: " + " | ".join(lines)


@pytest.mark.timeout(900)
def test_hostile_clients_change_nothing(procs, tmp_path):
    control, v0, _ = run_job(procs, tmp_path, "control", False)
    fuzzed, v1, stats = run_job(procs, tmp_path, "hostile", True)
    sent = stats["sent"]
    total = sum(sent.values())
    print(f"\ninsider (worker credential) messages by type: {dict(sorted(sent.items()))} = {total}")
    print(f"answers by code: {dict(sorted(stats['codes'].items()))}")
    print(f"outsiders: {stats['outsider_queued']} queued, {stats['outsider_blocked']} blocked, "
          f"{stats['outsider_answered']} answered")
    assert total >= INSIDER_MESSAGES, stats
    assert set(sent) == set(KINDS)
    assert v0 == v1 == JOB["training"]["max_iterations"]
    assert stats["outsider_answered"] == 0, "a client without this job's credentials got an answer"
    lat = stats["status_latency_s"]
    print(f"operator status under attack: {len(lat)} requests, max {max(lat) * 1e3:.1f} ms")
    assert lat and max(lat) < 5.0
    codes = stats["codes"]
    assert codes["forbidden"] > 0 and codes["unauthorized"] > 0 and codes["config_mismatch"] > 0
    assert codes["malformed"] > 0 and codes["hello_reply"] + codes["status"] > 0
    assert "ack" not in codes, "no forged Shutdown, EvalReport, Leave or Rollback may be acknowledged"
    assert "welcome" not in codes and "registered" not in codes and "reassignment" not in codes
    assert "shard_claimed" not in codes
    rejoined = [r for r in read_jsonl(tmp_path / "hostile" / "run" / "metrics" / "coordinator.jsonl")
                if r.get("event") == "worker_removed"]
    # Strict again since the stall's cause (a follower refusing a push whose plan had not arrived
    # yet) is fixed; a failure carries what shard 0 and the workers said about waiting pulls.
    assert np.array_equal(control, fuzzed), (
        f"hostile clients changed the parameters: max diff {np.abs(control - fuzzed).max():.3e}; "
        f"removals {[r['reason'] for r in rejoined]}; {stall_evidence(procs, tmp_path / 'hostile' / 'run')}")
