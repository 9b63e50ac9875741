"""Parameter server (BSP) versus PyTorch DDP (gloo) on the same machine, same job, one run.

Why: the only honest answer to "what does the parameter server cost?" is a side-by-side run
of the standard alternative on identical work. Both systems here train the same model from
the same initial parameters, with the same optimizer, on the same global batches in the same
order (iteration ``t`` uses ``global_batch_indices(seed, n_train, X, t)``, split into
contiguous per-worker parts), so their accuracy curves coincide up to float rounding and the
difference in time is the cost of the synchronisation machinery alone.

Usage (from the repository root)::

    python benchmarks/bench_ddp_vs_ps.py [--target 0.98] [--max-epochs 3] [--repeats 1]
        [--model lenet] [--workers 2] [--global-batch 128] [--out FILE.md]

Prints the exact configuration, then a Markdown table (PS-BSP and DDP-gloo rows: median
iteration, iterations to target, time to target, final accuracy, plus the PS/DDP ratios).
With ``--repeats R`` the two systems alternate (PS, DDP, PS, DDP, ...) so slow drifts of the
machine hit both alike, and the table shows medians with min-max.
"""

from __future__ import annotations

import sys
from pathlib import Path

# Runnable as `python benchmarks/bench_ddp_vs_ps.py` without installing: the repo root
# (one level up) must be importable, here and in the DDP ranks (they re-import this file).
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import argparse  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from dataclasses import asdict, dataclass, field  # noqa: E402
from datetime import timedelta  # noqa: E402
from typing import Any, Callable, Sequence  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.nn.parallel import DistributedDataParallel  # noqa: E402

from ps_common.config import JobConfig, load_config  # noqa: E402
from ps_launcher.launcher import LocalCluster  # noqa: E402
from ps_launcher.summary import percentile, time_to_accuracy  # noqa: E402
from ps_ml.datasets import load_dataset  # noqa: E402
from ps_ml.models import build_model, count_parameters  # noqa: E402
from ps_ml.reference import global_batch_indices  # noqa: E402
from ps_worker.evaluator import evaluate  # noqa: E402

DEFAULT_CONFIG = REPO_ROOT / "configs" / "mnist_bsp.yaml"
EVAL_EVERY = 50


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class RunResult:
    """One run of one system, in the units of the table (seconds; ``None`` = not reached)."""

    system: str
    median_iteration_s: float | None
    mean_iteration_s: float | None
    iterations_to_target: int | None
    time_to_target_s: float | None
    final_accuracy: float | None
    iterations: int
    stop_reason: str
    wall_s: float
    curve: list[dict[str, Any]] = field(default_factory=list)
    p95_iteration_s: float | None = None
    profile: dict[str, dict[str, float]] = field(default_factory=dict)


def make_config(args: argparse.Namespace) -> JobConfig:
    """The PS job config; DDP reads model, seed, data and optimizer from the same object."""
    overrides = [
        f"training.target_accuracy={args.target}",
        f"training.epochs={args.max_epochs}",
        f"cluster.num_workers={args.workers}",
        f"training.global_batch={args.global_batch}",
        f"model.name={args.model}",
        f"evaluator.every_iterations={EVAL_EVERY}",
        *args.ps_set,
    ]
    return load_config(args.config, overrides)


# --------------------------------------------------------------------------------------------
# Where the PS's time goes
# --------------------------------------------------------------------------------------------

WORKER_PHASES = ("data_s", "compute_s", "push_s", "wait_s", "pull_s", "iteration_s")


