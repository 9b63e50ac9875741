"""NARX speed predictor: a one-hidden-layer tanh network over lagged speeds and exogenous inputs.

LB-BSP's CPU-cluster predictor (DESIGN.md section 5): the next speed of a worker depends on its
recent speeds and on what else runs on its host (co-tenant CPU, memory pressure), which the worker
measures each iteration. Inputs at iteration t, to forecast the speed of t+1:

* ``speed_lags`` log-speeds ``log v_t, ..., log v_{t-speed_lags+1}``;
* ``exog_lags`` exogenous vectors ``x_t, ..., x_{t-exog_lags+1}`` (``x_t`` is the "current" one:
  measured during iteration t, known before t+1 starts).

Everything is z-scored with the statistics of the training window. The target is, by default, the
log-ratio ``log v_{t+1} - log v_t`` (``target="ratio"``): most of a speed series is its level,
which the last value already gets right, so the network only has to learn the change; this beat
the raw level (``target="level"``) on the recorded traces (see tests/unit/test_predictors.py and the
``ps-predict eval`` table in the report).

Online training: every ``refit_every`` updates, ``epochs`` full-batch Adam steps (warm-started
from the previous weights, ``weight_decay`` as an L2 term as in ``torch.optim.Adam``) on the last
``window`` input/target pairs; forecasts are a forward pass computed once per update
(``refit_offset`` shifts the refit schedule). Until ``min_train`` pairs exist the forecast is the
last value (memoryless cold start); forecasts are clipped to ``[clip_low, clip_high] * last``, and
with ``gate=True`` (default) the network's forecast is used only while its recent one-step errors
beat the last value's (:class:`predictors.base.BaselineGate`). On the recorded contention traces an
ungated network with 60 epochs and weight decay 1e-3 was 35% worse than the last value (it fits
the noise); 30 epochs, weight decay 1e-2 and the gate make it a few % better, while it still cuts
last-value RMSE by 2.5-5x on synthetic periodic and exogenous-driven series.

One implementation for one worker and for ten thousand: :class:`BatchNARX` holds every worker's
history, weights and normalisation in arrays with a worker ("slot") dimension, trains all the
workers that are due in one batched numpy model (batched matmuls, hand-written backward pass and
Adam with the formulas of ``torch.optim.Adam``), and forecasts all workers with two einsums.
:class:`NARXPredictor` (the registered scalar predictor, used by ``ps-predict eval``) is a one-slot
``BatchNARX`` refitting synchronously. A worker's training never depends on the other workers in
its batch: each has its own loss term, its parameters get only its gradient, and Adam is
element-wise.

Refits for the BatchSizeManager (``refit=``, see :mod:`predictors.refit`):

* ``"sync"``: inside ``update``, as the scalar predictor does (deterministic; tests, replays).
* ``"background"`` (default; a helper process) or ``"thread"``: the due workers' histories are
  handed to the executor and the forecasts keep using the current weights until the new ones are
  swapped in, at the next update or predict after the fit finished. With ``stagger=True`` each
  worker's refit phase is shifted by its id modulo ``refit_every``, so about 1/``refit_every`` of the
  workers refit per iteration instead of all of them at once.

Refits are handed over in jobs at most once per ``job_every`` updates (by default the largest
divisor of ``refit_every`` up to half of it: 5 for 10; 1, no coalescing, for a prime period),
unless a full job's worth is due, whatever the executor (a synchronous replay refits at the
updates a background run did). Each job costs the decision that hands it over, and the one that
swaps its result in, a fixed few hundred µs (pickling, the pipe, the swap-in): at 100 staggered
workers every decision paid it. What it costs in balance: a refit leaves up to
``job_every - 1`` updates late, once; then the staggered phases sit on the job updates and every
period is whole again (``refit_every`` is a multiple of ``job_every``).

What background refits cost in balance: forecasts use weights that are up to one refit period
(``refit_every`` iterations) plus the fit's own latency old, instead of at most one refit period;
a worker whose refit is still running when the next one comes due skips ahead to the newest data
(its period stretches rather than a queue building up). The inputs of each forecast (the lagged
speeds and loads) are always the newest. Once a fit has landed, forecasts equal those of a
synchronous refit on the same data (tested); the gate's error averages may differ for a while,
because they scored the older weights in between.

Everything is deterministic for a given ``seed`` and refit schedule (numpy only; torch is not used).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from predictors.base import (
    BaselineGate,
    GatedModelPredictor,
    check_band,
    register_predictor,
)
from predictors.batch import RefittingBatchPredictor
from predictors.refit import RefitExecutor
from ps_common.report import EXOG_KEYS

log = logging.getLogger(__name__)

_BETA1, _BETA2, _EPS = 0.9, 0.999, 1e-8         # torch.optim.Adam defaults


@dataclass(frozen=True)
class NARXConfig:
    """Hyper-parameters (validated); picklable, so that a refit job carries them to a helper."""

    speed_lags: int = 2
    exog_lags: int = 2
    hidden: int = 10
    window: int = 200
    refit_every: int = 10
    epochs: int = 30
    lr: float = 0.02
    weight_decay: float = 1e-2
    min_train: int = 10
    target: str = "ratio"
    n_exog: int = len(EXOG_KEYS)
    clip_low: float = 0.25
    clip_high: float = 4.0
    loss: str = "mse"
    gate: bool = True
    gate_decay: float = 0.9
    seed: int = 0
    refit_offset: int = 0

    def __post_init__(self) -> None:
        ints = {"speed_lags": self.speed_lags, "exog_lags": self.exog_lags, "hidden": self.hidden,
                "window": self.window, "refit_every": self.refit_every, "epochs": self.epochs,
                "min_train": self.min_train, "n_exog": self.n_exog, "seed": self.seed,
                "refit_offset": self.refit_offset}
        for k, v in ints.items():
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool):
                raise ValueError(f"narx: {k} must be an integer, got {v!r}")
        if (self.speed_lags < 1 or self.exog_lags < 0 or self.hidden < 1 or self.refit_every < 1
                or self.epochs < 1 or self.n_exog < 0):
            raise ValueError("narx: need speed_lags >= 1, exog_lags >= 0, hidden >= 1, "
                             "refit_every >= 1, epochs >= 1, n_exog >= 0")
        if self.min_train < 2 or self.window < self.min_train:
            raise ValueError(f"narx: need 2 <= min_train <= window, got {self.min_train}, {self.window}")
        if self.target not in ("ratio", "level"):
            raise ValueError(f"narx: target must be 'ratio' or 'level', got {self.target!r}")
        lr, wd = self.lr, self.weight_decay
        if not (lr > 0 and math.isfinite(lr)) or not (wd >= 0 and math.isfinite(wd)):
            raise ValueError(f"narx: need lr > 0 and weight_decay >= 0, got {lr}, {wd}")
        if self.loss not in ("mse", "huber"):
            raise ValueError(f"narx: loss must be 'mse' or 'huber', got {self.loss!r}")
        check_band("narx", self.clip_low, self.clip_high)
        if not (0.0 <= self.gate_decay < 1.0):
            raise ValueError(f"gate decay must be in [0, 1), got {self.gate_decay}")

    @property
    def exog_used(self) -> int:
        """Exogenous features per lag that enter the network (0 if none)."""
        return self.n_exog if self.exog_lags else 0

    @property
    def n_inputs(self) -> int:
        return self.speed_lags + self.exog_lags * self.n_exog

    @property
    def lag(self) -> int:
        """Observations needed for one input row."""
        return max(self.speed_lags, self.exog_lags, 1)

    @property
    def keep(self) -> int:
        """History kept per worker: a full window of pairs plus the lags."""
        return self.window + self.lag + 1


# ---------------------------------------------------------------------------------- the model
def init_weights(cfg: NARXConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray, float]:
    """Seeded initial weights (W1 (H, I), b1 (H,), w2 (H,), b2), uniform(±1/sqrt(fan_in)) drawn in
    the order torch's ``Linear`` layers hold them, from our own generator."""
    rng = np.random.default_rng(cfg.seed)
    b = 1.0 / math.sqrt(cfg.n_inputs)
    w1 = rng.uniform(-b, b, (cfg.hidden, cfg.n_inputs))
    b1 = rng.uniform(-b, b, (cfg.hidden,))
    b = 1.0 / math.sqrt(cfg.hidden)
    w2 = rng.uniform(-b, b, (1, cfg.hidden))[0]
    b2 = float(rng.uniform(-b, b, (1,))[0])
    return w1, b1, w2, b2


