"""``ps-compare``: run several modes on the same scenario, model, data and seeds, and report.

A comparison file is a job config (every section of ``ps-launch`` configs) plus a ``compare``
section listing the modes, each a name and the config overrides that make it:

    compare:
      repeats: 3
      modes:
        - {name: BSP, set: {mode.sync: bsp}}
        - {name: SSP s=5, set: {mode.sync: ssp, mode.staleness: 5}}

Repeat r of every mode runs with seed ``run.seed + r``, so each repeat meets every mode with
the same model initialisation, sample order and scenario. Runs alternate modes (r0: A, B, C;
r1: A, B, C ...) so slow drift of a shared machine spreads over all modes.
"""

from __future__ import annotations

import csv
import json
import statistics
from pathlib import Path
from typing import Any, Optional, Sequence

import yaml
from pydantic import Field, ValidationError
from tqdm import tqdm

from ps_common.config import ConfigError, JobConfig, StrictModel, format_validation_error, validate
from ps_common.errors import PsError
from ps_launcher.forked_process import fork_server_if_wanted
from ps_launcher.launcher import LocalCluster, new_run_dir
from ps_launcher.run_dir import RunDirInUse
from ps_server.job_config import check_job_config

COLUMNS = ["mode", "repeat", "seed", "median_iteration_s", "mean_iteration_s", "p95_iteration_s",
           "iterations_to_target", "time_to_target_s", "decision_cpu_ms", "decision_cpu_share",
           "final_accuracy", "training_s", "iterations", "samples", "stop_reason", "run_dir"]


class ComparisonInterrupted(PsError):
    """Ctrl-C, SIGTERM or SIGHUP: the run under way was stopped and gathered, no other starts;
    the report holds the runs that completed."""


class ModeSpec(StrictModel):
    name: str
    set: dict[str, Any] = Field(default_factory=dict)


class CompareConfig(StrictModel):
    repeats: int = Field(3, ge=1)
    modes: list[ModeSpec] = Field(min_length=1)
    target_accuracy: Optional[float] = Field(None, gt=0, le=1)


def load_comparison(path: str | Path, overrides: Sequence[str] = ()) -> tuple[JobConfig, CompareConfig]:
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except FileNotFoundError:
        raise ConfigError(f"comparison file not found: {p}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p}: not valid YAML: {exc}") from None
    if not isinstance(data, dict) or "compare" not in data:
        raise ConfigError(f"{p}: needs a 'compare' section with the modes to run")
    try:
        comp = CompareConfig.model_validate(data.pop("compare") or {})
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, f"{p} compare section").replace("  ", "  compare.")) from None
    base = validate(data, source=str(p)).with_overrides(list(overrides))
    base = base.model_copy(update={"scenario": base.scenario.resolved(p.parent)})
    names = [m.name for m in comp.modes]
    if len(set(names)) != len(names):
        raise ConfigError(f"{p}: compare.modes names must be unique, got {names}")
    for m in comp.modes:  # fail fast on a bad mode, before any run starts
        check_job_config(mode_config(base, m, 0), f"{p}, compare mode {m.name!r}")
    return base, comp


def mode_config(base: JobConfig, mode: ModeSpec, repeat: int) -> JobConfig:
    items = [f"{k}={json.dumps(v)}" for k, v in mode.set.items()]
    items.append(f"run.seed={base.run.seed + repeat}")
    try:
        return base.with_overrides(items)
    except ConfigError as exc:
        raise ConfigError(f"compare mode {mode.name!r}: {exc}") from None