def ps_profile(run_dir: Path) -> dict[str, dict[str, float]]:
    """Per-iteration means from a PS run directory: each worker's phases (from its metrics),
    each shard's busy time by phase (from the timings in its shutdown record), and the
    coordinator's decision time. Seconds."""
    from ps_common.metrics import read_jsonl

    out: dict[str, dict[str, float]] = {}
    for path in sorted((run_dir / "metrics").glob("worker-*.jsonl")):
        recs = list(read_jsonl(path))[20:]  # start-up left out
        if recs:
            out[path.stem] = {k: statistics.fmean(r[k] for r in recs) for k in WORKER_PHASES if k in recs[0]}
    coord = [r for r in read_jsonl(run_dir / "metrics" / "coordinator.jsonl") if "event" not in r]
    updates = max(1, len(coord))
    for path in sorted((run_dir / "metrics").glob("shard-*.jsonl")):
        end = [r for r in read_jsonl(path) if r.get("event") == "shutdown"]
        if not end or "timings" not in end[-1]:
            continue
        t = end[-1]["timings"]
        prof = {k: v["s"] / updates for k, v in t.items()}
        prof["busy_s (wall)"] = sum(v["s"] for k, v in t.items() if k != "cpu_total") / updates
        out[path.stem] = prof
    if coord:
        out["coordinator"] = {"decision_s": statistics.fmean(r.get("decision_s", 0.0) for r in coord)}
    return out


def render_profile(profiles: list[dict[str, dict[str, float]]]) -> str:
    """Microseconds per iteration by phase, the median over repeats."""
    names = sorted({n for p in profiles for n in p})
    lines = ["", "Where the PS's time goes (microseconds per iteration, median over repeats; shard rows "
             "count the shard's own loop by phase in wall time, which on a shared host includes "
             "waiting for a core, and cpu_total, the CPU the shard's loop consumed):", "",
             "| process | phase | us per iteration |", "|---|---|---|"]
    for n in names:
        phases = sorted({k for p in profiles for k in p.get(n, {})},
                        key=lambda k: -statistics.median(p.get(n, {}).get(k, 0.0) for p in profiles))
        for k in phases:
            v = statistics.median(p.get(n, {}).get(k, 0.0) for p in profiles)
            if v * 1e6 >= 1:
                lines.append(f"| {n} | {k} | {v * 1e6:.0f} |")
    return "\n".join(lines) + "\n"


def max_iterations(cfg: JobConfig, num_train: int) -> int:
    """Iterations the PS runs for ``training.epochs``: it stops once ``v * X >= epochs * N``."""
    assert cfg.training.epochs is not None
    return math.ceil(cfg.training.epochs * num_train / cfg.training.global_batch)


# --------------------------------------------------------------------------------------------
# Parameter server
# --------------------------------------------------------------------------------------------


def run_ps(cfg: JobConfig, run_dir: Path, system: str = "PS-BSP") -> RunResult:
    """One PS run through the real launcher (shards, workers, evaluator as processes)."""
    target = cfg.training.target_accuracy
    assert target is not None
    summary = LocalCluster(cfg, run_dir, progress=False).run()
    hit = time_to_accuracy(summary["accuracy_curve"], target)
    return RunResult(
        system=system,
        median_iteration_s=summary["median_iteration_s"],
        mean_iteration_s=summary["mean_iteration_s"], p95_iteration_s=summary["p95_iteration_s"],
        iterations_to_target=None if hit is None else int(hit["iterations"]),
        time_to_target_s=None if hit is None else float(hit["seconds"]),
        final_accuracy=summary["final_accuracy"],
        iterations=int(summary["iterations"]),
        stop_reason=summary["stop_reason"],
        wall_s=float(summary["wall_s"] or 0.0),
        curve=[{"version": p["version"], "elapsed": p["elapsed"], "accuracy": p["accuracy"]}
               for p in summary["accuracy_curve"]],
    )


def run_ps_quiet(cfg: JobConfig, run_dir: Path) -> RunResult:
    """The PS without its evaluator, for the same number of iterations: iteration time only."""
    summary = LocalCluster(cfg, run_dir, progress=False).run()
    return RunResult(system="PS-BSP, no evaluator", median_iteration_s=summary["median_iteration_s"],
                     mean_iteration_s=summary["mean_iteration_s"], p95_iteration_s=summary["p95_iteration_s"],
                     iterations_to_target=None, time_to_target_s=None, final_accuracy=None,
                     iterations=int(summary["iterations"]), stop_reason=summary["stop_reason"],
                     wall_s=float(summary["wall_s"] or 0.0), profile=ps_profile(run_dir))


