"""What idling between decisions does to a batch-size decision's CPU time on this host.

Why: bench_manager's table (c) finds a decision paced like a real run (one per 50 ms) about four
times as costly as the same decision in a tight loop. This splits that cost into its two parts
(applying the queued reports, then deciding) and measures them three ways: back to back, after
a 50 ms ``sleep`` (an idle core, as in the paced table), and after 50 ms of a spin-wait (a busy
core whose caches the spin barely touches). Two reference rows do a fixed small job (apply 4
reports to per-worker arrays) in plain Python and in numpy, so the host's own cold-start factor
is on the same table as the manager's; three more time one numpy call, 20 calls of one kind and
22 calls of 21 kinds, which shows what the cold start charges for (the kinds, not the calls).

Usage::

    python benchmarks/bench_decision_cold.py [--workers 4 100 1000] [--decisions 150]
    python benchmarks/bench_decision_cold.py --workers 4 --gaps 0 0.1 1 5 30 100
    python benchmarks/bench_decision_cold.py --workers 4 100 --refits narx arima

``--gaps``: the cold start against the idle time before a decision (the first row is the
tight loop, the ratio column is against it).

``--refits``: what the models that refit (NARX, ARIMA, refits in their helper process) add to a
paced decision: the decisions split by whether a refit job was handed to the helper in them,
one's results swapped in, both or neither, each group's mean CPU, with EMA's as the reference.

CPU times are this thread's (``time.thread_time``); mean over the decisions after 20 warm-up ones.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MODES = ("tight", "sleep 50 ms", "spin 50 ms")
WARMUP = 20
GAP_S = 0.05


def idle(mode: str | float) -> None:
    """Between two decisions: a sleep of ``mode`` seconds when a number, else the named mode."""
    if isinstance(mode, float):
        if mode > 0:
            time.sleep(mode)
    elif mode == "sleep 50 ms":
        time.sleep(GAP_S)
    elif mode == "spin 50 ms":
        end = time.perf_counter() + GAP_S
        while time.perf_counter() < end:
            pass


def manager_run(n: int, mode: str | float, decisions: int) -> tuple[float, float]:
    """Mean CPU seconds of (applying the reports, deciding) per decision, lbbsp-cpu with EMA."""
    from batchsize_manager import BatchSizeManager
    from batchsize_manager.simulation import SimulatedWorker, Simulation

    m = BatchSizeManager("lbbsp-cpu", 64 * n, policy_args={"predictor": "ema"})
    workers = [SimulatedWorker(1000.0 * (1 + i % 4), overhead=0.005, saturation_batch=0, noise=0.03, seed=i)
               for i in range(n)]
    sim = Simulation(m, workers)
    sim.run(30)
    assign = m.assign
    parts: list[tuple[float, float]] = []

    def timed_assign() -> dict[int, int]:
        t0 = time.thread_time()
        m._flush()                       # what assign() would do first, timed on its own
        t1 = time.thread_time()
        out = assign()
        parts.append((t1 - t0, time.thread_time() - t1))
        return out

    m.assign = timed_assign  # type: ignore[method-assign]
    for _ in range(decisions):
        sim.step()
        idle(mode)
    m.close()
    flush, decide = zip(*parts[WARMUP:])
    return statistics.fmean(flush), statistics.fmean(decide)


def refit_run(n: int, predictor: str, decisions: int, gap_s: float = 0.03) -> dict[str, list[float]]:
    """Decision CPU seconds (apply + decide) of lbbsp-cpu with ``predictor`` at ``n`` workers,
    one decision per ``gap_s`` of sleep, grouped by the refit traffic in each decision."""
    from batchsize_manager import BatchSizeManager
    from batchsize_manager.simulation import SimulatedWorker, Simulation

    m = BatchSizeManager("lbbsp-cpu", 64 * n, policy_args={"predictor": predictor})
    workers = [SimulatedWorker(1000.0 * (1 + i % 4), overhead=0.005, saturation_batch=0, noise=0.03, seed=i)
               for i in range(n)]
    sim = Simulation(m, workers)
    sim.run(40)                                   # past the models' first fits
    pred = m.policy.predictor
    groups: dict[str, list[float]] = {"none": [], "submit": [], "landing": [], "both": []}
    for i in range(decisions):
        jobs, fits = getattr(pred, "submitted_jobs", 0), getattr(pred, "landed_fits", 0)
        sim.step()
        submitted = getattr(pred, "submitted_jobs", 0) > jobs
        landed = getattr(pred, "landed_fits", 0) > fits
        if i >= WARMUP:
            key = "both" if submitted and landed else "submit" if submitted else "landing" if landed else "none"
            groups[key].append(m.last_decision_cpu_s)
        time.sleep(gap_s)
    m.close()
    return groups


def refit_table(workers: list[int], predictors: list[str], decisions: int) -> list[str]:
    lines = ["| predictor | workers | decisions: none / submit / landing / both | CPU µs, mean: none | "
             "submit | landing | both | all |", "|---|---|---|---|---|---|---|---|"]
    for n in workers:
        for predictor in ["ema", *predictors]:
            g = refit_run(n, predictor, decisions)
            every = [x for v in g.values() for x in v]
            cell = lambda v: f"{statistics.fmean(v) * 1e6:.0f}" if v else "-"  # noqa: E731
            lines.append(f"| {predictor} | {n:,} | {' / '.join(str(len(v)) for v in g.values())} | "
                         + " | ".join(cell(v) for v in g.values()) + f" | {cell(every)} |")
    return lines


def reference_jobs() -> dict[str, Callable[[], None]]:
    """Apply 4 reports (speed, EMA, overhead EMA, a window entry of 6 fields) in plain Python
    and in numpy: the same fixed job, to show the host's cold-start factor."""
    w, slots = 32, 64
    win = [np.full((slots, w), math.nan) for _ in range(6)]
    seen, fill = np.zeros(slots, dtype=np.int64), np.zeros(slots, dtype=np.int64)
    ema, over = np.full(slots, math.nan), np.full(slots, math.nan)
    reps = [(i, 64.0, 0.05 + 0.01 * i, 0.06 + 0.01 * i) for i in range(4)]

    def plain() -> None:
        for s, x, c, f in reps:
            v = x / c
            seen[s] += 1
            e = ema[s]
            ema[s] = v if e != e else 0.3 * v + 0.7 * e
            o = max(0.0, f - c)
            p = over[s]
            over[s] = o if p != p else 0.2 * o + 0.8 * p
            pos = int(fill[s]) % w
            for a, val in zip(win, (x, f, c, v, c, c)):
                a[s, pos] = val
            fill[s] += 1

    def vectorised() -> None:
        s = np.fromiter((r[0] for r in reps), np.int64, len(reps))
        x, c, f = (np.fromiter((r[k] for r in reps), float, len(reps)) for k in (1, 2, 3))
        v = x / c
        seen[s] += 1
        e = ema[s]
        ema[s] = np.where(np.isnan(e), v, 0.3 * v + 0.7 * e)
        o = np.maximum(0.0, f - c)
        p = over[s]
        over[s] = np.where(np.isnan(p), o, 0.2 * o + 0.8 * p)
        pos = fill[s] % w
        for a, val in zip(win, (x, f, c, v, c, c)):
            a[s, pos] = val
        fill[s] += 1

    return {"reference: apply 4 reports, plain Python": plain,
            "reference: apply 4 reports, numpy": vectorised}


