"""BatchSizeManager benchmark on the pure timing model (no sockets).

(a) Decision time per iteration (observe of every worker's report + assign), measured by the
    manager itself with ``time.perf_counter``, for 10 to 10,000 simulated workers, in a tight loop
    (the CPU cost of a decision). Reports carry finish times, as the coordinator's do; timed
    after lbbsp-cpu's 32-iteration window of them has filled (the steady state). Target: <= 10
    ms at 10,000 workers for lbbsp-cpu (EMA, last), lbbsp-gpu and uniform. One row has every
    worker under a CPU quota, so lbbsp-cpu's quota model (``quota_speed``) runs for all of them.
(b) Iteration time of uniform (BSP), static, lbbsp-cpu and lbbsp-gpu on 4 CPU-like workers with
    speeds 1, 1, 1/2, 1/4 (slowdowns 1, 1, 2, 4), against the ideal balanced bound
    c + X / Σ v_i, scaled so that the ideal iteration takes 50 ms. A second scenario adds a 2x
    slowdown of worker 0 from iteration 100 to 199. NARX and ARIMA refit synchronously here
    (``refit="sync"``: the same decisions as one predictor object per worker made, so the balance
    columns compare with earlier runs); their background-refit cost is in (c).
(c) Decision time as a fraction of the iteration time, for every predictor, at 4, 100 and 1,000
    workers: the (b) workers replicated (X = 64 N, ideal iteration 50 ms at every N). Twice:
    in a tight loop (the CPU cost of a decision; ratio to the simulated iteration of the run), and
    *paced* like a real job: after each decision the loop sleeps until the simulated iteration
    time has passed, so the process is idle between decisions (ratio to a 50 ms real-run
    iteration). Paced is the pessimistic case on this shared 2-core VM: after ~50 ms idle the
    caches and the CPU are cold and the same decision costs 2-4x its tight-loop time; in a real
    coordinator the same process handles every worker's push and pull in between.
    NARX and ARIMA run with the default background refits (a helper process) and, for
    comparison, synchronous ones. "wake-up p95" is the 95th percentile of how late the loop woke
    up from its sleep (a refit thread holding the GIL, or CPU contention, shows up there and not
    in the decision time); "lag" is the mean number of iterations between a refit's submission
    and its swap-in (the staleness background refits add).
(d) What planning ahead costs in balance. With ``mode.plan_ahead`` (the default) the coordinator
    decides the split of iteration t+1 while t computes, from the reports of t-1 and earlier;
    without it, after t's last report, on the path to the answers. The (b) scenarios run both
    ways (``Simulation(plan_ahead=...)``, same seeds): mean iteration against the ideal bound,
    the first 50 iterations (where a search converges), the 10 iterations after each speed
    change (where a one-iteration-older report shows) and how often the split moved; then
    lbbsp-gpu on GPU-like workers (flat below 32 samples), the kind its search is made for.

Simulated times are model seconds; decision times are real seconds on this machine (shared, so
they drift from run to run: compare rows of one run, not runs). Every table gives the median,
mean, p95 and max of the per-iteration decision time.

    python benchmarks/bench_manager.py [--quick] [--tables abcd] [--root DIR] [--compare DIR]

``--root`` runs the same tables against another checkout (e.g. the previous implementation);
features it lacks (refit modes) are skipped. ``--compare DIR`` prints (a) for DIR ("before") and
this checkout ("after") side by side, each row measured in two fresh processes started one right
after the other (alternating which goes first), so that both see the same machine load, in the
same steady state as (a) (each checkout's own window of finish times filled).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def _setup_path(root: Path) -> None:
    sys.path.insert(0, str(root))


def table_header(header: list[str]) -> str:
    return "| " + " | ".join(header) + " |\n|" + "|".join("---" for _ in header) + "|"


def table_row(cells: list[Any]) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(header: list[str], rows: list[list[Any]]) -> str:
    return "\n".join([table_header(header), *map(table_row, rows)])


def pct(xs: list[float], q: float) -> float:
    """q-th percentile (nearest rank, as a stall counts once it is in the sample)."""
    ys = sorted(xs)
    if not ys:
        return math.nan
    k = max(0, min(len(ys) - 1, math.ceil(q / 100.0 * len(ys)) - 1))
    return ys[k]


def stats_ms(ds: list[float]) -> list[str]:
    """median, mean, p95, max in ms."""
    return [f"{statistics.median(ds) * 1e3:.3f}", f"{statistics.fmean(ds) * 1e3:.3f}",
            f"{pct(ds, 95) * 1e3:.3f}", f"{max(ds) * 1e3:.3f}"]


def supports_refit() -> bool:
    import inspect

    from batchsize_manager.lbbsp import LBBSPCpuPolicy

    return "refit" in inspect.signature(LBBSPCpuPolicy.__init__).parameters


def make_manager(policy: str, X: int, args: dict[str, Any]) -> Any:
    from batchsize_manager import BatchSizeManager

    return BatchSizeManager(policy, X, policy_args=args)


def close(m: Any) -> None:
    if hasattr(m, "close"):
        m.close()


def refit_stats(m: Any) -> tuple[Any, str]:
    """(predictor or None, 'fits landed / submitted jobs, mean lag') for batched refit models."""
    pol = getattr(m, "_policy", None) or m.policy
    pred = getattr(pol, "predictor", None)
    if pred is None or not hasattr(pred, "landed_fits"):
        return None, ""
    lag = pred.lag_sum / pred.landed_fits if pred.landed_fits else math.nan
    return pred, f"{pred.landed_fits} fits landed, lag {lag:.1f} it."


def warm_refits(m: Any, timeout: float = 60.0) -> None:
    """Let a background helper finish starting (imports) and catch up before timing."""
    pol = getattr(m, "_policy", None) or m.policy
    pred = getattr(pol, "predictor", None)
    if pred is not None and hasattr(pred, "drain"):
        pred.drain(timeout)


# ----------------------------------------------------------------------------- (a) scaling
PER_SAMPLE_X = 64          # global batch = 64 samples per worker in the scaling table


def finish_window() -> int:
    """lbbsp-cpu's default window of finish times (0 in a checkout that has none)."""
    import inspect

    from batchsize_manager.lbbsp import LBBSPCpuPolicy

    param = inspect.signature(LBBSPCpuPolicy).parameters.get("finish_window")
    return int(param.default) if param is not None else 0