# --------------------------------------------------------------------------------------------
# DDP
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DDPSpec:
    """Everything a DDP rank needs, as plain picklable values (ranks are spawned, not forked)."""

    model: str
    seed: int
    dataset: str
    cache_dir: str | None
    synthetic_train: int
    synthetic_test: int
    world_size: int
    global_batch: int
    lr: float
    momentum: float
    weight_decay: float
    nesterov: bool
    target: float
    max_iterations: int
    eval_every: int
    master_port: int
    result_path: str


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ddp_rank(rank: int, spec: DDPSpec) -> None:
    """Body of one DDP rank: train on its part of each global batch, pause for evaluations.

    Rank ``r`` takes the ``r``-th contiguous part of iteration ``t``'s global batch, the same
    samples PS worker ``r`` gets under the uniform policy. DDP averages gradients over ranks,
    so a rank's mean cross-entropy is scaled by ``len(part) * world / X`` (exactly 1.0 for
    equal parts), which makes the update the global-batch step for any split.

    The evaluation is not training work, so it must not be charged to DDP: every
    ``eval_every`` iterations all ranks meet at a barrier, the clock stops, rank 0 measures
    test accuracy while the others wait in a broadcast of the stop decision, and the clock
    restarts. Rank 0 writes the result as JSON.
    """
    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(spec.master_port)
    dist.init_process_group("gloo", rank=rank, world_size=spec.world_size,
                            timeout=timedelta(minutes=10))
    try:
        _ddp_train(rank, spec)
    finally:
        gc.collect()  # DDP's reducer holds the group: freed with _ddp_train's frame, before it
        dist.destroy_process_group()
    # Leave without the interpreter's teardown, where gloo's threads can outlive what they use
    # and abort the process (a rank died of "terminate called without an active exception",
    # SIGABRT, once in about 30 runs; pytorch/pytorch#179291 describes the teardown case). An
    # error above still propagates to mp.spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _ddp_train(rank: int, spec: DDPSpec) -> None:
    """Training and evaluation of one rank (see :func:`_ddp_rank`); rank 0 writes the result."""
    data = load_dataset(spec.dataset, cache_dir=spec.cache_dir, seed=spec.seed,
                        synthetic_train=spec.synthetic_train, synthetic_test=spec.synthetic_test)
    model = build_model(spec.model, seed=spec.seed, num_classes=data.num_classes)
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=spec.lr, momentum=spec.momentum,
                          weight_decay=spec.weight_decay, nesterov=spec.nesterov)
    n, X, world = data.num_train, spec.global_batch, spec.world_size
    iteration_s: list[float] = []
    curve: list[dict[str, Any]] = []
    hit: dict[str, Any] | None = None
    train_s = 0.0
    version = 0
    stop = False
    stop_reason = f"reached max_iterations={spec.max_iterations}"
    dist.barrier()  # start the clock together, after all setup
    segment_start = time.perf_counter()
    while version < spec.max_iterations and not stop:
        t0 = time.perf_counter()
        idx = global_batch_indices(spec.seed, n, X, version)
        part = np.array_split(idx, world)[rank]
        x, y = data.train_batch(part)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(ddp(x), y)
        scale = len(part) * world / X
        if scale != 1.0:
            loss = loss * scale
        loss.backward()
        opt.step()
        version += 1
        iteration_s.append(time.perf_counter() - t0)
        if version % spec.eval_every == 0 or version == spec.max_iterations:
            dist.barrier()
            train_s += time.perf_counter() - segment_start
            flag = torch.zeros(1)
            if rank == 0:
                acc, _ = evaluate(model, data)
                curve.append({"version": version, "elapsed": train_s, "accuracy": acc})
                if hit is None and acc >= spec.target:
                    hit = {"iterations": version, "seconds": train_s}
                flag[0] = 1.0 if acc >= spec.target else 0.0
            dist.broadcast(flag, src=0)
            stop = bool(flag.item() > 0)
            if stop:
                stop_reason = f"reached target_accuracy={spec.target}"
            segment_start = time.perf_counter()
    if rank == 0:
        result = {
            "median_iteration_s": statistics.median(iteration_s) if iteration_s else None,
            "mean_iteration_s": statistics.fmean(iteration_s) if iteration_s else None,
            "p95_iteration_s": percentile(iteration_s, 0.95) if iteration_s else None,
            "iterations_to_target": None if hit is None else hit["iterations"],
            "time_to_target_s": None if hit is None else hit["seconds"],
            "final_accuracy": curve[-1]["accuracy"] if curve else None,
            "iterations": version,
            "stop_reason": stop_reason,
            "curve": curve,
        }
        Path(spec.result_path).write_text(json.dumps(result))
    dist.barrier()