def run_comparison(base: JobConfig, comp: CompareConfig, out_dir: Path, *, progress: bool = True,
                   overwrite: bool = False) -> list[dict[str, Any]]:
    """Every mode, ``comp.repeats`` times; a report directory that holds runs is refused unless
    ``overwrite`` (checked before the first run starts, not after an hour of them)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = out_dir / "runs"
    if runs.exists() and any(runs.iterdir()) and not overwrite:
        raise RunDirInUse(f"{out_dir} already holds a comparison's runs: choose another --out, "
                          "or pass --overwrite to replace them")
    target = comp.target_accuracy or base.training.target_accuracy or 0.97
    rows: list[dict[str, Any]] = []
    total = comp.repeats * len(comp.modes)
    bar = tqdm(total=total, unit="run", desc="ps-compare", disable=not progress, dynamic_ncols=True)
    server = fork_server_if_wanted(out_dir / "fork-server.log")   # one for every run
    try:
        for r in range(comp.repeats):
            for mode in comp.modes:
                cfg = mode_config(base, mode, r)
                bar.set_postfix_str(f"{mode.name} repeat {r + 1}/{comp.repeats}")
                run_dir = out_dir / "runs" / f"{_slug(mode.name)}-r{r}"
                cluster = LocalCluster(cfg, run_dir, progress=False, overwrite=overwrite, fork_server=server)
                summary = cluster.run()
                if cluster.interrupted:  # its processes are stopped; a cut-short run is no result
                    raise KeyboardInterrupt
                rows.append(_row(mode.name, r, cfg, summary, target, run_dir))
                bar.update(1)
                _write_csv(out_dir / "runs.csv", rows)
    except KeyboardInterrupt:
        if rows:
            write_report(out_dir, base, comp, rows, target)
        raise ComparisonInterrupted(f"interrupted after {len(rows)} of {total} runs"
                                    + (f"; {out_dir / 'report.md'} holds those" if rows else "")) from None
    finally:
        bar.close()
        if server is not None:
            server.close()
    write_report(out_dir, base, comp, rows, target)
    return rows


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in name).strip("-").lower()


def _row(mode: str, repeat: int, cfg: JobConfig, s: dict[str, Any], target: float, run_dir: Path
         ) -> dict[str, Any]:
    from ps_launcher.summary import time_to_accuracy

    hit = time_to_accuracy(s["accuracy_curve"], target)
    dec = s.get("decision") or {}
    return {
        "mode": mode, "repeat": repeat, "seed": cfg.run.seed,
        "median_iteration_s": s["median_iteration_s"],
        "mean_iteration_s": s.get("mean_iteration_s"), "p95_iteration_s": s.get("p95_iteration_s"),
        "iterations_to_target": None if hit is None else hit["iterations"],
        "time_to_target_s": None if hit is None else hit["seconds"],
        # the batch policy's CPU per decision (mean), and that as a share of the mean iteration
        "decision_cpu_ms": None if dec.get("cpu_mean_s") is None else dec["cpu_mean_s"] * 1e3,
        "decision_cpu_share": dec.get("cpu_mean_share"),
        "final_accuracy": s["final_accuracy"], "training_s": s["training_s"],
        "iterations": s["iterations"], "samples": s["samples"], "stop_reason": s["stop_reason"],
        "run_dir": str(run_dir),
    }


def _write_csv(path: Path, rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)


def spread(values: list[Any], fmt: str) -> str:
    """The median of ``values`` with [min-max] when there are several (None: not reached)."""
    vals = [v for v in values if v is not None]
    if not vals:
        return "not reached"
    med = statistics.median(vals)
    text = format(med, fmt)
    if len(vals) > 1:
        text += f" [{format(min(vals), fmt)}-{format(max(vals), fmt)}]"
    missing = len(values) - len(vals)
    if missing:
        text += f" ({missing} of {len(values)} not reached)"
    return text


def _scaled(rs: list[dict[str, Any]], key: str, factor: float) -> list[float | None]:
    """Column ``key`` of the rows times ``factor`` (None where a run has no value)."""
    return [None if r.get(key) is None else float(r[key]) * factor for r in rs]


def _decision_cell(rs: list[dict[str, Any]]) -> str:
    cpu = _scaled(rs, "decision_cpu_ms", 1.0)
    if all(c is None for c in cpu):
        return "-"
    return f"{spread(cpu, '.3f')} ({spread(_scaled(rs, 'decision_cpu_share', 100.0), '.2f')}%)"


def report_table(rows: list[dict[str, Any]], modes: list[str], target: float) -> str:
    lines = [
        f"| mode | time per iteration (ms): median | mean | p95 | iterations to {target:.0%} "
        f"| time to {target:.0%} (s) | final accuracy | batch-size decision: CPU ms (% of an iteration) |",
        "|---|---|---|---|---|---|---|---|",
    ]

    def ms(rs: list[dict[str, Any]], key: str) -> str:
        return spread(_scaled(rs, key, 1e3), ".1f")

    for m in modes:
        rs = [r for r in rows if r["mode"] == m]
        lines.append(f"| {m} | {ms(rs, 'median_iteration_s')} | {ms(rs, 'mean_iteration_s')} "
                     f"| {ms(rs, 'p95_iteration_s')} | {spread([r['iterations_to_target'] for r in rs], '.0f')} "
                     f"| {spread([r['time_to_target_s'] for r in rs], '.1f')} "
                     f"| {spread([r['final_accuracy'] for r in rs], '.4f')} | {_decision_cell(rs)} |")
    return "\n".join(lines)


def write_report(out_dir: Path, base: JobConfig, comp: CompareConfig, rows: list[dict[str, Any]],
                 target: float) -> str:
    from ps_launcher.compare_plots import plot_comparison

    modes = [m.name for m in comp.modes]
    labels = base.scenario.labels(base.cluster.num_workers)
    table = report_table(rows, modes, target)
    notes = [
        f"- scenario: {base.scenario.describe(base.cluster.num_workers)}"
        + (" (EMULATED slowdowns: workers sleep (f - 1) x their measured compute)" if labels.get("emulated") else "")
        + (" (real co-located CPU load)" if labels.get("real_load") else ""),
        f"- model {base.model.name}, dataset {base.data.dataset}, global batch {base.training.global_batch}, "
        f"{base.cluster.num_workers} workers, {base.cluster.num_shards} shard(s), "
        f"{comp.repeats} repeat(s) per mode (seeds {base.run.seed}..{base.run.seed + comp.repeats - 1})",
        "- cells: median over repeats [min-max]; time per iteration = seconds per global batch of X "
        "samples (async modes: per-update time scaled to X samples), the median, mean and p95 of each run",
        "- iterations = global batches of samples applied; time = training time from the first iteration",
        "- batch-size decision: the batch policy's CPU time per decision on shard 0 (mean of each run); "
        "with mode.plan_ahead it is made while the workers compute, off the path to the answers",
    ]
    text = "\n".join([f"# ps-compare: {base.run.name}", "", *notes, "", table, ""])
    plots = plot_comparison(out_dir, rows, modes)
    text += "\n" + "\n".join(f"![{p.stem}]({p.name})" for p in plots) + "\n"
    (out_dir / "report.md").write_text(text)
    _write_csv(out_dir / "runs.csv", rows)
    return table


def default_out_dir(base: JobConfig) -> Path:
    run_dir = new_run_dir(base)
    return run_dir.with_name(f"compare-{run_dir.name}")
