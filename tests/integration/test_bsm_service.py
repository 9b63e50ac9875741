"""ps-bsm: the batch-size manager served over the protocol (real sockets on loopback, the service
in a thread). Its command line: tests/unit/test_bsm_service_args.py; as its own process:
tests/system/test_bsm_service_cli.py."""

from __future__ import annotations

import math
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import zmq

from batchsize_manager import BatchSizeManager, WorkerReport
from ps_common import protocol as P
from ps_common.report import Telemetry
from ps_common.security.settings import SecurityConfig
from ps_common.transport import recv_frames
from ps_server.bsm_client import BatchSizeClient, RemoteError, TransportTimeout
from ps_server.bsm_service import BatchSizeService

X = 512
SPEED = {0: 1000.0, 1: 1000.0, 2: 1000.0 / 3}   # worker 2 is 3x slower (samples/s)


@pytest.fixture
def service():
    """Start services in threads with ``service(manager)``; every one is stopped afterwards."""
    started: list[tuple[BatchSizeService, object]] = []

    def start(manager: BatchSizeManager | None = None, **kw) -> BatchSizeService:
        m = manager or BatchSizeManager("lbbsp-cpu", X, policy_args={"predictor": "ema"})
        svc = BatchSizeService(m, poll_s=0.05, **kw)
        started.append((svc, svc.start()))
        return svc

    yield start
    for svc, thread in started:
        svc.stop()
        thread.join(timeout=5)
        assert not thread.is_alive(), "ps-bsm thread did not stop"


def run_iterations(c: BatchSizeClient, n: int, first: int = 0) -> dict[int, int]:
    for it in range(first, first + n):
        sizes = c.assign()
        assert sum(sizes.values()) == X
        for w, x in sizes.items():
            c.report(w, it, x, Telemetry(compute_s=x / SPEED[w], iteration_s=x / SPEED[w] + 0.002,
                                         data_s=0.001, prev_push_s=0.0005))
    return c.assign()


@pytest.mark.timeout(20)
def test_join_assign_rebalance_leave(service):
    svc = service()
    with BatchSizeClient(svc.endpoint, timeout_s=5) as c:
        for w in range(3):
            c.join(w)
        old_token = c.tokens[1]
        c.join(1)                                     # joining again is a restart: a new token
        assert c.tokens[1] != old_token
        first = c.assign()
        assert sorted(first) == [0, 1, 2] and sum(first.values()) == X
        assert max(first.values()) - min(first.values()) <= 1   # cold start: uniform
        assert c.last_decision_s >= 0

        sizes = run_iterations(c, 5, first=1)
        assert sum(sizes.values()) == X
        assert sizes[2] < 0.6 * min(sizes[0], sizes[1]), sizes   # ~73 vs ~220
        assert abs(sizes[0] - sizes[1]) <= 2

        st = c.stats(include_state=True)
        assert st["policy"] == "lbbsp-cpu" and st["global_batch"] == X and st["live"] == [0, 1, 2]
        assert st["reports"] == 15 and st["ignored_reports"] == 0 and st["rejoins"] == 1
        assert st["decisions"] == 7 and st["last_assignment"] == sizes
        assert 0 <= st["last_decision_s"] < 1 and st["mean_decision_s"] > 0
        assert st["state"]["live"] == [0, 1, 2] and st["state"]["policy"] == "lbbsp-cpu"
        assert "state" not in c.stats()

        c.leave(2)
        c.leave(2)                                    # unknown/departed ids are acknowledged
        after = c.assign()
        assert sorted(after) == [0, 1] and sum(after.values()) == X
        assert abs(after[0] - after[1]) <= 2          # equal speeds: an even split again