def run_ddp(cfg: JobConfig, work_dir: Path, repeat: int) -> RunResult:
    """One DDP run: spawn the ranks, join them all (spawn re-raises a rank's error)."""
    data = load_dataset(cfg.data.dataset, cache_dir=cfg.data.cache_dir, seed=cfg.run.seed,
                        synthetic_train=cfg.data.synthetic_train,
                        synthetic_test=cfg.data.synthetic_test)
    o, t = cfg.optimizer, cfg.training
    assert t.target_accuracy is not None
    result_path = work_dir / f"ddp-{repeat}.json"
    spec = DDPSpec(
        model=cfg.model.name, seed=cfg.run.seed, dataset=cfg.data.dataset,
        cache_dir=cfg.data.cache_dir, synthetic_train=cfg.data.synthetic_train,
        synthetic_test=cfg.data.synthetic_test, world_size=cfg.cluster.num_workers,
        global_batch=t.global_batch, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
        nesterov=o.nesterov, target=t.target_accuracy,
        max_iterations=max_iterations(cfg, data.num_train), eval_every=EVAL_EVERY,
        master_port=free_port(), result_path=str(result_path),
    )
    del data
    t0 = time.monotonic()
    mp.spawn(_ddp_rank, args=(spec,), nprocs=spec.world_size, join=True)
    wall = time.monotonic() - t0
    r = json.loads(result_path.read_text())
    return RunResult(system="DDP-gloo", median_iteration_s=r["median_iteration_s"],
                     mean_iteration_s=r["mean_iteration_s"], p95_iteration_s=r["p95_iteration_s"],
                     iterations_to_target=r["iterations_to_target"],
                     time_to_target_s=r["time_to_target_s"], final_accuracy=r["final_accuracy"],
                     iterations=r["iterations"], stop_reason=r["stop_reason"], wall_s=wall,
                     curve=r["curve"])


# --------------------------------------------------------------------------------------------
# Report
# --------------------------------------------------------------------------------------------


def _agg(values: Sequence[float | None], fmt: Callable[[float], str]) -> str:
    """Median (min-max) over the runs that have a value; says how many reached it if not all."""
    got = [v for v in values if v is not None]
    if not got:
        return "not reached"
    text = fmt(statistics.median(got))
    if len(values) > 1:
        text += f" ({fmt(min(got))}-{fmt(max(got))})"
    if len(got) < len(values):
        text += f", reached {len(got)}/{len(values)}"
    return text