#: (label, policy, policy args, CPU quota of every simulated worker or None)
SCALING: list[tuple[str, str, dict[str, Any], float | None]] = [
    ("lbbsp-cpu (ema)", "lbbsp-cpu", {"predictor": "ema"}, None),
    ("lbbsp-cpu (ema), every worker under a 0.5-core quota", "lbbsp-cpu", {"predictor": "ema"}, 0.5),
    ("lbbsp-cpu (last)", "lbbsp-cpu", {"predictor": "last"}, None),
    ("lbbsp-gpu", "lbbsp-gpu", {}, None),
    ("uniform (reference)", "uniform", {}, None),
    ("lbbsp-cpu (narx, background)", "lbbsp-cpu", {"predictor": "narx", "refit": "background"}, None),
    ("lbbsp-cpu (arima, background)", "lbbsp-cpu", {"predictor": "arima", "refit": "background"}, None),
    ("lbbsp-cpu (narx, sync)", "lbbsp-cpu", {"predictor": "narx", "refit": "sync"}, None),
]


def scaling_workers(n: int, quota: float | None = None) -> list[Any]:
    """Mixed speeds, 3% noise; with ``quota``, each held to that share of a core (the reports
    then carry the quota and CPU times, and lbbsp-cpu plans by them)."""
    from batchsize_manager.simulation import SimulatedWorker

    kw = {} if quota is None else {"cpu_quota": quota}
    return [SimulatedWorker(1000.0 * (1 + i % 4), overhead=0.005, saturation_batch=0, noise=0.03,
                            seed=i, **kw) for i in range(n)]


