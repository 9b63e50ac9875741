"""ARIMA(p, d, q) speed predictor: statsmodels fit every ``refit_every`` updates on a sliding window.

Fitting costs tens of milliseconds, so it happens only every ``refit_every`` updates; the
iterations in between reuse the fitted parameters. Two ways to forecast between refits:

* ``between="recursion"`` (default): the one-step ARMA recursion on the differenced series with the
  fitted coefficients and our own innovations (e_t = observed - forecast). It is what the Kalman
  filter settles to for an invertible model, and costs microseconds instead of milliseconds, which
  matters with ~10 workers per iteration.
* ``between="statsmodels"``: ``results.append(new, refit=False).forecast(1)`` (exact state-space
  filtering, a few milliseconds per update).

Until the window holds ``2 * (p + d + q) + 5`` points, when the window is constant, and whenever
statsmodels fails or warns that the fit did not converge, the forecast is the last value (a model
we cannot trust is worse than the memoryless baseline). Forecasts are clipped to
``[clip_low, clip_high] * last``, and with ``gate=True`` (default) the model's forecast is used only
while its recent one-step errors beat the last value's (:class:`predictors.base.BaselineGate`).

``refit_offset`` shifts the refit schedule (0..refit_every-1): give each worker's predictor a
different one so that ~10 workers' refits (tens of ms each) do not all land in one iteration.

Default order (2, 0, 0): on the recorded contention traces the orders we tried were all within a
few % of each other and of the last value; (2, 0, 1) often put the MA root at -1 (convergence
warnings, 2-3x slower fits) without doing better, while AR(2) also captures periodic speed
patterns (it halves last-value RMSE on a noisy 12-iteration sine).

Many workers (:class:`BatchARIMA`, what the BatchSizeManager uses): the recursion between refits
runs for all workers at once on arrays with a worker ("slot") dimension, with the same arithmetic
as :class:`ARIMAPredictor` (tested equal), and the statsmodels fits of the workers that are due are
one job for :mod:`predictors.refit`: synchronous (``refit="sync"``), or in a helper process
(``"background"``, default) or thread while the forecasts keep using the previous coefficients.
With ``stagger=True`` each worker's refit phase is shifted by its id, so about 1/``refit_every`` of
the workers refit per iteration. When a background fit lands, its coefficients and the recursion
state warmed over the fitted window are swapped in and the observations that arrived meanwhile are
replayed, so from then on the forecasts equal those of a synchronous refit. What that costs in
balance: forecasts use coefficients up to one refit period plus the fit's latency old (a worker
whose fit is still running when the next one comes due waits for it and then refits on the newest
window). Only ``between="recursion"`` is batched; the statsmodels mode stays one object per worker.
"""

from __future__ import annotations

import logging
import math
import warnings
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np

from predictors.base import BaselineGate, GatedModelPredictor, check_band, clip_to_band, register_predictor
from predictors.batch import RefittingBatchPredictor
from predictors.refit import RefitExecutor

log = logging.getLogger(__name__)


def fit_arima(data: np.ndarray, order: tuple[int, int, int], maxiter: int,
              low_memory: bool) -> tuple[dict[str, float], Any]:
    """statsmodels fit of one window; (parameters, results). Raises on failure or non-convergence."""
    from statsmodels.tools.sm_exceptions import ConvergenceWarning
    from statsmodels.tsa.arima.model import ARIMA

    trend = "c" if order[1] == 0 else "n"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # cov_type="none": parameter standard errors (a numerical Hessian) are never used.
        res = ARIMA(data, order=order, trend=trend).fit(
            method_kwargs={"maxiter": maxiter}, cov_type="none", low_memory=low_memory)
    if any(issubclass(w.category, ConvergenceWarning) for w in caught):
        raise RuntimeError("did not converge")
    params = dict(zip(res.model.param_names, np.asarray(res.params, dtype=np.float64)))
    if not all(math.isfinite(v) for v in params.values()):
        raise RuntimeError("non-finite parameters")
    return params, res


