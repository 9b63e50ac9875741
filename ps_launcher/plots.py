"""PNG plots of one run: test accuracy over time, per-worker iteration time and batch size."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ps_common.metrics import read_jsonl  # noqa: E402


def plot_run(run_dir: str | Path, summary: dict[str, Any]) -> list[Path]:
    """Write accuracy.png and workers.png into ``run_dir``; returns the paths written."""
    run_dir = Path(run_dir)
    out = []
    curve = [p for p in summary.get("accuracy_curve", []) if p["elapsed"] is not None]
    if curve:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([p["elapsed"] for p in curve], [p["accuracy"] for p in curve], marker="o", ms=3)
        ax.set_xlabel("training time (s)")
        ax.set_ylabel("test accuracy")
        ax.set_title(f"{run_dir.name}")
        ax.grid(alpha=0.3)
        fig.tight_layout()
        path = run_dir / "accuracy.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    workers = sorted((run_dir / "metrics").glob("worker-*.jsonl"))
    if workers:
        fig, (a1, a2) = plt.subplots(2, 1, figsize=(7, 5), sharex=True)
        for path in workers:
            recs = list(read_jsonl(path))
            its = [r["iteration"] for r in recs]
            a1.plot(its, [r["iteration_s"] * 1e3 for r in recs], lw=0.7, label=path.stem)
            a2.plot(its, [r["batch_size"] for r in recs], lw=0.9, label=path.stem)
        a1.set_ylabel("iteration (ms)")
        a2.set_ylabel("batch size")
        a2.set_xlabel("iteration")
        a1.legend(fontsize=7)
        fig.tight_layout()
        path = run_dir / "workers.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        out.append(path)
    return out
