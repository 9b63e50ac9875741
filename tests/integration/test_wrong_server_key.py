"""CURVE with the wrong server key, shard server and client in one process: the client names
the likely cause at once instead of waiting out the join timeout. (CURVE end to end over real
processes: tests/system/test_system_security.py.)"""

from __future__ import annotations

import time

import pytest
import zmq

from ps_common.security.keys import generate_keypair
from ps_common.security.settings import init_local_keys
from ps_common.transport import AuthenticationFailed


def test_a_client_holding_the_wrong_server_key_fails_fast_and_says_so(tmp_path):
    """A CURVE server cannot decrypt a HELLO made for another key and just closes; the client
    names the likely cause within a second instead of waiting out the join timeout."""
    import threading

    from ps_common.config import validate
    from ps_server.server import ShardServer
    from ps_worker.client import ShardClients

    sec = init_local_keys(tmp_path / "keys")
    cfg = validate({"model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256},
                    "training": {"global_batch": 32, "max_seconds": 60},
                    "cluster": {"num_shards": 1, "num_workers": 1},
                    "evaluator": {"enabled": False}, "security": sec.model_dump()})
    ctx = zmq.Context()
    server = ShardServer(cfg, 0, ctx=ctx)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    other_public, _ = generate_keypair(tmp_path / "other", "shard-impostor")
    wrong = sec.model_copy(update={"server_public_key": str(other_public)})
    clients = ShardClients(ctx, server.endpoint, timeout_s=30, connect_timeout_s=60, security=wrong)
    t0 = time.monotonic()
    try:
        with pytest.raises(AuthenticationFailed, match="server_public_key"):
            clients.join("w", cfg.job_digest(), "cpu")
        assert time.monotonic() - t0 < 5.0
    finally:
        clients.close()
        server.stop_event.set()
        thread.join(10)
        ctx.term()
