"""Offline evaluation: replay a trace through a predictor and score its one-step forecasts.

For every t the predictor first forecasts speed[t] from what it saw up to t-1, then is updated with
(speed[t], exog[t]) -- exactly the order the coordinator uses. The first ``warmup`` points are not
scored (every predictor starts cold), but they are timed, because refits cost the same there.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from predictors.base import Predictor, get_predictor
from predictors.traces import Trace

log = logging.getLogger(__name__)


@dataclass
class EvalResult:
    """Scores of one predictor on one trace (or pooled over several: ``trace='all traces'``)."""

    predictor: str
    trace: str
    n: int  # scored points
    rmse: float
    mape: float  # percent
    step_ms: float  # mean wall time of predict() + update(), all points
    predictions: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    sq_err: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))
    ape: np.ndarray = field(repr=False, default_factory=lambda: np.zeros(0))


def evaluate(predictor: Predictor, trace: Trace, warmup: int = 10, *, reset: bool = True) -> EvalResult:
    """One-step-ahead RMSE and MAPE of ``predictor`` on ``trace``, skipping ``warmup`` points."""
    if warmup < 0:
        raise ValueError(f"warmup must be >= 0, got {warmup}")
    if reset:
        predictor.reset()
    n = len(trace)
    preds = np.full(n, math.nan)
    elapsed = 0.0
    for t in range(n):
        t0 = time.perf_counter()
        preds[t] = predictor.predict()
        predictor.update(float(trace.speed[t]), trace.exog[t])
        elapsed += time.perf_counter() - t0
    start = max(warmup, 1)  # point 0 has no forecast
    y, p = trace.speed[start:], preds[start:]
    sq = (p - y) ** 2
    ape = np.abs(p - y) / y
    m = int(y.size)
    return EvalResult(
        predictor=predictor.name, trace=trace.name, n=m,
        rmse=float(math.sqrt(sq.mean())) if m else math.nan,
        mape=float(100.0 * ape.mean()) if m else math.nan,
        step_ms=1e3 * elapsed / n if n else math.nan,
        predictions=preds, sq_err=sq, ape=ape,
    )


def pool(results: Sequence[EvalResult], trace: str = "all traces") -> EvalResult:
    """Pool one predictor's results over traces: RMSE and MAPE over all scored points."""
    if not results:
        raise ValueError("nothing to pool")
    sq = np.concatenate([r.sq_err for r in results])
    ape = np.concatenate([r.ape for r in results])
    steps = sum(len(r.predictions) for r in results)
    ms = sum(r.step_ms * len(r.predictions) for r in results) / steps if steps else math.nan
    return EvalResult(results[0].predictor, trace, int(sq.size),
                      float(math.sqrt(sq.mean())) if sq.size else math.nan,
                      float(100.0 * ape.mean()) if ape.size else math.nan, ms,
                      sq_err=sq, ape=ape)


def evaluate_many(names: Iterable[str], traces: Sequence[Trace], warmup: int = 10,
                  params: Mapping[str, Mapping[str, Any]] | None = None) -> list[EvalResult]:
    """Every predictor on every trace (a fresh instance per trace), plus a pooled row each.

    Before timing, each predictor replays the first points of the first trace once, untimed, so
    that lazy imports (statsmodels, torch) and first-call set-up do not count as per-step cost.
    """
    params = params or {}
    out: list[EvalResult] = []
    for name in names:
        if traces:
            warm = get_predictor(name, **dict(params.get(name, {})))
            head = traces[0]
            for t in range(min(len(head), 40)):
                warm.update(float(head.speed[t]), head.exog[t])
                warm.predict()
        rows = []
        for tr in traces:
            pred = get_predictor(name, **dict(params.get(name, {})))
            rows.append(evaluate(pred, tr, warmup))
            log.debug("%s on %s: %s", name, tr.name, rows[-1])
        out.extend(rows)
        if len(traces) > 1:
            out.append(pool(rows))
    return out


def format_table(results: Sequence[EvalResult]) -> str:
    """Markdown table; 'RMSE/last' compares with the memoryless baseline on the same trace."""
    base = {r.trace: r.rmse for r in results if r.predictor == "last"}
    lines = ["| predictor | trace | n | RMSE (samples/s) | RMSE/last | MAPE % | ms/step |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        b = base.get(r.trace)
        rel = f"{r.rmse / b:.3f}" if b else "-"
        lines.append(f"| {r.predictor} | {r.trace} | {r.n} | {r.rmse:.2f} | {rel} | {r.mape:.2f} "
                     f"| {r.step_ms:.3f} |")
    return "\n".join(lines)
