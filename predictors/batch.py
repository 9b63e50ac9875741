"""Predictors for many workers at once: one row of numpy state per worker ("slot").

The BatchSizeManager forecasts every live worker's speed once per iteration. With one Python
predictor object per worker that is ~10 µs per worker for EMA and a full network training per
worker for NARX, all in the coordinator's message loop. A :class:`BatchPredictor` keeps the state
of all workers in arrays indexed by slot, so an iteration's updates and forecasts are a handful of
numpy operations whatever the number of workers, and model refits (NARX, ARIMA) are batched,
staggered and run off the caller's thread (:mod:`predictors.refit`).

Semantics per slot are those of the scalar :class:`~predictors.base.Predictor` of the same name
(the scalar NARX is a one-slot :class:`~predictors.narx.BatchNARX`; ARIMA's vectorised recursion is
tested against the scalar class): nan before the first update, otherwise a finite, positive
forecast that falls back to the last value. Inputs are validated by the caller (finite speeds > 0,
exogenous rows of the predictor's length).
"""

from __future__ import annotations

import contextlib
import math
import time
from typing import Any, Callable, Iterator, Mapping

import numpy as np

from predictors.base import Predictor, get_predictor


def grown(a: np.ndarray, capacity: int, fill: Any) -> np.ndarray:
    """``a`` with its first axis extended to ``capacity`` rows of ``fill``."""
    out = np.full((capacity,) + a.shape[1:], fill, dtype=a.dtype)
    out[: a.shape[0]] = a
    return out


#: How recent an update's look at the refit pipe must be for the predict after it to skip its own.
POLLED_FOR_S = 0.005


class BatchPredictor:
    """Base class: last value and update count per slot, growth, the finite-forecast guard."""

    name = "?"
    #: how many exogenous inputs the model reads (0: it ignores them, the caller may pass None)
    n_exog = 0

    def __init__(self) -> None:
        self.capacity = 0
        self._last = np.zeros(0)
        self._n = np.zeros(0, dtype=np.int64)
        self._arrays: dict[str, Any] = {}            # name -> fill value, for resize/reset
        self._polled_at: float | None = None   # when update() last polled, if no predict() since

    # ----- storage --------------------------------------------------------------------------
    def _def(self, name: str, tail: tuple[int, ...], dtype: Any, fill: Any) -> None:
        setattr(self, name, np.full((self.capacity,) + tail, fill, dtype=dtype))
        self._arrays[name] = fill

    def resize(self, capacity: int) -> None:
        """Make room for slots [0, capacity)."""
        if capacity <= self.capacity:
            return
        self._last = grown(self._last, capacity, math.nan)
        self._n = grown(self._n, capacity, 0)
        for name, fill in self._arrays.items():
            setattr(self, name, grown(getattr(self, name), capacity, fill))
        self.capacity = capacity

    def reset(self, slots: np.ndarray, keys: np.ndarray | None = None) -> None:
        """Forget everything about ``slots`` (a worker joined or left). ``keys`` are the workers'
        ids, which models with refits use to stagger them."""
        self.resize(int(slots.max()) + 1 if slots.size else 0)
        self._last[slots] = math.nan
        self._n[slots] = 0
        for name, fill in self._arrays.items():
            getattr(self, name)[slots] = fill
        self._reset_slots(slots, keys)

    # ----- the interface --------------------------------------------------------------------
    def update(self, slots: np.ndarray, values: np.ndarray, exog: np.ndarray | None = None) -> np.ndarray:
        """Record one observation for each of ``slots`` (unique): speeds and (n, n_exog) inputs.
        Returns each slot's count of observations, this one included (:meth:`n_updates`)."""
        self._poll_for_update()
        prev = self._last[slots]
        self._last[slots] = values
        n = self._n[slots] + 1
        self._n[slots] = n
        self._update(slots, values, exog, prev)
        return n

    def predict(self, slots: np.ndarray) -> np.ndarray:
        """Next-iteration speed of each slot: nan before its first update, else finite and > 0.
        Polls for finished refits unless :meth:`update` did less than :data:`POLLED_FOR_S` ago
        with no predict since: a decision applies its reports, then predicts, and looks at the
        refit pipe once, not twice; reports applied well before the decision do not count."""
        self._poll_before_predict()
        raw = self._predict(slots)
        last = self._last[slots]
        ok = np.isfinite(raw) & (raw > 0.0)          # comparisons with nan never warn
        return np.where(ok, raw, last)

    def _poll_for_update(self) -> None:
        self.poll()
        self._polled_at = time.monotonic()

    def _poll_before_predict(self) -> None:
        polled_at, self._polled_at = self._polled_at, None
        if polled_at is None or time.monotonic() - polled_at > POLLED_FOR_S:
            self.poll()

    def n_updates(self, slots: np.ndarray) -> np.ndarray:
        return self._n[slots]

    def poll(self) -> int:
        """Swap in the results of finished background refits; returns how many slots got new
        weights. Called by :meth:`update` and :meth:`predict`, so callers rarely need it."""
        return 0

    def drain(self, timeout: float | None = None) -> bool:
        """Wait for every refit in flight and swap it in (tests, checkpoints)."""
        return True

    @property
    def in_flight(self) -> int:
        """Refit jobs submitted and not yet swapped in."""
        return 0

    def close(self) -> None:
        """Release a background refit thread or process."""

    # ----- for subclasses -------------------------------------------------------------------
    def _reset_slots(self, slots: np.ndarray, keys: np.ndarray | None) -> None:
        pass

    def _update(self, slots: np.ndarray, values: np.ndarray, exog: np.ndarray | None,
                prev: np.ndarray) -> None:
        pass

    def _predict(self, slots: np.ndarray) -> np.ndarray:
        return self._last[slots]


