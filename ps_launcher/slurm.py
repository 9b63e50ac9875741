"""Run a job on Slurm: an sbatch script generated from the job's YAML, one task per process.

``ps-launch CONFIG --backend slurm --print`` writes the script. It asks for one task per shard,
worker and (when enabled) the evaluator, and runs ``python -m ps_launcher.slurm`` in each; that
task reads ``SLURM_PROCID`` and ``SLURM_NTASKS`` and becomes, in order, shard 0 (the
coordinator), the other shards, the workers (named ``worker-I``, with scenario index I, so
memory caps and scenarios follow them) and the evaluator. Shard 0 binds a free port on the
node it runs on and writes its endpoint into the run directory, which every node must see (a
shared file system, as Slurm clusters have); the others read it from there. The tasks load the
config the generator wrote into the run directory (``--set`` overrides included). Without
security settings the script makes a job secret in the run directory first.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from pathlib import Path
from typing import Mapping

from ps_common.config import JobConfig, load_config

ENDPOINT_FILE = "coordinator.endpoint"


def task_count(cfg: JobConfig) -> int:
    return cfg.cluster.num_shards + cfg.cluster.num_workers + (1 if cfg.evaluator.enabled else 0)


def role_of(cfg: JobConfig, procid: int) -> tuple[str, int]:
    """(role, index) of Slurm task ``procid``: ("shard", k), ("worker", i) or ("evaluator", 0)."""
    s, w = cfg.cluster.num_shards, cfg.cluster.num_workers
    if procid < s:
        return "shard", procid
    if procid < s + w:
        return "worker", procid - s
    if procid == s + w and cfg.evaluator.enabled:
        return "evaluator", 0
    raise ValueError(f"task {procid} has no role: the job has {task_count(cfg)} tasks")


def sbatch_script(cfg: JobConfig, config_path: Path, run_dir: Path, *, python: str = sys.executable,
                  time_limit: str = "01:00:00", partition: str | None = None,
                  extra_sbatch: tuple[str, ...] = ()) -> str:
    """The sbatch script for this job (paths made absolute: tasks may start elsewhere)."""
    config_path, run_dir = Path(config_path).resolve(), Path(run_dir).resolve()
    sec = cfg.security
    secret = run_dir / "job.secret" if not sec.curve and not sec.secret_file else None
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=lbbsp-{cfg.run.name}",
             f"#SBATCH --ntasks={task_count(cfg)}",
             "#SBATCH --cpus-per-task=1",
             f"#SBATCH --time={time_limit}",
             f"#SBATCH --output={run_dir}/slurm-%j.out"]
    if partition:
        lines.append(f"#SBATCH --partition={partition}")
    lines += [f"#SBATCH {x}" for x in extra_sbatch]
    q = shlex.quote
    lines += ["set -euo pipefail",
              f"mkdir -p {q(str(run_dir))}",
              f"rm -f {q(str(run_dir / ENDPOINT_FILE))}"]
    task = [python, "-m", "ps_launcher.slurm", "--config", str(config_path), "--run-dir", str(run_dir)]
    if secret is not None:
        lines.append(f"[ -e {q(str(secret))} ] || {q(python)} -m ps_launcher.keys_cli secret {q(str(secret))}")
        task += ["--secret-file", str(secret)]
    lines += ["start=$SECONDS", "status=0",
              "srun --kill-on-bad-exit=1 --label " + " ".join(q(x) for x in task) + " || status=$?",
              "# the run directory's summary and plots, as ps-launch writes them",
              " ".join(q(x) for x in [python, "-m", "ps_launcher.slurm", "--summarize", "--config",
                                      str(config_path), "--run-dir", str(run_dir)])
              + ' --wall-s "$((SECONDS - start))" || true',
              'exit "$status"']
    return "\n".join(lines) + "\n"


def _wait_for_endpoint(path: Path, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if path.exists():
            text = path.read_text().strip()
            if text:
                return text
        time.sleep(0.2)
    raise TimeoutError(f"shard 0 wrote no endpoint into {path} within {timeout_s:.0f}s")


def run_task(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """One Slurm task: find this task's role and run it (``python -m ps_launcher.slurm``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ps_launcher.slurm", description=run_task.__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--secret-file", default=None)
    ap.add_argument("--summarize", action="store_true",
                    help="after the tasks: write the run directory's summary and plots")
    ap.add_argument("--wall-s", type=float, default=None)
    args = ap.parse_args(argv)
    env = os.environ if env is None else env
    cfg = load_config(args.config)
    if args.summarize:
        from ps_launcher.plots import plot_run
        from ps_launcher.summary import summarize, summary_markdown

        summary = summarize(args.run_dir, global_batch=cfg.training.global_batch,
                            target_accuracy=cfg.training.target_accuracy, wall_s=args.wall_s,
                            num_shards=cfg.cluster.num_shards)
        plot_run(Path(args.run_dir), summary)
        print(summary_markdown(summary))
        return 0
    procid, ntasks = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    if ntasks != task_count(cfg):
        print(f"ps-launch slurm task: the allocation has {ntasks} tasks, the job needs {task_count(cfg)} "
              "(one per shard, worker and evaluator): regenerate the script", file=sys.stderr)
        return 2
    role, index = role_of(cfg, procid)
    run_dir = Path(args.run_dir)
    common = ["--config", args.config, "--run-dir", args.run_dir]
    if args.secret_file:
        common += ["--secret-file", args.secret_file]
    endpoint_file = run_dir / ENDPOINT_FILE
    if role == "shard" and index == 0:
        from ps_server import cli as server_cli

        return server_cli.main([*common, "--shard", "0", "--host", "0.0.0.0", "--port", "0",
                                "--advertise", _node_address(), "--endpoint-file", str(endpoint_file)])
    coordinator = _wait_for_endpoint(endpoint_file, cfg.transport.connect_timeout_s)
    if role == "shard":
        from ps_server import cli as server_cli

        return server_cli.main([*common, "--shard", str(index), "--host", "0.0.0.0", "--port", "0",
                                "--advertise", _node_address(), "--coordinator", coordinator])
    if role == "worker":
        from ps_worker import cli as worker_cli

        return worker_cli.main([*common, "--server", coordinator, "--name", f"worker-{index}",
                                "--scenario-index", str(index)])
    from ps_worker import evaluator_cli

    return evaluator_cli.main([*common, "--server", coordinator])


def _node_address() -> str:
    """This node's name as the other nodes reach it (Slurm's own name for it)."""
    import socket

    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


if __name__ == "__main__":
    sys.exit(run_task())
