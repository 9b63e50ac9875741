"""LB-BSP under static heterogeneity against BSP and the ideal balanced bound, in one run.

Four workers slowed 1, 1, 2, 4 (EMULATED: each sleeps (f - 1) x its measured compute). First
each worker's speed v_i is measured ALONE (a one-worker job with its slowdown, at batch X/N,
whole iterations: compute + communication). The ideal balanced bound is X / sum(v_i): the time
per iteration if X were split so that every worker finishes together, at those speeds. Then
BSP (uniform split) and LB-BSP (lbbsp-cpu) run the same 4-worker job; their median, mean and
p95 iteration times (LB-BSP after its first 20 iterations) are compared with the bound, and the
spread of the workers' finish times shows how even the barrier is.

    python benchmarks/bench_lbbsp_static.py [--iterations 150] [--predictor ema] [--model lenet]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from ps_common.config import load_config  # noqa: E402
from ps_common.metrics import read_jsonl  # noqa: E402
from ps_launcher.launcher import LocalCluster  # noqa: E402

SLOWDOWNS = [1.0, 1.0, 2.0, 4.0]


def run(base: list[str], extra: list[str], out: Path) -> list[dict]:
    cfg = load_config(ROOT / "configs" / "quick_synthetic.yaml", [*base, *extra], env={})
    LocalCluster(cfg, out, progress=False).run()
    return [r for r in read_jsonl(out / "metrics" / "coordinator.jsonl") if "event" not in r]


def finish_spread(recs: list[dict]) -> float:
    """max / min over workers of each one's 0.8 quantile of finish time as the servers saw it
    (what the barrier waits for; lbbsp-cpu equalises a high quantile of it)."""
    per: dict[str, list[float]] = {}
    for r in recs:
        for wid, tel in r["workers"].items():
            if "finish_s" in tel:
                per.setdefault(wid, []).append(tel["finish_s"])
    tails = [statistics.quantiles(v, n=10)[7] for v in per.values() if len(v) >= 2]
    return max(tails) / min(tails) if tails else float("nan")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=150)
    ap.add_argument("--global-batch", type=int, default=256)
    ap.add_argument("--model", default="lenet")
    ap.add_argument("--predictor", default="ema")
    ap.add_argument("--lb-args", default="",
                    help="more lbbsp-cpu arguments, YAML flow style without braces, e.g. 'finish_quantile: null'")
    args = ap.parse_args(argv)
    X, N = args.global_batch, len(SLOWDOWNS)
    base = [f"model.name={args.model}", f"training.global_batch={X}", "evaluator.enabled=false",
            "cluster.num_shards=1", "data.synthetic_train=8192"]
    tmp = Path(tempfile.mkdtemp(prefix="bench-lbbsp-"))
    alone = []
    for i, f in enumerate(SLOWDOWNS):
        recs = run(base, ["cluster.num_workers=1", f"training.global_batch={X // N}", "training.max_iterations=60",
                          f"scenario.slowdowns=[{f}]"], tmp / f"alone-{i}")
        t = statistics.median(r["duration"] for r in recs[10:])
        alone.append((X // N) / t)
    bound = X / sum(alone)
    scen = [f"cluster.num_workers={N}", f"training.max_iterations={args.iterations}",
            "scenario.name=static-1-1-2-4", f"scenario.slowdowns={SLOWDOWNS}"]
    bsp = run(base, [*scen, "mode.batch_policy=uniform"], tmp / "bsp")
    lb = run(base, [*scen, "mode.batch_policy=lbbsp-cpu",
                    f"mode.batch_policy_args={{predictor: {args.predictor}"
                    f"{', ' + args.lb_args if args.lb_args else ''}}}"], tmp / "lbbsp")
    t_bsp = statistics.median(r["duration"] for r in bsp[10:])
    t_lb = statistics.median(r["duration"] for r in lb[20:])
    stats = {name: (statistics.mean(r["duration"] for r in recs[skip:]),
                    statistics.quantiles([r["duration"] for r in recs[skip:]], n=20)[18],
                    finish_spread(recs[-30:]))
             for name, recs, skip in (("bsp", bsp, 10), ("lb", lb, 20))}
    decisions = [r["decision_s"] for r in lb[20:]]
    decision, decision_median = statistics.mean(decisions), statistics.median(decisions)
    final = lb[-1]["batch_sizes"]
    slow_of = {}
    for r in lb[-10:]:
        for w, tel in r["workers"].items():
            slow_of[w] = tel["slowdown"]
    split = ", ".join(f"{final[w]} (x{slow_of.get(w, 0):g})" for w in sorted(final, key=lambda w: slow_of.get(w, 0)))
    print(f"model {args.model}, X = {X}, {N} workers slowed {SLOWDOWNS} (EMULATED), 1 shard, "
          f"{args.iterations} iterations, lbbsp-cpu with {args.predictor}"
          f"{' (' + args.lb_args + ')' if args.lb_args else ''}\n")
    print("speeds measured alone (samples/s, whole iterations at batch X/N): "
          + ", ".join(f"{v:.0f}" for v in alone) + "\n")
    print("| | median iteration (ms) | mean | p95 | / ideal bound | / BSP | finish-time spread |")
    print("|---|---|---|---|---|---|---|")
    print(f"| ideal balanced bound X / sum(v_i) | {bound * 1e3:.1f} | | | 1.00 | {bound / t_bsp:.2f} | 1.00 |")
    for label, key, t in (("BSP (uniform split)", "bsp", t_bsp), (f"LB-BSP (lbbsp-cpu, {args.predictor})", "lb", t_lb)):
        mean, p95, spread = stats[key]
        print(f"| {label} | {t * 1e3:.1f} | {mean * 1e3:.1f} | {p95 * 1e3:.1f} | {t / bound:.2f} | "
              f"{t / t_bsp:.2f} | {spread:.2f} |")
    print("\nfinish-time spread: max / min over workers of each one's 0.8 quantile of the time from the "
          "answer that starts its iteration to its gradient being whole on every shard (last 30 iterations); "
          "1.00 is a perfectly even barrier.")
    print("\nper worker, last 30 iterations (medians; ms, samples/s): what the split is made from")
    print("| slowdown | run | batch | compute | finish | compute / batch (ms per sample) |")
    print("|---|---|---|---|---|---|")
    for name, recs in (("BSP", bsp), ("LB-BSP", lb)):
        per: dict[str, list[tuple[int, float, float]]] = {}
        slowdown: dict[str, float] = {}  # worker ids follow join order, which differs between runs
        for r in recs[-30:]:
            for w, tel in r["workers"].items():
                per.setdefault(w, []).append((r["batch_sizes"][w], tel["compute_s"], tel.get("finish_s", 0.0)))
                slowdown[w] = tel["slowdown"]
        for w in sorted(per, key=lambda w: slowdown[w]):
            xs, cs, fs = zip(*per[w])
            x, c = statistics.median(xs), statistics.median(cs)
            print(f"| x{slowdown[w]:g} | {name} | {x:.0f} | {c * 1e3:.1f} | {statistics.median(fs) * 1e3:.1f} | "
                  f"{c * 1e3 / x:.3f} |")
    print(f"\nLB-BSP final split (slowdown): {split}; decision time per iteration median "
          f"{decision_median * 1e3:.3f} ms, mean {decision * 1e3:.3f} ms = {decision / t_lb:.2%} of its median "
          f"iteration (wall clock in shard 0, which shares the cores with the workers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
