"""Checkpoint files on disk: a rollback's abandoned history is deleted, so ``--resume`` (which
loads the newest file) cannot come back to it."""

from __future__ import annotations

import numpy as np

from ps_server.checkpoint import drop_checkpoints_after, find_checkpoint, list_checkpoints, save_checkpoint


def test_a_rollback_deletes_this_shards_checkpoints_above_its_version(tmp_path):
    for shard in (0, 1):
        for v in (10, 20, 30, 40):
            save_checkpoint(tmp_path, shard, v, {"params": np.full(3, v, np.float32)}, {"version": v}, keep=10)
    assert drop_checkpoints_after(tmp_path, 1, 20) == [30, 40]
    assert [v for v, _ in list_checkpoints(tmp_path, 1)] == [10, 20]
    assert find_checkpoint(tmp_path, 1).name == "shard-1-v000000020.npz"   # what --resume loads
    assert [v for v, _ in list_checkpoints(tmp_path, 0)] == [10, 20, 30, 40]  # another shard's stay
    assert drop_checkpoints_after(tmp_path, 1, 20) == []