def measure_decisions(policy: str, args: dict[str, Any], n: int, warmup: int, iters: int,
                      quota: float | None = None) -> tuple[list[float], float, str]:
    """Per-iteration decision seconds for ``n`` workers with mixed speeds and 3% noise, the mean
    simulated iteration, and a refit note."""
    from batchsize_manager.simulation import Simulation

    m = make_manager(policy, PER_SAMPLE_X * n, args)
    sim = Simulation(m, scaling_workers(n, quota))
    sim.run(warmup)
    warm_refits(m)
    gc.collect()                      # earlier rows' garbage is not this row's pause
    out, its = [], []
    for _ in range(iters):
        rec = sim.step()                  # assign() of this step closes the previous decision
        out.append(m.last_decision_s)
        its.append(rec.iteration_s)
    note = refit_stats(m)[1]
    close(m)
    return out, statistics.fmean(its), note


def scaling_table(sizes: list[int], budget_s: float, refit_ok: bool) -> None:
    """Print (a), each row as soon as it is measured (a run cut short by a time limit keeps them)."""
    def row(cells: list[Any]) -> None:
        print(table_row(cells), flush=True)

    print(table_header(["policy", "workers", "median ms", "mean ms", "p95 ms", "max ms", "µs per worker",
                        "mean / sim. iteration", "note"]), flush=True)
    for label, policy, args, quota in SCALING:
        if "refit" in args and not refit_ok:
            if args["refit"] != "sync":
                continue
            args = {k: v for k, v in args.items() if k != "refit"}
            label = label.replace(", sync", "")
        model = args.get("predictor") in ("narx", "arima")
        per_worker_s = None
        for n in sizes:
            if model and per_worker_s is not None and per_worker_s * n > budget_s:
                row([label, f"{n:,}", "not measured", "", "", "", "", "",
                     f"projected ~{per_worker_s * n * 1e3:,.0f} ms/iteration"])
                continue
            if model and per_worker_s is None and n > 1000:
                row([label, f"{n:,}", "not measured", "", "", "", "", "",
                     "no smaller size measured to project its time from"])
                continue
            # Measured in the steady state of a long run: after lbbsp-cpu's window of finish
            # times (32 iterations) has filled; while it fills, rows are ragged and a decision
            # costs up to a quarter more at 10,000 workers. Models fit from their 10th-12th
            # observation, every 10 after: 20 iterations (two refit periods); the others 20
            # iterations (10 at 10k).
            warmup = finish_window() + 2
            iters = 20 if model or n <= 1000 else 10
            t0 = time.perf_counter()
            ds, it_s, note = measure_decisions(policy, args, n, warmup, iters, quota)
            wall = time.perf_counter() - t0
            per_worker_s = statistics.fmean(ds) / n
            row([label, f"{n:,}", *stats_ms(ds), f"{per_worker_s * 1e6:.2f}",
                 f"{statistics.fmean(ds) / it_s * 100:.2f}%",
                 f"{iters} it., {wall:.1f} s wall" + (f"; {note}" if note else "")])


def _one_measurement(root: Path, policy: str, args: dict[str, Any], n: int, warmup: int,
                     iters: int) -> list[float]:
    """Decision times of one (a) row, measured in a fresh process importing ``root``, after
    that checkout's own finish window (see (a)) and ``warmup`` more iterations."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--root", str(root), "--one",
           json.dumps([policy, args, n, warmup, iters])]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _supports_refit_at(root: Path) -> bool:
    """Does the checkout at ``root`` take lbbsp-cpu's ``refit`` argument? (asked in a fresh process)"""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--root", str(root), "--supports-refit"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120)
    return bool(json.loads(out.stdout.strip().splitlines()[-1]))


