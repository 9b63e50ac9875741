"""Plots of bench_gpu_memory.py's JSON lines (``--json``): the saturation curves, and for one
comparison of policies the time of every iteration and each worker's share and compute time.

    python benchmarks/plot_gpu_results.py docs/results/gpu_h100/results_call1.jsonl \\
        --out docs/results/gpu_h100
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def label(rec: dict) -> str:
    share = f", MPS {rec['sm_percent']}% of the SMs" if rec.get("sm_percent") else ""
    return f"{rec['model']}{share}"


def plot_saturation(recs: list[dict], out: Path) -> Path:
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(11, 4))
    for rec in recs:
        pts = [(p["batch"], p["s"]) for p in rec["saturation"] if p["s"] is not None]
        b, s = zip(*pts)
        ax_t.plot(b, [t * 1e3 for t in s], marker="o", label=label(rec))
        ax_s.plot(b, [t / n * 1e6 for n, t in pts], marker="o", label=label(rec))
    for ax, what in ((ax_t, "ms per forward + backward"), (ax_s, "µs per sample")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel(what)
        ax.grid(True, which="both", alpha=0.3)
    ax_t.legend(fontsize=8)
    fig.suptitle(f"Saturation on {recs[0]['device']}: flat below a batch size, then linear")
    fig.tight_layout()
    path = out / "saturation.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_policies(rec: dict, out: Path, name: str) -> Path:
    runs = [r for r in rec["runs"] if "error" not in r]
    fig, (ax_it, ax_w) = plt.subplots(1, 2, figsize=(12, 4.2))
    for r in runs:
        ax_it.plot([d * 1e3 for d in r["durations"]], label=f"{r['policy']} (median {r['median'] * 1e3:.1f} ms)")
    ax_it.axvline(rec["skip"], color="grey", ls=":", lw=1)
    ax_it.set_xlabel("iteration")
    ax_it.set_ylabel("iteration time, ms")
    ax_it.set_ylim(bottom=0)
    ax_it.legend(fontsize=8)
    ax_it.grid(alpha=0.3)
    n = len(runs[0]["workers"])
    width = 0.8 / len(runs)
    for k, r in enumerate(runs):
        xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(n)]
        ax_w.bar(xs, [w["median_compute_ms"] or 0 for w in r["workers"]], width, label=r["policy"])
        for x, w in zip(xs, r["workers"]):
            ax_w.text(x, (w["median_compute_ms"] or 0) + 1, f"{w['median_batch']:.0f}", ha="center",
                      fontsize=6, rotation=90)
    ticks = []
    for w in runs[0]["workers"]:
        bits = [f"worker {w['worker']}"]
        if w["sm_percent"] is not None:
            bits.append(f"{w['sm_percent']}% SMs")
        if w["slowdown"] != 1:
            bits.append(f"x{w['slowdown']:g} (emulated)")
        if w["limit_mb"] is not None:
            bits.append(f"{w['limit_mb']:.0f} MB")
        ticks.append("\n".join(bits))
    ax_w.set_xticks(range(n), ticks, fontsize=7)
    ax_w.set_ylabel("median compute ms (bar), samples (label)")
    ax_w.legend(fontsize=8)
    fig.suptitle(f"{rec['model']} on {rec['device']}, X = {rec['global_batch']} (statistics after iteration "
                 f"{rec['skip']})")
    fig.tight_layout()
    path = out / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", nargs="+", type=Path, help="JSON-lines files written by bench_gpu_memory.py --json")
    ap.add_argument("--out", type=Path, default=Path("."))
    args = ap.parse_args(argv)
    recs = [json.loads(line) for f in args.results for line in f.read_text().splitlines() if line.strip()]
    curves = [r for r in recs if r.get("saturation")]
    if curves:
        print(plot_saturation(curves, args.out))
    for k, rec in enumerate(r for r in recs if r.get("runs")):
        print(plot_policies(rec, args.out, f"policies_{k}"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
