"""Run a job on Slurm: an sbatch script generated from the job's YAML, one task per process.

``ps-launch CONFIG --backend slurm --print`` writes the script. The config's ``slurm:`` section
says what each role (shards, workers and, when enabled, the evaluator) asks for per task: CPUs,
memory, GPUs, partition, node features. By default the job is one allocation with a task slot
per process, each as large as the largest role's, and one ``srun --exact`` step per role
takes its share; with ``slurm.hetjob`` it is a heterogeneous job with a component per role,
each with exactly its own resources and partition (not run here: the single-host test Slurm
left every heterogeneous job pending). Each step runs ``python -m ps_launcher.slurm --role
ROLE`` in each of its tasks; ``SLURM_PROCID`` (within the step) is the index: shard 0 (the
coordinator) and the other shards, the workers (named ``worker-I``, with scenario index I, so
memory caps and scenarios follow them), the evaluator. The shards' step decides the job: when
it fails, the script stops the other steps. Shard 0 binds a free port on the node it runs on
and writes its endpoint into the run directory, which every node must see (a shared file
system, as Slurm clusters have); the others read it from there. The tasks load the config the
generator wrote into the run directory (``--set`` overrides included). Without security
settings the script makes a job secret in the run directory first.
"""

from __future__ import annotations

import os
import shlex
import sys
from pathlib import Path
from typing import Mapping

from ps_common.config import JobConfig, load_config
from ps_common.rendezvous import ENDPOINT_FILE, FILE_PREFIX

ROLES = ("shard", "worker", "evaluator")


def components(cfg: JobConfig) -> list[tuple[str, int]]:
    """The heterogeneous job's components in order: (role, number of tasks)."""
    out = [("shard", cfg.cluster.num_shards), ("worker", cfg.cluster.num_workers)]
    return out + ([("evaluator", 1)] if cfg.evaluator.enabled else [])


def task_count(cfg: JobConfig) -> int:
    return sum(n for _, n in components(cfg))