def coefficients(params: dict[str, float], order: tuple[int, int, int]) -> tuple[float, np.ndarray, np.ndarray]:
    p, _, q = order
    return (params.get("const", 0.0), np.array([params.get(f"ar.L{i}", 0.0) for i in range(1, p + 1)]),
            np.array([params.get(f"ma.L{j}", 0.0) for j in range(1, q + 1)]))


def one_step(ar: np.ndarray, ma: np.ndarray, w: Sequence[float], e: Sequence[float]) -> float:
    """ARMA one-step forecast of the next w from the newest w's and innovations."""
    out = 0.0
    for i in range(1, ar.size + 1):
        if len(w) >= i:
            out += ar[i - 1] * w[-i]
    for j in range(1, ma.size + 1):
        if len(e) >= j:
            out += ma[j - 1] * e[-j]
    return out


def warm_recursion(data: np.ndarray, order: tuple[int, int, int], mu: float, ar: np.ndarray,
                   ma: np.ndarray) -> tuple[list[float], list[float], float | None]:
    """Run the recursion over a window: (newest max(p,1) w's, newest max(q,1) innovations, w_hat)."""
    p, d, q = order
    w_all = np.diff(data, n=d) - mu if d else data - mu
    w: deque[float] = deque(maxlen=max(p, 1))
    e: deque[float] = deque(maxlen=max(q, 1))
    w_hat = None
    for x in w_all:
        if w_hat is not None and q:
            e.append(float(x) - w_hat)
        w.append(float(x))
        w_hat = one_step(ar, ma, w, e)
    return list(w), list(e), w_hat


def refit_job(payload: dict[str, Any]) -> dict[str, np.ndarray]:
    """Fit each window of a batch: coefficients and the recursion state warmed over the window,
    as arrays with one row per window (``ok`` False where the fit failed). A pure function."""
    hook = payload.get("hook")
    if hook is not None:                          # test hook: e.g. a deliberately slow fit
        hook()
    order, maxiter = payload["order"], payload["maxiter"]
    p, _, q = order
    P, Q = max(p, 1), max(q, 1)
    windows = payload["windows"]
    K = len(windows)
    out = {"ok": np.zeros(K, dtype=bool), "mu": np.zeros(K), "ar": np.zeros((K, p)),
           "ma": np.zeros((K, q)), "w": np.zeros((K, P)), "wn": np.zeros(K, dtype=np.int64),
           "e": np.zeros((K, Q)), "en": np.zeros(K, dtype=np.int64), "w_hat": np.full(K, math.nan)}
    for i in range(K):
        data = np.asarray(windows[i], dtype=np.float64)
        try:
            params, _ = fit_arima(data, order, maxiter, low_memory=True)
        except Exception as exc:  # noqa: BLE001 - LinAlgError, ValueError, non-convergence, ...
            log.debug("arima: fit failed (%s); last value until the next refit", exc)
            continue
        mu, ar, ma = coefficients(params, order)
        w, e, w_hat = warm_recursion(data, order, mu, ar, ma)
        out["ok"][i] = True
        out["mu"][i], out["ar"][i], out["ma"][i] = mu, ar, ma
        if w:
            out["w"][i, P - len(w):] = w
        if e:
            out["e"][i, Q - len(e):] = e
        out["wn"][i], out["en"][i] = len(w), len(e)
        out["w_hat"][i] = math.nan if w_hat is None else w_hat
    return out