@pytest.mark.timeout(20)
def test_bad_input_gets_errors_and_the_service_keeps_working(service):
    svc = service()
    with BatchSizeClient(svc.endpoint, timeout_s=5) as c:
        with pytest.raises(RemoteError) as e:
            c.assign()
        assert e.value.code == "no_workers"
        c.join(0)
        c.join(1)
        c.assign()
        before = c.stats(include_state=True)

        ok = Telemetry(compute_s=0.1)
        bad_reports = [
            ((7, 0, 10, ok), "unknown_worker"),
            ((-1, 0, 10, ok), "bad_request"),
            ((0, -3, 10, ok), "bad_request"),
            ((0, 0, -10, ok), "bad_request"),
            ((0, 0, X + 1, ok), "bad_request"),       # no worker's share exceeds X
            # fields of the report itself: refused by the protocol's decode, like any bad field
            ((0, 0, 10, Telemetry(compute_s=-0.1)), "malformed"),
            ((0, 0, 10, Telemetry(compute_s=math.nan)), "malformed"),
            ((0, 0, 10, Telemetry(compute_s=0.1, iteration_s=math.inf)), "malformed"),
            ((0, 0, 10, Telemetry(compute_s=0.1, data_s=math.nan)), "malformed"),
        ]
        for args, code in bad_reports:
            with pytest.raises(RemoteError) as e:
                c.report(*args)
            assert e.value.code == code, args
        for call in (c.join, c.leave):
            with pytest.raises(RemoteError) as e:
                call(-5)
            assert e.value.code == "bad_request"
        after = c.stats(include_state=True)
        for key in ("live", "reports", "ignored_reports", "decisions", "state", "last_assignment"):
            assert after[key] == before[key], key       # refused requests changed nothing
        assert after["errors_sent"] == before["errors_sent"] + len(bad_reports) + 2

    # Raw frames from a plain DEALER: garbage, bad msgpack, wrong types, unknown and foreign kinds.
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(svc.endpoint)
    try:
        hostile = [
            ([b"garbage"], "malformed"),
            ([b""], "malformed"),
            ([P.HEADER_PREFIX + b"\xc1\xc1"], "malformed"),             # not msgpack
            ([b"LBPS\x09" + b"\x80"], "malformed"),                     # wrong version
            (P.encode(P.BsmJoin(worker_id="x")), "malformed"),          # type from the schema
            (P.encode(P.BsmReport(worker_id=0, telemetry=Telemetry(compute_s="fast"))), "malformed"),
            ([P.HEADER_PREFIX + msgpack.packb({"t": "bsm_report", "worker_id": 0,
                                               "telemetry": {"samples_per_s": 1.0}})], "malformed"),
            ([*P.encode(P.BsmAssign()), b"extra frame"], "malformed"),  # no arrays allowed
            (P.encode(P.Hello(name="probe")), "unsupported"),           # valid, not for us
            (P.encode(P.Error(code="x")), "unsupported"),
        ]
        for frames, code in hostile:
            sock.send_multipart(frames)
            reply = recv_frames(sock, 5.0)
            assert reply is not None, f"no reply to {frames!r}"
            msg = P.decode(reply)
            assert isinstance(msg, P.Error) and msg.code == code, (frames, msg)
    finally:
        sock.close(linger=0)

    with BatchSizeClient(svc.endpoint, timeout_s=5) as c:
        sizes = c.assign()
        assert sorted(sizes) == [0, 1] and sum(sizes.values()) == X
        st = c.stats()
        assert st["malformed"] == 12   # 4 reports with bad fields, 8 hostile frames
        assert svc.malformed == 12


@pytest.mark.timeout(20)
def test_join_is_bounded_and_infeasible_splits_are_errors(service):
    svc = service(BatchSizeManager("uniform", 8, min_batch=4, max_batch=4))
    with BatchSizeClient(svc.endpoint, timeout_s=5) as c:
        c.join(0)
        with pytest.raises(RemoteError) as e:
            c.assign()                                  # one worker capped at 4 cannot take 8
        assert e.value.code == "infeasible"
        c.join(1)
        assert c.assign() == {0: 4, 1: 4}
        with pytest.raises(RemoteError) as e:
            c.join(2)                                   # X // min_batch = 2 workers at most
        assert e.value.code == "too_many_workers"
        assert c.stats()["live"] == [0, 1]


