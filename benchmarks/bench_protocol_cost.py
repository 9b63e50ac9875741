"""What the commit rule costs on the healthy path: this tree against an earlier commit, one run.

The same job (model, data, seed, shards, workers, global batch, iterations; evaluator off) is
launched alternately from this working tree and from a git worktree of ``--baseline`` (default:
the last commit before protocol version 2), R times each, so drift of a shared machine hits
both alike. The time per iteration is the gap between consecutive updates on shard 0 (the
``duration`` of each record in ``coordinator.jsonl``, written the same way by both trees),
first ``--skip`` iterations left out (start-up). Prints median, mean and p95 per tree, and the
ratio of medians and of means.

    python benchmarks/bench_protocol_cost.py [--baseline COMMIT] [--repeats 3] [--iterations 400]
        [--shards 2] [--workers 2] [--model lenet] [--global-batch 128]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BEFORE_V2 = "3ecc570"  # main before the coordinator-decided commits


def percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_once(tree: Path, run_dir: Path, args: argparse.Namespace) -> list[float]:
    sets = [f"model.name={args.model}", f"training.global_batch={args.global_batch}",
            f"training.max_iterations={args.iterations}", "training.epochs=null",
            "training.target_accuracy=null", "training.max_seconds=null", "evaluator.enabled=false",
            f"cluster.num_shards={args.shards}", f"cluster.num_workers={args.workers}"]
    cmd = [sys.executable, "-m", "ps_launcher.cli", str(REPO / "configs" / "mnist_bsp.yaml"),
           "--run-dir", str(run_dir), "--no-progress"]
    for s in sets:
        cmd += ["--set", s]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        raise RuntimeError(f"run in {tree} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    recs = [json.loads(line) for line in (run_dir / "metrics" / "coordinator.jsonl").read_text().splitlines()
            if line.strip()]
    durations = [r["duration"] for r in recs if "event" not in r and "duration" in r]
    return durations[args.skip:]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=BEFORE_V2, help="git commit to compare with")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=400)
    ap.add_argument("--skip", type=int, default=20, help="first iterations left out (start-up)")
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--global-batch", type=int, default=128)
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="lbps-bench-cost-"))
    base = work / "baseline"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(base), args.baseline],
                   check=True, capture_output=True)
    trees = {f"before ({args.baseline})": base, "this tree": REPO}
    samples: dict[str, list[float]] = {k: [] for k in trees}
    try:
        for r in range(args.repeats):
            for name, tree in trees.items():
                d = run_once(tree, work / f"{r}-{name.split()[0]}", args)
                samples[name] += d
                print(f"repeat {r} {name}: median {statistics.median(d) * 1e3:.2f} ms over {len(d)} iterations",
                      flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(base)], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)

    print(f"\n{args.model}, MNIST, {args.shards} shards, {args.workers} workers, X = {args.global_batch}, "
          f"{args.iterations} iterations x {args.repeats} repeats (first {args.skip} of each left out); "
          f"time between consecutive updates on shard 0\n")
    print("| tree | median (ms) | mean (ms) | p95 (ms) | iterations |")
    print("|---|---|---|---|---|")
    for name, xs in samples.items():
        print(f"| {name} | {statistics.median(xs) * 1e3:.2f} | {statistics.fmean(xs) * 1e3:.2f} | "
              f"{percentile(xs, 0.95) * 1e3:.2f} | {len(xs)} |")
    (b, bx), (n, nx) = samples.items()
    print(f"\nthis tree / before: median {statistics.median(nx) / statistics.median(bx):.2f}x, "
          f"mean {statistics.fmean(nx) / statistics.fmean(bx):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
