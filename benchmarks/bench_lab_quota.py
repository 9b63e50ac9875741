"""LB-BSP against BSP and the ideal balanced bound under real kernel CPU quotas, one run.

Each worker runs in a cgroup with its share of a core (``--quotas``, static, or rotating
between workers every ``--rotate-s`` seconds). In every repeat each quota's speed is measured alone:
one worker under its own quota, training whole iterations of X / N samples through a shard
(v_i = samples per second over all its measured iterations: throughput, quota stalls
included). The ideal balanced bound is X / sum(v_i). Then
BSP (uniform split) and LB-BSP (lbbsp-cpu) run with all workers at once, ``--repeats`` times,
alternating. Prints median / mean / p95 time per iteration and the ratio to the bound.

    python benchmarks/bench_lab_quota.py [--quotas 0.7,0.7,0.2,0.2] [--rotate-s 0] [--repeats 3]
        [--seconds 30] [--model lenet] [--global-batch 512] [--variants 'NAME=ARGS;...']
        [--plan-ahead-off]
        [--plot docs/results/lab_quota/finish_times_rotating.png]

``--plan-ahead-off`` adds LB-BSP with ``mode.plan_ahead=false`` (the split decided after an
iteration's last report rather than while it computes), to measure what planning ahead costs.

``--plot``: every worker's finish time (from the answer that starts its iteration to its
gradient being whole on the shards) and LB-BSP's split over the last repeat, the quota moves
dashed.

Needs root and the cgroup cpu controller (the lab's CPU quotas).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ps_common.config import load_config  # noqa: E402
from ps_common.metrics import read_jsonl  # noqa: E402
from ps_launcher.lab import cpu_quota_available  # noqa: E402
from ps_launcher.launcher import LocalCluster  # noqa: E402
from ps_launcher.plots import Panel, plot_panels  # noqa: E402
from ps_launcher.summary import percentile  # noqa: E402


def scenario_sets(quotas: list[float], rotate_s: float) -> list[str]:
    if rotate_s > 0:
        return [f"scenario.rotation={{period_s: {rotate_s}, fractions: {quotas}}}", "scenario.name=rotating"]
    workers = ", ".join(f"{{cpu_quota: {q}}}" for q in quotas)
    return [f"scenario.workers=[{workers}]", "scenario.name=static"]


def base_sets(args: argparse.Namespace) -> list[str]:
    return [f"model.name={args.model}", "data.dataset=mnist", f"training.global_batch={args.global_batch}",
            "training.epochs=null", "training.target_accuracy=null", "training.max_iterations=null",
            "evaluator.enabled=false", f"cluster.num_shards={args.shards}"]


def _iteration_records(run_dir: Path, skip: int) -> list[dict]:
    return [r for r in read_jsonl(run_dir / "metrics" / "coordinator.jsonl") if "event" not in r][skip:]


def durations(run_dir: Path, skip: int) -> list[float]:
    return [r["duration"] for r in _iteration_records(run_dir, skip)]


def decisions(run_dir: Path, skip: int) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of the batch policy's decision per iteration (shard 0's records)."""
    return [(r["decision_s"], r["decision_cpu_s"]) for r in _iteration_records(run_dir, skip)
            if r.get("decision_cpu_s") is not None]


def alone_speed(args: argparse.Namespace, quota: float, work: Path, tag: str) -> float:
    """Samples per second of one worker alone under ``quota``, whole iterations of X/N."""
    n = len(args.quotas)
    batch = args.global_batch // n
    cfg = load_config(None, [*base_sets(args), f"training.global_batch={batch}", "cluster.num_workers=1",
                             f"training.max_seconds={args.alone_seconds}",
                             f"scenario.workers=[{{cpu_quota: {quota}}}]"], env={})
    LocalCluster(cfg, work / f"alone-{tag}", progress=False).run()
    d = durations(work / f"alone-{tag}", args.skip)
    # Throughput, not the median iteration: under a quota most iterations run at full speed and
    # every few the worker waits out the rest of its CFS period, so the median of the durations
    # is the unthrottled speed (at 0.7 of a core it swung between 0.7x and 1x of a core's speed).
    return batch * len(d) / sum(d)


