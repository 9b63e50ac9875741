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

from predictors.jit import AVAILABLE, as_float64, as_int64, check_slots, gated_predict, jit, record_and_score

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
        n_out[i] = record_and_score(s, v, last, n, fc, merr, lerr, a)
        p = pos[s]
        logv[s, p] = math.log(v)
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
    """Compile (or load from the disk cache) the kernels for ``pred``'s arrays, so that the
    first decision does not pay for it: on no slot at all (numba compiles for the types, and
    an empty batch changes nothing)."""
    none = np.zeros(0, dtype=np.int64)
    p = pred
    update_step(none, np.zeros(0), NO_EXOG, p._last, p._n, p._fc, p._merr, p._lerr, p._logv, p._x,
                p._pos, p._cnt, p._since, p._tried, p._busy, p._has_w, p._w1, p._b1, p._w2, p._b2,
                p._mx, p._sx, p._my, p._sy, p._fparams, p._iparams)
    forecast_step(none, p._last, p._fc, p._logv, p._x, p._pos, p._has_w, p._w1, p._b1, p._w2,
                  p._b2, p._mx, p._sx, p._my, p._sy, p._fparams, p._iparams)
    gated_predict(none, p._fc, p._merr, p._lerr, p._last, p._gated)