def _median(values: Sequence[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return statistics.median(got) if got else None


def _ratio(ps: Sequence[float | None], ddp: Sequence[float | None]) -> str:
    """Ratio of the medians, plus the range of the per-repeat ratios when there are repeats."""
    a, b = _median(ps), _median(ddp)
    if a is None or b is None or b == 0:
        return "-"
    text = f"{a / b:.2f}x"
    pairs = [x / y for x, y in zip(ps, ddp) if x is not None and y is not None and y != 0]
    if len(ps) > 1 and pairs:
        text += f" ({min(pairs):.2f}-{max(pairs):.2f})"
    return text


def _cores() -> str:
    total = os.cpu_count()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return f"{total}"
    return f"{usable}" if usable == total else f"{usable} usable of {total}"


def _show_path(path: Path) -> str:
    """``path`` relative to the repository root when it lies inside it."""
    try:
        return str(path.resolve().relative_to(REPO_ROOT))
    except ValueError:
        return str(path)


PAUSED = "PS-BSP, evaluator pauses training"


def balanced_name(policy: str) -> str:
    return f"PS-BSP, {policy}, evaluator pauses training"


def render(cfg: JobConfig, args: argparse.Namespace, ps: list[RunResult], ddp: list[RunResult],
           num_train: int, num_params: int, quiet: list[RunResult] | None = None,
           paused: list[RunResult] | None = None, balanced: list[RunResult] | None = None) -> str:
    """The configuration, the table and the notes, as Markdown."""
    t, o, c = cfg.training, cfg.optimizer, cfg.cluster
    n_iter = max_iterations(cfg, num_train)
    parts = ", ".join(str(len(p)) for p in np.array_split(np.arange(t.global_batch), c.num_workers))
    ms = lambda v: f"{v * 1e3:.1f}"  # noqa: E731
    secs = lambda v: f"{v:.1f}"  # noqa: E731
    its = lambda v: f"{v:.0f}"  # noqa: E731
    acc = lambda v: f"{v:.4f}"  # noqa: E731
    lines = [
        "## PS-BSP vs DDP-gloo", "",
        f"- model: {cfg.model.name} ({num_params:,} parameters), dataset: {cfg.data.dataset} "
        f"({num_train:,} train images), seed {cfg.run.seed}",
        f"- workers (PS) = ranks (DDP): {c.num_workers}; global batch: {t.global_batch} "
        f"(per worker: {parts})",
        f"- optimizer: SGD lr={o.lr} momentum={o.momentum} weight_decay={o.weight_decay} "
        f"nesterov={o.nesterov}",
        f"- target test accuracy: {t.target_accuracy} (full test set, every {EVAL_EVERY} "
        f"iterations); max epochs: {t.epochs} ({n_iter} iterations)",
        f"- PS: {_show_path(args.config)}, "
        f"{c.num_shards} shards, sync {cfg.mode.sync}, batch policy {cfg.mode.batch_policy}, "
        f"{cfg.worker.torch_threads} torch thread per worker",
        f"- torch {torch.__version__}, {_cores()} CPU cores, 1 torch thread per DDP rank; "
        f"repeats: {len(ps)} (alternating PS, DDP){'; median (min-max)' if len(ps) > 1 else ''}",
        "",
        "| system | iteration (ms): median | mean | p95 | iterations to target | time to target (s) "
        "| final accuracy |",
        "|---|---|---|---|---|---|---|",
    ]
    rows = [("PS-BSP", ps), ("DDP-gloo", ddp)]
    if quiet:
        rows.insert(1, ("PS-BSP, no evaluator", quiet))
    if balanced:
        rows.insert(1, (balanced_name(args.balanced_run), balanced))
    if paused:
        rows.insert(1, (PAUSED, paused))
    for name, runs in rows:
        times = (f"{_agg([r.median_iteration_s for r in runs], ms)} | {_agg([r.mean_iteration_s for r in runs], ms)} "
                 f"| {_agg([r.p95_iteration_s for r in runs], ms)}")
        if runs is quiet:  # iteration time only: it has no evaluator to tell accuracy
            lines.append(f"| {name} | {times} | - | - | - |")
            continue
        lines.append(
            f"| {name} | {times} "
            f"| {_agg([r.iterations_to_target for r in runs], its)} "
            f"| {_agg([r.time_to_target_s for r in runs], secs)} "
            f"| {_agg([r.final_accuracy for r in runs], acc)} |")
    it_ratio = _ratio([r.median_iteration_s for r in ps], [r.median_iteration_s for r in ddp])
    tt_ratio = _ratio([r.time_to_target_s for r in ps], [r.time_to_target_s for r in ddp])
    mean_ratio = _ratio([r.mean_iteration_s for r in ps], [r.mean_iteration_s for r in ddp])
    p95_ratio = _ratio([r.p95_iteration_s for r in ps], [r.p95_iteration_s for r in ddp])
    lines += [f"| PS / DDP | {it_ratio} | {mean_ratio} | {p95_ratio} | | {tt_ratio} | |"]
    for name, runs in ((PAUSED, paused), (balanced_name(args.balanced_run or ""), balanced)):
        if not runs:
            continue
        lines += [f"| {name} / DDP | "
                  + " | ".join(_ratio([getattr(r, k) for r in runs], [getattr(r, k) for r in ddp])
                               for k in ("median_iteration_s", "mean_iteration_s", "p95_iteration_s"))
                  + f" | | {_ratio([r.time_to_target_s for r in runs], [r.time_to_target_s for r in ddp])} | |"]
    if quiet:
        q_ratio = _ratio([r.median_iteration_s for r in quiet], [r.median_iteration_s for r in ddp])
        e_ratio = _ratio([r.median_iteration_s for r in ps], [r.median_iteration_s for r in quiet])
        lines += [f"| PS without evaluator / DDP | {q_ratio} | | | | | |",
                  f"| PS with / without evaluator | {e_ratio} | | | | | |"]
    lines += [
        "",
        f"PS/DDP ratio: median iteration time {it_ratio}, time to target {tt_ratio}.", "",
        "Notes:",
        "- Same initial parameters, optimizer and sample order in both systems (iteration t = "
        "`global_batch_indices(seed, n_train, X, t)`, contiguous per-worker parts): the "
        "updates are mathematically identical, so the time difference is the system's. They "
        "differ in float rounding (gradient averaging order), which training amplifies, so "
        "accuracies at equal iterations are close but not identical.",
        "- PS iteration = time between consecutive updates on shard 0 (batch, compute, push, "
        "commit on every shard, answer). DDP iteration = rank 0's time from fetching its batch "
        "to the end of `optimizer.step()` (includes the gradient all-reduce).",
        "- Time to target counts training time only, from the moment training starts (PS: all "
        "workers joined; DDP: after process-group and DDP setup) to the end of the iteration "
        "whose parameters first measured >= target. Process start-up is excluded in both.",
        f"- DDP evaluation is excluded from its time: every {EVAL_EVERY} iterations all ranks "
        "pause at a barrier, the clock stops, rank 0 evaluates, the clock restarts.",
        f"- The PS evaluator is a separate process that evaluates concurrently with training "
        f"and competes with the {c.num_shards} shards and {c.num_workers} workers for the "
        f"{_cores()} cores, so PS times include that interference: the comparison is "
        f"conservative for the PS. It measures exactly versions 0, {EVAL_EVERY}, "
        f"{2 * EVAL_EVERY}, ... from the shards' snapshots (the time of a point is when that "
        "version was made, not when it was measured), so the PS stops a little after the "
        "target is reached (the evaluator's lag), which counts in its iterations but not in "
        "its time to target.",
    ]
    if paused:
        lines.append(
            f"- {PAUSED} (`evaluator.pause_training=true`): the PS measures as DDP does. At every "
            f"{EVAL_EVERY}th version shard 0 holds the workers' next assignments until the evaluator "
            "has reported that version, and the PS clock (iteration times, time to target) leaves "
            "the pause out; it stops at the version that reached the target. Its wall time "
            "includes the pauses, as DDP's does its evaluations.")
    if balanced:
        lines.append(
            f"- {balanced_name(args.balanced_run)}: as above, with batch policy {args.balanced_run}. Each "
            "iteration's global batch is the same set of samples, split by the workers' measured speeds "
            "instead of evenly, and the servers weight by batch size, so the updates are the same "
            "global-batch steps; what it balances is what the processes beside a worker take from its "
            "core (the shard, the evaluator).")
    for i, r in enumerate(ps):
        versions = ", ".join(str(p["version"]) for p in r.curve)
        run = f" (repeat {i + 1})" if len(ps) > 1 else ""
        lines.append(f"- PS evaluations{run} at iterations: {versions}")
    return "\n".join(lines) + "\n"


def _describe(r: RunResult) -> str:
    tt = "not reached" if r.time_to_target_s is None else \
        f"{r.time_to_target_s:.1f} s / {r.iterations_to_target} it"
    med = "-" if r.median_iteration_s is None else f"{r.median_iteration_s * 1e3:.1f} ms"
    fin = "-" if r.final_accuracy is None else f"{r.final_accuracy:.4f}"
    return (f"{r.system}: target {tt}, median iteration {med}, {r.iterations} iterations, "
            f"final accuracy {fin}, stop: {r.stop_reason}, wall {r.wall_s:.1f} s")


# --------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--target", type=float, default=0.98, help="target test accuracy")
    p.add_argument("--max-epochs", type=float, default=3.0, help="stop here if not at target")
    p.add_argument("--repeats", type=int, default=1, help="alternating PS/DDP pairs")
    p.add_argument("--model", default="lenet", help="registered model name")
    p.add_argument("--workers", type=int, default=2, help="PS workers = DDP ranks")
    p.add_argument("--global-batch", type=int, default=128, help="samples per iteration, all workers")
    p.add_argument("--out", type=Path, default=None, help="also write the Markdown here")
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="PS job config (YAML)")
    p.add_argument("--ps-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a PS config value, e.g. cluster.transport=ipc")
    p.add_argument("--no-evaluator-run", action="store_true",
                   help="also run the PS without its evaluator (iteration time only), to measure what the "
                        "evaluator costs training; as many iterations as the paused run if there is one, "
                        "else as the run with the evaluator beside training")
    p.add_argument("--paused-evaluator-run", action="store_true",
                   help="also run the PS with evaluator.pause_training=true (training waits while the "
                        "evaluator measures, and the clock stops, as in the DDP loop)")
    p.add_argument("--balanced-run", default=None, metavar="POLICY",
                   help="also run the PS paused for the evaluator with this batch policy (e.g. lbbsp-cpu): "
                        "the same global batches and updates, split by measured speed, so the CPU the "
                        "shard takes from the worker beside it is balanced out")
    p.add_argument("--keep-runs", type=Path, default=None,
                   help="keep the PS run directories and DDP results here (default: a temp dir, removed)")
    args = p.parse_args(argv)
    if not 0 < args.target <= 1:
        p.error("--target must be in (0, 1]")
    if args.repeats < 1 or args.workers < 1 or args.global_batch < args.workers:
        p.error("need --repeats >= 1, --workers >= 1 and --global-batch >= --workers")
    if args.max_epochs <= 0:
        p.error("--max-epochs must be > 0")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the alternating PS/DDP pairs, print (and optionally write) the Markdown report."""
    args = parse_args(argv)
    cfg = make_config(args)
    data = load_dataset(cfg.data.dataset, cache_dir=cfg.data.cache_dir, seed=cfg.run.seed,
                        synthetic_train=cfg.data.synthetic_train,
                        synthetic_test=cfg.data.synthetic_test)
    num_train = data.num_train
    num_params = count_parameters(build_model(cfg.model.name, seed=cfg.run.seed,
                                              num_classes=data.num_classes))
    del data
    if args.keep_runs is not None:
        work_dir = args.keep_runs.resolve()
        work_dir.mkdir(parents=True, exist_ok=True)
    else:
        work_dir = Path(tempfile.mkdtemp(prefix="bench-ddp-vs-ps-"))
    ps_runs: list[RunResult] = []
    ddp_runs: list[RunResult] = []
    quiet_runs: list[RunResult] = []
    paused_runs: list[RunResult] = []
    balanced_runs: list[RunResult] = []
    ddp_aborts: list[str] = []
    try:
        for i in range(args.repeats):
            tag = f"[{i + 1}/{args.repeats}]"
            print(f"{tag} PS-BSP ...", file=sys.stderr, flush=True)
            ps_runs.append(run_ps(cfg, work_dir / f"ps-{i}"))
            ps_runs[-1].profile = ps_profile(work_dir / f"ps-{i}")
            print(f"{tag} {_describe(ps_runs[-1])}", file=sys.stderr, flush=True)
            if args.paused_evaluator_run:
                print(f"{tag} {PAUSED} ...", file=sys.stderr, flush=True)
                paused_runs.append(run_ps(cfg.with_overrides(["evaluator.pause_training=true"]),
                                          work_dir / f"ps-paused-{i}", system=PAUSED))
                print(f"{tag} {_describe(paused_runs[-1])}", file=sys.stderr, flush=True)
            if args.balanced_run:
                name = balanced_name(args.balanced_run)
                print(f"{tag} {name} ...", file=sys.stderr, flush=True)
                balanced_runs.append(run_ps(cfg.with_overrides(["evaluator.pause_training=true",
                                                                f"mode.batch_policy={args.balanced_run}"]),
                                            work_dir / f"ps-balanced-{i}", system=name))
                print(f"{tag} {_describe(balanced_runs[-1])}", file=sys.stderr, flush=True)
            if args.no_evaluator_run:
                # as many iterations as the run it is compared with: the paused one when there
                # is one (it stops where DDP does), else the one with the evaluator beside it
                length = (paused_runs or ps_runs)[-1].iterations
                quiet_cfg = cfg.with_overrides(["evaluator.enabled=false", "training.target_accuracy=null"])
                quiet_cfg = quiet_cfg.model_copy(update={"training": quiet_cfg.training.model_copy(
                    update={"target_accuracy": None, "max_iterations": length})})
                print(f"{tag} PS-BSP without evaluator ...", file=sys.stderr, flush=True)
                quiet_runs.append(run_ps_quiet(quiet_cfg, work_dir / f"ps-quiet-{i}"))
                print(f"{tag} {_describe(quiet_runs[-1])}", file=sys.stderr, flush=True)
            print(f"{tag} DDP-gloo ...", file=sys.stderr, flush=True)
            try:
                ddp_runs.append(run_ddp(cfg, work_dir, i))
            except mp.ProcessExitedException as exc:  # the baseline crashed: say so, run it again
                ddp_aborts.append(f"{tag} {exc}")
                print(f"{tag} DDP-gloo aborted ({exc}); running it again with a fresh port",
                      file=sys.stderr, flush=True)
                ddp_runs.append(run_ddp(cfg, work_dir, i))
            print(f"{tag} {_describe(ddp_runs[-1])}", file=sys.stderr, flush=True)
    finally:
        if args.keep_runs is None:
            shutil.rmtree(work_dir, ignore_errors=True)
        else:
            (work_dir / "results.json").write_text(json.dumps(
                {"ps": [asdict(r) for r in ps_runs], "ddp": [asdict(r) for r in ddp_runs],
                 "ps_paused": [asdict(r) for r in paused_runs], "ps_quiet": [asdict(r) for r in quiet_runs],
                 "ps_balanced": [asdict(r) for r in balanced_runs]},
                indent=2))
    report = render(cfg, args, ps_runs, ddp_runs, num_train, num_params, quiet_runs, paused_runs, balanced_runs)
    if ddp_aborts:
        report += "- DDP runs that aborted and were run again: " + "; ".join(ddp_aborts) + "\n"
    report += render_profile([r.profile for r in ps_runs])
    print(report, end="")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