def compare_table(sizes: list[int], other: Path) -> str:
    """(a) for this checkout and ``other`` side by side: each row measured in two fresh processes
    started one after the other (alternating which goes first), so both see the same machine."""
    rows = []
    pairs = [(label, policy, args) for label, policy, args, quota in SCALING
             if args.get("refit") in (None, "sync") and quota is None]
    old_refit = _supports_refit_at(other)   # else its NARX refits inside the decision anyway
    flip = False
    for label, policy, args in pairs:
        old_args = args if old_refit else {k: v for k, v in args.items() if k != "refit"}
        for n in sizes:
            if args.get("predictor") == "narx" and n > 1000:
                continue
            # the steady state, as in (a): past each checkout's own window of finish times
            # (the child adds it; NARX models fit from their 10th-12th report)
            warmup = 2
            iters = 20 if n <= 1000 or args.get("predictor") == "narx" else 10
            jobs = {"new": (ROOT, args), "old": (other, old_args)}
            res = {}
            for which in (("old", "new") if flip else ("new", "old")):
                root, a = jobs[which]
                res[which] = _one_measurement(root, policy, a, n, warmup, iters)
            flip = not flip
            new, old = res["new"], res["old"]
            rows.append([label, f"{n:,}", *stats_ms(old), *stats_ms(new),
                         f"{statistics.fmean(old) / statistics.fmean(new):.1f}x",
                         f"{pct(old, 95) / pct(new, 95):.1f}x"])
    return table(["policy", "workers", "before median ms", "mean", "p95", "max", "after median ms",
                  "mean", "p95", "max", "mean before/after", "p95 before/after"], rows)


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
    ("lbbsp-cpu (arima, sync refits)", "lbbsp-cpu", {"predictor": "arima", "refit": "sync"}),
    ("lbbsp-cpu (narx, sync refits)", "lbbsp-cpu", {"predictor": "narx", "refit": "sync"}),
    ("lbbsp-gpu", "lbbsp-gpu", {}),
]


def cpu_workers(n: int, noise: float, dynamic: bool) -> list[Any]:
    """The 4 (b) workers replicated to ``n``; speeds scaled so that the ideal stays 50 ms."""
    from batchsize_manager.simulation import SimulatedWorker

    out = []
    for i in range(n):
        f = SLOWDOWNS[i % 4]
        v = BASE / f
        sched = [(100, v / 2), (200, v)] if dynamic and i % 4 == 0 else []
        out.append(SimulatedWorker(v, overhead=OVERHEAD, noise=noise, seed=17 + i, schedule=sched))
    return out


def _strip_refit(args: dict[str, Any], refit_ok: bool) -> dict[str, Any]:
    return args if refit_ok else {k: v for k, v in args.items() if k != "refit"}


def scenario_table(iterations: int, noise: float, dynamic: bool, refit_ok: bool) -> str:
    from batchsize_manager.simulation import Simulation, ideal_iteration_time

    ref = cpu_workers(4, 0.0, dynamic)
    ideal = statistics.fmean(ideal_iteration_time(ref, X, it) for it in range(iterations))
    rows = []
    for label, policy, args in POLICIES:
        m = make_manager(policy, X, _strip_refit(args, refit_ok))
        gc.collect()
        recs = Simulation(m, cpu_workers(4, noise, dynamic)).run(iterations)
        close(m)
        its = [r.iteration_s for r in recs]
        mean_it = statistics.fmean(its)
        tail = statistics.fmean(its[20:])
        changes = sum(1 for a, b in zip(recs, recs[1:]) if a.sizes != b.sizes)
        ds = [r.decision_s for r in recs[1:]]                     # recs[0] has no observe yet
        rows.append([label, f"{mean_it * 1e3:.1f}", f"{tail * 1e3:.1f}", f"{mean_it / ideal:.3f}",
                     str(changes), *stats_ms(ds), f"{statistics.fmean(ds) / IDEAL_S * 100:.2f}%",
                     f"{pct(ds, 95) / IDEAL_S * 100:.2f}%"])
    rows.append(["ideal bound c + X/Σv", f"{ideal * 1e3:.1f}", "", "1.000", "", "", "", "", "", "", ""])
    return table(["policy", "mean iteration ms", "mean after it. 20", "/ ideal", "split changes",
                  "decision median ms", "mean ms", "p95 ms", "max ms", "mean / 50 ms",
                  "p95 / 50 ms"], rows)