class RefittingBatchPredictor(BatchPredictor):
    """Executor handling for models with refits: lazy start, polling, draining, and a
    synchronous override for replays (``with p.sync_refits(): ...``)."""

    refit_mode = "sync"
    _executor: Any = None
    _sync_override: Any = None
    #: the per-iteration step runs as compiled kernels (:mod:`predictors.jit`), else as the
    #: subclass's numpy code (the reference)
    compiled = False
    _kernel: Any = None
    _gated = True                       #: the gate is on (the compiled predict reads it)
    _fc: np.ndarray                     # the compiled predict's inputs (NARX and ARIMA)
    _merr: np.ndarray
    _lerr: np.ndarray

    def _init_compiled(self, kernel: Any, compiled: bool | None, name: str) -> None:
        """Use ``kernel`` (a kernel module, numba imported with it: ~0.3 s, only where a model
        that refits is built) where numba imports, unless ``compiled`` is False."""
        if compiled and not kernel.AVAILABLE:
            raise ValueError(f"{name}: compiled=True needs numba, which does not import here")
        self.compiled = kernel.AVAILABLE if compiled is None else bool(compiled)
        self._kernel = kernel

    def predict(self, slots: np.ndarray) -> np.ndarray:
        if not self.compiled:
            return super().predict(slots)
        self._poll_before_predict()
        k = self._kernel
        return k.gated_predict(k.as_int64(slots), self._fc, self._merr, self._lerr, self._last, self._gated)

    def _init_refits(self, refit: Any, name: str) -> None:
        from predictors.refit import REFIT_MODES, RefitExecutor

        self.refit_mode = refit if isinstance(refit, str) else refit.kind
        self._executor = refit if isinstance(refit, RefitExecutor) else None
        self._sync_override = None
        if self._executor is None and self.refit_mode not in REFIT_MODES:
            raise ValueError(f"{name}: refit must be one of {', '.join(REFIT_MODES)}, "
                             f"got {self.refit_mode!r}")

    @property
    def executor(self) -> Any:
        """The executor refits go to (started on first use, or by :meth:`start`)."""
        if self._sync_override is not None:
            return self._sync_override
        if self._executor is None:
            from predictors.refit import make_executor

            self._executor = make_executor(self.refit_mode)
        return self._executor

    @property
    def synchronous(self) -> bool:
        return self._sync_override is not None or self.refit_mode == "sync"

    def start(self) -> None:
        """Start the background executor now (before timing), not at the first refit."""
        _ = self.executor

    @property
    def in_flight(self) -> int:
        return 0 if self._executor is None else self._executor.in_flight

    def drain(self, timeout: float | None = None) -> bool:
        ok = True if self._executor is None else self._executor.wait(timeout)
        self.poll()
        return ok

    def close(self) -> None:
        if self._executor is not None:
            self._executor.close()

    @contextlib.contextmanager
    def sync_refits(self) -> Iterator[None]:
        """Refit inline inside the block (checkpoint replays must not depend on timing)."""
        from predictors.refit import SyncRefits

        self.drain(60.0)
        self._sync_override = SyncRefits()
        try:
            yield
        finally:
            self._sync_override = None

    def _results(self) -> list[tuple[Any, Any, Any]]:
        out = []
        if self._sync_override is not None:
            out += self._sync_override.results()
        if self._executor is not None:
            out += self._executor.results()
        return out


