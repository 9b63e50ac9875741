"""Turn a run directory's per-process metrics into a summary (JSON + Markdown)."""

from __future__ import annotations

import bisect
import json
import statistics
from pathlib import Path
from typing import Any

from ps_common.metrics import read_jsonl
from ps_common.report import Telemetry

ACCURACY_MARKS = (0.90, 0.95, 0.97, 0.98, 0.99)


def _records(path: Path) -> list[dict[str, Any]]:
    return list(read_jsonl(path)) if path.exists() else []


def percentile(values: list[float], q: float) -> float:
    """The q-quantile by nearest rank (a stall shows in p95 where a median hides it)."""
    s = sorted(values)
    return s[min(len(s) - 1, max(0, int(round(q * len(s))) - 1))]


def time_to_accuracy(curve: list[dict[str, Any]], target: float) -> dict[str, Any] | None:
    """First evaluation at or above ``target``: its elapsed seconds, iterations and samples.

    ``iterations`` counts global batches (samples / X), so async modes, whose versions are
    single-worker updates, compare with round modes on the same scale.
    """
    for point in curve:
        if point["accuracy"] >= target:
            return {"seconds": point["elapsed"], "iterations": point["iterations"],
                    "samples": point["samples"]}
    return None


def normalized_durations(coord: list[dict[str, Any]], global_batch: int) -> list[float]:
    """Seconds per global batch for each update: duration x X / samples applied by it."""
    out = []
    prev = 0
    for r in coord:
        applied = r.get("applied_samples", prev + global_batch)
        n = applied - prev
        prev = applied
        if n > 0:
            out.append(r["duration"] * global_batch / n)
    return out


def decision_stats(coord: list[dict[str, Any]]) -> dict[str, float] | None:
    """The batch policy's decision time per iteration (shard 0's records): median, mean and
    p95 of its wall time and of its CPU time, and each mean as a share of the mean iteration.
    With ``mode.plan_ahead`` the decision is off the path to the answers, so its CPU time is
    what it costs; the wall time also counts the workers that ran while it was preempted."""
    its = [r["duration"] for r in coord if r.get("duration")]
    out: dict[str, float] = {}
    for key, name in (("decision_s", ""), ("decision_cpu_s", "cpu_")):
        xs = [float(r[key]) for r in coord if r.get(key) is not None]
        if xs:
            out.update({f"{name}median_s": statistics.median(xs), f"{name}mean_s": statistics.fmean(xs),
                        f"{name}p95_s": percentile(xs, 0.95)})
            if its:
                out[f"{name}mean_share"] = statistics.fmean(xs) / statistics.fmean(its)
    return out or None


class PausedBefore:
    """evaluator.pause_training: the seconds training was paused before each version (shard 0's
    records carry the running total), which elapsed times leave out; 0 for runs without pauses."""

    def __init__(self, coord: list[dict[str, Any]]) -> None:
        pts = sorted((int(r["version"]), float(r["paused_total_s"])) for r in coord if "paused_total_s" in r)
        self._versions = [v for v, _ in pts]
        self._totals = [t for _, t in pts]
        self._each = [float(r["paused_s"]) for r in coord if r.get("paused_s")]
        self.recorded = bool(pts)
        self._after = {int(r["version"]): float(r.get("paused_s", 0.0)) for r in coord}
        # Round modes (iteration t makes version t + 1): a worker's wait after pushing iteration t
        # is the wait for version t + 1, which holds that version's pause.
        self.rounds = all(int(r.get("iteration", -1)) == int(r["version"]) - 1 for r in coord)

    def held_at(self, version: int) -> float:
        """The pause at ``version`` (the one before the next commit, as its record says)."""
        return self._after.get(version + 1, 0.0)

    def in_wait_of(self, iteration: int) -> float:
        """The pause inside a worker's wait after pushing ``iteration`` (round modes; 0 in async
        modes, whose pauses hold whichever worker asks then)."""
        return self.held_at(iteration + 1) if self.recorded and self.rounds else 0.0

    def at(self, version: int) -> float:
        """Total pause before ``version`` was made (the pause that measures it comes after)."""
        i = bisect.bisect_right(self._versions, version)
        return self._totals[i - 1] if i else 0.0

    def stats(self) -> dict[str, float] | None:
        if not self.recorded:
            return None
        return {"total_s": self._totals[-1], "count": len(self._each),
                "mean_s": statistics.fmean(self._each) if self._each else 0.0,
                "max_s": max(self._each, default=0.0)}


