"""How predictable are a lab run's speed traces at all? The predictors against an in-sample bound.

Issue 10 asks for NARX one-step RMSE <= 0.8x EMA's on traces recorded under kernel CPU quotas.
This script puts the system's predictors (last, EMA, ARIMA, NARX) beside a bound no online
predictor can beat with the same inputs: a least-squares fit of log speed[t+1] on the last
``--lags`` log speeds and the inputs of iteration t, fitted on the *whole* trace it is scored on
(it sees the future). If even that fit stays near EMA, the inputs do not hold what would be
needed, and no tuning of NARX's lags, window or cadence can reach 0.8x.

Each is run twice: with the exogenous inputs the predictors get today (``EXOG_KEYS``: host CPU,
cotenant CPU, host memory) and with the worker's own CPU cgroup added (``cpu_quota`` and
``throttled_s`` in the worker's report: the quota in force and the time the kernel held the
worker back since its previous report).

    python benchmarks/bench_predictability.py RUN/metrics/worker-*.jsonl

Prints one table (pooled over the traces: RMSE in samples/s, its ratio to EMA's, MAPE).
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

from predictors import get_predictor
from predictors.evaluate import EvalResult, evaluate, pool
from predictors.traces import Trace, trace_from_worker_metrics
from ps_common.report import EXOG_KEYS

QUOTA_KEYS = ("cpu_quota", "throttled_s")
WARMUP = 10


def features(trace: Trace, lags: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows [speed[t-lags+1..t], log speed[t-lags+1..t], exog[t]] with their targets speed[t+1]
    and whether the point is scored (from WARMUP on, as the predictors)."""
    v, n = trace.speed, len(trace)
    rows = [np.concatenate((v[t - lags + 1:t + 1], np.log(v[t - lags + 1:t + 1]), trace.exog[t]))
            for t in range(lags - 1, n - 1)]
    return np.array(rows), v[lags:], np.arange(lags, n) >= max(WARMUP, 1)


def scored(name: str, trace: str, pred: np.ndarray, actual: np.ndarray) -> EvalResult:
    sq, ape = (pred - actual) ** 2, np.abs(pred - actual) / actual
    return EvalResult(predictor=name, trace=trace, n=int(actual.size), rmse=float(math.sqrt(sq.mean())),
                      mape=float(100 * ape.mean()), step_ms=0.0, sq_err=sq, ape=ape)


def in_sample_bound(trace: Trace, lags: int) -> EvalResult:
    """The least-squares fit of speed[t+1] on the rows of :func:`features` (and a constant),
    fitted on the very points it is scored on: no predictor linear in these inputs can have a
    smaller RMSE on this trace."""
    X, y, keep = features(trace, lags)
    X = np.column_stack((np.ones(len(X)), X))[keep]
    coef, *_ = np.linalg.lstsq(X, y[keep], rcond=None)
    return scored("in-sample bound", trace.name, X @ coef, y[keep])


def held_out_mlp(traces: list[Trace], lags: int, seed: int = 0) -> tuple[EvalResult, EvalResult]:
    """A nonlinear model with far more data than NARX's window: a 2 x 64 MLP trained on the
    first half of every trace at once (inputs standardized, speeds relative to the trace's
    first-half mean), scored on the second halves. Returns it and EMA on the same points."""
    import torch

    torch.manual_seed(seed)
    torch.set_num_threads(1)
    train_x, train_y, tests = [], [], []
    for tr in traces:
        X, y, keep = features(tr, lags)
        half = len(X) // 2
        scale = float(y[:half].mean())
        X = np.column_stack((X[:, :lags] / scale, X[:, lags:2 * lags] - math.log(scale), X[:, 2 * lags:]))
        train_x.append(X[:half][keep[:half]])
        train_y.append(y[:half][keep[:half]] / scale)
        ema = evaluate(get_predictor("ema"), tr, warmup=0).predictions[lags:]
        tests.append((X[half:], y[half:], scale, ema[half:]))
    Xt, yt = np.concatenate(train_x), np.concatenate(train_y)
    mu, sd = Xt.mean(0), Xt.std(0) + 1e-9
    net = torch.nn.Sequential(torch.nn.Linear(Xt.shape[1], 64), torch.nn.Tanh(), torch.nn.Linear(64, 64),
                              torch.nn.Tanh(), torch.nn.Linear(64, 1))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    xb = torch.tensor((Xt - mu) / sd, dtype=torch.float32)
    yb = torch.tensor(yt, dtype=torch.float32).unsqueeze(1)
    for _ in range(600):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(net(xb), yb)
        loss.backward()
        opt.step()
    preds, actual, emas = [], [], []
    with torch.no_grad():
        for X, y, scale, ema in tests:
            p = net(torch.tensor((X - mu) / sd, dtype=torch.float32)).squeeze(1).numpy() * scale
            preds.append(p)
            actual.append(y)
            emas.append(ema)
    a = np.concatenate(actual)
    return (scored("held-out MLP (second halves)", "all traces", np.concatenate(preds), a),
            scored("ema (second halves)", "all traces", np.concatenate(emas), a))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("metrics", nargs="+", type=Path, help="worker-*.jsonl of one run")
    ap.add_argument("--lags", type=int, default=4, help="past speeds in the in-sample bound")
    ap.add_argument("--predictors", default="last,ema,arima,narx")
    args = ap.parse_args(argv)
    rows = []
    for with_quota in (False, True):
        traces = [trace_from_worker_metrics(p, extra=QUOTA_KEYS if with_quota else ()) for p in args.metrics]
        inputs = "+ cgroup quota" if with_quota else "EXOG_KEYS"
        n_exog = len(EXOG_KEYS) + (len(QUOTA_KEYS) if with_quota else 0)
        for name in args.predictors.split(","):
            if with_quota and name not in ("narx",):
                continue  # the others take no exogenous input: the same numbers again
            kwargs = {"n_exog": n_exog} if name == "narx" else {}
            results = [evaluate(get_predictor(name, **kwargs), t, warmup=WARMUP) for t in traces]
            rows.append((name, inputs, pool(results)))
        rows.append(("in-sample bound", inputs, pool([in_sample_bound(t, args.lags) for t in traces])))
        mlp, ema_half = held_out_mlp(traces, args.lags)
        rows.append(("held-out MLP (second halves)", inputs, mlp))
        if not with_quota:
            rows.append(("ema (second halves)", inputs, ema_half))
    ema = next(r for n, _, r in rows if n == "ema").rmse
    ema_half = next(r for n, _, r in rows if n == "ema (second halves)").rmse
    n_points = rows[0][2].n
    print(f"# {len(args.metrics)} traces, {n_points} scored points; one-step RMSE of speed (samples/s), "
          f"warm-up {WARMUP}; in-sample bound: {args.lags} lags, fitted on what it scores")
    print("| predictor | exogenous inputs | RMSE | RMSE / EMA (same points) | MAPE % |")
    print("|---|---|---:|---:|---:|")
    for name, inputs, r in rows:
        base = ema_half if "second halves" in name else ema
        shown = inputs if name.startswith(("narx", "in-sample", "held-out")) else "none"
        print(f"| {name} | {shown} | {r.rmse:.1f} | {r.rmse / base:.3f} | {r.mape:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
