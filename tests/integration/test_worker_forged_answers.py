"""A real worker against stand-in shards (ROUTER sockets on loopback, no credentials) that answer
with well-formed messages a correct server never sends: an assignment outside the dataset, a
layout of shard slices that does not tile the model. The worker refuses them with a clear
``ProtocolError`` and says goodbye, instead of training on wrapped-around samples, loading
parameters nobody sent, or ending with a traceback while the barrier waits for its heartbeat.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.config import load_config
from ps_worker.worker import Worker

N_TRAIN = 512
pytestmark = pytest.mark.timeout(60)


class _StandInShard(threading.Thread):
    def __init__(self, ctx: zmq.Context, answer: Callable[[P.Message], list[P.Message]]) -> None:
        super().__init__(daemon=True)
        self.answer = answer
        self.received: list[P.Message] = []
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self.stop = threading.Event()

    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            if not poller.poll(50):
                continue
            ident, *frames = self.sock.recv_multipart()
            msg = P.decode(frames)
            self.received.append(msg)
            for out in self.answer(msg):
                self.sock.send_multipart([ident, *P.encode(out)])
        self.sock.close()


def _run(assignment: P.Assignment | None, ranges_of: Callable[[int], list[list[int]]],
         answer_push_at: int | None = None, push_assignment: P.Assignment | None = None) -> tuple[Any, list]:
    cfg = load_config(None, ["model.name=mlp", "data.dataset=synthetic", f"data.synthetic_train={N_TRAIN}",
                             "cluster.num_shards=2", "evaluator.enabled=false", "transport.timeout_s=4"], env={})
    worker = Worker(cfg, "", name="w")
    n = worker.flat.numel
    ranges = ranges_of(n)
    ctx = zmq.Context()
    shards: list[_StandInShard] = []

    def answer(k: int) -> Callable[[P.Message], list[P.Message]]:
        def reply(msg: P.Message) -> list[P.Message]:
            if isinstance(msg, P.Join):
                return [P.Welcome(worker_id=0, shard_endpoints=[s.endpoint for s in shards],
                                  shard_ranges=ranges, num_params=n, token="t")]
            if isinstance(msg, P.Heartbeat):
                return [P.HeartbeatReply(incarnation="i")]
            if isinstance(msg, P.Leave):
                return [P.Ack()]
            lo, hi = ranges[k]
            if isinstance(msg, P.Pull):
                return [P.Params(shard=k, version=0, log_hash="h", assignment=assignment if k == 0 else None,
                                 arrays=[np.zeros(hi - lo, np.float32)])]
            if isinstance(msg, P.Push) and answer_push_at is not None:   # no stop: version as given
                return [P.Params(shard=k, version=answer_push_at, log_hash="h",
                                 assignment=push_assignment if k == 0 else None,
                                 arrays=[np.zeros(hi - lo, np.float32)])]
            if isinstance(msg, P.Push):          # a worker that trained after all: stop it
                return [P.Params(shard=k, version=1, log_hash="h", stop=True,
                                 arrays=[np.zeros(hi - lo, np.float32)])]
            return []
        return reply

    shards.extend(_StandInShard(ctx, answer(k)) for k in range(2))
    for s in shards:
        s.start()
    worker.client.server = shards[0].endpoint
    try:
        with pytest.raises(P.ProtocolError) as err:
            worker.run()
    finally:
        for s in shards:
            s.stop.set()
            s.join(5)
        ctx.term()
    return err.value, shards[0].received


@pytest.mark.parametrize("ranges, size", [
    ([[0, -4, N_TRAIN]], 4),          # a negative start: numpy would wrap around to other samples
    ([[0, N_TRAIN - 4, N_TRAIN + 6]], 10),   # past the end: 4 samples for a batch of 10
    ([], 0),                           # nothing at all
])
def test_an_assignment_outside_the_dataset_is_refused_and_the_worker_says_goodbye(ranges, size):
    err, received = _run(P.Assignment(iteration=0, batch_size=size, ranges=ranges, global_batch=max(size, 1)),
                         lambda n: [[0, n // 2], [n // 2, n]])
    assert "assignment" in str(err)
    leaves = [m for m in received if isinstance(m, P.Leave)]
    assert len(leaves) == 1 and "ProtocolError" in leaves[0].reason
    assert not any(isinstance(m, P.Push) for m in received), "nothing was trained on"


def test_shard_slices_that_leave_parameters_out_are_refused_at_the_join():
    err, received = _run(None, lambda n: [[0, n // 2], [n // 2, n - 42]])
    assert "do not tile" in str(err)
    assert not any(isinstance(m, P.Pull) for m in received)
    assert [type(m) for m in received if isinstance(m, (P.Join, P.Leave))] == [P.Join, P.Leave], \
        "a member already: it says goodbye"


def test_an_answer_of_an_older_version_than_the_push_asked_for_is_refused():
    """Found by a review: the answer to a push of iteration 0 must be version 1 or later (or the
    stop); stand-in shards that answer with version 0 again (a forger on a shard's address, a
    server bug) were taken as the answer, and the worker trained iteration 1 on the parameters of
    version 0. Now a ``ProtocolError``, and a goodbye."""
    err, received = _run(P.Assignment(iteration=0, batch_size=8, ranges=[[0, 0, 8]], global_batch=8),
                         lambda n: [[0, n // 2], [n // 2, n]], answer_push_at=0)
    assert "answered version 0 to a pull of version 1 or later" in str(err)
    assert sum(isinstance(m, P.Push) for m in received) == 1, "no second iteration trained"
    leaves = [m for m in received if isinstance(m, P.Leave)]
    assert len(leaves) == 1 and "ProtocolError" in leaves[0].reason


def test_a_repeat_of_an_earlier_assignment_is_refused():
    """Round modes: shard 0 hands out the assignment of the version it answers with. An answer
    of version 1 that repeats iteration 0's assignment (a forger on shard 0's address, a server
    bug) was taken, and the worker computed iteration 0 again on version 1's parameters (its
    push then refused). Now a ``ProtocolError``, and a goodbye."""
    first = P.Assignment(iteration=0, batch_size=8, ranges=[[0, 0, 8]], global_batch=8)
    err, received = _run(first, lambda n: [[0, n // 2], [n // 2, n]], answer_push_at=1, push_assignment=first)
    assert "answered version 1 with an assignment for iteration 0" in str(err)
    assert sum(isinstance(m, P.Push) for m in received) == 1, "the repeat was not computed"
    leaves = [m for m in received if isinstance(m, P.Leave)]
    assert len(leaves) == 1 and "ProtocolError" in leaves[0].reason
