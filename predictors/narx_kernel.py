"""NARX's per-iteration step (score, record, forecast) compiled into one call per batch.

NARX's update and forecast in numpy are about 60 calls, each paid cold in a paced decision
(:mod:`predictors.jit`): update + predict after a 50 ms sleep took 470 µs at 4 workers and 510 µs
at 100; compiled, 160 and 220 µs (``benchmarks/bench_decision_cold.py --refits narx``).

The functions are the numpy code's arithmetic, slot by slot, in the same order of operations,
with two sources of last-bit differences: logs are the C library's ``log``, which differs from
numpy's vectorised ``np.log`` in the last bit for a few inputs in 10,000 (the history ring and
the gate's error averages can), and the forecast's dot products are summed in order, not by
``matmul``. Counts, clocks and the refit schedule are identical.
:class:`~predictors.narx.BatchNARX` calls them where numba imports and keeps its numpy code as the
reference and the fallback; ``tests/unit/test_predictors_batch.py`` runs both on the same traces.
Refit scheduling (coalescing, throttling, submission) stays in Python: the kernel only says which
slots are due. :func:`warm_up` compiles (or loads) the kernels when a BatchNARX is built, so that
no decision pays for it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from predictors.jit import AVAILABLE, as_float64, as_int64, check_slots, gated_predict, jit

__all__ = ["AVAILABLE", "as_float64", "as_int64", "forecast_step", "gated_predict", "update_step", "warm_up"]

#: Indices into the float parameters array handed to the kernels.
F_GATE_DECAY, F_CLIP_LOW, F_CLIP_HIGH = 0, 1, 2
#: Indices into the integer parameters array.
I_KEEP, I_LAG, I_MIN_TRAIN, I_REFIT_EVERY, I_SPEED_LAGS, I_EXOG_LAGS, I_RATIO, I_GATE = range(8)


@jit
def _forecast_one(s: int, logv: np.ndarray, x: np.ndarray, pos: np.ndarray, w1: np.ndarray,
                  b1: np.ndarray, w2: np.ndarray, b2: np.ndarray, mx: np.ndarray, sx: np.ndarray,
                  my: np.ndarray, sy: np.ndarray, last_v: float, fp: np.ndarray,
                  ip: np.ndarray) -> float:
    """The network's forecast of slot ``s``'s next speed from its newest inputs (``_forecast``)."""
    keep = ip[I_KEEP]
    speed_lags, exog_lags = ip[I_SPEED_LAGS], ip[I_EXOG_LAGS]
    E = x.shape[2]
    newest = (pos[s] - 1) % keep
    n_in = w1.shape[2]
    z = np.empty(n_in)
    col = 0
    for j in range(speed_lags):
        z[col] = (logv[s, (newest - j) % keep] - mx[s, col]) / sx[s, col]
        col += 1
    if E > 0:
        for j in range(exog_lags):
            r = (newest - j) % keep
            for e in range(E):
                z[col] = (x[s, r, e] - mx[s, col]) / sx[s, col]
                col += 1
    out = 0.0
    for h in range(w1.shape[1]):
        acc = 0.0
        for c in range(n_in):
            acc += w1[s, h, c] * z[c]
        out += w2[s, h] * math.tanh(acc + b1[s, h])
    out = (out + b2[s]) * sy[s] + my[s]
    log_next = logv[s, newest] + out if ip[I_RATIO] else out
    f = math.exp(min(log_next, 700.0))
    if not math.isfinite(f):
        return math.nan
    return min(max(f, fp[F_CLIP_LOW] * last_v), fp[F_CLIP_HIGH] * last_v)


@jit
def update_step(slots: np.ndarray, values: np.ndarray, exog: np.ndarray, last: np.ndarray,
                 n: np.ndarray, fc: np.ndarray, merr: np.ndarray, lerr: np.ndarray,
                 logv: np.ndarray, x: np.ndarray, pos: np.ndarray, cnt: np.ndarray,
                 since: np.ndarray, tried: np.ndarray, busy: np.ndarray, has_w: np.ndarray,
                 w1: np.ndarray, b1: np.ndarray, w2: np.ndarray, b2: np.ndarray, mx: np.ndarray,
                 sx: np.ndarray, my: np.ndarray, sy: np.ndarray, fp: np.ndarray,
                 ip: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """One observation per slot (``BatchPredictor.update`` + ``BatchNARX._update`` up to the
    refit submission): returns each slot's update count, which slots are due a refit, and how
    many. ``exog`` has one row per slot, or none (zeros are recorded)."""
    k = slots.size
    a = fp[F_GATE_DECAY]
    keep, lag = ip[I_KEEP], ip[I_LAG]
    min_train, refit_every = ip[I_MIN_TRAIN], ip[I_REFIT_EVERY]
    E = x.shape[2]
    has_exog = exog.shape[0] > 0
    n_out = np.empty(k, dtype=np.int64)
    due = np.zeros(k, dtype=np.bool_)
    n_due = 0
    check_slots(slots, last.shape[0])
    for i in range(k):
        s = slots[i]
        v = values[i]
        prev = last[s]
        last[s] = v
        n[s] += 1
        n_out[i] = n[s]
        lv = math.log(v)
        f = fc[s]
        if math.isfinite(f) and math.isfinite(prev):     # score the forecasts made for v
            merr[s] = a * merr[s] + (1 - a) * (math.log(f) - lv) ** 2
            lerr[s] = a * lerr[s] + (1 - a) * (math.log(prev) - lv) ** 2
        p = pos[s]
        logv[s, p] = lv
        for e in range(E):
            x[s, p, e] = exog[i, e] if has_exog else 0.0
        pos[s] = (p + 1) % keep
        c = min(cnt[s] + 1, keep)
        cnt[s] = c
        since[s] += 1
        if c - lag >= min_train and (not tried[s] or since[s] >= refit_every) and not busy[s]:
            due[i] = True
            n_due += 1
        if has_w[s]:
            fc[s] = _forecast_one(s, logv, x, pos, w1, b1, w2, b2, mx, sx, my, sy, v, fp, ip)
        else:
            fc[s] = math.nan
    return n_out, due, n_due


@jit
def forecast_step(slots: np.ndarray, last: np.ndarray, fc: np.ndarray, logv: np.ndarray,
                   x: np.ndarray, pos: np.ndarray, has_w: np.ndarray, w1: np.ndarray,
                   b1: np.ndarray, w2: np.ndarray, b2: np.ndarray, mx: np.ndarray, sx: np.ndarray,
                   my: np.ndarray, sy: np.ndarray, fp: np.ndarray, ip: np.ndarray) -> None:
    """Forecasts of ``slots`` from their newest inputs (after new weights were swapped in)."""
    check_slots(slots, last.shape[0])
    for i in range(slots.size):
        s = slots[i]
        if has_w[s]:
            fc[s] = _forecast_one(s, logv, x, pos, w1, b1, w2, b2, mx, sx, my, sy, last[s], fp, ip)
        else:
            fc[s] = math.nan


NO_EXOG = np.zeros((0, 0))


def warm_up(pred: Any) -> None:
    """Compile (or load from the disk cache) the kernels for ``pred``'s arrays, on a scratch
    copy of one slot, so that the first decision does not pay for it."""
    one = np.zeros(1, dtype=np.int64)
    keep = pred._keep
    arrays = dict(last=np.full(1, math.nan), n=np.zeros(1, dtype=np.int64),
                  fc=np.full(1, math.nan), merr=np.zeros(1), lerr=np.zeros(1),
                  logv=np.zeros((1, keep)), x=np.zeros((1, keep, pred._x.shape[2])),
                  pos=np.zeros(1, dtype=np.int64), cnt=np.zeros(1, dtype=np.int64),
                  since=np.zeros(1, dtype=np.int64), tried=np.zeros(1, dtype=bool),
                  busy=np.zeros(1, dtype=bool), has_w=np.ones(1, dtype=bool),
                  w1=pred._init[0][None].copy(), b1=pred._init[1][None].copy(),
                  w2=pred._init[2][None].copy(), b2=np.full(1, pred._init[3]),
                  mx=np.zeros((1, pred.cfg.n_inputs)), sx=np.ones((1, pred.cfg.n_inputs)),
                  my=np.zeros(1), sy=np.ones(1))
    a = arrays
    for exog in (NO_EXOG, np.ones((1, max(pred._x.shape[2], 1)))):
        update_step(one, np.ones(1), exog, a["last"], a["n"], a["fc"], a["merr"], a["lerr"],
                    a["logv"], a["x"], a["pos"], a["cnt"], a["since"], a["tried"], a["busy"],
                    a["has_w"], a["w1"], a["b1"], a["w2"], a["b2"], a["mx"], a["sx"], a["my"],
                    a["sy"], pred._fparams, pred._iparams)
    forecast_step(one, a["last"], a["fc"], a["logv"], a["x"], a["pos"], a["has_w"], a["w1"],
                  a["b1"], a["w2"], a["b2"], a["mx"], a["sx"], a["my"], a["sy"], pred._fparams,
                  pred._iparams)
    gated_predict(one, a["fc"], a["merr"], a["lerr"], a["last"], bool(pred.cfg.gate))