def _pause_lines(p: dict[str, float] | None) -> list[str]:
    if not p:
        return []
    return [f"| training paused for the evaluator (s, left out of the times above) | {p['total_s']:.1f} "
            f"in {p['count']:.0f} pauses (mean {p['mean_s']:.3f}, max {p['max_s']:.3f}) |"]


def final_versions(run_dir: Path) -> dict[str, Any]:
    """The version and history hash each shard saved at the end, and whether they all agree."""
    from ps_server.checkpoint import checkpoint_meta

    shards = []
    for path in sorted((run_dir / "final").glob("shard-*-v*.npz")):
        try:
            meta = checkpoint_meta(path)
        except Exception:  # a torn file of a killed run: report it as missing
            continue
        shards.append({"shard": meta.get("shard"), "version": meta.get("version"),
                       "log_hash": meta.get("log_hash")})
    agree = bool(shards) and len({(s["version"], s["log_hash"]) for s in shards}) == 1
    return {"shards": shards, "agree": agree, "version": shards[0]["version"] if agree else None}


def summarize(run_dir: str | Path, *, global_batch: int, target_accuracy: float | None = None,
              wall_s: float | None = None, stop_reason: str = "", num_shards: int | None = None) -> dict[str, Any]:
    run_dir = Path(run_dir)
    m = run_dir / "metrics"
    all_coord = _records(m / "coordinator.jsonl")
    coord = [r for r in all_coord if "event" not in r]
    events = [r for r in all_coord if "event" in r]
    evals = _records(m / "evaluator.jsonl")
    # evaluator.pause_training: elapsed leaves out the pauses before a version
    paused = PausedBefore(coord)
    start_wall = coord[0]["wall_time"] - coord[0]["elapsed"] - paused.at(coord[0]["version"]) if coord else None
    durations = normalized_durations(coord, global_batch)
    curve = []
    for e in evals:
        elapsed = e["version_time"] - start_wall - paused.at(e["version"]) if start_wall is not None else None
        curve.append({"version": e["version"], "samples": e["samples"],
                      "iterations": e["samples"] / global_batch,
                      "elapsed": None if elapsed is None else max(0.0, elapsed),
                      "accuracy": e["accuracy"], "loss": e["loss"]})
    if not evals:  # the evaluator ran elsewhere: shard 0 kept what it reported
        at = {0: 0.0, **{r["version"]: r["elapsed"] for r in coord}}
        seen: set[int] = set()
        for e in events:
            if e["event"] == "eval" and e["version"] not in seen:  # the final report repeats one
                seen.add(e["version"])
                curve.append({"version": e["version"], "samples": e["samples"],
                              "iterations": e["samples"] / global_batch, "elapsed": at.get(e["version"]),
                              "accuracy": e["accuracy"], "loss": e["loss"]})
    events = [e for e in events if e["event"] != "eval"]
    workers = _worker_stats(m, paused)
    workers_from = "workers' metrics"
    if not workers and coord:  # workers ran elsewhere: what their pushes told shard 0
        workers, workers_from = _worker_stats_from_coordinator(coord, paused), "shard 0's records"
    marks = sorted({*ACCURACY_MARKS, *([target_accuracy] if target_accuracy else [])})
    summary: dict[str, Any] = {
        "run_dir": str(run_dir),
        "stop_reason": stop_reason or (coord[-1].get("stop_reason", "") if coord else ""),
        "wall_s": wall_s,
        "training_s": coord[-1]["elapsed"] if coord else 0.0,
        "iterations": (coord[-1].get("applied_samples", 0) / global_batch) if coord else 0,
        "updates": len(coord),
        "samples": coord[-1].get("applied_samples", coord[-1]["samples"]) if coord else 0,
        "epochs": (coord[-1]["epoch"] if coord else 0),
        "median_iteration_s": statistics.median(durations) if durations else None,
        "mean_iteration_s": statistics.fmean(durations) if durations else None,
        "p95_iteration_s": percentile(durations, 0.95) if durations else None,
        "decision": decision_stats(coord),
        "evaluator_pauses": paused.stats(),
        "final_accuracy": curve[-1]["accuracy"] if curve else None,
        "final_accuracy_version": curve[-1]["version"] if curve else None,
        "best_accuracy": max((p["accuracy"] for p in curve), default=None),
        "final_loss": coord[-1]["loss"] if coord else None,
        "time_to_accuracy": {f"{t:g}": time_to_accuracy(curve, t) for t in marks},
        "accuracy_curve": curve,
        "membership_events": events,
        "workers": workers,
        "workers_from": workers_from,
        "final": {**final_versions(run_dir), "num_shards": num_shards},
    }
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (run_dir / "summary.md").write_text(summary_markdown(summary))
    return summary


