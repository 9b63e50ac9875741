"""Hostile input during a real run: thousands of malformed and random messages to every shard.

The servers must keep serving, and because BSP here is deterministic (fixed seeds, gradients
summed in worker-id order), the fuzzed run must end with exactly the parameters of a control
run with the same seed and no fuzzing. Forged messages with valid credentials (a real worker's
id and token, a shard's control token) are CURVE's job, not validation's; the fuzzer only
uses identities it could guess.
"""

from __future__ import annotations

import random
import threading


import msgpack
import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from tests.cluster_util import pull_params, start_servers, start_workers, status, wait_exit, write_config

pytestmark = pytest.mark.system

JOB = {
    "run": {"name": "fuzz", "seed": 9},
    "model": {"name": "mlp"},
    "data": {"dataset": "synthetic", "synthetic_train": 512, "synthetic_test": 128},
    "training": {"global_batch": 64, "max_iterations": 300},
    "optimizer": {"lr": 0.05, "momentum": 0.9},
    "cluster": {"num_shards": 2, "num_workers": 2},
    "evaluator": {"enabled": False},
}


def hostile_messages(rng: random.Random, sizes: list[int]):
    """A seeded stream of malformed, random and invalid-but-well-formed messages."""
    hdr = P.HEADER_PREFIX
    while True:
        kind = rng.randrange(12)
        n = rng.choice(sizes)
        if kind == 0:
            yield [rng.randbytes(rng.randrange(0, 64)) for _ in range(rng.randrange(1, 4))]
        elif kind == 1:
            yield [hdr + rng.randbytes(rng.randrange(0, 40))]
        elif kind == 2:
            yield [b"LBPS" + bytes([rng.randrange(2, 255)]) + msgpack.packb({"t": "pull"})]
        elif kind == 3:
            t = rng.choice(list(P.MESSAGE_TYPES))
            yield [hdr + msgpack.packb({"t": t, rng.choice(["worker_id", "iteration", "x"]): rng.choice(
                ["str", -1.5, [1, 2], {"a": 1}, None, True, 2**63, -(2**63)])}, use_bin_type=True)]
        elif kind == 4:  # push with a wrong size
            g = np.ones(n + rng.choice([-1, 1, 7]), np.float32)
            yield P.encode(P.Push(worker_id=1000 + rng.randrange(100), batch_size=8, expected_workers=2,
                                  global_batch=64, arrays=[g]))
        elif kind == 5:  # NaN / Inf gradient from an unknown worker
            g = np.full(n, rng.choice([np.nan, np.inf, -np.inf]), np.float32)
            yield P.encode(P.Push(worker_id=1000 + rng.randrange(100), batch_size=8, expected_workers=2,
                                  global_batch=64, arrays=[g]))
        elif kind == 6:  # array frame missing / header lies about arrays
            yield [hdr + msgpack.packb({"t": "push", "arrays": [["<f4", [n]]]})]
        elif kind == 7:  # forged control messages without the shard's token
            yield P.encode(rng.choice([P.Commit(iteration=rng.randrange(100), workers=[1000], batch_sizes=[64]),
                                       P.Rollback(version=0), P.CheckpointAt(version=3)]))
        elif kind == 8:  # shutdown / eval report / leave / heartbeat without credentials
            yield P.encode(rng.choice([P.Shutdown(reason="x"), P.EvalReport(accuracy=1.0),
                                       P.Leave(worker_id=rng.randrange(4)),
                                       P.Heartbeat(worker_id=rng.randrange(4))]))
        elif kind == 9:  # join with a wrong config digest
            yield P.encode(P.Join(name="intruder", job_digest="0" * 16))
        elif kind == 10:  # oversized array spec
            yield [hdr + msgpack.packb({"t": "push", "arrays": [["<f4", [2**40]]]}), b"\0" * 16]
        else:  # a harmless observer pull and a status request: must be answered normally
            yield P.encode(rng.choice([P.StatusRequest(), P.Hello(role="fuzz")]))


def fuzz(endpoints: list[str], sizes: list[int], count: int, stop: threading.Event, stats: dict) -> None:
    ctx = zmq.Context.instance()
    socks = []
    for ep in endpoints:
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDTIMEO, 1000)
        s.connect(ep)
        socks.append(s)
    gen = hostile_messages(random.Random(1234), sizes)
    try:
        for i in range(count):
            if stop.is_set():
                break
            sock = socks[i % len(socks)]
            sock.send_multipart(next(gen))
            stats["sent"] += 1
            while sock.poll(0):
                sock.recv_multipart()
                stats["replies"] += 1
            stop.wait(0.001)  # spread the attack over the whole run
    finally:
        for s in socks:
            s.close(linger=0)


def run_job(procs, tmp_path, name, fuzz_count):
    (tmp_path / name).mkdir()
    cfg_path, cfg = write_config(tmp_path / name, JOB)
    run = tmp_path / name / "run"
    eps = start_servers(procs, cfg_path, 2, run)
    from ps_common.layout import partition
    from ps_server.server import initial_parameters

    sizes = [b - a for a, b in partition(initial_parameters(cfg).size, 2)]
    stats = {"sent": 0, "replies": 0}
    stop = threading.Event()
    fuzzer = threading.Thread(target=fuzz, args=(eps, sizes, fuzz_count, stop, stats))
    if fuzz_count:
        fuzzer.start()
    wait_exit(start_workers(procs, cfg_path, eps[0], 2, run), timeout_s=300)
    stop.set()
    if fuzz_count:
        fuzzer.join(30)
    st = status(eps[0])
    params, version = pull_params(cfg, eps[0])
    return params, version, st, stats


def test_fuzzed_run_matches_control_run(procs, tmp_path):
    control, v0, _, _ = run_job(procs, tmp_path, "control", 0)
    fuzzed, v1, st, stats = run_job(procs, tmp_path, "fuzzed", 4000)
    assert stats["sent"] >= 2000, stats
    assert stats["replies"] > 0
    assert v0 == v1 == 300 and st.stop
    assert np.array_equal(control, fuzzed), (
        f"fuzzing changed the parameters: max diff {np.abs(control - fuzzed).max():.3e}")
    print(f"fuzz: sent {stats['sent']} hostile messages, {stats['replies']} error/normal replies")