# ----------------------------------------------------------------------------- (d) plan ahead
GPU_X = 512


def gpu_workers(noise: float, dynamic: bool) -> list[Any]:
    """4 GPU-like workers (flat below 32 samples, memory cap 512) with the (b) slowdowns."""
    from batchsize_manager.simulation import SimulatedWorker

    out = []
    for i, f in enumerate(SLOWDOWNS):
        v = 4000.0 / f
        sched = [(100, v / 2), (200, v)] if dynamic and i == 0 else []
        out.append(SimulatedWorker(v, overhead=0.01, saturation_batch=32, memory_cap=512, noise=noise,
                                   seed=5 + i, schedule=sched))
    return out


def plan_ahead_table(iterations: int, noise: float, refit_ok: bool) -> str:
    """Each (b) policy and scenario decided after the last report and planned ahead; then
    lbbsp-gpu on GPU-like workers, the kind its search is made for."""
    from batchsize_manager.simulation import Simulation, ideal_iteration_time

    changes = (100, 200)                            # both kinds of workers: slowed, restored
    gpu_rows = [("uniform (BSP)", "uniform", {}), ("lbbsp-gpu", "lbbsp-gpu", {})]
    cases = [(row, kind, dynamic) for kind, rows_ in (("CPU-like", POLICIES), ("GPU-like", gpu_rows))
             for dynamic in (False, True) for row in rows_]

    def workers(kind: str, noise_: float, dynamic: bool) -> list[Any]:
        return cpu_workers(4, noise_, dynamic) if kind == "CPU-like" else gpu_workers(noise_, dynamic)

    rows = []
    for (label, policy, args), kind, dynamic in cases:
        total = X if kind == "CPU-like" else GPU_X
        ideal = statistics.fmean(ideal_iteration_time(workers(kind, 0.0, dynamic), total, it)
                                 for it in range(iterations))
        runs = {}
        for ahead in (False, True):
            m = make_manager(policy, total, _strip_refit(args, refit_ok))
            gc.collect()
            recs = Simulation(m, workers(kind, noise, dynamic), plan_ahead=ahead).run(iterations)
            close(m)
            its = [r.iteration_s * 1e3 for r in recs]
            after = [its[i] for c in changes for i in range(c, min(c + 10, len(its)))] if dynamic else []
            moves = sum(1 for a, b in zip(recs, recs[1:]) if a.sizes != b.sizes)
            runs[ahead] = (statistics.fmean(its) / 1e3 / ideal, statistics.fmean(its[:50]),
                           statistics.fmean(after) if after else None, moves)
        now, ahead_r = runs[False], runs[True]
        rows.append([label, kind, "speed change at 100, 200" if dynamic else "static", f"{now[0]:.3f}",
                     f"{ahead_r[0]:.3f}", f"{ahead_r[0] / now[0]:.3f}", f"{now[1]:.1f} / {ahead_r[1]:.1f}",
                     "" if now[2] is None else f"{now[2]:.1f} / {ahead_r[2]:.1f}", f"{now[3]} / {ahead_r[3]}"])
    return table(["policy", "workers", "scenario", "/ ideal, decided after the last report",
                  "/ ideal, planned ahead", "ahead / after", "first 50 it. ms (after / ahead)",
                  "10 it. after each change ms (after / ahead)", "split changes (after / ahead)"], rows)


# ----------------------------------------------------------------------------- (c) overhead
OVERHEAD_ROWS = [
    ("uniform", "uniform", {}),
    ("lbbsp-gpu", "lbbsp-gpu", {}),
    ("lbbsp-cpu (last)", "lbbsp-cpu", {"predictor": "last"}),
    ("lbbsp-cpu (ema)", "lbbsp-cpu", {"predictor": "ema"}),
    ("lbbsp-cpu (arima)", "lbbsp-cpu", {"predictor": "arima", "refit": "background"}),
    ("lbbsp-cpu (narx)", "lbbsp-cpu", {"predictor": "narx", "refit": "background"}),
    ("lbbsp-cpu (arima, sync refits)", "lbbsp-cpu", {"predictor": "arima", "refit": "sync"}),
    ("lbbsp-cpu (narx, sync refits)", "lbbsp-cpu", {"predictor": "narx", "refit": "sync"}),
]


