"""PNG plots of one run: test accuracy over time, per-worker iteration time and batch size."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ps_common.metrics import read_jsonl  # noqa: E402


@dataclass
class Panel:
    """One panel of :func:`plot_panels`: a line per series, each ``(xs, ys)``, and dashed
    vertical marks (a link downgraded, quotas moved)."""

    title: str
    ylabel: str
    series: dict[str, tuple[list[float], list[float]]]
    marks: list[float] = field(default_factory=list)


def plot_panels(out: Path, panels: list[Panel], xlabel: str) -> None:
    """Panels stacked on one shared x axis (the lab benchmarks' per-worker finish times and
    splits), the legend on the first, saved to ``out``."""
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, 2.5 * len(panels)), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        for label, (xs, ys) in panel.series.items():
            ax.plot(xs, ys, lw=0.8, label=label)
        for x in panel.marks:
            ax.axvline(x, color="k", ls="--", lw=0.6)
        ax.set_ylabel(panel.ylabel)
        ax.set_title(panel.title, fontsize=9)
        ax.set_ylim(bottom=0)
    axes[0, 0].legend(fontsize=7, ncol=4)
    axes[-1, 0].set_xlabel(xlabel)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


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
