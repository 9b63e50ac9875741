"""PNG plots of a comparison: accuracy over time, per-worker iteration time and batch size."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ps_common.metrics import read_jsonl  # noqa: E402


def _worker_series(run_dir: Path, key: str) -> dict[str, tuple[list[float], list[float]]]:
    out = {}
    for path in sorted((run_dir / "metrics").glob("worker-*.jsonl")):
        recs = list(read_jsonl(path))
        if recs:
            t0 = recs[0]["wall_time"]
            out[path.stem] = ([r["wall_time"] - t0 for r in recs], [r[key] for r in recs])
    return out


def plot_comparison(out_dir: Path, rows: list[dict[str, Any]], modes: list[str]) -> list[Path]:
    paths = []
    colors = {m: f"C{i % 10}" for i, m in enumerate(modes)}
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        summ = Path(row["run_dir"]) / "summary.json"
        if not summ.exists():
            continue
        curve = [p for p in json.loads(summ.read_text())["accuracy_curve"] if p["elapsed"] is not None]
        label = row["mode"] if row["repeat"] == 0 else None
        ax.plot([p["elapsed"] for p in curve], [p["accuracy"] for p in curve], color=colors[row["mode"]],
                alpha=1.0 if row["repeat"] == 0 else 0.35, lw=1.3, label=label)
    ax.set_xlabel("training time (s)")
    ax.set_ylabel("test accuracy")
    ax.set_ylim(bottom=max(0.0, ax.get_ylim()[0]))
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    paths.append(out_dir / "accuracy_vs_time.png")
    fig.savefig(paths[-1], dpi=110)
    plt.close(fig)

    first = {r["mode"]: Path(r["run_dir"]) for r in rows if r["repeat"] == 0}
    for key, ylabel, fname, scale in (("iteration_s", "iteration time (ms)", "iteration_time.png", 1e3),
                                      ("batch_size", "batch size", "batch_size.png", 1.0)):
        n = len(modes)
        cols = min(3, n)
        nrows = math.ceil(n / cols)
        fig, axes = plt.subplots(nrows, cols, figsize=(4.2 * cols, 2.8 * nrows), squeeze=False, sharey=True)
        for ax, mode in zip(axes.flat, modes):
            if mode in first:
                for wname, (t, v) in _worker_series(first[mode], key).items():
                    ax.plot(t, [x * scale for x in v], lw=0.7, label=wname)
            ax.set_title(mode, fontsize=9)
            ax.set_xlabel("time (s)", fontsize=8)
            ax.set_ylabel(ylabel, fontsize=8)
            ax.grid(alpha=0.3)
        for ax in list(axes.flat)[n:]:
            ax.set_visible(False)
        axes.flat[0].legend(fontsize=6)
        fig.tight_layout()
        paths.append(out_dir / fname)
        fig.savefig(paths[-1], dpi=100)
        plt.close(fig)
    return paths