def overhead_run(policy: str, args: dict[str, Any], n: int, warmup: int, iters: int,
                 deadline_s: float, paced: bool) -> tuple[list[float], list[float], list[float], str]:
    """Decision seconds, simulated iteration seconds and wake-up delays of a tight or paced run."""
    from batchsize_manager.simulation import Simulation

    m = make_manager(policy, 64 * n, args)
    sim = Simulation(m, cpu_workers(n, 0.03, False))
    sim.run(warmup)
    warm_refits(m)
    gc.collect()                      # earlier rows' garbage is not this row's pause
    ds, its, wake = [], [], []
    end = time.perf_counter() + deadline_s
    for _ in range(iters):
        t0 = time.perf_counter()
        rec = sim.step()
        ds.append(m.last_decision_s)
        its.append(rec.iteration_s)
        rest = rec.iteration_s - (time.perf_counter() - t0)
        if paced and rest > 0:
            t1 = time.perf_counter()
            time.sleep(rest)
            wake.append(max(0.0, time.perf_counter() - t1 - rest))
        if time.perf_counter() > end:
            break
    note = refit_stats(m)[1]
    close(m)
    return ds, its, wake, note


def _pcts(ds: list[float], ref_s: float) -> str:
    return f"{statistics.fmean(ds) / ref_s * 100:.2f}% / {pct(ds, 95) / ref_s * 100:.2f}%"


