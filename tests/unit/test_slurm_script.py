"""The sbatch script ps-launch generates for Slurm: one task per role, mapped in order, and a job
secret made unless CURVE is on. (The script run on a real Slurm: tests/system/test_system_slurm.py.)"""

from __future__ import annotations

import pytest

from ps_common.config import validate
from ps_launcher.slurm import role_of, sbatch_script, task_count


def test_tasks_map_to_roles_and_the_script_asks_for_one_task_each(tmp_path):
    cfg = validate({"cluster": {"num_shards": 3, "num_workers": 4}})
    assert task_count(cfg) == 8
    assert [role_of(cfg, i) for i in range(8)] == [
        ("shard", 0), ("shard", 1), ("shard", 2), ("worker", 0), ("worker", 1), ("worker", 2), ("worker", 3),
        ("evaluator", 0)]
    with pytest.raises(ValueError, match="no role"):
        role_of(cfg, 8)
    script = sbatch_script(cfg, tmp_path / "job.yaml", tmp_path / "run")
    assert "#SBATCH --ntasks=8" in script and "srun --kill-on-bad-exit=1" in script
    assert f"keys_cli secret {tmp_path / 'run' / 'job.secret'}" in script, "no security: a job secret is made"
    curve = validate({"cluster": {"num_workers": 1}, "evaluator": {"enabled": False},
                      "security": {"curve": True, "server_secret_key": "/k/server.key_secret"}})
    assert "job.secret" not in sbatch_script(curve, tmp_path / "j.yaml", tmp_path / "r")
    assert task_count(curve) == 2
