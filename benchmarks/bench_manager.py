"""BatchSizeManager benchmark on the pure timing model (no sockets, no sleeps).

(a) Decision time per iteration (observe of every worker's report + assign), measured by the
    manager itself with ``time.perf_counter``, for 10 to 10,000 simulated workers.
(b) Iteration time of uniform (BSP), static, lbbsp-cpu and lbbsp-gpu on 4 CPU-like workers with
    speeds 1, 1, 1/2, 1/4 (slowdowns 1, 1, 2, 4), against the ideal balanced bound
    c + X / Σ v_i, scaled so that the ideal iteration takes 50 ms, plus the decision time as a
    fraction of that. A second scenario adds a 2x slowdown of worker 0 from iteration 100 to 199.

Simulated times are model seconds; decision times are real seconds on this machine (shared, so
they drift from run to run: compare rows of one run, not runs).

    python benchmarks/bench_manager.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchsize_manager import BatchSizeManager  # noqa: E402
from batchsize_manager.simulation import Simulation, SimulatedWorker, ideal_iteration_time  # noqa: E402

PER_SAMPLE_X = 64          # global batch = 64 samples per worker in the scaling table


def table(header: list[str], rows: list[list[Any]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


# ----------------------------------------------------------------------------- (a) scaling
SCALING = [
    ("lbbsp-cpu (ema)", "lbbsp-cpu", {"predictor": "ema"}),
    ("lbbsp-cpu (last)", "lbbsp-cpu", {"predictor": "last"}),
    ("lbbsp-cpu (narx)", "lbbsp-cpu", {"predictor": "narx"}),
    ("lbbsp-gpu", "lbbsp-gpu", {}),
    ("uniform (reference)", "uniform", {}),
]


def measure_decisions(policy: str, args: dict[str, Any], n: int, warmup: int, iters: int) -> list[float]:
    """Per-iteration decision seconds for ``n`` workers with mixed speeds and 3% noise."""
    workers = [SimulatedWorker(1000.0 * (1 + i % 4), overhead=0.005, saturation_batch=0, noise=0.03,
                               seed=i) for i in range(n)]
    m = BatchSizeManager(policy, PER_SAMPLE_X * n, policy_args=args)
    sim = Simulation(m, workers)
    sim.run(warmup)
    out = []
    for _ in range(iters):
        sim.step()                        # assign() of this step closes the previous decision
        out.append(m.last_decision_s)
    return out


def scaling_table(sizes: list[int], budget_s: float) -> str:
    rows = []
    for label, policy, args in SCALING:
        narx = args.get("predictor") == "narx"
        per_worker_s = None
        for n in sizes:
            if narx and per_worker_s is not None and per_worker_s * n > budget_s:
                rows.append([label, f"{n:,}", "not measured", "", "",
                             f"projected ~{per_worker_s * n * 1e3:,.0f} ms/iteration"])
                continue
            # NARX fits once per worker every 10 updates (from 10 observations on): measure 10
            # iterations after its first fit so that the mean includes exactly one refit each.
            warmup, iters = (12, 10) if narx else ((3, 10) if n <= 1000 else (2, 4))
            t0 = time.perf_counter()
            ds = measure_decisions(policy, args, n, warmup, iters)
            wall = time.perf_counter() - t0
            mean = statistics.fmean(ds)
            per_worker_s = mean / n
            rows.append([label, f"{n:,}", f"{mean * 1e3:.2f}", f"{max(ds) * 1e3:.2f}",
                         f"{per_worker_s * 1e6:.1f}", f"{iters} iterations, {wall:.1f} s wall"])
    return table(["policy", "workers", "mean decision ms", "max ms", "µs per worker", "note"], rows)


# ----------------------------------------------------------------------------- (b) 4 CPU workers
SLOWDOWNS = [1.0, 1.0, 2.0, 4.0]
X = 256
OVERHEAD = 0.005
IDEAL_S = 0.050
BASE = X / (IDEAL_S - OVERHEAD) / sum(1 / f for f in SLOWDOWNS)   # ideal = c + X / Σ v = 50 ms

POLICIES = [
    ("uniform (BSP)", "uniform", {}),
    ("static (K=5)", "static", {}),
    ("lbbsp-cpu (ema)", "lbbsp-cpu", {"predictor": "ema"}),
    ("lbbsp-cpu (last)", "lbbsp-cpu", {"predictor": "last"}),
    ("lbbsp-cpu (narx)", "lbbsp-cpu", {"predictor": "narx"}),
    ("lbbsp-gpu", "lbbsp-gpu", {}),
]


def cpu4(noise: float, dynamic: bool) -> list[SimulatedWorker]:
    out = []
    for i, f in enumerate(SLOWDOWNS):
        v = BASE / f
        sched = [(100, v / 2), (200, v)] if dynamic and i == 0 else []
        out.append(SimulatedWorker(v, overhead=OVERHEAD, noise=noise, seed=17 + i, schedule=sched))
    return out


def scenario_table(iterations: int, noise: float, dynamic: bool) -> str:
    ref = cpu4(0.0, dynamic)
    ideal = statistics.fmean(ideal_iteration_time(ref, X, it) for it in range(iterations))
    rows = []
    for label, policy, args in POLICIES:
        m = BatchSizeManager(policy, X, policy_args=args)
        recs = Simulation(m, cpu4(noise, dynamic)).run(iterations)
        its = [r.iteration_s for r in recs]
        mean_it = statistics.fmean(its)
        tail = statistics.fmean(its[20:])
        changes = sum(1 for a, b in zip(recs, recs[1:]) if a.sizes != b.sizes)
        dec = statistics.fmean(r.decision_s for r in recs[1:])     # recs[0] has no observe yet
        rows.append([label, f"{mean_it * 1e3:.1f}", f"{tail * 1e3:.1f}", f"{mean_it / ideal:.3f}",
                     str(changes), f"{dec * 1e3:.3f}", f"{dec / IDEAL_S * 100:.2f}%"])
    rows.append(["ideal bound c + X/Σv", f"{ideal * 1e3:.1f}", "", "1.000", "", "", ""])
    return table(["policy", "mean iteration ms", "mean after it. 20", "/ ideal", "split changes",
                  "decision ms", "decision / 50 ms"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer workers and iterations (smoke run)")
    ap.add_argument("--narx-budget-s", type=float, default=2.0,
                    help="skip NARX sizes projected above this many seconds per iteration")
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads for NARX fits (its nets are tiny: 1 is fastest)")
    args = ap.parse_args(argv)
    import torch  # imported before timing: NARX's first fit would otherwise pay for the import

    torch.set_num_threads(args.torch_threads)
    t0 = time.perf_counter()
    sizes = [10, 100] if args.quick else [10, 100, 1000, 10000]
    iterations = 120 if args.quick else 300
    print(f"## (a) Decision time per iteration (observe all reports + assign), X = {PER_SAMPLE_X}·N\n")
    print(scaling_table(sizes, args.narx_budget_s))
    print(f"\n## (b) 4 CPU-like workers, slowdowns {SLOWDOWNS}, X = {X}, overhead {OVERHEAD * 1e3:.0f} ms,"
          f" ideal = {IDEAL_S * 1e3:.0f} ms, 3% noise, {iterations} iterations\n")
    print("### static speeds\n")
    print(scenario_table(iterations, 0.03, dynamic=False))
    print("\n### worker 0 slowed 2x during iterations 100-199\n")
    print(scenario_table(iterations, 0.03, dynamic=True))
    print(f"\n(total {time.perf_counter() - t0:.0f} s, torch threads {torch.get_num_threads()}; the ideal "
          "bound is noise-free, so with 3% noise even a perfect split sits a few % above it: the "
          "barrier waits for the max of 4 noisy times)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
