"""Speed traces: one worker's per-iteration speed and exogenous inputs, as CSV.

Traces are how predictors are compared offline (DESIGN.md section 5): record them from real runs
under real contention (``ps-predict record`` or a worker's metrics file), replay them through every
predictor with :mod:`predictors.evaluate`.

CSV format (header required, extra columns ignored)::

    iteration,speed,host_cpu,cotenant_cpu,host_mem_pct
"""

from __future__ import annotations

import csv
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ps_common.report import EXOG_KEYS, Telemetry

log = logging.getLogger(__name__)

TRACE_COLUMNS: tuple[str, ...] = ("iteration", "speed", *EXOG_KEYS)


@dataclass
class Trace:
    """``speed[t]`` in samples/s and ``exog[t]`` (columns in :data:`EXOG_KEYS` order)."""

    speed: np.ndarray
    exog: np.ndarray
    name: str = "trace"
    iteration: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def __post_init__(self) -> None:
        self.speed = np.asarray(self.speed, dtype=np.float64).reshape(-1)
        n = self.speed.size
        self.exog = np.asarray(self.exog, dtype=np.float64).reshape(n, -1) if n else \
            np.zeros((0, len(EXOG_KEYS)))
        if self.iteration.size == 0:
            self.iteration = np.arange(n, dtype=np.int64)
        self.iteration = np.asarray(self.iteration, dtype=np.int64).reshape(-1)
        if self.iteration.size != n:
            raise ValueError(f"trace {self.name!r}: {self.iteration.size} iterations for {n} speeds")
        if not np.all(np.isfinite(self.speed)) or np.any(self.speed <= 0):
            raise ValueError(f"trace {self.name!r}: speeds must be finite and > 0")
        if not np.all(np.isfinite(self.exog)):
            raise ValueError(f"trace {self.name!r}: exogenous inputs must be finite")

    def __len__(self) -> int:
        return int(self.speed.size)


def load_trace(path: str | Path) -> Trace:
    """Read a trace CSV; missing exogenous columns are zeros, bad rows raise ``ValueError``."""
    path = Path(path)
    speeds: list[float] = []
    exogs: list[list[float]] = []
    iters: list[int] = []
    with open(path, newline="") as fh:
        reader = csv.DictReader(fh)
        cols = reader.fieldnames or []
        if "speed" not in cols:
            raise ValueError(f"{path}: no 'speed' column in header {cols}")
        for lineno, row in enumerate(reader, start=2):
            try:
                s = float(row["speed"])
                x = [float(row[k]) if row.get(k) not in (None, "") else 0.0 for k in EXOG_KEYS]
                it = int(float(row["iteration"])) if row.get("iteration") not in (None, "") \
                    else len(iters)
            except (TypeError, ValueError) as e:
                raise ValueError(f"{path}:{lineno}: bad row {row}: {e}") from None
            if not math.isfinite(s) or s <= 0:
                raise ValueError(f"{path}:{lineno}: speed must be finite and > 0, got {s}")
            speeds.append(s)
            exogs.append(x)
            iters.append(it)
    return Trace(np.array(speeds), np.array(exogs).reshape(len(speeds), len(EXOG_KEYS)),
                 name=path.stem, iteration=np.array(iters, dtype=np.int64))


def save_trace(trace: Trace, path: str | Path) -> Path:
    """Write a trace CSV (6 significant digits for speed, 0.1 for percentages: small fixtures)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if trace.exog.shape[1] != len(EXOG_KEYS):
        raise ValueError(f"trace {trace.name!r}: expected {len(EXOG_KEYS)} exogenous columns, "
                         f"got {trace.exog.shape[1]}")
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(TRACE_COLUMNS)
        for it, s, x in zip(trace.iteration, trace.speed, trace.exog):
            w.writerow([int(it), f"{s:.6g}", *(f"{v:.1f}" for v in x)])
    return path


def trace_from_worker_metrics(jsonl_path: str | Path, worker: int | None = None,
                              extra: tuple[str, ...] = ()) -> Trace:
    """Convert a worker's metrics file (JSON lines) into a trace; speed = batch_size / compute_s.

    Records without a positive ``compute_s``/``batch_size`` (or of another ``worker``, when given)
    are skipped; the rest are sorted by iteration. A file holding several workers needs ``worker``.
    ``extra``: more report fields appended to the exogenous columns (missing or None: 0.0), for
    trying inputs the predictors do not get (such a trace does not fit :func:`save_trace`).
    """
    from ps_common.metrics import read_jsonl  # the project's reader: skips a torn last line

    path = Path(jsonl_path)
    rows: list[tuple[int, float, list[float]]] = []
    workers: set[object] = set()
    skipped = 0
    for rec in read_jsonl(path):
        if "iteration" not in rec or "batch_size" not in rec:
            skipped += 1
            continue
        if worker is not None and rec.get("worker") != worker:
            continue
        workers.add(rec.get("worker"))
        tel = Telemetry.from_record(rec)  # the report's fields, by attribute (no compute_s: 0)
        try:
            bs, cs = float(rec["batch_size"]), float(tel.compute_s)
        except (TypeError, ValueError):
            skipped += 1
            continue
        if not (math.isfinite(bs) and math.isfinite(cs)) or bs <= 0 or cs <= 0:
            skipped += 1
            continue
        rows.append((int(rec["iteration"]), bs / cs, tel.exog() + [float(getattr(tel, k) or 0.0) for k in extra]))
    if len(workers) > 1:
        raise ValueError(f"{path}: records of several workers {sorted(map(str, workers))}; "
                         f"pass worker=")
    if skipped:
        log.info("%s: skipped %d records without a usable speed", path, skipped)
    rows.sort(key=lambda r: r[0])
    n = len(rows)
    return Trace(np.array([r[1] for r in rows], dtype=np.float64),
                 np.array([r[2] for r in rows], dtype=np.float64).reshape(n, len(EXOG_KEYS) + len(extra)),
                 name=path.stem, iteration=np.array([r[0] for r in rows], dtype=np.int64))