def _less(seconds: float, paused: float) -> float:
    """A worker's time without the pause it held (unchanged where there was none)."""
    return max(0.0, seconds - paused) if paused else seconds


def _worker_stats(m: Path, paused: PausedBefore) -> dict[str, dict[str, Any]]:
    """Per-worker means from each worker's own records; a pause for the evaluator (round modes)
    is left out of the wait and the iteration that held it, as the coordinator's clock does."""
    workers: dict[str, dict[str, Any]] = {}
    for path in sorted(m.glob("worker-*.jsonl")):
        recs = _records(path)
        if not recs:
            continue
        wid = path.stem.split("-", 1)[1]
        reports = [Telemetry.from_record(r) for r in recs]  # the worker's report of each iteration
        held = [paused.in_wait_of(int(r.get("iteration", -2))) for r in recs]
        workers[wid] = {
            "iterations": len(recs),
            "mean_batch": statistics.fmean(r["batch_size"] for r in recs),
            "mean_compute_s": statistics.fmean(t.compute_s for t in reports),
            # this iteration's wait, not a report's
            "mean_wait_s": statistics.fmean(_less(r["wait_s"], h) for r, h in zip(recs, held)),
            "mean_iteration_s": statistics.fmean(_less(t.iteration_s, h) for t, h in zip(reports, held)),
        }
    return workers


def _worker_stats_from_coordinator(coord: list[dict[str, Any]], paused: PausedBefore) -> dict[str, dict[str, Any]]:
    """Per-worker means from the telemetry each committed push carried to shard 0 (wait and
    iteration times are the previous iteration's, as the worker reports them: a record's own
    ``paused_s`` is the pause inside them in round modes)."""
    per: dict[str, list[tuple[int, Telemetry, float]]] = {}
    for r in coord:
        held = float(r.get("paused_s", 0.0)) if paused.rounds else 0.0
        for wid, tel in r.get("workers", {}).items():
            if int(wid) in r.get("accepted", []):
                per.setdefault(wid, []).append((r["batch_sizes"][wid], Telemetry.from_record(tel), held))
    out = {}
    for wid in sorted(per, key=int):
        rows = per[wid]
        out[wid] = {"iterations": len(rows),
                    "mean_batch": statistics.fmean(x for x, _, _ in rows),
                    "mean_compute_s": statistics.fmean(t.compute_s for _, t, _ in rows),
                    "mean_wait_s": statistics.fmean(_less(t.prev_wait_s, h) for _, t, h in rows),
                    "mean_iteration_s": statistics.fmean(_less(t.iteration_s, h) for _, t, h in rows)}
    return out


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec)


def _final_line(final: dict[str, Any] | None) -> str:
    if not final or not final["shards"]:
        return "not saved"
    if final["agree"]:
        have, want = len(final["shards"]), final.get("num_shards")
        where = (f"on {have} shards" if not want or have >= want else
                 f"on the {have} of {want} shards whose files are here (the others saved theirs on their "
                 f"own hosts; each follower checked its history hash against shard 0's at every commit)")
        return f"{final['version']}, history {final['shards'][0]['log_hash']}, {where}"
    return "SHARDS DISAGREE: " + ", ".join(f"{s['shard']}: {s['version']}/{s['log_hash']}" for s in final["shards"])


