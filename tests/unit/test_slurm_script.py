"""The sbatch script ps-launch generates for Slurm: one task per role, mapped in order, and a job
secret made unless CURVE is on. (The script run on a real Slurm: tests/system/test_system_slurm.py.)"""

from __future__ import annotations

import pytest

from ps_common.config import ConfigError, validate
from ps_launcher.slurm import components, run_task, sbatch_script, task_count


def _sbatch_lines(script: str) -> list[str]:
    return [ln.split("  #")[0].removeprefix("#SBATCH ") for ln in script.splitlines() if ln.startswith("#SBATCH")]


ROLES = {"worker": {"cpus": 4, "mem_mb": 6000, "gpus": 1, "constraint": "a100"}}


def test_one_allocation_and_one_step_per_role_by_default(tmp_path):
    cfg = validate({"cluster": {"num_shards": 3, "num_workers": 4}, "slurm": ROLES})
    assert components(cfg) == [("shard", 3), ("worker", 4), ("evaluator", 1)] and task_count(cfg) == 8
    script = sbatch_script(cfg, tmp_path / "job.yaml", tmp_path / "run")
    # every process a slot as large as the largest role's task; the workers' GPUs in all
    assert {"--ntasks=8", "--cpus-per-task=4", "--mem-per-cpu=1500M", "--gpus=4",
            "--constraint=a100"} <= set(_sbatch_lines(script)) and "hetjob" not in script
    steps = [ln.split(" /")[0] for ln in script.splitlines() if ln.startswith("srun ")]
    assert steps == ["srun --exact --ntasks=3 --cpus-per-task=1 --kill-on-bad-exit=1 --label",
                     "srun --exact --ntasks=4 --cpus-per-task=4 --mem-per-cpu=1500M --gpus-per-task=1 "
                     "--kill-on-bad-exit=1 --label",
                     "srun --exact --ntasks=1 --cpus-per-task=1 --kill-on-bad-exit=1 --label"]
    assert [ln.split("--role ")[1].split()[0] for ln in script.splitlines() if ln.startswith("srun ")] == [
        "shard", "worker", "evaluator"]
    assert f"keys_cli secret {tmp_path / 'run' / 'job.secret'}" in script, "no security: a job secret is made"
    curve = validate({"cluster": {"num_workers": 1}, "evaluator": {"enabled": False},
                      "security": {"curve": True, "server_secret_key": "/k/server.key_secret"}})
    assert "job.secret" not in sbatch_script(curve, tmp_path / "j.yaml", tmp_path / "r")
    assert task_count(curve) == 2


def test_a_heterogeneous_job_gives_each_role_exactly_its_own(tmp_path):
    with pytest.raises(ConfigError, match="different partitions"):
        validate({"slurm": {"shard": {"partition": "cpu"}, "worker": {"partition": "gpu"}}})
    cfg = validate({"cluster": {"num_shards": 3, "num_workers": 4},
                    "slurm": {**ROLES, "shard": {"partition": "cpu"}, "hetjob": True}})
    script = sbatch_script(cfg, tmp_path / "job.yaml", tmp_path / "run")
    parts, cur = [], []
    for opt in _sbatch_lines(script):
        if opt == "hetjob":
            parts.append(cur)
            cur = []
        else:
            cur.append(opt)
    parts.append(cur)
    assert len(parts) == 3
    assert {"--ntasks=3", "--cpus-per-task=1", "--partition=cpu"} <= set(parts[0])
    assert {"--ntasks=4", "--cpus-per-task=4", "--mem-per-cpu=1500M", "--gpus-per-task=1",
            "--constraint=a100"} <= set(parts[1])
    assert {"--ntasks=1", "--cpus-per-task=1"} <= set(parts[2])
    steps = [ln for ln in script.splitlines() if ln.startswith("srun ")]
    assert [s.split()[1] for s in steps] == ["--het-group=0", "--het-group=1", "--het-group=2"]


def test_a_task_refuses_a_step_of_the_wrong_size(tmp_path, capsys):
    cfg_file = tmp_path / "job.yaml"
    cfg_file.write_text("cluster: {num_shards: 2, num_workers: 3}\n")
    rc = run_task(["--config", str(cfg_file), "--run-dir", str(tmp_path), "--role", "worker"],
                  env={"SLURM_PROCID": "0", "SLURM_NTASKS": "2"})
    assert rc == 2 and "the worker step has 2 tasks, the job needs 3" in capsys.readouterr().err
