"""Large answers are tracked until ZeroMQ has handed them to the kernel, so that the shard's
work that can wait (the next step's momentum decay) does not compete with their sending."""

from __future__ import annotations

import time

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_server.router import TRACK_BYTES, Limits, RouterLoop


@pytest.fixture
def pair():
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 10_000)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"hello")
    assert router.poll(10_000)
    ident, _ = router.recv_multipart()
    yield RouterLoop(router, {}, server="test", limits=Limits()), ident, dealer
    dealer.close()
    router.close()
    ctx.term()


def _params(nbytes: int) -> P.Params:
    return P.Params(shard=0, version=1, version_time=0.0, stop=False,
                    arrays=[np.ones(nbytes // 4, dtype=np.float32)])


def test_a_large_answer_is_sending_until_zeromq_has_handed_it_over(pair):
    loop, ident, dealer = pair
    assert loop.reply(ident, _params(128 * TRACK_BYTES))  # 128 MB: tens of ms over loopback
    assert loop.sending(), "ZeroMQ's I/O thread has only just been handed 128 MB"
    deadline = time.monotonic() + 30
    while loop.sending():    # the peer's I/O thread takes it in without the peer reading
        assert time.monotonic() < deadline, "still sending after 30 s"
        time.sleep(0.005)
    frames = dealer.recv_multipart(copy=False)
    assert P.decode(frames).arrays[0].size == 32 * TRACK_BYTES


def test_small_answers_are_not_tracked(pair):
    loop, ident, dealer = pair
    assert loop.reply(ident, _params(TRACK_BYTES // 2))
    assert not loop.sending()
    dealer.recv_multipart()
