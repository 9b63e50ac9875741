"""One worker's link downgraded mid-run (the LB-BSP paper's micro-benchmark), on real links.

Every process runs on a host of its own (a network namespace on one bridge, ps_launcher.lab).
At ``--at-s`` seconds the last worker's link drops to ``--rate-mbit`` with ``--delay-ms`` added
each way (tbf and the lab's delay relay: real TCP). Its parameters and gradients now take longer
to cross; the worker cannot see that (its push returns once ZeroMQ has queued it), the servers
can (``finish_s``: from the answer that starts its iteration to its gradient being whole).

Runs BSP (uniform), LB-BSP with lbbsp-cpu and with lbbsp-gpu, ``--repeats`` times alternating,
and prints, before and after the downgrade: median / mean / p95 time per iteration, the model
bound, and how many iterations after the downgrade it took to get within 1.2x of the bound.

The bound for the link comes from the BSP run of the same repeat, after the downgrade: each
worker's speed v_i (x_i / compute_i) and the time outside compute c_i (finish_i - compute_i,
median), solved for equal finish times with sum x_i = X and x_i >= 1 (``equal_finish_times``;
the slowest worker's finish at that split, since a worker whose transfer alone takes longer
than the others' finish stays last at its floor), plus BSP's median time from the last
gradient to the next iteration's start. It is what a perfect split
would give with those measured costs; on 2 shared cores the speeds move with the load.

    python benchmarks/bench_lab_link.py [--rate-mbit 100] [--delay-ms 5] [--at-s 15]
        [--seconds 40] [--repeats 2] [--plot docs/results/lab_link/finish_times.png] [--variants 'NAME=ARGS;...']

Needs root, network namespaces, tbf and /dev/net/tun (the lab's links).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batchsize_manager.allocation import equal_finish_times  # noqa: E402
from ps_common.config import load_config  # noqa: E402
from ps_common.metrics import read_jsonl  # noqa: E402
from ps_launcher.lab import delay_available, netns_available  # noqa: E402
from ps_launcher.launcher import LocalCluster  # noqa: E402
from ps_launcher.plots import Panel, plot_panels  # noqa: E402
from ps_launcher.summary import percentile  # noqa: E402

MODES = {
    "BSP (uniform)": ["mode.batch_policy=uniform"],
    "LB-BSP (lbbsp-cpu)": ["mode.batch_policy=lbbsp-cpu", "mode.batch_policy_args={predictor: ema}"],
    "LB-BSP (lbbsp-gpu)": ["mode.batch_policy=lbbsp-gpu"],
}


def rows_of(run: Path) -> tuple[list[dict], float]:
    """Iteration rows and the wall time of the downgrade (from the lab's own log)."""
    rows = [r for r in read_jsonl(run / "metrics" / "coordinator.jsonl") if "event" not in r]
    lab = list(read_jsonl(run / "metrics" / "lab.jsonl"))
    change = next(r for r in lab if r.get("rate_mbit") is not None or (r.get("delay_ms") or 0) > 0)
    return rows, float(change["wall_time"])


def split_phases(rows: list[dict], t_change: float, settle: int) -> tuple[list[dict], list[dict]]:
    before = [r for r in rows if r["wall_time"] < t_change][settle:]
    after = [r for r in rows if r["wall_time"] >= t_change]
    return before, after


def link_bound(after_bsp: list[dict], global_batch: int) -> float:
    """Equal-finish iteration time with the per-worker costs BSP measured after the downgrade."""
    workers = sorted(after_bsp[0]["workers"], key=int)
    v, c = [], []
    for w in workers:
        tels = [r["workers"][w] for r in after_bsp if w in r["workers"]]
        xs = [r["batch_sizes"][w] for r in after_bsp if w in r["workers"]]
        v.append(statistics.median(x / t["compute_s"] for x, t in zip(xs, tels) if t["compute_s"] > 0))
        c.append(statistics.median(max(0.0, t["finish_s"] - t["compute_s"]) for t in tels if "finish_s" in t))
    x, _ = equal_finish_times(v, c, float(global_batch), [1.0] * len(v), [math.inf] * len(v))
    # A worker whose time outside compute alone exceeds the others' finish sits at its floor and
    # still finishes last: no split can take a link's transfer time away.
    t_eq = max(ci + xi / vi for ci, xi, vi in zip(c, x, v))
    tail = statistics.median(r["duration"] - max(t.get("finish_s", 0.0) for t in r["workers"].values())
                             for r in after_bsp)
    return t_eq + max(0.0, tail)


def recovery(after: list[dict], bound: float, window: int = 10) -> int | None:
    """Iterations after the downgrade until the median of ``window`` iterations is <= 1.2 x bound."""
    d = [r["duration"] for r in after]
    for k in range(len(d) - window + 1):
        if statistics.median(d[k:k + window]) <= 1.2 * bound:
            return k + window
    return None


def plot(runs: dict[str, Path], out: Path) -> None:
    panels = []
    for name, run in runs.items():
        rows, t_change = rows_of(run)
        t0 = rows[0]["wall_time"]
        series = {}
        for w in sorted(rows[-1]["workers"], key=int):
            pts = [(r["wall_time"] - t0, r["workers"][w]["finish_s"] * 1e3) for r in rows
                   if w in r["workers"] and "finish_s" in r["workers"][w]]
            series[f"worker {w}"] = ([p[0] for p in pts], [p[1] for p in pts])
        panels.append(Panel(name, "finish (ms)", series, [t_change - t0]))
    plot_panels(out, panels, "seconds since the first iteration (dashed: link downgraded)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--rate-mbit", type=float, default=100.0)
    ap.add_argument("--delay-ms", type=float, default=5.0)
    ap.add_argument("--at-s", type=float, default=15.0, help="seconds after the lab starts")
    ap.add_argument("--seconds", type=float, default=40.0, help="training seconds per run")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--settle", type=int, default=20, help="first iterations left out")
    ap.add_argument("--plot", type=Path, default=None, help="per-worker finish times of the last repeat")
    ap.add_argument("--variants", default="",
                    help="more lbbsp-cpu runs side by side: 'NAME=ARGS;NAME=ARGS' with ARGS a "
                         "mode.batch_policy_args mapping, e.g. 'no restart={predictor: ema, regime_factor: null}'")
    ap.add_argument("--from-dir", type=Path, default=None,
                    help="analyse the runs an earlier invocation left in this directory instead of running")
    args = ap.parse_args(argv)
    why = None if args.from_dir else netns_available() or (delay_available() if args.delay_ms > 0 else None)
    if why:
        print(f"bench_lab_link: lab links unavailable: {why}", file=sys.stderr)
        return 2
    n = args.workers
    link = (f"{{link: {{steps: [{{at_seconds: {args.at_s}, rate_mbit: {args.rate_mbit}"
            + (f", delay_ms: {args.delay_ms}" if args.delay_ms > 0 else "") + "}]}}")
    scenario = [f"scenario.workers=[{', '.join(['{}'] * (n - 1) + [link])}]", "scenario.name=link-downgrade"]
    base = [f"model.name={args.model}", "data.dataset=mnist", f"training.global_batch={args.global_batch}",
            "training.epochs=null", "training.target_accuracy=null", "training.max_iterations=null",
            f"training.max_seconds={args.seconds}", "evaluator.enabled=false", "cluster.num_shards=1",
            f"cluster.num_workers={n}", *scenario]
    work = args.from_dir or Path(tempfile.mkdtemp(prefix="lbps-bench-link-"))
    print(f"runs in {work}", flush=True)
    modes = dict(MODES)
    for item in filter(None, (v.strip() for v in args.variants.split(";"))):
        vname, _, vargs = item.partition("=")
        modes[f"LB-BSP {vname.strip()}"] = ["mode.batch_policy=lbbsp-cpu", f"mode.batch_policy_args={vargs.strip()}"]
    stats: dict[str, dict[str, list]] = {m: {"before": [], "after": [], "recover": [], "split": []} for m in modes}
    bounds: list[tuple[float, float]] = []
    last: dict[str, Path] = {}
    for r in range(args.repeats):
        bound_after = None
        for name, sets in modes.items():
            run = work / f"{r}-{'-'.join(name.replace('(', '').replace(')', '').split())}"
            if args.from_dir is None:
                cfg = load_config(None, [*base, f"run.seed={r}", *sets], env={})
                LocalCluster(cfg, run, progress=False).run()
            rows, t_change = rows_of(run)
            before, after = split_phases(rows, t_change, args.settle)
            if bound_after is None:  # BSP runs first in every repeat
                bound_after = link_bound(after[args.settle:], args.global_batch)
                bound_before = link_bound(before, args.global_batch)
                bounds.append((bound_before, bound_after))
            s = stats[name]
            s["before"] += [x["duration"] for x in before]
            s["after"] += [x["duration"] for x in after[args.settle:]]
            s["recover"].append(recovery(after, bound_after))
            s["split"].append([after[-1]["batch_sizes"][k] for k in sorted(after[-1]["batch_sizes"], key=int)])
            last[name] = run
            print(f"repeat {r} {name}: before {statistics.median([x['duration'] for x in before]) * 1e3:.1f} ms, "
                  f"after {statistics.median([x['duration'] for x in after]) * 1e3:.1f} ms "
                  f"(bound {bound_after * 1e3:.1f} ms)", flush=True)
    b_before = statistics.median(b[0] for b in bounds)
    b_after = statistics.median(b[1] for b in bounds)
    print(f"\n{args.model}, MNIST, X = {args.global_batch}, {n} workers each on its own host, 1 shard; "
          f"at {args.at_s:g} s worker {n - 1}'s link drops to {args.rate_mbit:g} Mbit/s"
          + (f" + {args.delay_ms:g} ms each way" if args.delay_ms > 0 else "")
          + f"; {args.seconds:g} s x {args.repeats} repeats\n")
    print(f"model bound (equal finish times with BSP's measured per-worker costs): before "
          f"{b_before * 1e3:.1f} ms, after {b_after * 1e3:.1f} ms\n")
    print("| mode | before: median (ms) | after: median | mean | p95 | after median / bound "
          "| iterations to 1.2x bound | last split |")
    print("|---|---|---|---|---|---|---|---|")
    for name, s in stats.items():
        a = s["after"]
        rec = ", ".join("never" if k is None else str(k) for k in s["recover"])
        print(f"| {name} | {statistics.median(s['before']) * 1e3:.1f} | {statistics.median(a) * 1e3:.1f} | "
              f"{statistics.fmean(a) * 1e3:.1f} | {percentile(a, 0.95) * 1e3:.1f} | "
              f"{statistics.median(a) / b_after:.2f} | {rec} | {s['split'][-1]} |")
    if args.plot:
        plot(last, args.plot)
        print(f"\nper-worker finish times: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