@register_predictor("arima")
class ARIMAPredictor(GatedModelPredictor):
    """Sliding-window ARIMA with periodic refits (see module docstring)."""

    def __init__(self, order: Sequence[int] = (2, 0, 0), window: int = 100, refit_every: int = 10,
                 log_transform: bool = False, between: str = "recursion",
                 clip_low: float = 0.25, clip_high: float = 4.0, maxiter: int = 50,
                 gate: bool = True, gate_decay: float = 0.9, refit_offset: int = 0) -> None:
        super().__init__()
        try:
            p, d, q = (int(v) for v in order)
        except (TypeError, ValueError):
            raise ValueError(f"arima: order must be three integers (p, d, q), got {order!r}") from None
        if min(p, d, q) < 0 or p + q == 0 or d > 2:
            raise ValueError(f"arima: need p, q >= 0 with p + q >= 1 and 0 <= d <= 2, got {order!r}")
        self.order = (p, d, q)
        self.min_points = 2 * (p + d + q) + 5
        if int(window) < self.min_points:
            raise ValueError(f"arima: window must be >= {self.min_points} for order {self.order}")
        if int(refit_every) < 1:
            raise ValueError(f"arima: refit_every must be >= 1, got {refit_every}")
        if between not in ("recursion", "statsmodels"):
            raise ValueError(f"arima: between must be 'recursion' or 'statsmodels', got {between!r}")
        if int(maxiter) < 1:
            raise ValueError(f"arima: maxiter must be >= 1, got {maxiter}")
        check_band("arima", clip_low, clip_high)
        self.window = int(window)
        self.refit_every = int(refit_every)
        self.refit_offset = int(refit_offset) % self.refit_every
        self.log_transform = bool(log_transform)
        self.between = between
        self.clip_low, self.clip_high = float(clip_low), float(clip_high)
        self.maxiter = int(maxiter)
        self.gate = bool(gate)
        self._gate = BaselineGate(gate_decay)
        self.n_fits = 0
        self.n_failed_fits = 0
        self._reset()

    # ------------------------------------------------------------------------------ state
    def _reset(self) -> None:
        self._y: deque[float] = deque(maxlen=self.window)  # transformed observations
        self._since_fit = 0
        self._tried = False  # a fit was attempted (failed fits are retried only every refit_every)
        self._res: Any = None  # statsmodels results (between="statsmodels")
        self._fitted = False
        self._mu = 0.0
        self._ar = np.zeros(0)
        self._ma = np.zeros(0)
        # recursion state on the differenced series w_t = (1 - B)^d y_t - mu
        self._w: deque[float] = deque(maxlen=max(self.order[0], 1))
        self._e: deque[float] = deque(maxlen=max(self.order[2], 1))
        self._w_hat: float | None = None  # forecast of the next w
        self._forecast: float | None = None  # model forecast of the next speed (None: no model)
        self._gate.reset()

    def _tf(self, v: float) -> float:
        return math.log(v) if self.log_transform else v

    def _inv(self, v: float) -> float:
        return math.exp(min(v, 700.0)) if self.log_transform else v

    # ---------------------------------------------------------------------------- updates
    def _update(self, value: float, exog: np.ndarray | None) -> None:
        self._gate.observe(value, self._forecast, self._last)
        y = self._tf(value)
        self._y.append(y)
        self._since_fit += 1
        if self._fitted:
            self._advance(y)
        if len(self._y) >= self.min_points and (not self._tried or self._since_fit >= self.refit_every):
            self._refit()
        self._forecast = self._model_forecast(value) if self._fitted else None

    def _advance(self, y: float) -> None:
        """Feed one new observation to the fitted model without refitting."""
        if self.between == "statsmodels":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    self._res = self._res.append([y], refit=False)
            except Exception as e:  # noqa: BLE001 - any statsmodels failure means "no model"
                log.debug("arima: append failed (%s); last value until the next refit", e)
                self._fitted = False
            return
        w = self._diff_last(self._y) - self._mu
        if self._w_hat is not None and self.order[2]:
            self._e.append(w - self._w_hat)
        self._w.append(w)
        self._w_hat = self._one_step()

    def _diff_last(self, ys: Sequence[float]) -> float:
        """(1 - B)^d applied at the newest point."""
        d = self.order[1]
        n = len(ys)
        return float(sum((-1) ** k * math.comb(d, k) * ys[n - 1 - k] for k in range(d + 1)))

    def _one_step(self) -> float:
        return one_step(self._ar, self._ma, self._w, self._e)

    def _refit(self) -> None:
        self._since_fit = 0 if self._tried else self.refit_offset
        self._tried = True
        data = np.asarray(self._y, dtype=np.float64)
        self._fitted = False
        self._res = None
        if np.ptp(data) <= 1e-12 * max(1.0, abs(float(data[-1]))):
            return  # constant window: nothing to model, the last value is exact
        self.n_fits += 1
        try:
            params, res = fit_arima(data, self.order, self.maxiter,
                                    low_memory=self.between == "recursion")
        except Exception as e:  # noqa: BLE001 - LinAlgError, ValueError, non-convergence, ...
            self.n_failed_fits += 1
            log.debug("arima: fit failed (%s); last value until the next refit", e)
            return
        self._mu, self._ar, self._ma = coefficients(params, self.order)
        if self.between == "statsmodels":
            self._res = res
        else:
            self._warm_recursion(data)
        self._fitted = True

    def _warm_recursion(self, data: np.ndarray) -> None:
        """Run the ARMA recursion over the window so the innovations match the new coefficients."""
        w, e, self._w_hat = warm_recursion(data, self.order, self._mu, self._ar, self._ma)
        self._w.clear()
        self._w.extend(w)
        self._e.clear()
        self._e.extend(e)

    # ---------------------------------------------------------------------------- forecast
    def _model_forecast(self, last: float) -> float | None:
        """The fitted model's forecast of the next speed, clipped to the band around ``last``."""
        if self.between == "statsmodels":
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    y_next = float(np.asarray(self._res.forecast(1))[0])
            except Exception as e:  # noqa: BLE001
                log.debug("arima: forecast failed (%s)", e)
                return None
        else:
            assert self._w_hat is not None
            d = self.order[1]
            ys = self._y
            n = len(ys)
            # y_{t+1} = w_{t+1} + mu - sum_{k=1..d} (-1)^k C(d,k) y_{t+1-k}
            y_next = self._w_hat + self._mu - sum((-1) ** k * math.comb(d, k) * ys[n - k]
                                                  for k in range(1, d + 1))
        f = self._inv(y_next)
        return clip_to_band(f, last, self.clip_low, self.clip_high) if math.isfinite(f) else None