def plot(runs: dict[str, Path], out: Path) -> None:
    """Per-worker finish times of each run, then the batch sizes of the last one."""
    panels = []
    for name, run in runs.items():
        rows = [r for r in read_jsonl(run / "metrics" / "coordinator.jsonl") if "event" not in r]
        t0 = rows[0]["wall_time"]
        moves = sorted({r["wall_time"] - t0 for r in read_jsonl(run / "metrics" / "lab.jsonl")
                        if "cpu_quota" in r and r.get("t", 0.0) > 0})
        finish, split = {}, {}
        for w in sorted(rows[-1]["workers"], key=int):
            seen = [r for r in rows if w in r["workers"]]
            timed = [r for r in seen if "finish_s" in r["workers"][w]]
            finish[f"worker {w}"] = ([r["wall_time"] - t0 for r in timed],
                                     [r["workers"][w]["finish_s"] * 1e3 for r in timed])
            split[f"worker {w}"] = ([r["wall_time"] - t0 for r in seen], [r["batch_sizes"][w] for r in seen])
        panels.append(Panel(name, "finish (ms)", finish, moves))
    panels.append(Panel(f"{name}: split", "batch size", split, moves))
    plot_panels(out, panels, "seconds since the first iteration (dashed: the quotas moved)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quotas", default="0.7,0.7,0.2,0.2", help="each worker's share of a core")
    ap.add_argument("--rotate-s", type=float, default=0.0, help="rotate the quotas between workers (s); 0: static")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0, help="training seconds per run")
    ap.add_argument("--alone-seconds", type=float, default=12.0)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--global-batch", type=int, default=512)
    ap.add_argument("--shards", type=int, default=1)
    ap.add_argument("--skip", type=int, default=20, help="first iterations left out")
    ap.add_argument("--policy-args", default="{predictor: ema}")
    ap.add_argument("--plot", type=Path, default=None, help="per-worker finish times of the last repeat")
    ap.add_argument("--variants", default="",
                    help="more LB-BSP runs side by side: 'NAME=ARGS;NAME=ARGS' with ARGS a "
                         "mode.batch_policy_args mapping, e.g. 'q0.5={predictor: ema, finish_quantile: 0.5}'")
    ap.add_argument("--keep-runs", action="store_true",
                    help="keep every run's directory (records, summaries) and print where; by default "
                         "they are removed once the table and the plot are made")
    ap.add_argument("--plan-ahead-off", action="store_true",
                    help="also run LB-BSP with mode.plan_ahead=false (decided after the last report)")
    args = ap.parse_args(argv)
    if why := cpu_quota_available():
        print(f"bench_lab_quota: CPU quotas unavailable: {why}", file=sys.stderr)
        return 2
    args.quotas = [float(q) for q in args.quotas.split(",")]
    work = Path(tempfile.mkdtemp(prefix="lbps-bench-quota-"))
    alone: dict[float, list[float]] = {q: [] for q in sorted(set(args.quotas))}
    modes = {"BSP (uniform)": ["mode.batch_policy=uniform"],
             "LB-BSP (lbbsp-cpu)": ["mode.batch_policy=lbbsp-cpu", f"mode.batch_policy_args={args.policy_args}"]}
    if args.plan_ahead_off:
        modes["LB-BSP, decided after the last report"] = [*modes["LB-BSP (lbbsp-cpu)"], "mode.plan_ahead=false"]
    for item in filter(None, (v.strip() for v in args.variants.split(";"))):
        vname, _, vargs = item.partition("=")
        modes[f"LB-BSP {vname.strip()}"] = ["mode.batch_policy=lbbsp-cpu", f"mode.batch_policy_args={vargs.strip()}"]
    samples: dict[str, list[float]] = {m: [] for m in modes}
    decided: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    splits: dict[str, list] = {m: [] for m in modes}
    last_runs: dict[str, Path] = {}
    for r in range(args.repeats):
        for q in alone:   # alone speeds in every repeat
            alone[q].append(alone_speed(args, q, work, f"{q:g}-{r}"))
            print(f"repeat {r} alone at {q:g} core: {alone[q][-1]:.0f} samples/s", flush=True)
        for name, sets in modes.items():
            cfg = load_config(None, [*base_sets(args), f"cluster.num_workers={len(args.quotas)}",
                                     f"training.max_seconds={args.seconds}", f"run.seed={r}",
                                     *scenario_sets(args.quotas, args.rotate_s), *sets], env={})
            run = work / f"{r}-{'-'.join(name.replace('(', '').replace(')', '').split())}"
            LocalCluster(cfg, run, progress=False).run()
            last_runs[name] = run
            d = durations(run, args.skip)
            samples[name] += d
            decided[name] += decisions(run, args.skip)
            last = [x for x in read_jsonl(run / "metrics" / "coordinator.jsonl") if "event" not in x][-1]
            splits[name].append([last["batch_sizes"][k] for k in sorted(last["batch_sizes"], key=int)])
            print(f"repeat {r} {name}: median {statistics.median(d) * 1e3:.1f} ms", flush=True)
    speeds = {q: statistics.median(vs) for q, vs in alone.items()}
    bound = args.global_batch / sum(speeds[q] for q in args.quotas)
    kind = f"rotating every {args.rotate_s:g} s" if args.rotate_s else "static"
    print(f"\n{args.model}, MNIST, X = {args.global_batch}, {len(args.quotas)} workers with CPU quotas "
          f"{args.quotas} ({kind}), {args.shards} shard(s), {args.seconds:g} s x {args.repeats} repeats "
          f"(first {args.skip} iterations of each left out)\n")
    print(f"ideal balanced bound X / sum(v_i) = {bound * 1e3:.1f} ms (v_i alone under its quota, median "
          "of the repeats: " + ", ".join(f"{q:g} core {speeds[q]:.0f}/s (range {min(alone[q]):.0f}-"
                                         f"{max(alone[q]):.0f})" for q in sorted(speeds)) + ")\n")
    print("| mode | median (ms) | mean (ms) | p95 (ms) | median / bound | mean / bound | last split "
          "| decision wall ms: mean / p95 | decision CPU ms: mean / p95 | decision CPU / iteration |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, xs in samples.items():
        med, mean, p95 = statistics.median(xs), statistics.fmean(xs), percentile(xs, 0.95)
        wall = [w for w, _ in decided[name]]
        cpu = [c for _, c in decided[name]]
        dec = (f"{statistics.fmean(wall) * 1e3:.3f} / {percentile(wall, 0.95) * 1e3:.3f} | "
               f"{statistics.fmean(cpu) * 1e3:.3f} / {percentile(cpu, 0.95) * 1e3:.3f} | "
               f"{statistics.fmean(cpu) / mean * 100:.2f}%") if cpu else "- | - | -"
        print(f"| {name} | {med * 1e3:.1f} | {mean * 1e3:.1f} | {p95 * 1e3:.1f} | {med / bound:.2f} | "
              f"{mean / bound:.2f} | {splits[name][-1]} | {dec} |")
    print("\nThe decision's wall time also counts the time the coordinator was preempted (the workers "
          "ran); its CPU time is what it cost the host. With mode.plan_ahead it is made while the "
          "workers compute, off the path to the answers.")
    if args.plot:
        plot(last_runs, args.plot)
        print(f"\nper-worker finish times: {args.plot}")
    if args.keep_runs:
        print(f"\nrun directories: {work}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
