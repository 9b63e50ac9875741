"""Slurm: the sbatch script ps-launch generates, run on a real (single-host) Slurm.

The real run skips where Slurm is absent (``bash scripts/setup_slurm.sh`` installs and starts
one from Debian's packages); the script's content and the task-to-role mapping are checked
everywhere, in tests/unit/test_slurm_script.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from tests.cluster_util import consistent_end

pytestmark = pytest.mark.system


def slurm_unavailable() -> str | None:
    if shutil.which("sbatch") is None:
        return "sbatch not installed (bash scripts/setup_slurm.sh sets up a single-host Slurm)"
    out = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=30)
    if out.returncode != 0 or not re.search(r"idle|mix|alloc", out.stdout):
        return f"no Slurm node up (sinfo: {out.stdout.strip() or out.stderr.strip()})"
    return None


@pytest.mark.timeout(400)
def test_a_job_runs_on_slurm_from_the_generated_script(tmp_path):
    reason = slurm_unavailable()
    if reason:
        pytest.skip(reason)
    run_dir = tmp_path / "run"
    gen = subprocess.run([sys.executable, "-m", "ps_launcher.cli", "configs/quick_synthetic.yaml", "--backend",
                          "slurm", "--print", "--run-dir", str(run_dir), "--set", "training.max_iterations=40",
                          "--set", "cluster.num_shards=2", "--set", "cluster.num_workers=2",
                          "--set", "slurm.worker.cpus=2"],  # a role with resources of its own
                         capture_output=True, text=True, timeout=120)
    assert gen.returncode == 0, gen.stderr
    assert "srun --exact --ntasks=2 --cpus-per-task=2" in gen.stdout, "the workers' step asks for 2 CPUs each"
    script = tmp_path / "job.sbatch"
    script.write_text(gen.stdout)
    sub = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, timeout=60)
    assert sub.returncode == 0, sub.stderr
    job = sub.stdout.strip().split(";")[0]
    try:
        done = subprocess.run(["bash", "-c", f"while squeue -h -j {job} 2>/dev/null | grep -q .; do sleep 1; done"],
                              timeout=300)
        assert done.returncode == 0
    finally:
        subprocess.run(["scancel", job], capture_output=True, timeout=30)  # a no-op once it ended
    log = (run_dir / f"slurm-{job}.out").read_text()
    params, version = consistent_end(run_dir, 2)
    assert version == 40, log[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["iterations"] == 40 and summary["final"]["agree"], summary
    assert len(summary["workers"]) == 2
    assert (run_dir / "workers.png").exists()
    # Every task ran its role: the evaluator measured the final version too.
    assert summary["final_accuracy_version"] == 40, log[-3000:]