class BatchLast(BatchPredictor):
    """Memoryless: the forecast is the newest observation."""

    name = "last"


class BatchEMA(BatchPredictor):
    """``s <- alpha * v + (1 - alpha) * s`` per slot, started at the first observation."""

    name = "ema"

    # Per-slot state arrays made by _def() (one row per worker slot).
    _s: np.ndarray

    def __init__(self, alpha: float = 0.3) -> None:
        super().__init__()
        alpha = float(alpha)
        if not (0.0 < alpha <= 1.0) or not math.isfinite(alpha):
            raise ValueError(f"ema: alpha must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self._def("_s", (), np.float64, math.nan)

    def _update(self, slots: np.ndarray, values: np.ndarray, exog: np.ndarray | None,
                prev: np.ndarray) -> None:
        s = self._s[slots]
        self._s[slots] = np.where(np.isnan(s), values, self.alpha * values + (1.0 - self.alpha) * s)

    def _predict(self, slots: np.ndarray) -> np.ndarray:
        return self._s[slots]


class ScalarPredictors(BatchPredictor):
    """Adapter: one scalar :class:`Predictor` per slot, for predictors without a batched
    implementation (custom registrations, a ``predictor_factory``, ARIMA's statsmodels mode).
    Correct at any scale, but costs a Python call per worker and per iteration, refits included."""

    def __init__(self, factory: Callable[[], Predictor], name: str = "?", n_exog: int = 0) -> None:
        super().__init__()
        self._factory = factory
        self.name = name
        self.n_exog = n_exog
        self._preds: list[Predictor | None] = []

    def resize(self, capacity: int) -> None:
        super().resize(capacity)
        self._preds.extend([None] * (capacity - len(self._preds)))

    def _reset_slots(self, slots: np.ndarray, keys: np.ndarray | None) -> None:
        for s in slots.tolist():
            self._preds[s] = None

    def _update(self, slots: np.ndarray, values: np.ndarray, exog: np.ndarray | None,
                prev: np.ndarray) -> None:
        for i, s in enumerate(slots.tolist()):
            p = self._preds[s]
            if p is None:
                p = self._preds[s] = self._factory()
            p.update(float(values[i]), None if exog is None else exog[i])

    def _predict(self, slots: np.ndarray) -> np.ndarray:
        out = np.full(slots.size, math.nan)
        for i, s in enumerate(slots.tolist()):
            p = self._preds[s]
            if p is not None:
                out[i] = p.predict()
        return out


def get_batch_predictor(name: str, args: Mapping[str, Any] | None = None, *, refit: str = "background",
                        stagger: bool = True,
                        factory: Callable[[], Predictor] | None = None) -> BatchPredictor:
    """The batched form of registered predictor ``name`` with hyper-parameters ``args``.

    ``refit`` (``sync``, ``thread``, ``process``, ``background``) and ``stagger`` (spread each
    worker's refits over the refit period by its id) apply to the models that refit (NARX, ARIMA).
    Predictors without a batched implementation, and any ``factory``, are wrapped one object per
    worker (:class:`ScalarPredictors`).
    """
    args = dict(args or {})
    if factory is not None:
        return ScalarPredictors(factory, name, 3)
    if name == "last" and not args:
        return BatchLast()
    if name == "ema" and set(args) <= {"alpha"}:
        return BatchEMA(**args)
    if name == "narx":
        from predictors.narx import BatchNARX

        return BatchNARX(**args, refit=refit, stagger=stagger)
    if name == "arima" and args.get("between", "recursion") == "recursion":
        from predictors.arima import BatchARIMA

        return BatchARIMA(**args, refit=refit, stagger=stagger)
    get_predictor(name, **args)                   # validate once (clear errors at start-up)
    return ScalarPredictors(lambda: get_predictor(name, **args), name, 3)