def _mem_per_cpu(mem_mb: int | None, cpus: int) -> int | None:
    return None if mem_mb is None else -(-mem_mb // cpus)   # a task's memory as its CPUs' share


def _resources(cfg: JobConfig, role: str, tasks: int, *, place: bool = True) -> list[str]:
    """One role's options: a hetjob component's (``place``: with partition and constraint) or a
    step's within the job's allocation."""
    r = getattr(cfg.slurm, role)
    opts = [f"--ntasks={tasks}", f"--cpus-per-task={r.cpus}"]
    if (m := _mem_per_cpu(r.mem_mb, r.cpus)) is not None:
        opts.append(f"--mem-per-cpu={m}M")
    if r.gpus:
        opts.append(f"--gpus-per-task={r.gpus}")
    if place and r.partition:
        opts.append(f"--partition={r.partition}")
    if place and r.constraint:
        opts.append(f"--constraint={r.constraint}")
    return opts


def _allocation(cfg: JobConfig) -> list[str]:
    """One allocation in which every role's step fits: a task slot per process, each as large
    as the largest role's task (roles that differ much: ``slurm.hetjob``)."""
    roles = [(getattr(cfg.slurm, role), n) for role, n in components(cfg)]
    opts = [f"--ntasks={task_count(cfg)}", f"--cpus-per-task={max(r.cpus for r, _ in roles)}"]
    mems = [m for r, _ in roles if (m := _mem_per_cpu(r.mem_mb, r.cpus)) is not None]
    if mems:
        opts.append(f"--mem-per-cpu={max(mems)}M")
    if gpus := sum(r.gpus * n for r, n in roles):
        opts.append(f"--gpus={gpus}")
    for what in ("partition", "constraint"):
        named = {getattr(r, what) for r, _ in roles} - {None}
        if named:  # at most one (the config refuses more without hetjob)
            opts.append(f"--{what}={named.pop()}")
    return opts


def sbatch_script(cfg: JobConfig, config_path: Path, run_dir: Path, *, python: str = sys.executable,
                  time_limit: str = "01:00:00", partition: str | None = None,
                  extra_sbatch: tuple[str, ...] = ()) -> str:
    """The sbatch script for this job (paths made absolute: tasks may start elsewhere)."""
    config_path, run_dir = Path(config_path).resolve(), Path(run_dir).resolve()
    sec = cfg.security
    secret = run_dir / "job.secret" if not sec.curve and not sec.secret_file else None
    lines = ["#!/bin/bash",
             f"#SBATCH --job-name=lbbsp-{cfg.run.name}",
             f"#SBATCH --time={time_limit}",
             f"#SBATCH --output={run_dir}/slurm-%j.out"]
    if partition:  # every component's, unless the role names its own
        lines.append(f"#SBATCH --partition={partition}")
    lines += [f"#SBATCH {x}" for x in extra_sbatch]
    if cfg.slurm.hetjob:
        for i, (role, n) in enumerate(components(cfg)):
            if i:
                lines.append("#SBATCH hetjob")
            lines += [f"#SBATCH {x}  # {role}" if j == 0 else f"#SBATCH {x}"
                      for j, x in enumerate(_resources(cfg, role, n))]
    else:
        lines += [f"#SBATCH {x}" for x in _allocation(cfg)]
    q = shlex.quote
    lines += ["set -euo pipefail",
              f"mkdir -p {q(str(run_dir))}",
              f"rm -f {q(str(run_dir / ENDPOINT_FILE))}"]
    task = [python, "-m", "ps_launcher.slurm", "--config", str(config_path), "--run-dir", str(run_dir)]
    if secret is not None:
        lines.append(f"[ -e {q(str(secret))} ] || {q(python)} -m ps_launcher.keys_cli secret {q(str(secret))}")
        task += ["--secret-file", str(secret)]
    lines += ["start=$SECONDS", "status=0", "steps=()"]
    for i, (role, n) in enumerate(components(cfg)):
        # hetjob: the component's own resources; else this role's share of the allocation
        # (--exact: the step takes only what it asks for, so the steps run side by side)
        where = [f"--het-group={i}"] if cfg.slurm.hetjob else ["--exact", *_resources(cfg, role, n, place=False)]
        lines.append(" ".join(["srun", *where, "--kill-on-bad-exit=1", "--label"])
                     + " " + " ".join(q(x) for x in [*task, "--role", role]) + " &")
        lines.append("steps+=($!)")
    lines += ["# the shards' step (the first) decides: when it fails, nothing is left to train with",
              'wait "${steps[0]}" || { status=$?; kill "${steps[@]:1}" 2>/dev/null || true; }',
              'for s in "${steps[@]:1}"; do wait "$s" || true; done',
              "# the run directory's summary and plots, as ps-launch writes them",
              " ".join(q(x) for x in [python, "-m", "ps_launcher.slurm", "--summarize", "--config",
                                      str(config_path), "--run-dir", str(run_dir)])
              + ' --wall-s "$((SECONDS - start))" || true',
              'exit "$status"']
    return "\n".join(lines) + "\n"


def run_task(argv: list[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """One Slurm task: find this task's role and run it (``python -m ps_launcher.slurm``)."""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m ps_launcher.slurm", description=run_task.__doc__)
    ap.add_argument("--config", required=True)
    ap.add_argument("--run-dir", required=True)
    ap.add_argument("--secret-file", default=None)
    ap.add_argument("--role", choices=ROLES, help="this task's component of the heterogeneous job")
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
    if args.role is None:
        ap.error("--role is required (the script passes it to each component's step)")
    index, ntasks = int(env["SLURM_PROCID"]), int(env["SLURM_NTASKS"])
    wanted = dict(components(cfg)).get(args.role, 0)
    if ntasks != wanted:
        print(f"ps-launch slurm task: the {args.role} step has {ntasks} tasks, the job needs {wanted}: "
              "regenerate the script", file=sys.stderr)
        return 2
    role = args.role
    run_dir = Path(args.run_dir)
    common = ["--config", args.config, "--run-dir", args.run_dir]
    if args.secret_file:
        common += ["--secret-file", args.secret_file]
    endpoint_file = run_dir / ENDPOINT_FILE
    if role == "shard" and index == 0:
        from ps_server import cli as server_cli

        return server_cli.main([*common, "--shard", "0", "--host", "0.0.0.0", "--port", "0",
                                "--advertise", _node_address(), "--endpoint-file", str(endpoint_file)])
    coordinator = FILE_PREFIX + str(endpoint_file)   # read once the task has started up
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