@pytest.mark.timeout(20)
def test_client_observe_accepts_worker_reports_and_times_out(service):
    svc = service()
    with BatchSizeClient(svc.endpoint, timeout_s=5) as c:
        c.join(3)
        c.observe(WorkerReport(worker_id=3, iteration=0, batch_size=X,
                               telemetry=Telemetry(compute_s=0.5, iteration_s=0.6)))
        assert c.stats()["reports"] == 1
    with BatchSizeClient("tcp://127.0.0.1:9", timeout_s=0.3) as dead:   # nothing listens there
        with pytest.raises(TransportTimeout):
            dead.assign()
    with pytest.raises(RuntimeError, match="closed"):
        c.assign()


@contextmanager
def curve_service(key_dir: Path, **kw: Any) -> Iterator[tuple[BatchSizeService, SecurityConfig, zmq.Context]]:
    """A ``uniform`` service under CURVE with a single-host key set (one key per role), in a
    thread with a context and authenticator of its own; stopped and checked afterwards."""
    if not zmq.has("curve"):
        pytest.skip("libzmq without CURVE")
    from ps_common.security.authenticator import stop_authenticators
    from ps_common.security.settings import init_local_keys

    sec = init_local_keys(key_dir)
    ctx = zmq.Context()
    svc = BatchSizeService(BatchSizeManager("uniform", X), ctx=ctx, security=sec, poll_s=0.05, **kw)
    thread = svc.start()
    try:
        yield svc, sec, ctx
    finally:
        svc.stop()
        thread.join(timeout=5)
        stop_authenticators(ctx)
        ctx.term()
    assert not thread.is_alive()


@pytest.mark.timeout(20)
def test_curve_clients_must_be_allowed(tmp_path):
    with curve_service(tmp_path / "keys") as (svc, sec, ctx):
        with BatchSizeClient(svc.endpoint, timeout_s=5, security=sec, ctx=ctx) as c:
            c.join(0)
            assert c.assign() == {0: X}
        with BatchSizeClient(svc.endpoint, timeout_s=0.5, ctx=ctx) as plain:
            with pytest.raises(TransportTimeout):
                plain.join(1)


@pytest.mark.timeout(20)
def test_the_operator_may_evict_a_worker_without_its_token_and_a_worker_may_not(tmp_path):
    with curve_service(tmp_path / "keys") as (svc, sec, ctx):
        with BatchSizeClient(svc.endpoint, timeout_s=5, security=sec, ctx=ctx) as worker, \
                BatchSizeClient(svc.endpoint, timeout_s=5, security=sec, ctx=ctx) as other, \
                BatchSizeClient(svc.endpoint, timeout_s=5, security=sec, ctx=ctx, role="operator") as op:
            worker.join(0)
            worker.join(1)
            with pytest.raises(RemoteError) as e:
                other.leave(0)                         # the worker role needs the token
            assert e.value.code == "bad_token"
            assert worker.stats()["live"] == [0, 1]
            op.leave(0)                                # an operator evicts a worker that died
            assert worker.assign() == {1: X}


def test_an_iteration_of_many_buckets_loses_no_answer(service):
    """Each rank sends all its buckets and reads the answers only after the last one (as DDP's
    hook does): with more buckets than a socket's default high-water marks (100 each side) the
    service must queue their answers, not drop them."""
    import threading

    import torch

    from batchsize_manager.integrations.ddp_server_exchange import ServerExchange

    n_buckets = 700
    svc = service(BatchSizeManager("uniform", 64), world_size=2)
    got: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        ex = ServerExchange(svc.endpoint, r, timeout_s=20.0)
        try:
            sizes = ex.open(0)
            tensors = [torch.full((16384,), float(r + b)) for b in range(n_buckets)]  # 64 KB each
            futures = [ex.submit(t, b, b == n_buckets - 1, sizes[r], Telemetry(compute_s=0.01))
                       for b, t in enumerate(tensors)]
            got[r] = [float(f.wait()[0]) for f in futures]
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            ex.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    want = [b + 0.5 for b in range(n_buckets)]     # the mean of r + b over ranks 0 and 1
    assert got == {0: want, 1: want}
    assert svc.router.counters["replies_dropped.hwm"] == 0
