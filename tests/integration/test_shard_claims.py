"""dmlc servers claim their follower index by name (``ps-server --name``), and shard 0 keeps the
claims in its checkpoints: a server restarted under the same name gets its index back, also
from a shard 0 that was itself restarted (``--resume auto``: resumed where a checkpoint exists,
a fresh start otherwise, so a cluster manager can run the same command every time)."""

from __future__ import annotations

import pytest
import zmq

from ps_common import protocol as P
from ps_common.security.authenticator import stop_authenticators
from ps_server.router import Refused
from ps_server.server import ShardServer
from tests.cluster_util import write_config


def _claim(server: ShardServer, name: str) -> int:
    reply = server.role._on_claim_shard(b"", "shard", P.ClaimShard(job_digest=server.job_digest, instance=name))
    assert isinstance(reply, P.ShardClaimed)
    return reply.shard


def test_named_claims_survive_a_restart_of_either_side(tmp_path):
    _, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256, "synthetic_test": 64},
        "training": {"global_batch": 32, "max_iterations": 5},
        "cluster": {"num_shards": 4, "num_workers": 1}, "evaluator": {"enabled": False},
        "checkpoint": {"every_iterations": 1},
    })
    run = tmp_path / "run"
    # A context each: a closed server's ZAP handler leaves its inproc endpoint asynchronously
    ctx = zmq.Context()
    first = ShardServer(cfg, 0, ctx=ctx, run_dir=run, resume="auto")  # what a k8s pod runs every time
    try:
        assert not first.resumed, "no checkpoint yet: a fresh start"
        assert [_claim(first, n) for n in ("server-b", "server-a")] == [1, 2]
        assert _claim(first, "server-b") == 1, "the same name (a restarted server) gets its index back"
        first.write_checkpoint()
        first.checkpointer.flush()
        assert _claim(first, "server-c") == 3, "claimed after the checkpoint"
        with pytest.raises(Refused, match="claimed or registered"):
            _claim(first, "server-d")
    finally:
        first.close()
        stop_authenticators(ctx)
        ctx.destroy(linger=0)

    ctx = zmq.Context()
    resumed = ShardServer(cfg, 0, ctx=ctx, run_dir=run, resume="auto")
    try:
        assert resumed.resumed, "the same command goes on from the checkpoint"
        assert resumed.role.claims == {"server-b": 1, "server-a": 2}, "the checkpoint's claims"
        assert _claim(resumed, "server-a") == 2 and _claim(resumed, "server-b") == 1
        assert _claim(resumed, "server-new") == 3, "the index claimed after the checkpoint is free again"
    finally:
        resumed.close()
        stop_authenticators(ctx)
        ctx.destroy(linger=0)