def numpy_call_jobs() -> dict[str, Callable[[], None]]:
    """What numpy's calls cost after idling, by how many different ones run: one call, 20 calls
    of one function, and 22 calls of 21 different functions (each on 8 floats). Why: a decision
    for a few workers is some 100 small numpy calls of some 50 kinds, and the host charges the
    first call of each kind for the caches it finds cold, more than the work itself."""
    a = np.linspace(1.0, 2.0, 8)

    def one() -> None:
        a.sum()

    def same() -> None:
        for _ in range(20):
            a.sum()

    def distinct() -> None:
        b = a + 1.0
        c = b * 2.0
        d = np.sqrt(c)
        d.max()
        f = np.where(b > 1.5, c, d)
        g = np.sort(f)
        np.isfinite(g).all()
        j = np.minimum(b, c)
        np.maximum(j, 0.0)
        b @ c
        np.count_nonzero(b)
        n = np.flatnonzero(b > 1.5)
        p = np.concatenate([b[n], c])
        np.isnan(p).any()
        np.floor(np.full(4, 1.5)).astype(np.int64)

    return {"reference: 1 numpy call": one, "reference: 20 numpy calls, one kind": same,
            "reference: 22 numpy calls, 21 kinds": distinct}


def reference_run(job: Callable[[], None], mode: str | float, decisions: int) -> float:
    ts = []
    for _ in range(decisions):
        t0 = time.thread_time()
        job()
        ts.append(time.thread_time() - t0)
        idle(mode)
    return statistics.fmean(ts[WARMUP:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[4, 100, 1000])
    ap.add_argument("--decisions", type=int, default=150)
    ap.add_argument("--gaps", type=float, nargs="+", default=None, metavar="MS",
                    help="instead: one whole decision (apply + decide, EMA, at the first --workers) "
                         "after sleeps of these many ms, to show how the cold start grows with the idle time")
    ap.add_argument("--refits", nargs="+", default=None, metavar="PREDICTOR", choices=("narx", "arima"),
                    help="instead: decisions paced 30 ms apart, grouped by the refit traffic in them "
                         "(a job handed to the helper, results swapped in), for these predictors and EMA")
    args = ap.parse_args(argv)
    if args.decisions <= WARMUP:
        ap.error(f"--decisions must exceed the {WARMUP} warm-up ones")
    us = lambda s: f"{s * 1e6:.1f}"  # noqa: E731
    if args.gaps is not None:
        n = args.workers[0]
        print(f"## One lbbsp-cpu (ema) decision at {n} workers after an idle sleep: CPU µs (mean of "
              f"{args.decisions - WARMUP} decisions)\n")
        print("| sleep between decisions (ms) | apply the reports | decide | whole | whole / first row |")
        print("|---|---|---|---|---|")
        base = None
        for gap in args.gaps:
            apply_s, decide_s = manager_run(n, gap / 1e3, args.decisions)
            base = base or apply_s + decide_s
            print(f"| {gap:g} | {us(apply_s)} | {us(decide_s)} | {us(apply_s + decide_s)} | "
                  f"{(apply_s + decide_s) / base:.1f}x |")
        return 0
    if args.refits is not None:
        print(f"## One lbbsp-cpu decision per 30 ms, by the refit traffic in it (CPU µs, mean; "
              f"{args.decisions - WARMUP} decisions after {WARMUP} more and 40 iterations of warm-up)\n")
        print("\n".join(refit_table(args.workers, args.refits, args.decisions)))
        return 0
    lines = ["| what | workers | " + " | ".join(f"{m}: CPU µs" for m in MODES) + " | sleep / tight |",
             "|---|---|" + "---|" * (len(MODES) + 1)]
    for n in args.workers:
        runs = {mode: manager_run(n, mode, args.decisions) for mode in MODES}
        for i, part in enumerate(("lbbsp-cpu (ema): apply the queued reports", "lbbsp-cpu (ema): decide")):
            vals = [runs[mode][i] for mode in MODES]
            lines.append(f"| {part} | {n:,} | " + " | ".join(us(v) for v in vals)
                         + f" | {vals[1] / vals[0]:.1f}x |")
    jobs = [(name, "4", job) for name, job in reference_jobs().items()]
    jobs += [(name, "", job) for name, job in numpy_call_jobs().items()]
    for name, workers, job in jobs:
        vals = [reference_run(job, mode, args.decisions) for mode in MODES]
        lines.append(f"| {name} | {workers} | " + " | ".join(us(v) for v in vals) + f" | {vals[1] / vals[0]:.1f}x |")
    print(f"## Decision CPU time after idling ({args.decisions} decisions per cell, the first {WARMUP} "
          "left out; 50 ms between decisions as in bench_manager's paced table)\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