def design(logv: np.ndarray, x: np.ndarray, cfg: NARXConfig) -> tuple[np.ndarray, np.ndarray]:
    """Training pairs of K histories of equal length L (chronological, oldest first).

    Rows t = lag-1 .. L-2 (the last ``window`` of them): newest-first speed lags, then newest-first
    exogenous vectors; targets log v_{t+1} - log v_t (ratio) or log v_{t+1} (level).
    """
    K, L = logv.shape
    n = min(L - cfg.lag, cfg.window)
    ts = np.arange(L - 1 - n, L - 1)
    cols = [logv[:, ts - j] for j in range(cfg.speed_lags)]
    if cfg.exog_lags and cfg.n_exog:
        for j in range(cfg.exog_lags):
            cols.extend(x[:, ts - j, e] for e in range(cfg.n_exog))
    X = np.stack(cols, axis=2)
    nxt = logv[:, ts + 1]
    y = nxt - logv[:, ts] if cfg.target == "ratio" else nxt
    return X, y


def train(X: np.ndarray, y: np.ndarray, w1: np.ndarray, b1: np.ndarray, w2: np.ndarray,
          b2: np.ndarray, cfg: NARXConfig) -> dict[str, np.ndarray]:
    """Full-batch Adam on K independent networks at once; returns weights, normalisation and ok.

    X (K, n, I), y (K, n); weights with a leading K axis (warm start). ``ok`` is False where the
    last loss was not finite (the caller re-initialises that worker's network at its next refit).
    """
    K, n, _ = X.shape
    mx = X.mean(axis=1)
    sx = X.std(axis=1)
    sx = np.where(sx > 1e-9, sx, 1.0)   # constant inputs carry no information: leave them at 0
    my = y.mean(axis=1)
    sy = y.std(axis=1)
    sy = np.where(sy <= 1e-9, 1.0, sy)
    if cfg.target == "ratio":
        my = np.zeros(K)                # keep "no change" at exactly 0: a flat series is exact
    Xn = (X - mx[:, None, :]) / sx[:, None, :]
    yn = (y - my[:, None]) / sy[:, None]
    params = [w1.copy(), b1.copy(), w2.copy(), b2.astype(np.float64).copy()]
    m = [np.zeros_like(p) for p in params]
    v = [np.zeros_like(p) for p in params]
    wd, lr = cfg.weight_decay, cfg.lr
    loss = np.zeros(K)
    with np.errstate(over="ignore", invalid="ignore"):
        for step in range(1, cfg.epochs + 1):
            W1, B1, W2, B2 = params
            h = np.tanh(Xn @ W1.transpose(0, 2, 1) + B1[:, None, :])         # (K, n, H)
            out = np.einsum("knh,kh->kn", h, W2) + B2[:, None]
            r = out - yn
            if cfg.loss == "mse":
                loss = np.mean(r * r, axis=1)
                dout = r * (2.0 / n)
            else:                                                            # huber, delta 1
                a = np.abs(r)
                loss = np.mean(np.where(a < 1.0, 0.5 * r * r, a - 0.5), axis=1)
                dout = np.clip(r, -1.0, 1.0) / n
            g_w2 = np.einsum("kn,knh->kh", dout, h)
            g_b2 = dout.sum(axis=1)
            da = dout[:, :, None] * W2[:, None, :] * (1.0 - h * h)
            g_w1 = da.transpose(0, 2, 1) @ Xn
            g_b1 = da.sum(axis=1)
            bc1 = 1.0 - _BETA1 ** step
            bc2_sqrt = (1.0 - _BETA2 ** step) ** 0.5
            step_size = lr / bc1
            for p, g, mi, vi in zip(params, (g_w1, g_b1, g_w2, g_b2), m, v):
                if wd != 0:
                    g = g + wd * p
                mi += (1.0 - _BETA1) * (g - mi)
                vi *= _BETA2
                vi += (1.0 - _BETA2) * (g * g)
                p -= step_size * (mi / (np.sqrt(vi) / bc2_sqrt + _EPS))
    ok = np.isfinite(loss)
    for p in params:
        ok &= np.isfinite(p.reshape(K, -1)).all(axis=1)
    return {"w1": params[0], "b1": params[1], "w2": params[2], "b2": params[3],
            "mx": mx, "sx": sx, "my": my, "sy": sy, "ok": ok}


