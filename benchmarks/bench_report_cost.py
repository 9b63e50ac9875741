"""What a worker's report costs shard 0 on arrival, per report, in this tree and another one.

Why: a change that makes the batch-size decision cheaper by doing work when a report arrives
(the rows of ``Telemetry.row`` and ``WorkerReport.received``) moves CPU rather than saving it
unless the arrival stays cheap; ``bench_manager.py`` and ``bench_fleet.py`` time the decision,
this times the arrival. Per push, in the order shard 0 does them: decoding a ``Push`` that
carries a worker's report (10 measured fields, as a CPU worker's), and one without a report
for reference; making the coordinator's report of it; adding the servers' finish time to it.
Microbenchmarks: best of ``--rounds`` x ``--calls`` calls, in microseconds; with ``--root DIR``
the same measurements of the tree at DIR run in a fresh process right after this tree's, and
the two print side by side (the VM's speed moves from minute to minute: compare the rows of
one run).

    python benchmarks/bench_report_cost.py [--root DIR] [--calls 5000] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]

STEPS = ("decode a push with a report", "decode a push without a report", "make the coordinator's report",
         "add the finish time")


def _best_us(f: Callable[[], Any], calls: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            f()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best * 1e6


def measure(calls: int, rounds: int) -> dict[str, float]:
    """The steps' times in this process's tree (whatever ``sys.path`` finds first)."""
    import numpy as np

    from batchsize_manager.reports import WorkerReport
    from ps_common.protocol import Push, decode, encode
    from ps_common.report import Telemetry

    tel = Telemetry(data_s=0.001, compute_s=0.01, iteration_s=0.02, prev_push_s=0.001,
                    prev_wait_s=0.002, prev_pull_s=0.001, proc_cpu=100.0, host_cpu=50.0,
                    cotenant_cpu=1.0, rss_mb=500.0, host_mem_pct=40.0)
    grad = np.zeros(10, dtype=np.float32)

    def frames(t: Telemetry | None) -> list[Any]:
        push = Push(worker_id=3, token="t", iteration=5, batch_size=64, loss=0.3, telemetry=t, arrays=[grad])
        return [f if isinstance(f, np.ndarray) else bytes(f) for f in encode(push)]

    with_report, without = frames(tel), frames(None)
    received = decode(with_report).telemetry
    assert received is not None
    make = getattr(WorkerReport, "received", None)      # absent before the rows
    if make is not None:
        def made() -> WorkerReport:
            return make(3, 5, 64, received)
    else:
        def made() -> WorkerReport:
            return WorkerReport(worker_id=3, iteration=5, batch_size=64, telemetry=received)
    report = made()
    fns: list[Callable[[], Any]] = [lambda: decode(with_report), lambda: decode(without), made,
                                    lambda: report.with_telemetry(report.telemetry.with_finish(0.02))]
    return {name: _best_us(f, calls, rounds) for name, f in zip(STEPS, fns)}


def _measure_at(root: Path, calls: int, rounds: int) -> dict[str, float]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--one", str(root), "--calls", str(calls),
           "--rounds", str(rounds)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=None, help="another checkout to measure beside this one")
    ap.add_argument("--calls", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--one", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one is not None:
        sys.path.insert(0, str(args.one))
        print(json.dumps(measure(args.calls, args.rounds)))
        return 0
    trees = [("this tree", ROOT)] + ([("--root", args.root.resolve())] if args.root else [])
    results = [(label, _measure_at(root, args.calls, args.rounds)) for label, root in trees]
    print(f"best of {args.rounds} x {args.calls:,} calls, µs per call\n")
    print("| step | " + " | ".join(f"{label} ({root})" for (label, root) in trees) + " |")
    print("|---|" + "---|" * len(trees))
    for step in STEPS:
        print(f"| {step} | " + " | ".join(f"{r[step]:.2f}" for _, r in results) + " |")
    total = [sum(r[s] for s in STEPS if s != STEPS[1]) for _, r in results]
    print("| per report (all but the reference row) | " + " | ".join(f"{t:.2f}" for t in total) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