def _decision_lines(d: dict[str, float] | None) -> list[str]:
    if not d:
        return []

    def scaled(key: str, factor: float) -> float | None:
        v = d.get(key)
        return None if v is None else v * factor

    lines = []
    for prefix, what in (("", "wall"), ("cpu_", "CPU")):
        if d.get(f"{prefix}mean_s") is None:
            continue                              # a run recorded before CPU times were
        ms = " / ".join(_fmt(scaled(f"{prefix}{k}", 1e3), ".3f") for k in ("median_s", "mean_s", "p95_s"))
        share = _fmt(scaled(f"{prefix}mean_share", 100.0), ".2f")
        lines.append(f"| batch-size decision (ms): median / mean / p95, {what} | {ms} (mean: {share}% "
                     "of an iteration) |")
    return lines


def summary_markdown(s: dict[str, Any]) -> str:
    lines = [
        f"# Run summary: {s['run_dir']}", "",
        "| metric | value |", "|---|---|",
        f"| stop reason | {s['stop_reason']} |",
        f"| training time (s) | {_fmt(s['training_s'], '.1f')} |",
        f"| iterations (global batches) | {s['iterations']:.0f} |",
        f"| samples | {s['samples']} |",
        f"| time per global batch (s): median / mean / p95 | {_fmt(s['median_iteration_s'], '.4f')} / "
        f"{_fmt(s.get('mean_iteration_s'), '.4f')} / {_fmt(s.get('p95_iteration_s'), '.4f')} |",
        *_decision_lines(s.get("decision")),
        *_pause_lines(s.get("evaluator_pauses")),
        f"| final test accuracy | {_fmt(s['final_accuracy'], '.4f')} |",
        f"| final version (every shard) | {_final_line(s.get('final'))} |",
        f"| final training loss | {_fmt(s['final_loss'], '.4f')} |",
    ]
    for t, hit in s["time_to_accuracy"].items():
        val = "not reached" if hit is None else f"{hit['seconds']:.1f} s, {hit['iterations']:.0f} it"
        lines.append(f"| time to {float(t):.0%} | {val} |")
    if s["workers"]:
        lines += ["", "| worker | iterations | mean batch | compute (s) | wait (s) | iteration (s) |",
                  "|---|---|---|---|---|---|"]
        for wid, w in s["workers"].items():
            lines.append(f"| {wid} | {w['iterations']} | {w['mean_batch']:.1f} | {w['mean_compute_s']:.4f} "
                         f"| {w['mean_wait_s']:.4f} | {w['mean_iteration_s']:.4f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """``ps-summary RUN_DIR``: the summary and plots of a run directory, e.g. shard 0's of a job
    started by hand across hosts (the evaluator's reports and the workers' telemetry reach
    shard 0, so its directory alone suffices)."""
    import argparse
    import sys

    from ps_common.config import load_config
    from ps_common.errors import PsError

    ap = argparse.ArgumentParser(prog="ps-summary", description=main.__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--config", default=None, help="the job's config (default RUN_DIR/config.yaml)")
    args = ap.parse_args(argv)
    run_dir = Path(args.run_dir)
    cfg_path = Path(args.config) if args.config else run_dir / "config.yaml"
    if not (run_dir / "metrics" / "coordinator.jsonl").exists():
        print(f"ps-summary: {run_dir} holds no coordinator records (metrics/coordinator.jsonl): give "
              "shard 0's --run-dir", file=sys.stderr)
        return 2
    try:
        cfg = load_config(cfg_path, env={})
    except PsError as exc:
        print(f"ps-summary: {exc}", file=sys.stderr)
        return 2
    from ps_launcher.plots import plot_run

    summary = summarize(run_dir, global_batch=cfg.training.global_batch,
                        target_accuracy=cfg.training.target_accuracy, num_shards=cfg.cluster.num_shards)
    plot_run(run_dir, summary)
    print(summary_markdown(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
