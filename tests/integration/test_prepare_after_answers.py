"""A shard does the next step's gradient-free part (the momentum's decay) once its answers have
left, not while ZeroMQ still sends them (on a busy host it would slow them), and at the latest
after PREPARE_WAIT_S (a peer that does not read must not keep it waiting)."""

from __future__ import annotations

import numpy as np
import zmq

import ps_server.server as server_module
from ps_server.server import ShardServer
from tests.cluster_util import write_config


def _server(tmp_path) -> ShardServer:
    _, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256},
        "training": {"global_batch": 32, "max_iterations": 4},
        "optimizer": {"lr": 0.1, "momentum": 0.9},
        "cluster": {"num_shards": 1, "num_workers": 1}, "evaluator": {"enabled": False},
    })
    srv = ShardServer(cfg, 0, ctx=zmq.Context.instance())
    st = srv.state
    st.receive(0, 0, 32, np.ones(st.size, dtype=np.float32))
    st.apply(0, [[0, 32]], 1.0)                     # a momentum buffer now exists
    return srv


def test_the_decay_waits_for_the_answers_to_leave(tmp_path, monkeypatch):
    srv = _server(tmp_path)
    try:
        opt = srv.state.optimizer
        sending = [True]
        monkeypatch.setattr(srv.router, "sending", lambda: sending[0])
        srv.serve_pulls()
        assert srv.prepare_when_sent() and not opt._acc_is_decayed
        sending[0] = False
        assert not srv.prepare_when_sent() and opt._acc_is_decayed
        np.testing.assert_array_equal(opt._acc, opt.buf * np.float32(0.9))
    finally:
        srv.close()


def test_a_peer_that_does_not_read_delays_it_at_most_prepare_wait_s(tmp_path, monkeypatch):
    srv = _server(tmp_path)
    try:
        monkeypatch.setattr(srv.router, "sending", lambda: True)
        monkeypatch.setattr(server_module, "PREPARE_WAIT_S", 0.0)
        srv.serve_pulls()
        assert not srv.prepare_when_sent() and srv.state.optimizer._acc_is_decayed
    finally:
        srv.close()