def refit_job(payload: dict[str, Any]) -> dict[str, np.ndarray]:
    """One batched refit: K workers' chronological histories -> new weights (pure function).

    Workers with the same history length train together (no padding); a worker without weights
    starts from the seeded initialisation, the others warm-start. Runs in the caller (sync) or in
    a background thread or process.
    """
    cfg: NARXConfig = payload["cfg"]
    hook = payload.get("hook")
    if hook is not None:                          # test hook: e.g. a deliberately slow fit
        hook()
    logv, x, count = payload["logv"], payload["x"], payload["count"]
    if "pos" in payload:                          # ring rows: rotate to oldest-first
        keep = logv.shape[1]
        idx = (payload["pos"][:, None] + np.arange(keep)[None, :]) % keep
        logv = np.take_along_axis(logv, idx, axis=1)
        x = np.take_along_axis(x, idx[:, :, None], axis=1) if x.shape[2] else x
    has_w = payload["has_w"]
    K = logv.shape[0]
    w1, b1, w2, b2 = (payload[k].copy() for k in ("w1", "b1", "w2", "b2"))
    if not has_w.all():
        iw1, ib1, iw2, ib2 = init_weights(cfg)
        fresh = ~has_w
        w1[fresh], b1[fresh], w2[fresh], b2[fresh] = iw1, ib1, iw2, ib2
    n_in = cfg.n_inputs
    out = {"w1": np.empty_like(w1), "b1": np.empty_like(b1), "w2": np.empty_like(w2),
           "b2": np.empty(K), "mx": np.empty((K, n_in)), "sx": np.empty((K, n_in)), "my": np.empty(K),
           "sy": np.empty(K), "ok": np.zeros(K, dtype=bool)}
    for L in sorted(set(count.tolist())):
        rows = np.flatnonzero(count == L)
        X, y = design(logv[rows, -L:], x[rows, -L:], cfg)
        res = train(X, y, w1[rows], b1[rows], w2[rows], b2[rows], cfg)
        for k, val in res.items():
            out[k][rows] = val
    return out