def overhead_table(sizes: list[int], iters: int, budget_s: float, refit_ok: bool) -> str:
    rows = []
    for label, policy, args in OVERHEAD_ROWS:
        if "refit" in args and not refit_ok:
            if args["refit"] != "sync":
                continue
            args = {k: v for k, v in args.items() if k != "refit"}
        model = args.get("predictor") in ("narx", "arima")
        sync_model = model and args.get("refit", "sync") == "sync"
        for n in sizes:
            if sync_model and n > 100:
                rows.append([label, f"{n:,}", "not measured (sync refits: ~N/10 fits inside "
                             "every decision)", "", "", "", "", "", "", "", ""])
                continue
            warm = 30 if model else 10
            tight, its, _, _ = overhead_run(policy, args, n, warm, iters, budget_s, paced=False)
            paced, _, wake, note = overhead_run(policy, args, n, warm, iters, budget_s, paced=True)
            it_s = statistics.fmean(its)
            rows.append([label, f"{n:,}", f"{it_s * 1e3:.1f}",
                         f"{statistics.fmean(tight) * 1e3:.3f} / {pct(tight, 95) * 1e3:.3f} / "
                         f"{max(tight) * 1e3:.2f}", _pcts(tight, it_s),
                         f"{statistics.median(paced) * 1e3:.3f} / {statistics.fmean(paced) * 1e3:.3f}"
                         f" / {pct(paced, 95) * 1e3:.3f} / {max(paced) * 1e3:.2f}",
                         _pcts(paced, IDEAL_S), f"{pct(wake, 95) * 1e3:.2f}" if wake else "",
                         f"{len(tight)}+{len(paced)} it." + (f"; paced: {note}" if note else "")])
    return table(["policy", "workers", "sim. iteration ms",
                  "tight loop: mean / p95 / max ms", "tight: mean / p95 of sim. iteration",
                  "paced: median / mean / p95 / max ms", "paced: mean / p95 of 50 ms",
                  "wake-up p95 ms", "note"], rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer workers and iterations (smoke run)")
    ap.add_argument("--root", type=Path, default=ROOT,
                    help="checkout whose batchsize_manager/predictors to measure (default: this one)")
    ap.add_argument("--tables", default="abcd", help="which tables to print (subset of 'abcd')")
    ap.add_argument("--sizes", type=int, nargs="+", default=None,
                    help="(a): these worker counts instead of 10 100 1000 10000 (NARX and ARIMA above 1,000 "
                         "are measured only when a smaller size was, to project their time from)")
    ap.add_argument("--model-budget-s", type=float, default=2.0,
                    help="(a): skip NARX/ARIMA sizes projected above this many seconds per iteration")
    ap.add_argument("--paced-budget-s", type=float, default=20.0,
                    help="(c): wall-clock cap per row")
    ap.add_argument("--compare", type=Path, default=None, metavar="DIR",
                    help="print (a) for DIR (before) and this checkout (after) side by side, each "
                         "row measured in fresh processes one right after the other")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--supports-refit", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    _setup_path(args.root.resolve())
    if args.supports_refit:                  # internal: for --compare, JSON on stdout
        print(json.dumps(supports_refit()))
        return 0
    if args.one is not None:                 # internal: one (a) measurement, JSON on stdout
        policy, pargs, n, warmup, iters = json.loads(args.one)
        warmup += finish_window()    # internal to --compare: past this checkout's window
        print(json.dumps(measure_decisions(policy, pargs, n, warmup, iters)[0]))
        return 0
    if args.compare is not None:
        sizes = [10, 100] if args.quick else [10, 100, 1000, 10000]
        print(f"## (a') Decision time per iteration, before ({args.compare}) and after (this "
              f"checkout), tight loop, X = {PER_SAMPLE_X}·N\n")
        print(compare_table(args.sizes or sizes, args.compare.resolve()))
        return 0
    import numpy  # noqa: F401  (imported before timing)

    try:                 # the previous implementation trained NARX with torch: import it untimed
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover
        pass
    import batchsize_manager

    refit_ok = supports_refit()
    t0 = time.perf_counter()
    print(f"(measuring {Path(batchsize_manager.__file__).resolve().parent.parent})\n")
    sizes = [10, 100] if args.quick else [10, 100, 1000, 10000]
    iterations = 120 if args.quick else 300
    if "a" in args.tables:
        print(f"## (a) Decision time per iteration (observe all reports + assign), tight loop, "
              f"X = {PER_SAMPLE_X}·N\n")
        scaling_table(args.sizes or sizes, args.model_budget_s, refit_ok)
    if "b" in args.tables:
        print(f"\n## (b) 4 CPU-like workers, slowdowns {SLOWDOWNS}, X = {X}, overhead "
              f"{OVERHEAD * 1e3:.0f} ms, ideal = {IDEAL_S * 1e3:.0f} ms, 3% noise, {iterations} "
              "iterations\n")
        print("### static speeds\n")
        print(scenario_table(iterations, 0.03, dynamic=False, refit_ok=refit_ok))
        print("\n### worker 0 slowed 2x during iterations 100-199\n")
        print(scenario_table(iterations, 0.03, dynamic=True, refit_ok=refit_ok))
    if "c" in args.tables:
        csizes = [4, 100] if args.quick else [4, 100, 1000]
        citers = 40 if args.quick else 120
        print(f"\n## (c) Decision time vs iteration time, tight loop and paced like a real run (the "
              f"(b) workers replicated, X = 64·N, ideal 50 ms), {citers} measured iterations each\n")
        print(overhead_table(csizes, citers, args.paced_budget_s, refit_ok))
    if "d" in args.tables:
        print(f"\n## (d) Planning ahead: the split of t+1 decided while t computes (reports up to t-1), "
              f"against deciding it after t's last report; the (b) workers, then 4 GPU-like ones (same "
              f"slowdowns, flat below 32 samples, X = {GPU_X}); 3% noise, {iterations} iterations\n")
        print(plan_ahead_table(iterations, 0.03, refit_ok))
    print(f"\n(total {time.perf_counter() - t0:.0f} s; the ideal bound is noise-free, so with 3% "
          "noise even a perfect split sits a few % above it: the barrier waits for the max of 4 "
          "noisy times)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
