"""send_frames / recv_all: pyzmq's multipart send and receive without its per-call overhead,
with the same results, and the same refusal of a frame that is not a buffer."""

from __future__ import annotations

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.transport import recv_all, send_frames


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    for s in (a, b):
        s.setsockopt(zmq.LINGER, 0)
    a.bind("inproc://frames")
    b.connect("inproc://frames")
    yield a, b
    a.close()
    b.close()
    ctx.term()


def test_a_message_arrives_whole_zero_copy_frames_included(pair):
    a, b = pair
    grad = np.arange(100_000, dtype=np.float32)          # above pyzmq's copy threshold
    msg = P.Push(worker_id=3, token="t", iteration=7, batch_size=64, pull=True, arrays=[grad])
    frames = P.encode(msg)
    send_frames(a, [b"ident", *frames])
    got = recv_all(b, zmq.NOBLOCK)
    assert [bytes(f.buffer) for f in got] == [b"ident", *(bytes(memoryview(f)) for f in frames)]
    back = P.decode(got[1:])
    assert isinstance(back, P.Push) and back.iteration == 7
    np.testing.assert_array_equal(back.arrays[0], grad)
    send_frames(a, [zmq.Frame(b"one")], zmq.NOBLOCK)     # a single frame, flags as given
    assert [f.bytes for f in recv_all(b)] == [b"one"]


def test_other_buffers_take_pyzmqs_path_and_a_non_buffer_sends_nothing(pair):
    a, b = pair
    send_frames(a, [b"x", np.ones(3, dtype=np.float32), bytearray(b"y")])
    got = recv_all(b)
    assert [bytes(f.buffer) for f in got] == [b"x", np.ones(3, dtype=np.float32).tobytes(), b"y"]
    with pytest.raises(TypeError):
        send_frames(a, [b"first", object()])
    send_frames(a, [b"next"])                             # no half-sent message in front of it
    assert [f.bytes for f in recv_all(b)] == [b"next"]
    with pytest.raises(zmq.Again):
        recv_all(b, zmq.NOBLOCK)
