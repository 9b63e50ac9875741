"""A rollback deletes the abandoned history's checkpoints, so a shard restarted with ``--resume``
(which loads its newest file) comes back to the history the job went on with."""

from __future__ import annotations

from tests.cluster_util import in_process_shard_0, small_checkpointing_job


def test_resume_after_a_rollback_loads_the_rollbacks_version_not_the_abandoned_newest(tmp_path):
    cfg = small_checkpointing_job(tmp_path, num_shards=1)
    run = tmp_path / "run"
    with in_process_shard_0(cfg, run) as first:
        for v in (10, 20, 30):            # checkpoints of one history (versions stand in for commits)
            first.state.version = v
            first.write_checkpoint()
        first.checkpointer.flush()
        first.role.rollback_all(10, "a follower diverged")   # 20 and 30 are abandoned
        assert first.state.version == 10
    assert sorted(p.name for p in (run / "checkpoints").glob("shard-0-*.npz")) == ["shard-0-v000000010.npz"]
    with in_process_shard_0(cfg, run, resume="auto") as resumed:
        assert resumed.resumed and resumed.state.version == 10