# ---------------------------------------------------------------------------------- batched
def default_job_every(refit_every: int) -> int:
    """The largest divisor of ``refit_every`` up to half of it (1 for a prime period: no
    coalescing), so that staggered phases settle on the job updates (see the module docstring)."""
    return max(d for d in range(1, max(1, refit_every // 2) + 1) if refit_every % d == 0)


def job_cap(pred: Any, n: int) -> int:
    """Twice the refits one job carries on average (``job_every`` updates' worth of ``n``
    staggered workers), at least 16."""
    return max(16, 2 * pred.job_every * -(-n // pred.refit_every))


def throttle_due(pred: Any, slots: np.ndarray, due: np.ndarray, since: np.ndarray) -> np.ndarray | None:
    """Shared by the batched NARX and ARIMA: limit background refit submissions (see
    :meth:`BatchNARX._throttle`). ``job_slots`` defaults to twice the refits expected per job
    (``job_every`` updates' worth)."""
    if pred.in_flight >= pred.max_jobs:
        return None
    k = int(np.count_nonzero(due))
    cap = pred.job_slots or job_cap(pred, slots.size)
    if k <= cap:
        return due
    idx = np.flatnonzero(due)
    keep = idx[np.argsort(-since[idx], kind="stable")[:cap]]      # the most overdue first
    out = np.zeros(due.size, dtype=bool)
    out[keep] = True
    return out


class BatchNARX(RefittingBatchPredictor):
    """NARX for many workers: per-slot histories, weights and gate; batched, staggered refits."""

    name = "narx"

    # Per-slot state arrays made by _def() (one row per worker slot).
    _logv: np.ndarray
    _x: np.ndarray
    _pos: np.ndarray
    _cnt: np.ndarray
    _since: np.ndarray
    _tried: np.ndarray
    _offset: np.ndarray
    _has_w: np.ndarray
    _w1: np.ndarray
    _b1: np.ndarray
    _w2: np.ndarray
    _b2: np.ndarray
    _mx: np.ndarray
    _sx: np.ndarray
    _my: np.ndarray
    _sy: np.ndarray
    _fc: np.ndarray
    _merr: np.ndarray
    _lerr: np.ndarray
    _fits: np.ndarray
    _busy: np.ndarray
    _gen: np.ndarray

    def __init__(self, *, refit: str | RefitExecutor = "background", stagger: bool = True,
                 compiled: bool | None = None, **hyper: Any) -> None:
        super().__init__()
        self.cfg = cfg = NARXConfig(**hyper)
        from predictors import narx_kernel

        self._init_compiled(narx_kernel, compiled, "narx")
        self._gated = bool(cfg.gate)
        self.n_exog = cfg.exog_used
        self.stagger = bool(stagger)
        self._init_refits(refit, "narx")
        #: test hook: a zero-argument callable run at the start of every refit job (must pickle
        #: for the process executor)
        self.fit_hook: Any = None
        self.refit_fn = refit_job
        self.refit_every = cfg.refit_every
        self.max_jobs = 2                #: background jobs in flight at most
        self.job_slots: int | None = None  #: workers per background job at most (None: auto)
        #: refits are handed over at most once per this many updates (see the module docstring)
        self.job_every = default_job_every(cfg.refit_every)
        self.last_job_at = -(1 << 62)    #: the update that handed over the last job
        H, n_in, E, keep = cfg.hidden, cfg.n_inputs, max(cfg.n_exog, 0), cfg.keep
        self._keep = keep
        self._lag_idx = np.arange(cfg.speed_lags)[None, :]
        self._exog_cols = bool(cfg.exog_lags and cfg.n_exog)
        self._exog_idx = np.arange(cfg.exog_lags)[None, :]
        self._init = init_weights(cfg)
        self._def("_logv", (keep,), np.float64, 0.0)
        self._def("_x", (keep, E), np.float64, 0.0)
        self._def("_pos", (), np.int64, 0)
        self._def("_cnt", (), np.int64, 0)
        self._def("_since", (), np.int64, 0)
        self._def("_tried", (), bool, False)
        self._def("_offset", (), np.int64, cfg.refit_offset % cfg.refit_every)
        self._def("_has_w", (), bool, False)
        self._def("_w1", (H, n_in), np.float64, 0.0)
        self._def("_b1", (H,), np.float64, 0.0)
        self._def("_w2", (H,), np.float64, 0.0)
        self._def("_b2", (), np.float64, 0.0)
        self._def("_mx", (n_in,), np.float64, 0.0)
        self._def("_sx", (n_in,), np.float64, 1.0)
        self._def("_my", (), np.float64, 0.0)
        self._def("_sy", (), np.float64, 1.0)
        self._def("_fc", (), np.float64, math.nan)      # network forecast (nan: none)
        self._def("_merr", (), np.float64, 0.0)
        self._def("_lerr", (), np.float64, 0.0)
        self._def("_fits", (), np.int64, 0)
        self._def("_busy", (), bool, False)             # a refit of this slot is in flight
        self._def("_gen", (), np.int64, 0)
        self._gen_counter = 0
        self.submitted_jobs = 0
        self.landed_fits = 0
        self.updates = 0                 #: update() calls (iterations, for a manager)
        self.lag_sum = 0                 #: Σ over landed fits of updates between submit and swap-in
        self._fparams = np.zeros(3)
        self._fparams[[narx_kernel.F_GATE_DECAY, narx_kernel.F_CLIP_LOW, narx_kernel.F_CLIP_HIGH]] = (
            cfg.gate_decay, cfg.clip_low, cfg.clip_high)
        self._iparams = np.zeros(8, dtype=np.int64)
        self._iparams[[narx_kernel.I_KEEP, narx_kernel.I_LAG, narx_kernel.I_MIN_TRAIN,
                       narx_kernel.I_REFIT_EVERY, narx_kernel.I_SPEED_LAGS, narx_kernel.I_EXOG_LAGS,
                       narx_kernel.I_RATIO, narx_kernel.I_GATE]] = (
            keep, cfg.lag, cfg.min_train, cfg.refit_every, cfg.speed_lags,
            cfg.exog_lags if self._exog_cols else 0, cfg.target == "ratio", cfg.gate)
        if self.compiled:
            narx_kernel.warm_up(self)

    def _reset_slots(self, slots: np.ndarray, keys: np.ndarray | None) -> None:
        cfg = self.cfg
        self._gen_counter += 1
        self._gen[slots] = self._gen_counter             # results in flight for them are stale
        if self.stagger and keys is not None:
            self._offset[slots] = (cfg.refit_offset + keys) % cfg.refit_every
        else:
            self._offset[slots] = cfg.refit_offset % cfg.refit_every

    def n_fits(self, slots: np.ndarray | None = None) -> np.ndarray | int:
        """Successful fits swapped in (per slot, or in total)."""
        return int(self._fits.sum()) if slots is None else self._fits[slots]

    # ----- updates --------------------------------------------------------------------------
    def update(self, slots: np.ndarray, values: np.ndarray, exog: np.ndarray | None = None) -> np.ndarray:
        if not self.compiled:
            return super().update(slots, values, exog)
        self._poll_for_update()
        kern = self._kernel
        slots, values = kern.as_int64(slots), kern.as_float64(values)
        k, E = slots.shape[0], self._x.shape[2]
        if values.shape != (k,):
            raise ValueError(f"narx: {values.shape} speeds for {k} slots")
        if exog is None or E == 0:
            exog = self._kernel.NO_EXOG
        elif exog.ndim != 2 or exog.shape[0] != k or exog.shape[1] < E:
            raise ValueError(f"narx: exogenous inputs of shape {exog.shape} for {k} slots and {E} inputs")
        else:
            exog = kern.as_float64(exog)
        n, due, n_due = self._kernel.update_step(
            slots, values, exog, self._last, self._n, self._fc, self._merr, self._lerr, self._logv,
            self._x, self._pos, self._cnt, self._since, self._tried, self._busy, self._has_w,
            self._w1, self._b1, self._w2, self._b2, self._mx, self._sx, self._my, self._sy,
            self._fparams, self._iparams)
        self.updates += 1
        if n_due:
            self._schedule(slots, due)
        return n

    def _update(self, slots: np.ndarray, values: np.ndarray, exog: np.ndarray | None,
                prev: np.ndarray) -> None:
        cfg = self.cfg
        self.updates += 1
        # score the forecasts made for this value (model vs last) before anything moves
        fc = self._fc[slots]
        ok = np.isfinite(fc) & np.isfinite(prev)
        if ok.any():
            s, lv = slots[ok], np.log(values[ok])
            a = cfg.gate_decay
            self._merr[s] = a * self._merr[s] + (1 - a) * (np.log(fc[ok]) - lv) ** 2
            self._lerr[s] = a * self._lerr[s] + (1 - a) * (np.log(prev[ok]) - lv) ** 2
        pos = self._pos[slots]
        self._logv[slots, pos] = np.log(values)
        if self._x.shape[2]:
            self._x[slots, pos] = 0.0 if exog is None else exog[:, : self._x.shape[2]]
        self._pos[slots] = (pos + 1) % self._keep
        cnt = np.minimum(self._cnt[slots] + 1, self._keep)
        self._cnt[slots] = cnt
        since = self._since[slots] + 1
        self._since[slots] = since
        tried = self._tried[slots]
        due = (cnt - cfg.lag >= cfg.min_train) & (~tried | (since >= cfg.refit_every))
        due &= ~self._busy[slots]
        if due.any():
            self._schedule(slots, due)
        self._forecast(slots)

    def _schedule(self, slots: np.ndarray, due: np.ndarray) -> None:
        """Hand the refits due now (``due``, aligned with ``slots``; at least one) to the
        executor, unless they wait for the next job update or the helper is busy."""
        if self._coalesced(due) or (not self.synchronous and self.in_flight >= self.max_jobs):
            return
        chosen = due if self.synchronous else self._throttle(slots, due, self._since[slots])
        if chosen is not None:
            self.last_job_at = self.updates
            d = slots[chosen]
            self._since[d] = np.where(self._tried[d], 0, self._offset[d])
            self._tried[d] = True
            self._submit(d)
            if self.synchronous:
                self.poll()

    def _coalesced(self, due: np.ndarray) -> bool:
        """Do the refits due now wait for the next job update? A job leaves at most once per
        ``job_every`` updates, unless a full job's worth is due; whatever the executor, so that
        a synchronous replay refits at the updates a background run did."""
        if self.job_every > 1 and self.updates - self.last_job_at < self.job_every:
            return int(np.count_nonzero(due)) < (self.job_slots or job_cap(self, due.size))
        return False

    def _throttle(self, slots: np.ndarray, due: np.ndarray, since: np.ndarray) -> np.ndarray | None:
        """Background refits: at most ``max_jobs`` jobs in flight and ``job_slots`` workers per
        job (the most overdue first). The rest stay due: when the helper cannot keep up, refit
        periods stretch instead of a queue (and the caller's share of the work) growing."""
        return throttle_due(self, slots, due, since)

    def _submit(self, d: np.ndarray) -> None:
        cfg = self.cfg
        payload = {"cfg": cfg, "logv": self._logv[d], "x": self._x[d], "pos": self._pos[d],
                   "count": self._cnt[d], "has_w": self._has_w[d],
                   "w1": self._w1[d], "b1": self._b1[d], "w2": self._w2[d], "b2": self._b2[d],
                   "hook": self.fit_hook}
        self._busy[d] = True
        self.submitted_jobs += 1
        self.executor.submit(self.refit_fn, payload, (d, self._gen[d].copy(), self.updates))

    def poll(self) -> int:
        done = self._results()
        if not done:
            return 0
        landed = 0
        for tag, res, err in done:
            d, gen, at = tag
            live = self._gen[d] == gen                  # not reset since it was submitted
            d = d[live]
            self._busy[d] = False
            if err is not None or res is None:
                log.warning("narx: refit of %d workers failed (%s); keeping their weights", d.size, err)
                continue
            ok = res["ok"][live]
            good, bad = d[ok], d[~ok]
            if bad.size:
                log.debug("narx: training diverged for %d workers; last value until their next refit",
                          bad.size)
                self._has_w[bad] = False
                self._fc[bad] = math.nan
            if good.size:
                sel = np.flatnonzero(live)[ok]
                for name in ("w1", "b1", "w2", "b2", "mx", "sx", "my", "sy"):
                    getattr(self, "_" + name)[good] = res[name][sel]
                self._has_w[good] = True
                self._fits[good] += 1
                landed += good.size
                self.lag_sum += (self.updates - at) * good.size
                self._forecast(good[self._n[good] > 0])
        self.landed_fits += landed
        return landed

    # ----- forecasts ------------------------------------------------------------------------
    def _forecast(self, slots: np.ndarray) -> None:
        """Network forecast of each slot's next speed from its newest inputs (nan: no network)."""
        if self.compiled:
            self._kernel.forecast_step(slots, self._last, self._fc, self._logv, self._x, self._pos,
                                      self._has_w, self._w1, self._b1, self._w2, self._b2,
                                      self._mx, self._sx, self._my, self._sy, self._fparams,
                                      self._iparams)
            return
        has = self._has_w[slots]
        self._fc[slots[~has]] = math.nan
        if not has.any():
            return
        s = slots[has]
        cfg = self.cfg
        keep = self._keep
        newest = (self._pos[s] - 1) % keep
        lags = self._logv[s[:, None], (newest[:, None] - self._lag_idx) % keep]      # (k, sl)
        if self._exog_cols:
            xs = self._x[s[:, None], (newest[:, None] - self._exog_idx) % keep]      # (k, el, E)
            row = np.concatenate([lags, xs.reshape(s.size, -1)], axis=1)
        else:
            row = lags
        z = (row - self._mx[s]) / self._sx[s]
        h = np.tanh(np.matmul(self._w1[s], z[:, :, None])[:, :, 0] + self._b1[s])
        out = np.einsum("kh,kh->k", self._w2[s], h) + self._b2[s]
        out = out * self._sy[s] + self._my[s]
        log_next = lags[:, 0] + out if cfg.target == "ratio" else out
        with np.errstate(over="ignore", invalid="ignore"):
            f = np.exp(np.minimum(log_next, 700.0))
            last = self._last[s]
            f = np.where(np.isfinite(f), np.minimum(np.maximum(f, cfg.clip_low * last),
                                                    cfg.clip_high * last), math.nan)
        self._fc[s] = f

    def _predict(self, slots: np.ndarray) -> np.ndarray:
        fc = self._fc[slots]
        use = np.isfinite(fc)
        if self.cfg.gate:
            use &= self._merr[slots] < self._lerr[slots]
        return np.where(use, fc, self._last[slots])


# ---------------------------------------------------------------------------------- scalar
@register_predictor("narx")
class NARXPredictor(GatedModelPredictor):
    """Sliding-window online NARX network (see module docstring): a one-slot :class:`BatchNARX`
    that refits synchronously."""

    def __init__(self, speed_lags: int = 2, exog_lags: int = 2, hidden: int = 10,
                 window: int = 200, refit_every: int = 10, epochs: int = 30, lr: float = 0.02,
                 weight_decay: float = 1e-2, min_train: int = 10, target: str = "ratio",
                 n_exog: int = len(EXOG_KEYS), clip_low: float = 0.25, clip_high: float = 4.0,
                 loss: str = "mse", gate: bool = True, gate_decay: float = 0.9, seed: int = 0,
                 refit_offset: int = 0) -> None:
        super().__init__()
        hyper: dict[str, Any] = dict(
            speed_lags=speed_lags, exog_lags=exog_lags, hidden=hidden, window=window,
            refit_every=refit_every, epochs=epochs, lr=lr, weight_decay=weight_decay,
            min_train=min_train, target=target, n_exog=n_exog, clip_low=clip_low,
            clip_high=clip_high, loss=loss, gate=gate, gate_decay=gate_decay, seed=seed,
            refit_offset=refit_offset)
        self._batch = BatchNARX(refit="sync", stagger=False, **hyper)
        cfg = self._batch.cfg
        self.cfg = cfg
        self.loss, self.gate = cfg.loss, cfg.gate
        self._gate = BaselineGate(cfg.gate_decay)   # interface of GatedModelPredictor; the batch
                                                    # keeps the gate's state (``_merr``/``_lerr``)
        self.speed_lags, self.exog_lags, self.hidden = cfg.speed_lags, cfg.exog_lags, cfg.hidden
        self.window, self.refit_every, self.epochs = cfg.window, cfg.refit_every, cfg.epochs
        self.refit_offset = cfg.refit_offset % cfg.refit_every
        self.min_train, self.n_exog, self.seed = cfg.min_train, cfg.n_exog, cfg.seed
        self.lr, self.weight_decay, self.target = cfg.lr, cfg.weight_decay, cfg.target
        self.clip_low, self.clip_high = cfg.clip_low, cfg.clip_high
        self.n_inputs = cfg.n_inputs
        self._slot = np.zeros(1, dtype=np.int64)
        self._reset()

    @property
    def n_fits(self) -> int:
        fits = self._batch.n_fits(self._slot)
        assert isinstance(fits, np.ndarray)
        return int(fits[0])

    def _reset(self) -> None:
        self._n_exog = self.n_exog if self.n_exog > 0 else None
        self._forecast = None
        self._batch.reset(self._slot, None)

    def _update(self, value: float, exog: np.ndarray | None) -> None:
        x = None
        if self._batch.n_exog:
            x = np.zeros((1, self.n_exog)) if exog is None else exog.reshape(1, -1)
        self._batch.update(self._slot, np.array([value]), x)
        fc = float(self._batch._fc[0])
        self._forecast = fc if math.isfinite(fc) else None

    def _predict(self) -> float:
        return float(self._batch.predict(self._slot)[0])
