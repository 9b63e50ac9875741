"""The worker's side of streamed answers over real sockets: two stand-in shards (ROUTER sockets
on loopback) answer a real ``ShardClients`` pull in parts, interleaved; one stops the job in the
middle of an answer; one forges a part of another version. Messages are well-formed throughout:
what is tested is whether the parts make up their answer."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.transport import Connection
from ps_worker.client import ShardClients

RANGES = [(0, 6), (6, 10)]
VALUES = np.arange(10, dtype=np.float32) + 0.5


@pytest.fixture
def shards():
    """Two ROUTER sockets and a ShardClients connected to them, as after a join."""
    ctx = zmq.Context()
    routers = []
    for _ in RANGES:
        r = ctx.socket(zmq.ROUTER)
        r.setsockopt(zmq.LINGER, 0)
        r.bind("tcp://127.0.0.1:*")
        routers.append(r)
    clients = ShardClients(ctx, "unused", timeout_s=5, connect_timeout_s=5)
    clients.conns = [Connection(ctx, r.getsockopt(zmq.LAST_ENDPOINT).decode(), role="worker", timeout_s=5)
                     for r in routers]
    clients.ranges = RANGES
    clients.token = "t"
    try:
        yield clients, routers
    finally:
        clients.close()
        for r in routers:
            r.close()
        ctx.term()


def asked(router: zmq.Socket) -> bytes:
    """The identity of the client whose Pull this stand-in shard received."""
    ident, *frames = router.recv_multipart()
    assert isinstance(P.decode(frames), P.Pull)
    return ident


def answer(k: int, cuts: list[int], **fields) -> list[P.Params]:
    """Shard k's answer with VALUES' slice, cut at the given offsets into its slice."""
    a, b = RANGES[k]
    bounds = [0, *cuts, b - a]
    head = {"shard": k, "version": 3, "log_hash": "h", **fields}
    return [P.Params(offset=lo, parts=len(bounds) - 1, arrays=[VALUES[a + lo:a + hi]], **head)
            for lo, hi in zip(bounds, bounds[1:])]


def send(router: zmq.Socket, ident: bytes, msg: P.Message) -> None:
    router.send_multipart([ident, *P.encode(msg)], copy=True)


def left_queued(clients: ShardClients) -> list[int]:
    """Shards whose connection still holds a message after a moment."""
    return [k for k, c in enumerate(clients.conns) if c.sock.poll(300)]


def test_answers_in_interleaved_parts_fill_the_parameters(shards):
    clients, routers = shards
    params = np.zeros(10, np.float32)
    for c in clients.conns:
        c.send(P.Pull(worker_id=0, token="t", min_version=3))
    idents = [asked(r) for r in routers]
    a0, a1 = answer(0, [2, 4]), answer(1, [1])
    for k, msg in [(0, a0[0]), (1, a1[0]), (0, a0[1]), (1, a1[1]), (0, a0[2])]:
        send(routers[k], idents[k], msg)
    res = clients._collect(params, worker_id=0, min_version=3, t0=0.0, consistent=True, abort=None,
                           honor_stop=True, exact=False)
    assert res.version == 3 and not res.stop
    np.testing.assert_array_equal(params, VALUES)
    assert left_queued(clients) == []


def test_a_stop_in_parts_leaves_no_part_queued(shards):
    """Shard 0 answers with the stop in three parts while shard 1's answer is half read: the
    worker returns at the stop and reads the rest of both, so no part can pass for a later answer."""
    clients, routers = shards
    params = np.zeros(10, np.float32)
    for c in clients.conns:
        c.send(P.Pull(worker_id=0, token="t", min_version=3))
    idents = [asked(r) for r in routers]
    a1 = answer(1, [1, 2])
    send(routers[1], idents[1], a1[0])

    def the_rest() -> None:  # once the worker has read shard 1's first part (it waits for more)
        time.sleep(0.3)
        for msg in answer(0, [2, 4], stop=True):
            send(routers[0], idents[0], msg)
        time.sleep(0.05)
        for msg in a1[1:]:
            send(routers[1], idents[1], msg)

    later = threading.Thread(target=the_rest)
    later.start()
    try:
        res = clients._collect(params, worker_id=0, min_version=3, t0=0.0, consistent=True, abort=None,
                               honor_stop=True, exact=False)
    finally:
        later.join()
    assert res.stop
    np.testing.assert_array_equal(params[6:7], VALUES[6:7])  # shard 1's first part was in place
    assert left_queued(clients) == []


@pytest.mark.parametrize("forged", ["other_version", "gap"])
def test_a_forged_part_is_a_protocol_error(shards, forged):
    clients, routers = shards
    params = np.zeros(10, np.float32)
    for c in clients.conns:
        c.send(P.Pull(worker_id=0, token="t", min_version=3))
    idents = [asked(r) for r in routers]
    for msg in answer(0, [3]):
        send(routers[0], idents[0], msg)
    a1 = answer(1, [1, 2])
    send(routers[1], idents[1], a1[0])
    if forged == "other_version":
        a1[1].version = 4
        send(routers[1], idents[1], a1[1])
    else:
        send(routers[1], idents[1], a1[2])
    with pytest.raises(P.ProtocolError, match="shard 1"):
        clients._collect(params, worker_id=0, min_version=3, t0=0.0, consistent=True, abort=None,
                         honor_stop=True, exact=False)
