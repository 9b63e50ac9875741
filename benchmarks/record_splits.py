"""Record the splits lbbsp-cpu makes on fixed scenarios, to show that a speed-up changed no decision.

Why: an optimization of the decision path must leave every split (and predicted iteration time)
as it was. This drives the BatchSizeManager through fixed simulated and fuzzed scenarios, with
the ``batchsize_manager`` and ``predictors`` of the checkout given by ``--root``, and writes every
decision to JSON; ``--compare A B`` lists the scenarios whose decisions differ, and where first.

Scenarios: 4 workers under every predictor (NARX and ARIMA refitting synchronously, so the
result does not depend on timing) with CPU quotas, a rotation, a speed change, a memory cap that
out-of-memory reports find, a leave and a join; 5 workers fed fuzzed reports (NaN, inf, None,
negative and denormal fields, duplicated reports); 6 workers under each variant of the policy's
options; 20, 100 and 1,000 workers.

Usage::

    python benchmarks/record_splits.py --root OLD_CHECKOUT --out before.json
    python benchmarks/record_splits.py --out after.json
    python benchmarks/record_splits.py --compare before.json after.json [--rtol 1e-12]

The exit status is 1 when any split differs (or a scenario is missing); predicted times that
differ beyond ``--rtol`` are listed (an optimization that reorders a sum moves their last bits).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

Decisions = list[list[Any]]


def _args(predictor: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    args = {"predictor": predictor, **(extra or {})}
    if predictor in ("narx", "arima"):
        args["refit"] = "sync"
    return args


def _predicted(manager: Any) -> str:
    """The predicted iteration time of the last split, exactly (repr of the float)."""
    return repr(manager.policy.predicted_s)


def simulated(n: int, predictor: str, iterations: int, extra: dict[str, Any] | None = None, *,
              quota: bool = True, cap: bool = False, churn: bool = False) -> Decisions:
    from batchsize_manager import BatchSizeManager
    from batchsize_manager.simulation import SimulatedWorker, Simulation

    m = BatchSizeManager("lbbsp-cpu", 64 * n, policy_args=_args(predictor, extra), min_batch=2)
    workers = []
    for i in range(n):
        q = (0.2 if i % 2 else 0.7) if quota and i % 3 == 1 else None
        workers.append(SimulatedWorker(1000.0 * (1 + i % 4), overhead=0.004 + 0.001 * (i % 3), noise=0.05,
                                       seed=i, cpu_quota=q, quota_schedule=((40, 0.5),) if q else (),
                                       schedule=((60, 500.0 + 100 * i),) if i % 4 == 2 else (),
                                       memory_cap=90 if cap and i == 0 else None))
    sim = Simulation(m, workers)
    out: Decisions = []
    for t in range(iterations):
        if churn and t == 30 and n > 2:
            sim.remove_worker(1)
        if churn and t == 45:
            sim.add_worker(n + 5, SimulatedWorker(2500.0, overhead=0.003, noise=0.05, seed=99))
        rec = sim.step()
        out.append([sorted(rec.sizes.items()), _predicted(m)])
    m.close()
    return out


def fuzzed(predictor: str, iterations: int, seed: int) -> Decisions:
    from batchsize_manager import BatchSizeManager, WorkerReport
    from ps_common.report import Telemetry

    rng = random.Random(seed)
    m = BatchSizeManager("lbbsp-cpu", 256, policy_args=_args(predictor))
    for w in range(5):
        m.join(w)
    odd = [None, math.nan, math.inf, -1.0, 0.0, 1e-320]

    def value(x: float) -> Any:
        return rng.choice(odd) if rng.random() < 0.08 else x

    out: Decisions = []
    for t in range(iterations):
        sizes = m.assign()
        out.append([sorted(sizes.items()), _predicted(m)])
        for w, x in sizes.items():
            c = 0.001 * x * (1 + w) * rng.uniform(0.8, 1.3)
            q = rng.choice([None, 0.3, 0.6, 2.0]) if w % 2 else None
            tel = Telemetry(data_s=value(0.001), compute_s=value(c), prev_push_s=value(0.002),
                            prev_pull_s=value(0.002), finish_s=value(c + rng.uniform(0.003, 0.02)),
                            cpu_quota=q, cpu_s=None if q is None else value(c * 1.1),
                            compute_cpu_s=None if q is None else value(c), proc_cpu=value(90.0),
                            host_cpu=50.0, cotenant_cpu=value(10.0), rss_mb=400.0, host_mem_pct=30.0)
            m.observe(WorkerReport(worker_id=w, iteration=t, batch_size=x, telemetry=tel))
            if rng.random() < 0.03:          # the same worker twice in one batch of reports
                m.observe(WorkerReport(worker_id=w, iteration=t, batch_size=x, telemetry=tel))
        if t == 20:
            m.leave(3)
        if t == 25:
            m.join(9)
    m.close()
    return out


VARIANTS: dict[str, dict[str, Any]] = {
    "tail-overhead": {"finish_tail": "overhead"}, "stalls-fixed": {"stalls": "fixed"},
    "no-quota-model": {"use_quota": False}, "no-overhead": {"use_overhead": False},
    "no-max-factor": {"max_factor": None}, "no-finish-quantile": {"finish_quantile": None}}


def record() -> dict[str, Decisions]:
    cases: dict[str, Decisions] = {}
    for predictor in ("ema", "last", "narx", "arima"):
        cases[f"sim4-{predictor}"] = simulated(4, predictor, 120, cap=True, churn=True)
        cases[f"fuzz-{predictor}"] = fuzzed(predictor, 80, 1)
    for name, extra in VARIANTS.items():
        cases[f"sim6-{name}"] = simulated(6, "ema", 80, extra, churn=True)
    cases["sim20-no-quotas"] = simulated(20, "ema", 60, quota=False)
    cases["sim100-ema"] = simulated(100, "ema", 60, churn=True)
    cases["sim100-narx"] = simulated(100, "narx", 40)
    cases["sim1000-ema"] = simulated(1000, "ema", 30)
    return cases


def compare(a: dict[str, Decisions], b: dict[str, Decisions], rtol: float = 0.0) -> list[str]:
    """One line per scenario whose splits differ (how many, and the first), whose predicted
    iteration times differ by more than ``rtol`` (relative), or that only one recording has."""
    lines = []
    for name in sorted(set(a) | set(b)):
        if name not in a or name not in b:
            lines.append(f"{name}: only in {'the second' if name not in a else 'the first'}")
            continue
        x, y = a[name], b[name]
        differ = [i for i, (p, q) in enumerate(zip(x, y)) if p[0] != q[0]]
        if differ or len(x) != len(y):
            i = differ[0] if differ else min(len(x), len(y))
            lines.append(f"{name}: {len(differ)} of {len(x)} splits differ (lengths {len(x)}, {len(y)}); "
                         f"first at decision {i}: {x[i] if i < len(x) else None} against "
                         f"{y[i] if i < len(y) else None}")
            continue
        worst = max((_relative(float(p[1]), float(q[1])) for p, q in zip(x, y)), default=0.0)
        if worst > rtol:
            lines.append(f"{name}: same splits; predicted times differ by up to {worst:.1e} (relative)")
    return lines


def _relative(p: float, q: float) -> float:
    if p == q or (math.isnan(p) and math.isnan(q)):
        return 0.0
    return abs(p - q) / max(abs(p), abs(q)) if math.isfinite(p) and math.isfinite(q) else math.inf


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", type=Path, default=ROOT, help="checkout to record (default: this one)")
    ap.add_argument("--out", type=Path, help="where to write the decisions (JSON)")
    ap.add_argument("--compare", type=Path, nargs=2, metavar=("A", "B"), help="compare two recordings")
    ap.add_argument("--rtol", type=float, default=0.0,
                    help="--compare: tolerated relative difference of predicted times (default: none)")
    args = ap.parse_args(argv)
    if args.compare:
        a, b = (json.loads(p.read_text()) for p in args.compare)
        diff = compare(a, b, args.rtol)
        print("\n".join(diff) if diff else f"all {len(a)} scenarios decided the same")
        return 1 if any("splits differ" in line or "only in" in line for line in diff) else 0
    if args.out is None:
        ap.error("--out FILE (or --compare A B)")
    sys.path.insert(0, str(args.root.resolve()))
    cases = record()
    args.out.write_text(json.dumps(cases))
    print(f"{len(cases)} scenarios, {sum(len(v) for v in cases.values())} decisions -> {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