# ---------------------------------------------------------------------------------- batched
class BatchARIMA(RefittingBatchPredictor):
    """ARIMA for many workers: vectorised recursion, batched and staggered statsmodels refits."""

    name = "arima"

    # Per-slot state arrays made by _def() (one row per worker slot).
    _y: np.ndarray
    _pos: np.ndarray
    _cnt: np.ndarray
    _nobs: np.ndarray
    _since: np.ndarray
    _tried: np.ndarray
    _offset: np.ndarray
    _fitted: np.ndarray
    _mu: np.ndarray
    _ar: np.ndarray
    _ma: np.ndarray
    _w: np.ndarray
    _wn: np.ndarray
    _e: np.ndarray
    _en: np.ndarray
    _what: np.ndarray
    _fc: np.ndarray
    _merr: np.ndarray
    _lerr: np.ndarray
    _fits: np.ndarray
    _failed: np.ndarray
    _busy: np.ndarray
    _gen: np.ndarray

    def __init__(self, order: Sequence[int] = (2, 0, 0), window: int = 100, refit_every: int = 10,
                 log_transform: bool = False, between: str = "recursion",
                 clip_low: float = 0.25, clip_high: float = 4.0, maxiter: int = 50,
                 gate: bool = True, gate_decay: float = 0.9, refit_offset: int = 0, *,
                 refit: str | RefitExecutor = "background", stagger: bool = True,
                 compiled: bool | None = None) -> None:
        super().__init__()
        if between != "recursion":
            raise ValueError("arima: only between='recursion' is batched")
        # the scalar class validates every hyper-parameter with the same messages
        ref = ARIMAPredictor(order=order, window=window, refit_every=refit_every,
                             log_transform=log_transform, between=between, clip_low=clip_low,
                             clip_high=clip_high, maxiter=maxiter, gate=gate, gate_decay=gate_decay,
                             refit_offset=refit_offset)
        self.order = ref.order
        self.min_points, self.window, self.refit_every = ref.min_points, ref.window, ref.refit_every
        self.refit_offset, self.log_transform = ref.refit_offset, ref.log_transform
        self.clip_low, self.clip_high, self.maxiter = ref.clip_low, ref.clip_high, ref.maxiter
        self.gate, self.gate_decay = ref.gate, float(gate_decay)
        self.stagger = bool(stagger)
        self._init_refits(refit, "arima")
        self.fit_hook: Any = None                  #: test hook run at the start of every refit job
        self.refit_fn = refit_job
        self.max_jobs = 2                          #: background jobs in flight at most
        self.job_slots: int | None = None          #: workers per background job (None: auto)
        # Refits leave as they come due, not coalesced as NARX's (see predictors.narx):
        # statsmodels fits take long enough that at most max_jobs in flight already gate the
        # submissions, and a landing replays every observation that arrived during its fit, so
        # a larger job's later landing costs the decision more (tried: jobs of up to 100 of 100
        # workers landed in 11 ms decisions). One update's worth per job, for throttle_due.
        self.job_every = 1
        p, d, q = self.order
        self._P, self._Q = max(p, 1), max(q, 1)
        # history for the fit window plus observations that arrive while a fit runs (replayed)
        self.keep = self.window + max(2 * self.refit_every, 16) + d + 1
        self._diff_coef = [float((-1) ** k * math.comb(d, k)) for k in range(d + 1)]
        self._def("_y", (self.keep,), np.float64, 0.0)
        self._def("_pos", (), np.int64, 0)
        self._def("_cnt", (), np.int64, 0)
        self._def("_nobs", (), np.int64, 0)
        self._def("_since", (), np.int64, 0)
        self._def("_tried", (), bool, False)
        self._def("_offset", (), np.int64, self.refit_offset)
        self._def("_fitted", (), bool, False)
        self._def("_mu", (), np.float64, 0.0)
        self._def("_ar", (max(p, 0),), np.float64, 0.0)
        self._def("_ma", (max(q, 0),), np.float64, 0.0)
        self._def("_w", (self._P,), np.float64, 0.0)
        self._def("_wn", (), np.int64, 0)
        self._def("_e", (self._Q,), np.float64, 0.0)
        self._def("_en", (), np.int64, 0)
        self._def("_what", (), np.float64, math.nan)
        self._def("_fc", (), np.float64, math.nan)
        self._def("_merr", (), np.float64, 0.0)
        self._def("_lerr", (), np.float64, 0.0)
        self._def("_fits", (), np.int64, 0)
        self._def("_failed", (), np.int64, 0)
        self._def("_busy", (), bool, False)
        self._def("_gen", (), np.int64, 0)
        self._gen_counter = 0
        self.submitted_jobs = 0
        self.landed_fits = 0
        self.updates = 0                 #: update() calls (iterations, for a manager)
        self.lag_sum = 0                 #: Σ over landed fits of updates between submit and swap-in
        from predictors import arima_kernel as kernel

        self._init_compiled(kernel, compiled, "arima")
        self._gated = bool(self.gate)
        self._coef = np.array(self._diff_coef)
        self._fparams = np.zeros(3)
        self._fparams[[kernel.F_GATE_DECAY, kernel.F_CLIP_LOW, kernel.F_CLIP_HIGH]] = (
            self.gate_decay, self.clip_low, self.clip_high)
        self._iparams = np.zeros(8, dtype=np.int64)
        self._iparams[[kernel.I_P, kernel.I_D, kernel.I_Q, kernel.I_KEEP, kernel.I_WINDOW,
                       kernel.I_MIN_POINTS, kernel.I_REFIT_EVERY, kernel.I_LOG]] = (
            p, d, q, self.keep, self.window, self.min_points, self.refit_every, self.log_transform)
        if self.compiled:
            kernel.warm_up(self)

    def n_fits(self, slots: np.ndarray | None = None) -> np.ndarray | int:
        """Fits attempted (per slot, or in total), as the scalar class counts them."""
        return int(self._fits.sum()) if slots is None else self._fits[slots]

    def _reset_slots(self, slots: np.ndarray, keys: np.ndarray | None) -> None:
        self._gen_counter += 1
        self._gen[slots] = self._gen_counter
        if self.stagger and keys is not None:
            self._offset[slots] = (self.refit_offset + keys) % self.refit_every
        else:
            self._offset[slots] = self.refit_offset

    # ----- recursion ------------------------------------------------------------------------
    def _yback(self, s: np.ndarray, back: np.ndarray | int) -> np.ndarray:
        """y ``back`` observations before the newest one (0: the newest)."""
        return self._y[s, (self._pos[s] - 1 - back) % self.keep]

    def _diff(self, s: np.ndarray, back: np.ndarray | int) -> np.ndarray:
        """(1 - B)^d y at ``back`` observations before the newest (same arithmetic as the scalar)."""
        acc = self._diff_coef[0] * self._yback(s, back)
        for k in range(1, len(self._diff_coef)):
            acc = acc + self._diff_coef[k] * self._yback(s, back + k)
        return acc

    def _one_step(self, s: np.ndarray) -> np.ndarray:
        p, _, q = self.order
        out = np.zeros(s.size)
        wn, en = self._wn[s], self._en[s]
        for i in range(1, p + 1):
            out = out + np.where(wn >= i, self._ar[s, i - 1] * self._w[s, self._P - i], 0.0)
        for j in range(1, q + 1):
            out = out + np.where(en >= j, self._ma[s, j - 1] * self._e[s, self._Q - j], 0.0)
        return out

    def _advance(self, s: np.ndarray, back: np.ndarray | int = 0) -> None:
        """Feed the observation ``back`` steps before the newest to the fitted recursion."""
        w = self._diff(s, back) - self._mu[s]
        if self.order[2]:
            has = np.isfinite(self._what[s])
            if has.any():
                h = s[has]
                self._e[h, :-1] = self._e[h, 1:]
                self._e[h, -1] = w[has] - self._what[h]
                self._en[h] = np.minimum(self._en[h] + 1, self._Q)
        self._w[s, :-1] = self._w[s, 1:]
        self._w[s, -1] = w
        self._wn[s] = np.minimum(self._wn[s] + 1, self._P)
        self._what[s] = self._one_step(s)

    # ----- updates --------------------------------------------------------------------------
    def update(self, slots: np.ndarray, values: np.ndarray, exog: np.ndarray | None = None) -> np.ndarray:
        if not self.compiled:
            return super().update(slots, values, exog)
        self._poll_for_update()
        slots, values = self._kernel.as_int64(slots), self._kernel.as_float64(values)
        if values.shape != slots.shape:
            raise ValueError(f"arima: {values.shape} speeds for {slots.shape[0]} slots")
        n, due, n_due = self._kernel.update_step(
            slots, values, self._last, self._n, self._fc, self._merr, self._lerr, self._y,
            self._pos, self._cnt, self._nobs, self._since, self._tried, self._busy, self._fitted,
            self._mu, self._ar, self._ma, self._w, self._wn, self._e, self._en, self._what,
            self._coef, self._fparams, self._iparams)
        self.updates += 1
        if n_due and self._schedule(slots, due):
            self._forecast(slots[due])      # a submission or a landing changed their models
        return n

    def _update(self, slots: np.ndarray, values: np.ndarray, exog: np.ndarray | None,
                prev: np.ndarray) -> None:
        self.updates += 1
        fc = self._fc[slots]
        ok = np.isfinite(fc) & np.isfinite(prev)
        if ok.any():
            s, lv = slots[ok], np.log(values[ok])
            a = self.gate_decay
            self._merr[s] = a * self._merr[s] + (1 - a) * (np.log(fc[ok]) - lv) ** 2
            self._lerr[s] = a * self._lerr[s] + (1 - a) * (np.log(prev[ok]) - lv) ** 2
        y = np.log(values) if self.log_transform else values
        pos = self._pos[slots]
        self._y[slots, pos] = y
        self._pos[slots] = (pos + 1) % self.keep
        cnt = np.minimum(self._cnt[slots] + 1, self.keep)
        self._cnt[slots] = cnt
        self._nobs[slots] += 1
        since = self._since[slots] + 1
        self._since[slots] = since
        fitted = self._fitted[slots]
        if fitted.any():
            self._advance(slots[fitted])
        tried = self._tried[slots]
        due = ((np.minimum(cnt, self.window) >= self.min_points)
               & (~tried | (since >= self.refit_every)) & ~self._busy[slots])
        if due.any():
            self._schedule(slots, due)
        self._forecast(slots)

    def _schedule(self, slots: np.ndarray, due: np.ndarray) -> bool:
        """Hand the refits due now (``due``, aligned with ``slots``; at least one) to the
        executor, unless the helper is busy; whether a job left."""
        if self.synchronous:
            chosen: np.ndarray | None = due
        elif self.in_flight >= self.max_jobs:
            return False                    # they stay due (the usual case while a fit runs)
        else:
            from predictors.narx import throttle_due

            chosen = throttle_due(self, slots, due, self._since[slots])
        if chosen is None:
            return False
        d = slots[chosen]
        self._since[d] = np.where(self._tried[d], 0, self._offset[d])
        self._tried[d] = True
        self._submit(d)
        if self.synchronous:
            self.poll()
        return True

    def _windows(self, d: np.ndarray) -> np.ndarray | list[np.ndarray]:
        """Each slot's fit window (oldest first): one (K, window) array when all are full."""
        n = np.minimum(self._cnt[d], self.window)
        if (n == self.window).all():
            idx = (self._pos[d][:, None] - self.window + np.arange(self.window)[None, :]) % self.keep
            return self._y[d[:, None], idx]
        out = []
        for s, k in zip(d.tolist(), n.tolist()):
            idx = (self._pos[s] - k + np.arange(k)) % self.keep
            out.append(self._y[s, idx])
        return out

    def _submit(self, d: np.ndarray) -> None:
        windows = self._windows(d)
        if isinstance(windows, np.ndarray):
            last = np.abs(windows[:, -1])
            const = np.ptp(windows, axis=1) <= 1e-12 * np.maximum(1.0, last)
        else:
            const = np.array([np.ptp(w) <= 1e-12 * max(1.0, abs(float(w[-1]))) for w in windows])
        if self.synchronous:
            self._fitted[d] = False                # as the scalar: no model while refitting
        if const.any():
            c = d[const]                           # constant window: the last value is exact
            self._fitted[c] = False
            self._fc[c] = math.nan
        keep = np.flatnonzero(~const)
        if keep.size == 0:
            return
        d = d[keep]
        if isinstance(windows, np.ndarray):
            windows = windows[keep] if keep.size < const.size else windows
        else:
            windows = [windows[i] for i in keep.tolist()]
        self._fits[d] += 1
        self._busy[d] = True
        self.submitted_jobs += 1
        payload = {"order": self.order, "maxiter": self.maxiter, "windows": windows,
                   "hook": self.fit_hook}
        self.executor.submit(self.refit_fn, payload, (d, self._gen[d].copy(), self._nobs[d].copy(),
                                                       self.updates))

    def poll(self) -> int:
        done = self._results()
        if not done:
            return 0
        landed = 0
        for tag, res, err in done:
            d, gen, nobs0, at = tag
            live = self._gen[d] == gen
            self._busy[d[live]] = False
            if err is not None or res is None:
                log.warning("arima: refit of %d workers failed (%s); keeping their models",
                            int(live.sum()), err)
                continue
            ok = res["ok"]
            bad = d[live & ~ok]
            if bad.size:
                self._failed[bad] += 1
                self._fitted[bad] = False
                self._fc[bad] = math.nan
            sel = np.flatnonzero(live & ok)
            if sel.size == 0:
                continue
            g = d[sel]
            self._mu[g] = res["mu"][sel]
            self._ar[g] = res["ar"][sel]
            self._ma[g] = res["ma"][sel]
            self._w[g] = res["w"][sel]
            self._wn[g] = res["wn"][sel]
            self._e[g] = res["e"][sel]
            self._en[g] = res["en"][sel]
            self._what[g] = res["w_hat"][sel]
            self._fitted[g] = True
            self._replay(g, self._nobs[g] - nobs0[sel])
            self._forecast(g[self._n[g] > 0])
            landed += g.size
            self.lag_sum += (self.updates - at) * g.size
        self.landed_fits += landed
        return landed

    def _set_state(self, s: int, w: list[float], e: list[float], w_hat: float | None) -> None:
        self._w[s] = 0.0
        if w:
            self._w[s, self._P - len(w):] = w
        self._wn[s] = len(w)
        self._e[s] = 0.0
        if e:
            self._e[s, self._Q - len(e):] = e
        self._en[s] = len(e)
        self._what[s] = math.nan if w_hat is None else w_hat

    def _replay(self, ss: np.ndarray, lag: np.ndarray) -> None:
        """Advance freshly landed recursions through the observations that arrived during the fit."""
        if not lag.any():
            return
        late = (lag > 0) & (lag + self.order[1] > self._cnt[ss])
        for s in ss[late].tolist():                # history gone: re-warm over the current window
            data = self._windows(np.array([s]))[0]
            w, e, w_hat = warm_recursion(data, self.order, float(self._mu[s]), self._ar[s], self._ma[s])
            self._set_state(s, w, e, w_hat)
        ok = ~late
        ss, lag = ss[ok], lag[ok]
        if self.compiled:
            self._kernel.replay_step(ss, lag, self._last, self._y, self._pos, self._mu, self._ar,
                                     self._ma, self._w, self._wn, self._e, self._en, self._what,
                                     self._coef, self._iparams)
            return
        for back in range(int(lag.max(initial=0)) - 1, -1, -1):
            sel = ss[lag > back]
            if sel.size:
                self._advance(sel, back)

    # ----- forecasts ------------------------------------------------------------------------
    def _forecast(self, slots: np.ndarray) -> None:
        if self.compiled:
            self._kernel.forecast_step(slots, self._last, self._fc, self._y, self._pos,
                                       self._fitted, self._mu, self._what, self._coef,
                                       self._fparams, self._iparams)
            return
        fitted = self._fitted[slots] & np.isfinite(self._what[slots])
        self._fc[slots[~fitted]] = math.nan
        if not fitted.any():
            return
        s = slots[fitted]
        acc = np.zeros(s.size)
        for k in range(1, len(self._diff_coef)):
            acc = acc + self._diff_coef[k] * self._yback(s, k - 1)
        y_next = self._what[s] + self._mu[s] - acc
        with np.errstate(over="ignore", invalid="ignore"):
            f = np.exp(np.minimum(y_next, 700.0)) if self.log_transform else y_next
            last = self._last[s]
            f = np.where(np.isfinite(f), np.minimum(np.maximum(f, self.clip_low * last),
                                                    self.clip_high * last), math.nan)
        self._fc[s] = f

    def _predict(self, slots: np.ndarray) -> np.ndarray:
        fc = self._fc[slots]
        use = np.isfinite(fc)
        if self.gate:
            use &= self._merr[slots] < self._lerr[slots]
        return np.where(use, fc, self._last[slots])
