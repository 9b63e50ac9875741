"""LB-BSP batch policies: static load balancing, the analytical CPU rule and the GPU search.

All three are pure decision logic driven by :class:`WorkerReport` s: no clocks, no I/O, no
randomness, so the same reports always give the same splits (tests and replays rely on it).

* ``static``: profile each worker's speed once, then split proportionally for the rest of the run
  (the baseline that isolates the value of being dynamic).
* ``lbbsp-cpu``: predict every worker's speed with a :mod:`predictors` model and solve for equal
  finish times, t_i(x) = x / v_i + c_i (DESIGN.md §5, "CPU clusters").
* ``lbbsp-gpu``: leader/straggler numerical search, for workers whose time is flat below a
  saturation batch and whose memory caps the batch (DESIGN.md §5, "GPU clusters").
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from batchsize_manager.allocation import (
    SMALL_N,
    CapsArg,
    bounded_split_arrays,
    caps_array,
    check_feasible_arrays,
    finish_time_split_arrays,
    split_small,
)
from batchsize_manager.policies import BatchPolicy, register_policy
from batchsize_manager.reports import EXOG_KEYS, ReportBatch, WorkerReport, occurrence_rounds
from batchsize_manager.slots import SlotTable
from ps_common.report import ROW_INDEX


def grown(a: np.ndarray, capacity: int, fill: Any) -> np.ndarray:
    """``a`` with its first axis extended to ``capacity`` rows of ``fill``."""
    out = np.full((capacity,) + a.shape[1:], fill, dtype=a.dtype)
    out[: a.shape[0]] = a
    return out

log = logging.getLogger(__name__)


class Workspace:
    """Reusable float buffers of one policy's decisions, by name.

    A fresh 10,000 x 32 float array costs about 2 ms of page faults when first written (640
    pages, measured on this VM), five times what numpy then spends sorting it; a decision that
    made its temporaries afresh spent most of its time there."""

    def __init__(self) -> None:
        self._bufs: dict[str, np.ndarray] = {}

    def get(self, name: str, rows: int, cols: int) -> np.ndarray:
        """A C-contiguous (rows, cols) buffer, its contents undefined."""
        b = self._bufs.get(name)
        if b is None or b.shape[0] < rows or b.shape[1] != cols:
            cap = max(rows, 2 * b.shape[0]) if b is not None and b.shape[1] == cols else rows
            b = self._bufs[name] = np.empty((cap, cols))
        return b[:rows]


def _row_quantile(a: np.ndarray, q: float, *, inplace: bool = False, full: bool = False) -> np.ndarray:
    """``np.nanquantile(a, q, axis=1)`` (linear interpolation) in one sort: NaNs sort last, so
    row i's values are its first n_i. nanquantile loops over rows in Python: 280 ms for
    10,000 workers x 32 iterations, against a few ms here. Once every row is full (the steady
    state) both positions are the same in every row. (numpy sorts short rows with SIMD
    networks: 0.4 ms for 10,000 x 32, where ``np.partition`` at two positions takes 3.5 ms.)
    ``inplace``: sort ``a`` itself (a scratch buffer) instead of a copy. ``full``: the caller
    knows that no row holds a NaN, so they are not looked for."""
    if inplace:
        a.sort(axis=1)
        s = a
    else:
        s = np.sort(a, axis=1)
    if a.shape[1] and (full or not np.isnan(s[:, -1]).any()):   # NaNs sort last: none in any row
        pos = q * (a.shape[1] - 1)
        lo = int(math.floor(pos))
        hi = min(lo + 1, a.shape[1] - 1)
        return s[:, lo] * (1.0 - (pos - lo)) + s[:, hi] * (pos - lo)
    n = np.count_nonzero(~np.isnan(s), axis=1)
    pos = q * np.maximum(n - 1, 0)
    lo = np.floor(pos).astype(np.int64)
    hi = np.minimum(lo + 1, np.maximum(n - 1, 0))
    rows = np.arange(a.shape[0])
    frac = pos - lo
    out = s[rows, lo] * (1.0 - frac) + s[rows, hi] * frac
    return np.where(n > 0, out, np.nan)


_ONES: dict[int, np.ndarray] = {}


def _ones(width: int) -> np.ndarray:
    """A read-only vector of ``width`` ones: row sums as products (5x faster than ``sum(1)``)."""
    ones = _ONES.get(width)
    if ones is None:
        ones = _ONES[width] = np.ones(width)
        ones.flags.writeable = False
    return ones


STALL_MODELS = ("per_sample", "fixed")
STALL_BASE_QUANTILE = 0.25


def stall_share(finish: np.ndarray, compute: np.ndarray, x: np.ndarray,
                planned: np.ndarray, scratch: tuple[np.ndarray, np.ndarray] | None = None) -> np.ndarray:
    """Per worker (row), the share of its time above its usual floor that its planned work explains.

    A worker held to a CPU quota runs at full speed until its share of the period is spent, then
    stalls until the next period: the stalls are the bill for the work it did, and giving it
    fewer samples makes them shorter and rarer. Charged as a fixed time instead (the tail
    quantile of finish_j - x_j / v_i), a stall every few iterations dominates every split
    alike, no move looks worth ``threshold``, and the split stays where it is (seen in CI:
    a 0.2-core worker kept 128 of 256 samples for 785 iterations). A stall lands in compute or
    outside it, and a smoothed speed forecast barely sees either, so each iteration's work is
    x_j over the speed its batch was planned with (``planned``; its measured compute where there
    was no plan). The floor b_i is the ``STALL_BASE_QUANTILE`` of finish_j - work_j (a low
    quantile: the time outside compute when nothing stalls); the share is sum(work_j) /
    sum(finish_j - b_i), at most 1, and the forecast speed times the share is the speed the
    worker kept up over the window. The plan follows a real change of speed within a few
    iterations, so such a change is not taken for a stall for longer than that. A link's
    constant delay leaves the share at 1; random stalls unrelated to the work are charged to the
    samples too, which gives that worker fewer samples than a fixed charge would.

    ``scratch``: two buffers of ``finish``'s shape for the temporaries (:class:`Workspace`).
    """
    w_buf, r_buf = scratch if scratch is not None else (np.empty_like(finish), np.empty_like(finish))
    with np.errstate(invalid="ignore", divide="ignore"):
        return _stall_share(finish, compute, x, planned, w_buf, r_buf)


def _stall_share(finish: np.ndarray, compute: np.ndarray, x: np.ndarray, planned: np.ndarray,
                 w_buf: np.ndarray, r_buf: np.ndarray, full: bool = False) -> np.ndarray:
    """:func:`stall_share` into the buffers, under the caller's ``np.errstate`` (invalid and
    divide ignored). ``full``: the caller knows every window is full (no NaN in ``finish``),
    so the windows still filling are not looked for: each numpy call costs the decision several
    µs when the coordinator has been idle (``benchmarks/bench_decision_cold.py``)."""
    work = np.divide(x, planned, out=w_buf)
    planned_ok = planned > 0                                      # nan > 0 is False
    if not planned_ok.all():                                      # its measured compute stands in
        np.copyto(work, compute, where=~planned_ok)
    ragged = False
    if not full:
        missing = np.isnan(finish)                                # windows still filling
        ragged = bool(missing.any())
        if ragged:
            work[missing] = np.nan
    base = _row_quantile(np.subtract(finish, work, out=r_buf), STALL_BASE_QUANTILE,
                         inplace=True, full=not ragged)           # nan rows: no finish yet
    ones = _ones(finish.shape[1])
    if ragged:                                                    # sums over the times there are
        n = finish.shape[1] - np.count_nonzero(missing, axis=1)
        work[missing] = 0.0
        np.copyto(r_buf, finish)
        r_buf[missing] = 0.0
        finish_sum = r_buf @ ones
    else:
        n, finish_sum = finish.shape[1], finish @ ones
    share = np.minimum((work @ ones) / (finish_sum - n * base), 1.0)   # nan stays nan, inf is 1
    return np.where(share > 0, share, 1.0)                        # nan, 0 or less: no share known


#: Window entries with CPU times a worker needs before its quota replaces its clocks.
QUOTA_MIN_ENTRIES = 4


def quota_speed(finish: np.ndarray, cpu: np.ndarray, work_cpu: np.ndarray, x: np.ndarray,
                quota: np.ndarray, scratch: tuple[np.ndarray, np.ndarray] | None = None
                ) -> tuple[np.ndarray, np.ndarray]:
    """Per worker (row): the speed and fixed time a CPU quota of ``quota`` cores lets it sustain,
    from the CPU its iterations cost. An iteration of x samples costs a + s x CPU seconds (s:
    CPU per sample of data loading, forward and backward, sum(work_cpu) / sum(x); a: the mean
    CPU outside them, the per-iteration cost of exchange, optimizer step and bookkeeping), and
    the quota grants ``quota`` CPU seconds per second, so the worker sustains one iteration per
    L + (a + s x) / quota seconds, where L is what it waits for besides its CPU (a link, the
    service): the ``STALL_BASE_QUANTILE`` of finish - cpu. Returns (quota / s, L + a / quota);
    nan for rows with fewer than :data:`QUOTA_MIN_ENTRIES` complete entries.

    Why: under a quota the worker runs at full speed until the period's share is spent, then not
    at all, so its clocks swing with where the stall fell, while its CPU per iteration does not.
    Equal finish times with these speeds are the split where every worker uses its quota
    alike. Measured (DDP ranks through the servers, quotas 0.7/0.7/0.2/0.2, static, 2 repeats
    each the same day): the split the quotas imply, fixed by hand, ran at 31.6 / 31.9 ms
    (median / mean) where the clocks' tail model settled at 35.3 / 38.4 ms with the 0.2-core
    ranks' share swinging from 14 to 64; this model gave 30.9 / 32.2 ms.

    ``scratch``: two buffers of ``finish``'s shape for the temporaries (:class:`Workspace`).
    Complete windows (the steady state) take row sums as products and no masking.
    """
    a, b = scratch if scratch is not None else (np.empty_like(finish), np.empty_like(finish))
    ones = _ones(finish.shape[1])
    with np.errstate(invalid="ignore", divide="ignore"):
        np.add(finish, cpu, out=a)
        a += work_cpu                                    # nan wherever one of the three is
        full = np.isfinite(a)
        if full.all():                                   # every window complete: no masking
            n = finish.shape[1]
            work_sum = work_cpu @ ones
            per_sample = work_sum / (x @ ones)
            fixed = np.maximum(0.0, (cpu @ ones - work_sum) / n)
            np.subtract(finish, cpu, out=b)
        else:
            n = np.count_nonzero(full, axis=1)
            missing = ~full

            def row_sums(col: np.ndarray) -> np.ndarray:
                np.copyto(a, col)
                a[missing] = 0.0
                return a @ ones

            work_sum = row_sums(work_cpu)
            per_sample = work_sum / row_sums(x)
            fixed = np.maximum(0.0, (row_sums(cpu) - work_sum) / n)
            np.subtract(finish, cpu, out=b)
            b[missing] = math.nan
        waits = np.maximum(0.0, _row_quantile(b, STALL_BASE_QUANTILE, inplace=True))
        speed = quota / per_sample
        overhead = waits + fixed / quota
    bad = (n < QUOTA_MIN_ENTRIES) | ~(per_sample > 0)
    return np.where(bad, math.nan, speed), np.where(bad, math.nan, overhead)


def _at(column: np.ndarray, rows: np.ndarray | None) -> np.ndarray:
    """``column`` at positions ``rows`` (None: all of it, no copy)."""
    return column if rows is None else column[rows]


def _finite_entry(row: Sequence[Any]) -> bool:
    """Does a saved finish-window row hold what :meth:`LBBSPCpuPolicy._observe` writes: a finite
    batch size, a finite finish time > 0 and a finite compute time?"""
    try:
        x, f, c = (float(r) for r in row[:3])
    except (TypeError, ValueError):
        return False
    return math.isfinite(x) and math.isfinite(c) and math.isfinite(f) and f > 0


def _ring_order(count: int, size: int) -> list[int]:
    """Positions of a ring buffer of ``size`` that has had ``count`` writes, oldest first."""
    n = min(count, size)
    return [(count - n + j) % size for j in range(n)]


def _str_keys(d: Mapping[int, Any]) -> dict[str, Any]:
    return {str(k): v for k, v in d.items()}


def _within(split: Mapping[int, int] | None, workers: Sequence[int], total: int, min_batch: int,
            caps: Mapping[int, int | None]) -> bool:
    """Is ``split`` still a valid answer for these workers, total and bounds?"""
    if split is None or sorted(split) != sorted(workers) or sum(split.values()) != total:
        return False
    for w, x in split.items():
        cap = caps.get(w)
        if x < min_batch or (cap is not None and x > cap):
            return False
    return True


def _within_arrays(prev: tuple[np.ndarray, np.ndarray] | None, ids: np.ndarray, total: int,
                   min_batch: int, caps: np.ndarray) -> bool:
    """:func:`_within` for a split held as (sorted ids, sizes) arrays."""
    if prev is None:
        return False
    pids, px = prev
    if pids.size != ids.size or not (pids == ids).all() or int(np.add.reduce(px)) != total:
        return False
    return bool((px >= min_batch).all() and (px <= caps).all())


def _split_dict(split: tuple[np.ndarray, np.ndarray] | None) -> dict[int, int] | None:
    return None if split is None else dict(zip(split[0].tolist(), split[1].tolist()))


def _split_arrays(d: Mapping[Any, Any] | None) -> tuple[np.ndarray, np.ndarray] | None:
    if d is None:
        return None
    items = sorted((int(k), int(v)) for k, v in d.items())
    return (np.array([k for k, _ in items], dtype=np.int64),
            np.array([v for _, v in items], dtype=np.int64))


class SlotPolicy(BatchPolicy):
    """Base of the vectorised policies: per-worker state in arrays indexed by slot.

    ``observe`` is a batch of one; the BatchSizeManager hands over whole iterations through
    ``observe_batch``. OOM reports carry no timing (their caps are the manager's) and are taken
    out of the batch first; a batch holding several reports of one worker is applied in rounds
    (first reports, then second ones, ...), which gives the same state as one call per report.
    """

    native_arrays = True

    def __init__(self) -> None:
        self._scratch = np.zeros(0, dtype=np.int64)
        self._slots = SlotTable(self._grow_slots, self._init_slots)
        self._cache: tuple[Any, np.ndarray, int] = (None, np.zeros(0, dtype=np.int64), -1)

    # ----- storage (subclasses extend) ------------------------------------------------------
    def _grow_slots(self, capacity: int) -> None:
        self._scratch = np.zeros(capacity, dtype=np.int64)

    def _init_slots(self, slots: np.ndarray, ids: np.ndarray) -> None:
        pass

    def _slots_for(self, ids: np.ndarray) -> np.ndarray:
        """Slots of the sorted ``ids`` (created for unknown ones); cached for the manager's array."""
        cached_ids, cached, version = self._cache
        if version == self._slots.version and (
                cached_ids is ids or (cached_ids is not None and cached_ids.size == ids.size
                                      and np.array_equal(cached_ids, ids))):
            return cached
        slots = self._slots.lookup(ids, create=True)
        self._cache = (ids, slots, self._slots.version)
        return slots

    # ----- reports ----------------------------------------------------------------------------
    def observe(self, report: WorkerReport) -> None:
        self.observe_batch(ReportBatch([report]))

    def observe_batch(self, batch: ReportBatch) -> None:
        if batch.n == 0:
            return
        if batch.any_oom:
            rest = np.flatnonzero(~batch.oom)
            if rest.size == 0:
                return
            batch = batch.take(rest)
        if batch.small:                           # a few reports: dict lookups, no id column
            slots = self._slots.lookup_list([r.worker_id for r in batch.reports], create=True)
        else:
            if self.kernels is not None and (head := batch.head) is not None:
                slots, status = self.kernels.known_slots(head, self._slots.lut, self._scratch)
                if status == 0:                   # every worker known, none twice: one call
                    self._observe(batch, slots)
                    return
            slots = self._slots.lookup(batch.worker, create=True)
        rounds = occurrence_rounds(slots, self._scratch)
        if rounds is None:
            self._observe(batch, slots)
        else:
            for idx in rounds:
                self._observe(batch.take(idx), slots[idx])

    def _observe(self, batch: ReportBatch, slots: np.ndarray) -> None:
        """Apply reports of distinct workers (``slots`` unique, aligned with ``batch``)."""

    # ----- decisions --------------------------------------------------------------------------
    def assign(self, workers: Sequence[int], global_batch: int, min_batch: int = 1, *,
               max_batch: CapsArg = None) -> dict[int, int]:
        ws = sorted(int(w) for w in workers)
        ids = np.array(ws, dtype=np.int64)
        x = self.assign_arrays(ids, global_batch, min_batch, caps_array(ws, max_batch))
        return dict(zip(ws, x.tolist()))

    def assign_arrays(self, ids: np.ndarray, global_batch: int, min_batch: int,
                      caps: np.ndarray, *, checked: bool = False) -> np.ndarray:
        if not checked:
            check_feasible_arrays(ids, global_batch, min_batch, caps)
        return self._assign(ids, self._slots_for(ids), int(global_batch), int(min_batch), caps)

    def _assign(self, ids: np.ndarray, slots: np.ndarray, total: int, min_batch: int,
                caps: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def _reset_all(self) -> None:
        """Forget every slot (before restoring a checkpoint)."""
        self._slots.clear()
        self._cache = (None, np.zeros(0, dtype=np.int64), -1)


# ---------------------------------------------------------------------------------------------
@register_policy("static")
class StaticPolicy(SlotPolicy):
    """Profile each worker for ``profile_iterations`` reports, then x_i ∝ speed, frozen.

    The speed is the median samples/s of the profiling reports (robust to a slow first,
    warm-up iteration). Until a worker is profiled it gets the mean speed of the profiled ones,
    so the initial cohort is split uniformly and a late joiner gets an average share while it is
    being profiled. Later changes in speed are ignored on purpose: that is what "static" means.
    """

    def __init__(self, profile_iterations: int = 5) -> None:
        if profile_iterations < 1:
            raise ValueError(f"profile_iterations must be >= 1, got {profile_iterations}")
        self.profile_iterations = int(profile_iterations)
        self._speed = np.zeros(0)                   # nan: not profiled yet
        self._samples = np.zeros((0, self.profile_iterations))
        self._ns = np.zeros(0, dtype=np.int64)
        super().__init__()

    def _grow_slots(self, capacity: int) -> None:
        super()._grow_slots(capacity)
        self._speed = grown(self._speed, capacity, math.nan)
        self._samples = grown(self._samples, capacity, 0.0)
        self._ns = grown(self._ns, capacity, 0)

    def _init_slots(self, slots: np.ndarray, ids: np.ndarray) -> None:
        self._speed[slots] = math.nan
        self._ns[slots] = 0

    @property
    def speeds(self) -> dict[int, float]:
        """The frozen speeds of the workers profiled so far."""
        return {w: float(self._speed[s]) for w, s in self._slots.items() if not math.isnan(self._speed[s])}

    def join(self, worker_id: int) -> None:
        s = self._slots.get(int(worker_id))       # a (re)joining worker is profiled afresh
        if s >= 0:
            self._init_slots(np.array([s]), np.array([int(worker_id)]))
        else:
            self._slots.add(int(worker_id))

    def leave(self, worker_id: int) -> None:
        self._slots.remove(int(worker_id))

    def _observe(self, batch: ReportBatch, slots: np.ndarray) -> None:
        v = batch.speed()
        ok = np.isfinite(v) & np.isnan(self._speed[slots])
        if not ok.any():
            return
        s, v = slots[ok], v[ok]
        n = self._ns[s]
        self._samples[s, n] = v
        n = n + 1
        self._ns[s] = n
        done = n >= self.profile_iterations
        if done.any():
            d = s[done]
            self._speed[d] = np.median(self._samples[d], axis=1)
            self._ns[d] = 0

    def _assign(self, ids: np.ndarray, slots: np.ndarray, total: int, min_batch: int,
                caps: np.ndarray) -> np.ndarray:
        sp = self._speed[slots]
        known = ~np.isnan(sp)
        prior = float(sp[known].sum()) / int(known.sum()) if known.any() else 1.0
        return bounded_split_arrays(np.where(known, sp, prior), total, min_batch, caps)

    def state_dict(self) -> dict[str, Any]:
        speed, samples = {}, {}
        for w, s in self._slots.items():
            if not math.isnan(self._speed[s]):
                speed[str(w)] = float(self._speed[s])
            else:
                samples[str(w)] = self._samples[s, : self._ns[s]].tolist()
        return {"speed": speed, "samples": samples}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._reset_all()
        for k, v in state.get("speed", {}).items():
            self._speed[self._slots.add(int(k))] = float(v)
        for k, v in state.get("samples", {}).items():
            s = self._slots.add(int(k))
            xs = [float(x) for x in v][: self.profile_iterations]
            self._samples[s, : len(xs)] = xs
            self._ns[s] = len(xs)


# ---------------------------------------------------------------------------------------------
#: Up to this many workers the estimate and the split run compiled; above it on numpy. A
#: compiled call saves the per-call cost of some 40 numpy calls, which a decision paced like a
#: real run pays with cold caches (at 100 workers of ``bench_fleet.py`` the decision's CPU fell
#: by half), but its scalar loops do the arithmetic of many rows slower than numpy's SIMD
#: (sorting networks, vector division): at 10,000 workers in a tight loop the tail model took
#: 7.3 ms compiled against 2.3 ms on numpy, and the split 0.86 against 0.22 ms. Paced by 50 ms
#: sleeps (``bench_decision_cold.py --workers 300 1000``), deciding cost the same both ways at
#: 300 workers (370 and 356 µs) and 1,021 against 611 µs at 1,000.
COMPILED_MAX_WORKERS = 256

#: Where :func:`batchsize_manager.lbbsp_kernel.observe_rows` reads a report's row.
_ROW_COLS = np.array([ROW_INDEX[k] for k in ("compute_s", "finish_s", "data_s", "prev_push_s", "prev_pull_s",
                                             "cpu_s", "compute_cpu_s", "cpu_quota")], dtype=np.int64)
_EXOG_COLS = np.array([ROW_INDEX[k] for k in EXOG_KEYS], dtype=np.int64)   # :meth:`Telemetry.exog`'s
_NO_COLS = np.zeros(0, dtype=np.int64)


def _load_kernel(compiled: bool | None) -> Any:
    """:mod:`batchsize_manager.lbbsp_kernel`, loaded (compiled or read from the disk cache) now
    rather than inside a decision, or None for the numpy path: ``compiled`` False, or None where
    numba does not import."""
    if compiled is False:
        return None
    from batchsize_manager import lbbsp_kernel
    if not lbbsp_kernel.AVAILABLE:
        if compiled:
            raise ValueError("lbbsp-cpu: compiled=True needs numba, which does not import here")
        return None
    lbbsp_kernel.warm_up()
    return lbbsp_kernel


def _default_predictor_factory(name: str, args: Mapping[str, Any]) -> Callable[[], Any]:
    """A zero-argument builder of ``predictors.get_predictor(name, **args)``, validated once now."""
    try:
        from predictors import get_predictor
    except ImportError as exc:  # pragma: no cover - the package ships with the project
        raise ValueError(f"lbbsp-cpu needs the 'predictors' package: {exc}") from None
    get_predictor(name, **dict(args))         # fail at start-up on a bad name or argument
    return lambda: get_predictor(name, **dict(args))


@register_policy("lbbsp-cpu")
class LBBSPCpuPolicy(SlotPolicy):
    """Analytical LB-BSP: predicted speeds v_i and overheads c_i -> equal predicted finish times.

    x_i = v_i (T* - c_i), T* = (X + Σ v_j c_j) / Σ v_j, clamped to [min_batch, cap_i] with
    water-filling and rounded by largest remainder (Σ x_i = X exactly). The previous split is kept
    unless the new one is predicted to shorten the iteration (max_i c_i + x_i / v_i) by more than
    ``threshold``: re-splitting on noise costs re-cut data ranges and jittery batch sizes for no
    gain. Unmeasured workers (cold start, late joiners) get the mean measured speed and overhead;
    with none measured the split is uniform. Between two decisions a worker's batch changes by at
    most a factor ``max_factor`` (a trust region against one-iteration artefacts; None disables
    it). The overhead c_i is an EMA (``overhead_alpha``) of data + push + pull time. The first
    ``warmup`` reports of each worker are ignored: a first iteration carries lazy initialisation
    and an initial pull that waited for the job to start (measured: 98 ms of "pull" against 1 ms of
    compute), which would otherwise starve that worker. When communication dominates (compute a
    few ms against noisy push/pull times of the same size), equalising c_i + x_i / v_i can drive
    the split to an extreme (seen: 63/1 of 64 on the 2-worker synthetic MLP run, which was in fact
    14% faster there: less push contention); ``use_overhead=False`` or a larger ``min_batch``
    keeps it near speed-proportional.

    ``predictor`` defaults to ``"ema"``: it smooths iteration jitter, reacts to a real step within a
    few iterations, costs microseconds per worker and needs no training; ``"narx"`` (the paper's
    choice) can be selected and uses the host/co-tenant CPU and memory telemetry as exogenous
    inputs. ``history`` observations per worker are kept so that a checkpoint can rebuild any
    predictor by replaying them.

    Finish times seen by the servers (``finish_s``, put into the reports by the coordinator: from
    the answer that starts a worker's iteration to its gradient being whole on every shard)
    replace the worker's own overhead: c_i is then the ``finish_quantile`` (default 0.9) of
    finish_j - x_j / v_i over the worker's last ``finish_window`` (32) iterations. A high quantile,
    not a mean, because the barrier waits for each iteration's slowest worker: under a CPU quota a
    worker that spent its share of a 100 ms period stalls until the next one (seen: median finish
    35 ms, p90 93 ms), and equalising means leaves every iteration to the worst stall. Giving it
    work for its tail lowers its CPU need per period until the stalls become rare. The same term
    carries a slow link (parameters and gradients crossing it), which the worker cannot see: its
    push returns as soon as ZeroMQ has queued it. ``finish_tail="overhead"`` takes the quantile
    of finish_j - compute_j instead (compute noise left to the predictor's mean); under static
    kernel quotas 0.7, 0.7, 0.2, 0.2 it gave 60 ms per iteration against 48 ms for the default
    (``benchmarks/bench_lab_quota.py --variants``), so noisy compute belongs in the tail too.
    In the same bench, 0.9 over 32 iterations gave 44 ms against 51 ms for 0.8 over 16.
    ``stalls="per_sample"`` (default; with ``finish_tail="finish"``) first lowers v_i to the
    speed the worker kept up over the window (:func:`stall_share`), because a quota's stalls
    grow with the work given; ``"fixed"`` charges them as time outside compute only, which left
    a 0.2-core worker at half the batch for a whole run (those lab numbers predate the change).

    Workers held to less than a core by a CPU quota (``cpu_quota`` in their reports, read from
    their own cgroup) that also report their CPU times (``cpu_s``, ``compute_cpu_s``) are planned
    by what the quota sustains instead (``use_quota``, default on; :func:`quota_speed`): an
    iteration of x samples costs a_i + s_i x CPU seconds, so it takes L_i + (a_i + s_i x) /
    quota_i. The clocks cannot show that: the kernel runs the worker at full speed until the
    period's share is spent and then not at all, so they swing with where the stall fell, and
    the tail model above kept the 0.2-core ranks of the lab between 14 and 64 samples. DDP
    ranks through the servers, quotas 0.7/0.7/0.2/0.2 (``docs/results/lab_ddp/``, 3 repeats):
    34.7 / 39.2 ms median / mean per iteration static and 39.8 / 47.2 ms rotating every 5 s
    with the clocks, 33.2 / 34.1 and 35.2 / 37.5 ms with the quota model, which settles at the
    split the quotas imply and follows a moved quota from the next report. Above one core a
    quota rarely binds a one-thread worker and the clocks stand.

    Cost: every worker's state (predictor, overhead, history) is a row of numpy arrays and one
    iteration's reports are applied together (:mod:`predictors.batch`), so a decision costs a few
    µs per worker. NARX and ARIMA refits are batched, staggered over the refit period by worker id
    (``stagger``) and, with ``refit="background"`` (default), run in a helper process while the
    forecasts keep using the previous weights; ``refit="sync"`` refits inside the decision, as one
    predictor object per worker did (deterministic: tests, replays). What background refits cost
    in balance: forecasts use weights up to one refit period (``refit_every`` iterations) plus the
    fit's latency old; the inputs of every forecast are always the newest reports. Where numba
    imports (``compiled`` None, the default, or True), a batch of received reports is observed
    in one compiled pass over their rows, and up to ``COMPILED_MAX_WORKERS`` workers the
    steady-state estimate and the split are one compiled call each
    (:mod:`batchsize_manager.lbbsp_kernel`); at 100 workers of ``benchmarks/bench_fleet.py``
    that took a decision's CPU from 0.669 to 0.322 ms (EMA) and from 0.845 to 0.533 ms (NARX).
    The price is numba's import and the kernels' load in the process (0.4 + 0.9 s of CPU beside
    a busy test loop, and 130 MB), which a small job pays too: on numpy the 4-worker decision
    missed 1% of the iteration (``docs/results/ddp_vs_ps/lazy_kernels_2026-11-28/``).
    ``compiled=False`` keeps the numpy code, the reference the tests hold the kernels to.
    """

    def __init__(self, predictor: str = "ema", predictor_args: Mapping[str, Any] | None = None,
                 threshold: float = 0.05, overhead_alpha: float = 0.3, use_overhead: bool = True,
                 use_exog: bool | None = None, history: int = 32, warmup: int = 1,
                 max_factor: float | None = 2.0,
                 predictor_factory: Callable[[], Any] | None = None, refit: str = "background",
                 stagger: bool = True, finish_quantile: float | None = 0.9, finish_window: int = 32,
                 finish_tail: str = "finish", stalls: str = "per_sample",
                 use_quota: bool = True, compiled: bool | None = None) -> None:
        if finish_tail not in ("finish", "overhead"):
            raise ValueError(f"finish_tail must be 'finish' or 'overhead', got {finish_tail!r}")
        if stalls not in STALL_MODELS:
            raise ValueError(f"stalls must be one of {', '.join(STALL_MODELS)}, got {stalls!r}")
        self.finish_tail = finish_tail
        self.stalls = stalls
        if finish_quantile is not None and not (0.0 < finish_quantile <= 1.0):
            raise ValueError(f"finish_quantile must be in (0, 1] (or None), got {finish_quantile}")
        if finish_window < 2:
            raise ValueError(f"finish_window must be >= 2, got {finish_window}")
        self.finish_quantile = None if finish_quantile is None else float(finish_quantile)
        self.finish_window = int(finish_window)
        self.use_quota = bool(use_quota)
        self._fcpu = np.full((0, self.finish_window), math.nan)   # cpu_s of the window's iterations
        self._fwork = np.full((0, self.finish_window), math.nan)  # compute_cpu_s of the same
        self._quota = np.zeros(0)                     # cpu_quota of the newest report, nan: none
        self._fx = np.zeros((0, self.finish_window))  # batch sizes of the last finish times
        self._ff = np.full((0, self.finish_window), math.nan)  # finish_s, nan: none yet
        self._fc = np.zeros((0, self.finish_window))  # compute_s of the same iterations
        self._fv = np.full((0, self.finish_window), math.nan)  # the speed each batch was planned with
        self._workspace = Workspace()
        self._rows_of: tuple[np.ndarray, Callable[[np.ndarray, str], np.ndarray]] | None = None
        self._bounds: tuple[tuple[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]] | None = None
        self._bounds_lists_of: tuple[list[int], list[float], list[float]] | None = None
        self._vplan = np.zeros(0)                     # predicted speed at the last decision, nan: none
        self._fn = np.zeros(0, dtype=np.int64)        # finish times seen per worker
        if not (0.0 <= threshold < 1.0):
            raise ValueError(f"threshold must be in [0, 1), got {threshold}")
        if not (0.0 < overhead_alpha <= 1.0):
            raise ValueError(f"overhead_alpha must be in (0, 1], got {overhead_alpha}")
        if history < 1:
            raise ValueError(f"history must be >= 1, got {history}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        if max_factor is not None and not max_factor > 1.0:
            raise ValueError(f"max_factor must be > 1 (or None), got {max_factor}")
        self.max_factor = None if max_factor is None else float(max_factor)
        self.warmup = int(warmup)
        self.predictor_name = predictor
        self.predictor_args = dict(predictor_args or {})
        self.threshold = float(threshold)
        self.overhead_alpha = float(overhead_alpha)
        self.use_overhead = bool(use_overhead)
        self.use_exog = (predictor == "narx") if use_exog is None else bool(use_exog)
        self.history = int(history)
        from predictors.batch import get_batch_predictor
        from predictors.refit import REFIT_MODES

        if refit not in REFIT_MODES:
            raise ValueError(f"refit must be one of {', '.join(REFIT_MODES)}, got {refit!r}")
        self.refit = refit

        if predictor_factory is None:
            _default_predictor_factory(predictor, self.predictor_args)   # clear errors now
        self._pred = get_batch_predictor(predictor, self.predictor_args, refit=refit,
                                         stagger=stagger, factory=predictor_factory)
        self.kernels = _load_kernel(compiled)
        #: the reports' pass, the estimate and the split run compiled where they pay
        #: (:mod:`batchsize_manager.lbbsp_kernel`), else on numpy (the reference)
        self.compiled = self.kernels is not None
        self._n_exog = len(EXOG_KEYS)
        self._overhead = np.zeros(0)              # nan: none yet
        self._seen = np.zeros(0, dtype=np.int64)  # reports per worker since it joined (warmup)
        # the last ``history`` observations per worker (ring; write index = updates % history)
        self._hv = np.zeros((0, self.history))
        self._hx = np.zeros((0, self.history, self._n_exog if self.use_exog else 0))
        self._prev: tuple[np.ndarray, np.ndarray] | None = None
        #: (ids, caps, total, min_batch) of the decision that made or kept ``_prev``
        self._prev_bounds: tuple[np.ndarray, np.ndarray, int, int] | None = None
        self.changes = 0                 #: how often the returned split changed
        self.predicted_s = math.nan      #: predicted iteration time of the last returned split
        super().__init__()
        if hasattr(self._pred, "start") and refit != "sync":
            self._pred.start()           # the helper process starts now, not inside a decision

    @property
    def predictor(self) -> Any:
        """The batched predictor (:class:`predictors.batch.BatchPredictor`)."""
        return self._pred

    def close(self) -> None:
        self._pred.close()

    def _grow_slots(self, capacity: int) -> None:
        super()._grow_slots(capacity)
        self._overhead = grown(self._overhead, capacity, math.nan)
        self._seen = grown(self._seen, capacity, 0)
        self._hv = grown(self._hv, capacity, 0.0)
        self._hx = grown(self._hx, capacity, 0.0)
        self._fx = grown(self._fx, capacity, 0.0)
        self._ff = grown(self._ff, capacity, math.nan)
        self._fc = grown(self._fc, capacity, 0.0)
        self._fv = grown(self._fv, capacity, math.nan)
        self._vplan = grown(self._vplan, capacity, math.nan)
        self._fn = grown(self._fn, capacity, 0)
        self._fcpu = grown(self._fcpu, capacity, math.nan)
        self._fwork = grown(self._fwork, capacity, math.nan)
        self._quota = grown(self._quota, capacity, math.nan)
        self._pred.resize(capacity)

    def _init_slots(self, slots: np.ndarray, ids: np.ndarray) -> None:
        self._overhead[slots] = math.nan
        self._seen[slots] = 0
        self._ff[slots] = math.nan
        self._fv[slots] = math.nan
        self._vplan[slots] = math.nan
        self._fn[slots] = 0
        self._fcpu[slots] = math.nan
        self._fwork[slots] = math.nan
        self._quota[slots] = math.nan
        self._pred.reset(slots, ids)

    # ----- membership and observations ----------------------------------------------------
    def join(self, worker_id: int) -> None:
        self._forget(int(worker_id))
        self._slots.add(int(worker_id))

    def leave(self, worker_id: int) -> None:
        self._forget(int(worker_id))

    def _forget(self, w: int) -> None:
        self._slots.remove(w)

    def _observe(self, batch: ReportBatch, slots: np.ndarray) -> None:
        k = self.kernels
        if k is not None:
            read = batch.read_rows()
            if read is not None:                        # received reports: one compiled pass
                head, tel = read
                _, ks, v, exog = k.observe_rows(
                    k.as_int64(slots), head, tel, _ROW_COLS, _EXOG_COLS if self.use_exog else _NO_COLS,
                    self._seen, self.warmup, self._overhead, self.overhead_alpha, self.use_overhead,
                    self.finish_quantile is not None, self._fn, self._fx, self._ff, self._fc,
                    self._fv, self._vplan, self.use_quota, self._fcpu, self._fwork, self._quota)
                if ks.size:
                    counts = self._pred.update(ks, v, exog if self.use_exog else None)
                    k.record_history(ks, k.as_int64(counts), v, exog, self._hv, self._hx)
                return
        v = batch.speed()
        rows = None
        if not batch.speeds_finite():
            ok = np.isfinite(v)
            slots, v = slots[ok], v[ok]
            rows = np.flatnonzero(ok)
            if slots.size == 0:
                return
        seen = self._seen[slots] + 1
        self._seen[slots] = seen
        if int(seen.min()) <= self.warmup:             # some are still warming up
            go = seen > self.warmup
            slots, v = slots[go], v[go]
            rows = np.flatnonzero(go) if rows is None else rows[go]
            if slots.size == 0:
                return
        self._feed(slots, v, _at(batch.exog(), rows) if self.use_exog else None)
        if self.use_overhead:
            o = _at(batch.overhead(), rows)
        else:
            o = np.zeros(slots.size)
        prev = self._overhead[slots]
        a = self.overhead_alpha
        self._overhead[slots] = np.where(np.isnan(prev), o, a * o + (1 - a) * prev)
        if self.finish_quantile is not None:
            fin = _at(batch.finish, rows)               # finite, 0 where not seen
            fs, at = slots, rows
            if not fin.min() > 0:                       # the coordinator's reports: all seen
                keep = np.flatnonzero(fin > 0)
                fs, fin, at = slots[keep], fin[keep], keep if rows is None else rows[keep]
            if fs.size:
                count = self._fn[fs]
                pos = count % self.finish_window
                self._fx[fs, pos] = _at(batch.batch, at)
                self._ff[fs, pos] = fin
                self._fc[fs, pos] = _at(batch.compute, at)   # finite and > 0, as the speed is
                self._fv[fs, pos] = self._vplan[fs]
                if self.use_quota:
                    self._fcpu[fs, pos] = _at(batch.measured("cpu_s"), at)
                    self._fwork[fs, pos] = _at(batch.measured("compute_cpu_s"), at)
                self._fn[fs] = count + 1
        if self.use_quota:
            self._quota[slots] = _at(batch.measured("cpu_quota"), rows)

    def _feed(self, slots: np.ndarray, v: np.ndarray, exog: np.ndarray | None) -> None:
        pos = (self._pred.update(slots, v, exog) - 1) % self.history
        self._hv[slots, pos] = v
        if self._hx.shape[2]:
            self._hx[slots, pos] = 0.0 if exog is None else exog

    # ----- decision -----------------------------------------------------------------------
    def _estimate_arrays(self, slots: np.ndarray,
                         plan: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
        """Predicted speeds and overheads aligned with ``slots`` (unmeasured: the means), or None
        when no worker is measured. ``plan``: a decision uses them, so remember each worker's
        forecast as the speed its next batch is planned with (:func:`stall_share`)."""
        v = self._pred.predict(slots)            # nan (unmeasured) or finite and > 0
        kern = self.kernels if slots.size <= COMPILED_MAX_WORKERS else None
        if kern is not None:                     # the steady state in one compiled call
            slots, v = kern.as_int64(slots), kern.as_float64(v)
            done, ve, ce = kern.estimate(
                slots, v, plan, self._vplan, self._overhead, self.finish_quantile is not None, self._fn,
                self.use_quota, self._quota, self._ff, self._fx, self._fc, self._fv,
                self.finish_quantile or 0.0, STALL_BASE_QUANTILE, self.stalls == "per_sample",
                self.finish_tail == "finish")
            if done:
                return ve, ce
        elif plan:                               # on numpy (the kernel plans its own)
            self._vplan[slots] = v
        ok = v > 0
        k = int(np.count_nonzero(ok))
        if k == 0:
            return None
        oh = self._overhead[slots]
        if self.finish_quantile is not None:
            v, oh = self._tail_overhead(slots, v, oh)
        if k == v.size:
            v_all = v
            known_c = oh == oh                   # not nan
            kc = int(np.count_nonzero(known_c))
            if kc == v.size:
                return v, oh
        else:
            v_all = np.where(ok, v, float(np.add.reduce(v[ok])) / k)
            known_c = ok & (oh == oh)
            kc = int(np.count_nonzero(known_c))
        mean_c = float(np.add.reduce(oh[known_c])) / kc if kc else 0.0
        return v_all, np.where(known_c, oh, mean_c)

    def _tail_overhead(self, slots: np.ndarray, v: np.ndarray,
                       oh: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(v_i, c_i) from server-seen finish times, for workers with at least 4 of them and a
        speed (the others keep ``v`` and ``oh``): c_i is the quantile of finish_j - x_j / v_i over
        the last iterations; with ``stalls="per_sample"`` v_i is first lowered by
        :func:`stall_share`, so that stalls which come from the worker's own work are charged to
        its samples rather than fixed. Workers the quota model plans (``use_quota``) skip all
        that: their clocks are not what it reads."""
        fn = self._fn[slots]
        ready = (fn >= 4) & (v > 0)
        if not ready.any():
            return v, oh
        every = bool(ready.all())
        out = v_out = None
        if self.use_quota:
            held = ready & (self._quota[slots] < 1.0)           # nan: False
            if held.any():
                out, v_out = oh.copy(), v.copy()
                ready = self._quota_model(slots, ready, held, v_out, out)
                if not ready.any():
                    return v_out, out
                every = False
        if every:                    # the steady state: every row, nothing to copy or scatter
            vr, q = self._tail_rows(slots, v, full=int(fn.min()) >= self.finish_window)
            return vr, np.maximum(0.0, q)
        if out is None or v_out is None:
            out, v_out = oh.copy(), v.copy()
        vr, q = self._tail_rows(slots[ready], v[ready], full=False)
        out[ready] = np.maximum(0.0, q)
        v_out[ready] = vr
        return v_out, out

    def _tail_rows(self, s: np.ndarray, vr: np.ndarray, full: bool) -> tuple[np.ndarray, np.ndarray]:
        """(v_i, the ``finish_quantile`` of finish_j - x_j / v_i) for slots ``s`` with speeds
        ``vr`` (lowered by :func:`stall_share` first where ``stalls="per_sample"``). ``full``:
        every one of their windows is full, so no NaN is looked for (written entries are finite:
        :meth:`_observe` keeps only finite speeds and finish times, restores drop the others)."""
        assert self.finish_quantile is not None  # the caller asks only when it is set
        rows = self._window_rows(s)
        finish = rows(self._ff, "finish")
        ws, k, w = self._workspace, s.size, self.finish_window
        rest = ws.get("rest", k, w)
        with np.errstate(invalid="ignore", divide="ignore"):
            if self.finish_tail == "finish":
                x = rows(self._fx, "x")
                if self.stalls == "per_sample":
                    vr = vr * _stall_share(finish, rows(self._fc, "compute"), x, rows(self._fv, "planned"),
                                           ws.get("work", k, w), rest, full)
                np.divide(x, vr[:, None], out=rest)
                np.subtract(finish, rest, out=rest)
            else:
                np.subtract(finish, rows(self._fc, "compute"), out=rest)
        return vr, _row_quantile(rest, self.finish_quantile, inplace=True, full=full)

    def _window_rows(self, s: np.ndarray) -> Callable[[np.ndarray, str], np.ndarray]:
        """Rows ``s`` of a (slots x window) state array: a view when the slots run in one block
        (the usual case), else a copy into the reused buffer ``name`` (see Workspace). Only the
        buffers are ever written. Remembered for the last ``s`` object: the manager hands the
        same slots array to every decision until membership changes (slot arrays are never
        written in place)."""
        cached = self._rows_of
        if cached is not None and cached[0] is s:
            return cached[1]
        ws, k, w = self._workspace, s.size, self.finish_window
        if s[-1] - s[0] == k - 1 and (k == 1 or (s[1:] > s[:-1]).all()):   # distinct slots
            lo = int(s[0])
            rows: Callable[[np.ndarray, str], np.ndarray] = lambda a, name: a[lo:lo + k]  # noqa: E731
        else:
            rows = lambda a, name: np.take(a, s, axis=0, out=ws.get(name, k, w))  # noqa: E731
        self._rows_of = (s, rows)
        return rows

    def _quota_model(self, slots: np.ndarray, ready: np.ndarray, held: np.ndarray, v: np.ndarray,
                     c: np.ndarray) -> np.ndarray:
        """For the ``held`` workers (``ready`` ones held to less than a core by their reports'
        ``cpu_quota``; at least one) whose reports carry CPU times, set (v, c) in place to
        :func:`quota_speed`'s: what the quota lets them sustain, not what their clocks showed
        between its stalls. Returns ``ready`` without the workers it planned."""
        pos = np.flatnonzero(held)
        hs = slots if pos.size == slots.size else slots[pos]
        rows = self._window_rows(hs)
        ws, k, w = self._workspace, hs.size, self.finish_window
        vq, cq = quota_speed(rows(self._ff, "finish"), rows(self._fcpu, "cpu"), rows(self._fwork, "work_cpu"),
                             rows(self._fx, "x"), self._quota[hs],
                             scratch=(ws.get("rest", k, w), ws.get("work", k, w)))
        ok = np.isfinite(vq) & (vq > 0) & np.isfinite(cq)
        if ok.all():
            v[pos], c[pos] = vq, cq
            return ready & ~held
        if not ok.any():
            return ready
        planned = pos[ok]
        v[planned] = vq[ok]
        c[planned] = cq[ok]
        left = ready.copy()
        left[planned] = False
        return left

    def estimates(self, workers: Sequence[int]) -> tuple[dict[int, float], dict[int, float]]:
        """Predicted speed and overhead per worker (unmeasured ones get the measured means)."""
        ws = sorted(int(w) for w in workers)
        est = self._estimate_arrays(self._slots.lookup(np.array(ws, dtype=np.int64), create=True))
        if est is None:
            return {}, {}
        return dict(zip(ws, est[0].tolist())), dict(zip(ws, est[1].tolist()))

    @staticmethod
    def predicted_time(split: Mapping[int, int], speeds: Mapping[int, float],
                       overheads: Mapping[int, float]) -> float:
        """max_i c_i + x_i / v_i: the iteration time the model predicts for ``split``."""
        return max(overheads[w] + x / speeds[w] for w, x in split.items())

    def _assign(self, ids: np.ndarray, slots: np.ndarray, total: int, min_batch: int,
                caps: np.ndarray) -> np.ndarray:
        est = self._estimate_arrays(slots, plan=True)
        prev = self._prev
        if est is None:
            out = bounded_split_arrays(np.ones(ids.size), total, min_batch, caps)
            self.predicted_s = math.nan
        else:
            v, c = est
            within = self._prev_within(ids, total, min_batch, caps)
            try:
                out = self._decide(ids, v, c, total, min_batch, caps, within)
            except (ValueError, OverflowError) as exc:   # the solve overflowed: keep going
                out = self._fallback(exc, ids, total, min_batch, caps, within)
        if prev is None or (out is not prev[1] and not (
                prev[0].size == ids.size and (prev[0] == ids).all() and (prev[1] == out).all())):
            if prev is not None:
                self.changes += 1
            self._prev = (ids.copy(), out.copy())
        self._prev_bounds = (ids, caps, total, min_batch)
        return out.copy()

    def _decide(self, ids: np.ndarray, v: np.ndarray, c: np.ndarray, total: int, min_batch: int,
                caps: np.ndarray, within: bool) -> np.ndarray:
        """The equal-finish-time split of ``total`` for speeds ``v`` and overheads ``c``, kept at
        the previous one unless predicted ``threshold`` faster (``within``: the previous split
        is still a valid answer); sets :attr:`predicted_s`."""
        prev = self._prev
        if not within:
            out = self._split(v, c, total, np.full(ids.size, float(min_batch)), caps)
            self.predicted_s = self._latest_finish(c, out, v)
            return out
        assert prev is not None
        px = prev[1]
        lo, hi = self._bounds_around(px, caps, min_batch)
        vl = v.tolist() if v.size <= SMALL_N else None
        if vl is not None and min(vl) > 0:   # Python floats, as the split itself: same operations
            cl = c.tolist()
            pl, lol, hil = self._bounds_lists
            xl = split_small(vl, cl, total, lol, hil)
            t_prev = max([ci + xi / vi for ci, xi, vi in zip(cl, pl, vl)])
            t_new = max([ci + xi / vi for ci, xi, vi in zip(cl, xl, vl)])
            out = np.array(xl, dtype=np.int64)
        else:
            out = self._split(v, c, total, lo, hi)
            t_prev = self._latest_finish(c, px, v)
            t_new = self._latest_finish(c, out, v)
        if not t_new < t_prev * (1.0 - self.threshold):
            out = px
            t_new = t_prev
        self.predicted_s = t_new
        return out

    def _fallback(self, exc: Exception, ids: np.ndarray, total: int, min_batch: int, caps: np.ndarray,
                  within: bool) -> np.ndarray:
        """The split when the solve failed on the estimates (speeds near the float limit, which a
        report may carry, overflow its sums): the previous split where it is still valid, else
        the even one within the bounds; the job goes on and the next decision tries again."""
        log.warning("lbbsp-cpu: no equal-finish split from the estimates (%s); %s", exc,
                    "keeping the previous split" if within else "splitting evenly")
        self.predicted_s = math.nan
        if within:
            assert self._prev is not None
            return self._prev[1]
        return bounded_split_arrays(np.ones(ids.size), total, min_batch, caps)

    def _split(self, v: np.ndarray, c: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """:func:`finish_time_split_arrays`, compiled where the policy is (up to SMALL_N workers
        both use :func:`split_small`, whose algorithm the kernel is)."""
        k = self.kernels
        if k is None or v.size <= SMALL_N or v.size > COMPILED_MAX_WORKERS:
            return finish_time_split_arrays(v, c, total, lo, hi)
        return k.split(k.as_float64(v), k.as_float64(c), total, k.as_float64(lo), k.as_float64(hi))

    def _latest_finish(self, c: np.ndarray, x: np.ndarray, v: np.ndarray) -> float:
        """max_i c_i + x_i / v_i (:meth:`predicted_time` by position)."""
        k = self.kernels
        if k is None:
            return float((c + x / v).max())
        return float(k.latest_finish(k.as_float64(c), k.as_int64(x), k.as_float64(v)))

    def _bounds_around(self, px: np.ndarray, caps: np.ndarray, min_batch: int) -> tuple[np.ndarray, np.ndarray]:
        """(lo, hi) for the next split around the previous one, ``px``. Bounds [x / f, x * f]
        (``max_factor``): one noisy iteration moves a worker's batch by at most a factor f, a
        real change is followed in a few decisions; feasible because ``px`` lies inside them.
        The same arrays while ``px`` (kept splits keep their array), ``caps`` and the floor stay."""
        key = (px, caps, min_batch)
        cached = self._bounds
        if cached is not None and cached[0][0] is px and cached[0][1] is caps and cached[0][2] == min_batch:
            return cached[1]
        f = self.max_factor
        if f is None:
            bounds = np.full(px.size, float(min_batch)), caps
        else:
            bounds = np.maximum(float(min_batch), np.floor(px / f)), np.minimum(caps, np.ceil(px * f))
        self._bounds = (key, bounds)
        self._bounds_lists_of = None
        return bounds

    @property
    def _bounds_lists(self) -> tuple[list[int], list[float], list[float]]:
        """The previous split and the bounds of :meth:`_bounds_around`'s last answer, as lists
        (made once per answer, for the Python-float split of a few workers)."""
        if self._bounds_lists_of is None:
            assert self._bounds is not None
            (px, _, _), (lo, hi) = self._bounds
            self._bounds_lists_of = (px.tolist(), lo.tolist(), hi.tolist())
        return self._bounds_lists_of

    def _prev_within(self, ids: np.ndarray, total: int, min_batch: int, caps: np.ndarray) -> bool:
        """Is the previous split still a valid answer? Known without looking when this decision
        has the very ``ids`` and ``caps`` objects and the bounds of the one that made or kept it
        (the manager passes the same objects until membership or caps change)."""
        b = self._prev_bounds
        if b is not None and b[0] is ids and b[1] is caps and b[2] == total and b[3] == min_batch:
            return True
        return _within_arrays(self._prev, ids, total, min_batch, caps)

    # ----- checkpoints ----------------------------------------------------------------------
    def _history(self, s: int) -> list[list[Any]]:
        idx = _ring_order(int(self._pred.n_updates(np.array([s]))[0]), self.history)
        if self._hx.shape[2]:
            return [[float(self._hv[s, i]), self._hx[s, i].tolist()] for i in idx]
        return [[float(self._hv[s, i]), None] for i in idx]

    def state_dict(self) -> dict[str, Any]:
        items = self._slots.items()
        return {
            "predictor": self.predictor_name,
            "history": {str(w): self._history(s) for w, s in items
                        if self._pred.n_updates(np.array([s]))[0] > 0},
            "overhead": {str(w): float(self._overhead[s]) for w, s in items
                         if not math.isnan(self._overhead[s])},
            "seen": {str(w): int(self._seen[s]) for w, s in items if self._seen[s] > 0},
            "prev": _split_dict(self._prev),
            "changes": self.changes,
            "finish": {str(w): self._finish_rows(s) for w, s in items if self._fn[s] > 0},
        }

    def _finish_rows(self, s: int) -> list[list[float]]:
        """Worker slot ``s``'s finish window, oldest first, as [batch, finish_s, compute_s,
        planned speed, cpu_s, compute_cpu_s] rows (nan: none)."""
        idx = _ring_order(int(self._fn[s]), self.finish_window)
        return [[float(a[s, i]) for a in (self._fx, self._ff, self._fc, self._fv, self._fcpu, self._fwork)]
                for i in idx]

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Rebuild predictors by replaying the saved observations (exact for EMA/last up to the
        replay window; NARX and ARIMA refit on the replayed history, synchronously), and restore
        each worker's window of finish times (older checkpoints have none: it refills)."""
        if state.get("predictor", self.predictor_name) != self.predictor_name:
            log.warning("checkpoint used predictor %r, now %r: replaying its history anyway",
                        state.get("predictor"), self.predictor_name)
        self._reset_all()
        hist = {int(k): h for k, h in state.get("history", {}).items()}
        for w in hist:
            self._slots.add(w)
        order = sorted(hist)
        sync = getattr(self._pred, "sync_refits", None)
        with (sync() if sync is not None else contextlib.nullcontext()):
            for j in range(max((len(h) for h in hist.values()), default=0)):
                ws = [w for w in order if len(hist[w]) > j]
                slots = self._slots.lookup(np.array(ws, dtype=np.int64))
                v = np.array([float(hist[w][j][0]) for w in ws])
                ex = [hist[w][j][1] for w in ws]
                exog = None
                if any(e is not None for e in ex) or self.use_exog:
                    exog = np.array([[float(x) for x in e] if e is not None else [0.0] * self._n_exog
                                     for e in ex]).reshape(len(ws), -1)
                    if exog.shape[1] != self._n_exog:
                        exog = None
                self._feed(slots, v, exog if self.use_exog else None)
        for k, v in state.get("overhead", {}).items():
            self._overhead[self._slots.add(int(k))] = float(v)
        for k, v in state.get("seen", {}).items():
            self._seen[self._slots.add(int(k))] = int(v)
        for k, rows in state.get("finish", {}).items():
            s = self._slots.add(int(k))
            rows = [r for r in rows if _finite_entry(r)][-self.finish_window:]   # as _observe writes
            for j, row in enumerate(rows):
                self._fx[s, j], self._ff[s, j], self._fc[s, j] = (float(r) for r in row[:3])
                self._fv[s, j] = float(row[3]) if len(row) > 3 else math.nan
                self._fcpu[s, j] = float(row[4]) if len(row) > 4 else math.nan
                self._fwork[s, j] = float(row[5]) if len(row) > 5 else math.nan
            self._fn[s] = len(rows)
        self._prev = _split_arrays(state.get("prev"))
        self._prev_bounds = None
        self.changes = int(state.get("changes", 0))


# ---------------------------------------------------------------------------------------------
@register_policy("lbbsp-gpu")
class LBBSPGpuPolicy(SlotPolicy):
    """Numerical LB-BSP: move samples from the straggler to the leader until finish times agree.

    Finish time of a worker = compute_s + fixed overhead (:func:`~batchsize_manager.reports.overhead_one`:
    the servers' ``finish_s`` where the report has one, else data + push + pull; never the barrier wait),
    as the median over a monitoring window of W iterations at its current size (W starts at
    ``window``). Once every worker has a full window, the straggler (slowest) gives Δ samples
    (``step``, default X // 32) to the leader (fastest worker below its memory cap): "fast
    approach". A worker moving back the way it came means we overshot: halve Δ and double W (up to
    ``max_window``): "fine tune". Converged when (f_straggler - f_leader) / f_straggler is within
    ``tolerance`` (a worker held at its memory cap may finish earlier: nothing can be moved to it),
    when a 1-sample step oscillates, or when no move is possible (straggler at the floor, nobody
    with headroom). The split is then frozen.

    Re-trigger (Δ and W back to their initial values): (1) converged, and the spread has been out
    of tolerance for W consecutive iterations (slow drift); (2) in any phase after the first
    approach, a worker's own finish time at an unchanged batch size moved by more than ``drift``
    (median of its last ``window`` iterations against its earlier ones): the environment changed
    (a co-tenant, a throttled link), and a search that has shrunk to 1-sample steps over 12-iteration
    windows would otherwise crawl towards the new balance.

    Memory caps live in the BatchSizeManager, keyed by worker name (configured, probed, learned
    from OOM errors and reported headroom), and reach the policy as ``max_batch`` (the excess of a
    worker whose cap shrank moves to the others at the next decision; a worker without room is
    never the leader). No predictions, no randomness. Why not the CPU rule? On GPUs time is flat
    below a saturation batch and memory bounds the batch, so one speed number cannot give the
    split; search can.

    Cost: the finish-time windows are rows of one array (newest last), medians and the
    leader/straggler choice are vectorised over workers; a decision costs ~1 µs per worker.
    """

    def __init__(self, window: int = 3, step: int | None = None, tolerance: float = 0.05,
                 max_window: int = 12, drift: float = 0.15, use_overhead: bool = True) -> None:
        if window < 1 or max_window < window:
            raise ValueError(f"need 1 <= window <= max_window, got window={window}, max_window={max_window}")
        if step is not None and step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        if not (0.0 < tolerance < 1.0):
            raise ValueError(f"tolerance must be in (0, 1), got {tolerance}")
        if not drift > 0:
            raise ValueError(f"drift must be > 0, got {drift}")
        self.window0 = int(window)
        self.max_window = int(max_window)
        self.step0 = None if step is None else int(step)
        self.tolerance = float(tolerance)
        self.drift = float(drift)
        self.use_overhead = bool(use_overhead)
        self._split: tuple[np.ndarray, np.ndarray] | None = None   # (sorted ids, sizes)
        self._total: int | None = None
        self._delta = 1
        self._window = self.window0
        self.phase = "approach"          #: "approach", "fine" or "converged"
        self._fin = np.zeros((0, self.max_window))   # finish times, newest last
        self._fn = np.zeros(0, dtype=np.int64)       # how many are valid
        self._dir = np.zeros(0, dtype=np.int64)      # last move: +1 received, -1 gave, 0 none
        self._shift = np.zeros(0, dtype=bool)        # finish time jumped at an unchanged size
        self._dirty = np.zeros(0, dtype=bool)        # a new sample whose drift check is pending
        self._out = 0                    # consecutive out-of-tolerance iterations while converged
        self._fresh = False
        self.moves = 0
        self.oscillations = 0
        self.retriggers = 0
        self.last_spread = math.nan
        super().__init__()

    def _grow_slots(self, capacity: int) -> None:
        super()._grow_slots(capacity)
        self._fin = grown(self._fin, capacity, 0.0)
        self._fn = grown(self._fn, capacity, 0)
        self._dir = grown(self._dir, capacity, 0)
        self._shift = grown(self._shift, capacity, False)
        self._dirty = grown(self._dirty, capacity, False)

    def _init_slots(self, slots: np.ndarray, ids: np.ndarray) -> None:
        self._fn[slots] = 0
        self._dir[slots] = 0
        self._shift[slots] = False
        self._dirty[slots] = False

    @property
    def split(self) -> dict[int, int] | None:
        """The current split (None before the first decision)."""
        return _split_dict(self._split)

    @property
    def step(self) -> int:
        """The current Δ (samples moved per decision)."""
        return self._delta

    @property
    def window(self) -> int:
        """The current monitoring window W (iterations)."""
        return self._window

    def _initial_step(self, total: int) -> int:
        return self.step0 if self.step0 is not None else max(1, total // 32)

    def _restart_search(self) -> None:
        self.phase = "approach"
        self._delta = self._initial_step(self._total or 1)
        self._window = self.window0
        self._dir[:] = 0
        self._out = 0

    def join(self, worker_id: int) -> None:
        s = self._slots.get(int(worker_id))
        if s >= 0:
            self._check_drift(np.array([s]))  # its last sample's check, on the old window
            self._fn[s] = 0                   # a fresh monitoring window
        else:
            self._slots.add(int(worker_id))

    def leave(self, worker_id: int) -> None:
        self._slots.remove(int(worker_id))

    def _observe(self, batch: ReportBatch, slots: np.ndarray) -> None:
        split = self._split
        if split is None or split[0].size == 0:
            return
        sid, sx = split
        w = batch.worker
        i = np.minimum(np.searchsorted(sid, w), max(sid.size - 1, 0))
        c = batch.compute
        with np.errstate(invalid="ignore"):
            ok = (sid[i] == w) & (sx[i] == batch.batch) & np.isfinite(c) & (c > 0)
        if not ok.any():
            return                            # measured at a size we no longer use
        s = slots[ok]
        f = c[ok] + (batch.overhead()[ok] if self.use_overhead else 0.0)
        again = s[self._dirty[s]]
        if again.size:                  # a second report since the last check: check the first
            self._check_drift(again)
        self._fin[s, :-1] = self._fin[s, 1:]
        self._fin[s, -1] = f
        self._fn[s] = np.minimum(self._fn[s] + 1, self.max_window)
        self._dirty[s] = True
        self._fresh = True

    def _check_drift(self, s: np.ndarray | None = None) -> None:
        """Has a worker's finish time moved at an unchanged size? Median of its last ``window``
        samples against its earlier ones, evaluated once per new sample (lazily: at the next
        decision, or before the worker's next sample) for the workers in ``s`` (default: all
        with a sample not checked yet)."""
        if s is None:
            s = np.flatnonzero(self._dirty)
        if s.size == 0:
            return
        self._dirty[s] = False
        if self.phase == "approach" and self._delta == self._initial_step(self._total or 1):
            return              # a shift would be cleared unused at the next decision: skip
        k = self.window0
        n = self._fn[s]
        chk = n >= 2 * k
        if chk.any():
            s, n = s[chk], n[chk]
            M = self.max_window
            recent = _row_median(self._fin[s, M - k:])
            older = np.empty(s.size)
            for m in sorted(set(n.tolist())):       # (np.unique imports numpy.ma on first use)
                g = n == m
                older[g] = _row_median(self._fin[s[g], M - m: M - k])
            self._shift[s[np.abs(recent - older) > self.drift * older]] = True

    def _set_many(self, slots: np.ndarray, pos: np.ndarray, x: np.ndarray) -> None:
        """Give the workers at ``pos`` of the split new sizes; a changed size restarts its window."""
        assert self._split is not None
        sx = self._split[1]
        changed = sx[pos] != x
        sx[pos] = x
        self._fn[slots[changed]] = 0

    def _medians(self, slots: np.ndarray, n: int) -> np.ndarray | None:
        if (self._fn[slots] < n).any():
            return None
        M = self.max_window
        return _row_median(self._fin[slots, M - n:])

    def _roles(self, f: np.ndarray, caps: np.ndarray) -> tuple[int, int | None, float]:
        """(straggler, leader or None, spread) as positions. The spread is measured between the
        two: a fast worker held back by its memory cap finishing early is not an imbalance we can
        fix."""
        assert self._split is not None
        s = int(np.argmax(f))                           # slowest; ties to the lowest id
        room = self._split[1] < caps
        room[s] = False
        if not room.any():
            return s, None, 0.0
        ld = int(np.argmin(np.where(room, f, math.inf)))  # fastest with headroom; ties: lowest id
        return s, ld, (float((f[s] - f[ld]) / f[s]) if f[s] > 0 else 0.0)

    def _assign(self, ids: np.ndarray, slots: np.ndarray, total: int, min_batch: int,
                caps: np.ndarray) -> np.ndarray:
        self._check_drift()
        split = self._split
        if split is None or split[0].size != ids.size or not np.array_equal(split[0], ids) \
                or self._total != total:
            self._resplit(ids, slots, total, min_batch, caps)
            self._restart_search()
        elif not _within_arrays(split, ids, total, min_batch, caps):
            self._resplit(ids, slots, total, min_batch, caps)   # a cap shrank (OOM): keep searching
            if self.phase == "converged":
                self.phase = "approach"
        else:
            shifted = self._shift[slots]
            if shifted.any() and (self.phase != "approach" or self._delta != self._initial_step(total)):
                log.info("lbbsp-gpu: finish time of workers %s shifted at unchanged batch sizes; "
                         "restarting the search", ids[shifted].tolist())
                sh = slots[shifted]                  # keep only the samples taken after the shift
                self._fn[sh] = np.minimum(self._fn[sh], self.window0)
                self.retriggers += 1
                self._restart_search()
            if self.phase == "converged":
                self._watch(slots, min_batch, caps)
            else:
                self._search(slots, min_batch, caps)
        self._shift[:] = False
        self._fresh = False
        assert self._split is not None
        return self._split[1].copy()

    def _resplit(self, ids: np.ndarray, slots: np.ndarray, total: int, min_batch: int,
                 caps: np.ndarray) -> None:
        """Re-split keeping the current proportions (newcomers get the mean share), within bounds."""
        n = ids.size
        old = np.zeros(n, dtype=np.int64)
        had = np.zeros(n, dtype=bool)
        if self._split is not None and self._split[0].size:
            sid, sx = self._split
            i = np.minimum(np.searchsorted(sid, ids), sid.size - 1)
            had = sid[i] == ids
            old = np.where(had, sx[i], 0)
        k = int(had.sum())
        scale = total / self._total if self._total and k else 1.0
        mean = float(old[had].sum()) / k * scale if k else 1.0
        weights = np.where(had, old * scale, mean)
        new = bounded_split_arrays(weights, total, min_batch, caps)
        changed = ~had | (old != new)
        self._fn[slots[changed]] = 0
        self._split = (ids.copy(), new)
        self._total = total

    def _watch(self, slots: np.ndarray, min_batch: int, caps: np.ndarray) -> None:
        """Converged: re-trigger once the spread has been out of tolerance for a full window."""
        if not self._fresh:
            return                            # no new report since the last decision
        f = self._medians(slots, self._window)
        if f is None or slots.size < 2:
            return
        _, _, self.last_spread = self._roles(f, caps)
        self._out = self._out + 1 if self.last_spread > self.tolerance else 0
        if self._out >= self._window:
            log.info("lbbsp-gpu: finish-time spread %.3f out of tolerance for %d iterations; "
                     "restarting the search", self.last_spread, self._out)
            self.retriggers += 1
            self._restart_search()
            self._search(slots, min_batch, caps)

    def _search(self, slots: np.ndarray, min_batch: int, caps: np.ndarray) -> None:
        """One leader/straggler decision, once every worker has a full window at its size."""
        assert self._split is not None
        f = self._medians(slots, self._window)
        if f is None or slots.size < 2:
            return
        s, ld, self.last_spread = self._roles(f, caps)
        sx = self._split[1]
        if self.last_spread <= self.tolerance:
            self._converge("finish times within tolerance")
            return
        if ld is None or sx[s] <= min_batch:
            self._converge("no move possible")
            return
        if self._dir[slots[s]] == +1 or self._dir[slots[ld]] == -1:
            self.oscillations += 1
            if self._delta == 1:
                self._converge("1-sample step oscillates")
                return
            self._delta = max(1, self._delta // 2)
            self._window = min(2 * self._window, self.max_window)
            self.phase = "fine"
        cap_l = caps[ld]
        amount = min(self._delta, int(sx[s]) - min_batch,
                     int(cap_l) - int(sx[ld]) if math.isfinite(cap_l) else self._delta)
        pos = np.array([s, ld])
        self._set_many(slots[pos], pos, np.array([sx[s] - amount, sx[ld] + amount]))
        self._dir[slots[s]], self._dir[slots[ld]] = -1, +1
        self.moves += 1

    def _converge(self, why: str) -> None:
        log.debug("lbbsp-gpu converged (%s): spread %.3f, step %d, window %d", why, self.last_spread,
                  self._delta, self._window)
        self.phase = "converged"
        self._out = 0

    # ----- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        self._check_drift()
        items = self._slots.items()
        M = self.max_window
        return {
            "split": _split_dict(self._split),
            "total": self._total, "delta": self._delta, "window": self._window, "phase": self.phase,
            "fin": {str(w): self._fin[s, M - self._fn[s]:].tolist() for w, s in items},
            "dir": {str(w): int(self._dir[s]) for w, s in items if self._dir[s] != 0},
            "out": self._out, "shifted": [w for w, s in items if self._shift[s]],
            "moves": self.moves, "oscillations": self.oscillations, "retriggers": self.retriggers,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._reset_all()
        self._split = _split_arrays(state.get("split"))
        self._total = state.get("total")
        self._delta = int(state.get("delta", 1))
        self._window = int(state.get("window", self.window0))
        self.phase = str(state.get("phase", "approach"))
        M = self.max_window
        for k, v in state.get("fin", {}).items():
            s = self._slots.add(int(k))
            xs = [float(x) for x in v][-M:]
            self._fin[s, M - len(xs):] = xs
            self._fn[s] = len(xs)
        for k, v in state.get("dir", {}).items():
            self._dir[self._slots.add(int(k))] = int(v)
        self._out = int(state.get("out", 0))
        for w in state.get("shifted", []):
            self._shift[self._slots.add(int(w))] = True
        self.moves = int(state.get("moves", 0))
        self.oscillations = int(state.get("oscillations", 0))
        self.retriggers = int(state.get("retriggers", 0))


def _row_median(a: np.ndarray) -> np.ndarray:
    """Median of each row of a short 2-D array, with :func:`_median`'s arithmetic (a sort of 3-12
    values per row; a min/max network for 3, which is 5x cheaper than ``np.median``)."""
    m = a.shape[1]
    if m == 1:
        return a[:, 0].copy()
    if m == 2:
        return 0.5 * (a[:, 0] + a[:, 1])
    if m == 3:
        x, y, z = a[:, 0], a[:, 1], a[:, 2]
        return np.maximum(np.minimum(x, y), np.minimum(np.maximum(x, y), z))
    ys = np.sort(a, axis=1)
    return ys[:, m // 2].copy() if m % 2 else 0.5 * (ys[:, m // 2 - 1] + ys[:, m // 2])


def _median(xs: list[float]) -> float:
    """Median of a short list (cheaper than statistics.median for the 3-12 samples we keep)."""
    ys = sorted(xs)
    n = len(ys)
    return ys[n // 2] if n % 2 else 0.5 * (ys[n // 2 - 1] + ys[n // 2])
