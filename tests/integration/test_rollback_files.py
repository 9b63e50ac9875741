"""A rollback deletes the abandoned history's checkpoints, so a shard restarted with ``--resume``
(which loads its newest file) comes back to the history the job went on with."""

from __future__ import annotations

import zmq

from ps_common.security.authenticator import stop_authenticators
from ps_server.server import ShardServer
from tests.cluster_util import write_config


def test_resume_after_a_rollback_loads_the_rollbacks_version_not_the_abandoned_newest(tmp_path):
    _, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256, "synthetic_test": 64},
        "training": {"global_batch": 32, "max_iterations": 5},
        "cluster": {"num_shards": 1, "num_workers": 1}, "evaluator": {"enabled": False},
        "checkpoint": {"every_iterations": 1},
    })
    run = tmp_path / "run"
    ctx = zmq.Context()
    first = ShardServer(cfg, 0, ctx=ctx, run_dir=run)
    try:
        for v in (10, 20, 30):            # checkpoints of one history (versions stand in for commits)
            first.state.version = v
            first.write_checkpoint()
        first.checkpointer.flush()
        first.role.rollback_all(10, "a follower diverged")   # 20 and 30 are abandoned
        assert first.state.version == 10
    finally:
        first.close()
        stop_authenticators(ctx)
        ctx.destroy(linger=0)
    assert sorted(p.name for p in (run / "checkpoints").glob("shard-0-*.npz")) == ["shard-0-v000000010.npz"]
    ctx = zmq.Context()
    resumed = ShardServer(cfg, 0, ctx=ctx, run_dir=run, resume="auto")
    try:
        assert resumed.resumed and resumed.state.version == 10
    finally:
        resumed.close()
        stop_authenticators(ctx)
        ctx.destroy(linger=0)
