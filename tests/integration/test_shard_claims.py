"""dmlc servers claim their follower index by name (``ps-server --name``), and shard 0 keeps the
claims in its checkpoints: a server restarted under the same name gets its index back, also
from a shard 0 that was itself restarted (``--resume auto``: resumed where a checkpoint exists,
a fresh start otherwise, so a cluster manager can run the same command every time)."""

from __future__ import annotations

import pytest

from ps_common import protocol as P
from ps_server.router import Refused
from ps_server.server import ShardServer
from tests.cluster_util import in_process_shard_0, small_checkpointing_job


def _claim(server: ShardServer, name: str) -> int:
    reply = server.role._on_claim_shard(b"", "shard", P.ClaimShard(job_digest=server.job_digest, instance=name))
    assert isinstance(reply, P.ShardClaimed)
    return reply.shard


def test_named_claims_survive_a_restart_of_either_side(tmp_path):
    cfg = small_checkpointing_job(tmp_path, num_shards=4)
    run = tmp_path / "run"
    with in_process_shard_0(cfg, run, resume="auto") as first:   # what a k8s pod runs every time
        assert not first.resumed, "no checkpoint yet: a fresh start"
        assert [_claim(first, n) for n in ("server-b", "server-a")] == [1, 2]
        assert _claim(first, "server-b") == 1, "the same name (a restarted server) gets its index back"
        first.write_checkpoint()
        first.checkpointer.flush()
        assert _claim(first, "server-c") == 3, "claimed after the checkpoint"
        with pytest.raises(Refused, match="claimed or registered"):
            _claim(first, "server-d")

    with in_process_shard_0(cfg, run, resume="auto") as resumed:
        assert resumed.resumed, "the same command goes on from the checkpoint"
        assert resumed.role.claims == {"server-b": 1, "server-a": 2}, "the checkpoint's claims"
        assert _claim(resumed, "server-a") == 2 and _claim(resumed, "server-b") == 1
        assert _claim(resumed, "server-new") == 3, "the index claimed after the checkpoint is free again"
