"""ARIMA's per-iteration step (score, record, the fitted recursion, forecast) compiled into one
call per batch.

Between refits :class:`~predictors.arima.BatchARIMA` runs the one-step ARMA recursion with the
fitted coefficients: about 50 numpy calls per update and forecast, each paid cold in a paced
decision (:mod:`predictors.jit`). The functions here are the numpy code's arithmetic, slot by
slot, in the same order of operations; logs (the gate's, and with ``log_transform`` the
series') and exp are the C library's, which differ from numpy's vectorised ones in the last bit
for a few inputs in 10,000, so the gate's error averages can differ there, and with
``log_transform`` the series too (``tests/unit/test_predictors_batch.py`` runs both on the same
traces). The replay of the
observations that arrived during a fit, when its coefficients land, is a kernel too (in numpy
it cost about 15 calls per observation replayed); the fits and the swap-in stay in numpy, and
the update kernel only says which slots are due. :func:`warm_up` compiles (or loads) the kernels when a
BatchARIMA is built, so that no decision pays for it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from predictors.jit import AVAILABLE, as_float64, as_int64, check_slots, gated_predict, jit, record_and_score

__all__ = ["AVAILABLE", "as_float64", "as_int64", "forecast_step", "gated_predict", "replay_step",
           "update_step", "warm_up"]

#: Indices into the float parameters array handed to the kernels.
F_GATE_DECAY, F_CLIP_LOW, F_CLIP_HIGH = 0, 1, 2
#: Indices into the integer parameters array.
I_P, I_D, I_Q, I_KEEP, I_WINDOW, I_MIN_POINTS, I_REFIT_EVERY, I_LOG = range(8)


@jit
def _yback(y: np.ndarray, pos: np.ndarray, s: int, back: int, keep: int) -> float:
    """y ``back`` observations before the newest one (0: the newest)."""
    return y[s, (pos[s] - 1 - back) % keep]


@jit
def _forecast_one(s: int, y: np.ndarray, pos: np.ndarray, fitted: np.ndarray, mu: np.ndarray,
                  what: np.ndarray, coef: np.ndarray, last_v: float, fp: np.ndarray,
                  ip: np.ndarray) -> float:
    """The fitted model's forecast of slot ``s``'s next speed (``BatchARIMA._forecast``)."""
    if not (fitted[s] and math.isfinite(what[s])):
        return math.nan
    keep = ip[I_KEEP]
    acc = 0.0
    for k in range(1, coef.size):
        acc = acc + coef[k] * _yback(y, pos, s, k - 1, keep)
    y_next = what[s] + mu[s] - acc
    f = math.exp(min(y_next, 700.0)) if ip[I_LOG] else y_next
    if not math.isfinite(f):
        return math.nan
    return min(max(f, fp[F_CLIP_LOW] * last_v), fp[F_CLIP_HIGH] * last_v)


@jit
def _advance(s: int, back: int, y: np.ndarray, pos: np.ndarray, mu: np.ndarray, ar: np.ndarray,
             ma: np.ndarray, w: np.ndarray, wn: np.ndarray, e: np.ndarray, en: np.ndarray,
             what: np.ndarray, coef: np.ndarray, ip: np.ndarray) -> None:
    """Feed slot ``s``'s observation ``back`` steps before the newest to its fitted recursion
    (``BatchARIMA._advance``)."""
    p, q, keep = ip[I_P], ip[I_Q], ip[I_KEEP]
    P, Q = w.shape[1], e.shape[1]
    acc = coef[0] * _yback(y, pos, s, back, keep)
    for k in range(1, coef.size):
        acc = acc + coef[k] * _yback(y, pos, s, back + k, keep)
    wv = acc - mu[s]
    if q and math.isfinite(what[s]):
        for j in range(Q - 1):
            e[s, j] = e[s, j + 1]
        e[s, Q - 1] = wv - what[s]
        en[s] = min(en[s] + 1, Q)
    for j in range(P - 1):
        w[s, j] = w[s, j + 1]
    w[s, P - 1] = wv
    wn[s] = min(wn[s] + 1, P)
    out = 0.0
    for i in range(1, p + 1):
        out = out + (ar[s, i - 1] * w[s, P - i] if wn[s] >= i else 0.0)
    for j in range(1, q + 1):
        out = out + (ma[s, j - 1] * e[s, Q - j] if en[s] >= j else 0.0)
    what[s] = out


@jit
def update_step(slots: np.ndarray, values: np.ndarray, last: np.ndarray, n: np.ndarray,
                fc: np.ndarray, merr: np.ndarray, lerr: np.ndarray, y: np.ndarray, pos: np.ndarray,
                cnt: np.ndarray, nobs: np.ndarray, since: np.ndarray, tried: np.ndarray,
                busy: np.ndarray, fitted: np.ndarray, mu: np.ndarray, ar: np.ndarray,
                ma: np.ndarray, w: np.ndarray, wn: np.ndarray, e: np.ndarray, en: np.ndarray,
                what: np.ndarray, coef: np.ndarray, fp: np.ndarray,
                ip: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
    """One observation per slot (``BatchPredictor.update`` + ``BatchARIMA._update`` up to the
    refit submission): returns each slot's update count, which slots are due a refit, and how
    many."""
    check_slots(slots, last.shape[0])
    k = slots.size
    a = fp[F_GATE_DECAY]
    keep, window, min_points, refit_every = ip[I_KEEP], ip[I_WINDOW], ip[I_MIN_POINTS], ip[I_REFIT_EVERY]
    n_out = np.empty(k, dtype=np.int64)
    due = np.zeros(k, dtype=np.bool_)
    n_due = 0
    for i in range(k):
        s = slots[i]
        v = values[i]
        n_out[i] = record_and_score(s, v, last, n, fc, merr, lerr, a)
        p = pos[s]
        y[s, p] = math.log(v) if ip[I_LOG] else v
        pos[s] = (p + 1) % keep
        c = min(cnt[s] + 1, keep)
        cnt[s] = c
        nobs[s] += 1
        since[s] += 1
        if fitted[s]:
            _advance(s, 0, y, pos, mu, ar, ma, w, wn, e, en, what, coef, ip)
        if min(c, window) >= min_points and (not tried[s] or since[s] >= refit_every) and not busy[s]:
            due[i] = True
            n_due += 1
        fc[s] = _forecast_one(s, y, pos, fitted, mu, what, coef, v, fp, ip)
    return n_out, due, n_due


@jit
def forecast_step(slots: np.ndarray, last: np.ndarray, fc: np.ndarray, y: np.ndarray,
                  pos: np.ndarray, fitted: np.ndarray, mu: np.ndarray, what: np.ndarray,
                  coef: np.ndarray, fp: np.ndarray, ip: np.ndarray) -> None:
    """Forecasts of ``slots`` from their current state (after a landing or a submission)."""
    check_slots(slots, last.shape[0])
    for i in range(slots.size):
        s = slots[i]
        fc[s] = _forecast_one(s, y, pos, fitted, mu, what, coef, last[s], fp, ip)


@jit
def replay_step(slots: np.ndarray, lag: np.ndarray, last: np.ndarray, y: np.ndarray,
                pos: np.ndarray, mu: np.ndarray, ar: np.ndarray, ma: np.ndarray, w: np.ndarray,
                wn: np.ndarray, e: np.ndarray, en: np.ndarray, what: np.ndarray,
                coef: np.ndarray, ip: np.ndarray) -> None:
    """Advance freshly landed recursions through the ``lag`` observations each slot got while
    its fit ran, oldest first (``BatchARIMA._replay``, for slots whose history still holds
    them)."""
    check_slots(slots, last.shape[0])
    for i in range(slots.size):
        for back in range(lag[i] - 1, -1, -1):
            _advance(slots[i], back, y, pos, mu, ar, ma, w, wn, e, en, what, coef, ip)


def warm_up(pred: Any) -> None:
    """Compile (or load from the disk cache) the kernels for ``pred``'s arrays, so that the
    first decision does not pay for it: on no slot at all (numba compiles for the types, and
    an empty batch changes nothing)."""
    none = np.zeros(0, dtype=np.int64)
    p = pred
    recursion = (p._y, p._pos, p._mu, p._ar, p._ma, p._w, p._wn, p._e, p._en, p._what)
    update_step(none, np.zeros(0), p._last, p._n, p._fc, p._merr, p._lerr, p._y, p._pos, p._cnt,
                p._nobs, p._since, p._tried, p._busy, p._fitted, *recursion[2:], p._coef,
                p._fparams, p._iparams)
    forecast_step(none, p._last, p._fc, p._y, p._pos, p._fitted, p._mu, p._what, p._coef,
                  p._fparams, p._iparams)
    gated_predict(none, p._fc, p._merr, p._lerr, p._last, p._gated)
    replay_step(none, none, p._last, *recursion, p._coef, p._iparams)
