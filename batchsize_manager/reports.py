"""Worker reports as the manager sees them: one by one, and many at once as numpy columns.

:class:`WorkerReport` is a worker's :class:`~ps_common.report.Telemetry` (the one definition of
what a worker measures) and whose iteration it was.

The manager buffers the reports of an iteration and hands them to the policy as one
:class:`ReportBatch` when it next decides. A report its receiver made with
:meth:`WorkerReport.received` of a decoded telemetry carries its numbers as one row of bytes
(:attr:`WorkerReport.row`): a batch of them is read in one pass, the rows joined into one record
array whose columns are the fields. Otherwise every field a policy reads is extracted
with one pass per field and one array conversion (about 0.03 µs per report and field while the
reports are in the CPU cache; three times that for 10,000 reports received an iteration ago).
The per-report rules (:meth:`WorkerReport.speed`, :func:`overhead_one`, :meth:`Telemetry.exog`)
are applied to whole columns with the same results. Malformed values (strings, objects) in a
report built locally fall back to the per-value rule.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, is_not
from typing import Any, Callable, ClassVar, Sequence

import numpy as np

from ps_common.frozen import fill, fillable
from ps_common.report import EXOG_KEYS, ROW_INDEX, Telemetry


@dataclass(frozen=True)
class WorkerReport:
    """One worker's report of one finished iteration, as the manager and the policies see it.

    ``row``: the report as one record of bytes, ``(worker_id, iteration, batch_size)`` as int64
    and then :attr:`Telemetry.row`, where it was made by :meth:`received` from a telemetry with
    a row; else None. A batch of such reports is read in one pass (:class:`ReportBatch`).
    """

    worker_id: int
    iteration: int
    batch_size: int
    telemetry: Telemetry = Telemetry()

    row: ClassVar[bytes | None] = None

    @classmethod
    def received(cls, worker_id: int, iteration: int, batch_size: int, telemetry: Telemetry) -> WorkerReport:
        """A report as its receiver makes it (shard 0 of a push): with its :attr:`row` when the
        telemetry has one (as a decoded one does) and the numbers fit in int64."""
        state: dict[str, Any] = {"worker_id": worker_id, "iteration": iteration, "batch_size": batch_size,
                                 "telemetry": telemetry}
        if telemetry.row is not None:
            try:
                state["row"] = _HEAD.pack(worker_id, iteration, batch_size) + telemetry.row
            except struct.error:                     # not int64: read by attribute instead
                pass
        return fill(WorkerReport, state)

    def speed(self) -> float | None:
        """Samples per second of compute, or None when the report carries no usable timing."""
        v = _speed_one(self.batch_size, self.telemetry.compute_s)
        return None if math.isnan(v) else v

    def with_telemetry(self, telemetry: Telemetry) -> WorkerReport:
        """This report with ``telemetry`` instead: ``dataclasses.replace`` without ``__init__``
        (:mod:`ps_common.frozen`; shard 0 does it for every worker's every report)."""
        change: dict[str, Any] = {"telemetry": telemetry}
        row = self.row
        if row is not None:
            change["row"] = None if telemetry.row is None else row[:_HEAD.size] + telemetry.row
        return fill(WorkerReport, self.__dict__, change)


assert fillable(WorkerReport), "with_telemetry copies reports without __init__"


def overhead_one(tel: Telemetry) -> float:
    """Everything but compute in the worker's finish time, never the barrier wait: finish_s -
    compute_s where the servers measured a finish time (what a slow link or a CPU quota adds
    outside compute, which the worker cannot see), else data + previous push + previous pull
    (``prev_wait_s`` is left out on purpose: it is the imbalance being removed)."""
    f = _float_or_nan(tel.finish_s)
    if math.isfinite(f) and f > 0:
        c = _float_or_nan(tel.compute_s)
        return max(0.0, f - (c if math.isfinite(c) else 0.0))
    return _num_one(tel.data_s) + _num_one(tel.prev_push_s) + _num_one(tel.prev_pull_s)


def _num_one(raw: Any) -> float:
    """A duration that counts: finite and > 0, else 0."""
    if raw is None:
        return 0.0
    try:
        v = float(raw)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return v if 0.0 < v < math.inf else 0.0


def _float_or_nan(raw: Any) -> float:
    if raw is None:
        return math.nan
    try:
        return float(raw)
    except (TypeError, ValueError, OverflowError):
        return math.nan


def _measured_one(raw: Any) -> float:
    """A measured value: the float where finite, else nan."""
    v = _float_or_nan(raw)
    return v if math.isfinite(v) else math.nan


def _speed_one(batch_size: Any, compute_s: Any) -> float:
    """:meth:`WorkerReport.speed` for one report; nan where unusable."""
    try:
        c = float(compute_s)
        if batch_size <= 0 or not math.isfinite(c) or c <= 0:
            return math.nan
        v = batch_size / c
    except (TypeError, ValueError, OverflowError):
        return math.nan
    return v if math.isfinite(v) else math.nan      # a denormal compute time would give inf


def floats(values: Sequence[Any]) -> np.ndarray:
    """float64 column of ``values``: None and unconvertible values become nan."""
    try:
        return np.fromiter(values, dtype=np.float64, count=len(values))   # all numbers: fastest
    except (TypeError, ValueError, OverflowError):
        pass
    try:
        return np.array(values, dtype=np.float64)                         # None -> nan
    except (TypeError, ValueError, OverflowError):
        return np.fromiter((_float_or_nan(v) for v in values), dtype=np.float64, count=len(values))


def _column(items: Sequence[Any], get: Callable[[Any], Any]) -> np.ndarray:
    """float64 column of ``get(item)`` (None and unconvertible values: nan), read without an
    intermediate list when every value is a number (the usual case). A field nobody measured
    (all None: the quota fields without quotas) becomes nan without a conversion per value
    (43 µs instead of 61 per 1,024 reports, best of 5 x 200 here)."""
    try:
        return np.fromiter(map(get, items), dtype=np.float64, count=len(items))
    except (TypeError, ValueError, OverflowError):
        values = [get(t) for t in items]
        if values.count(None) == len(values):
            return np.full(len(values), math.nan)
        return floats(values)


def _tel_column(tels: list[Telemetry], name: str) -> np.ndarray:
    """float64 column of field ``name`` (None and unconvertible values: nan)."""
    return _column(tels, attrgetter(name))


def ints(items: Sequence[Any], get: Callable[[Any], Any] | None = None) -> np.ndarray:
    """int64 column of worker ids, ``get(item)`` per item if given (ids outside int64 raise
    ``ValueError``)."""
    try:
        values = items if get is None else map(get, items)
        return np.fromiter(values, dtype=np.int64, count=len(items))
    except (TypeError, OverflowError) as exc:
        raise ValueError(f"worker ids must be integers within int64: {exc}") from None


_WORKER_ID = attrgetter("worker_id")
_BATCH_SIZE = attrgetter("batch_size")
_OOM = attrgetter("oom")
_HEADROOM = attrgetter("mem_headroom_mb")

_NO_ROWS = np.zeros(0, dtype=np.int64)
_NO_ROWS.flags.writeable = False

#: Batches up to this size are read by the numpy code with the per-report rules on Python values
#: (one array per column at the end): for a few reports, numpy's per-call cost exceeds the work.
#: A compiled pass reads their rows all the same (:meth:`ReportBatch.read_rows`).
SMALL_BATCH = 16

_HEAD = struct.Struct("<3q")          # WorkerReport.row: worker_id, iteration, batch_size, then
_RECORD = np.dtype([("head", "<i8", (3,)), ("tel", "<f8", (len(ROW_INDEX),))])   # Telemetry.row
_EXOG_AT = [ROW_INDEX[k] for k in EXOG_KEYS]
_UNREAD: Any = object()


def _records_of(reports: Sequence[WorkerReport]) -> np.ndarray | None:
    """The reports' :attr:`WorkerReport.row` as one record array (one pass, one join), or None
    when some report has no row."""
    if getattr(reports[0], "row", None) is None:   # built locally: no pass for nothing
        return None
    try:
        joined = b"".join([r.row for r in reports])  # type: ignore[misc]
    except (TypeError, AttributeError):       # a row is None, or not a WorkerReport
        return None
    return np.frombuffer(joined, dtype=_RECORD)


class ReportBatch:
    """Columns of a list of :class:`WorkerReport` (lazily extracted).

    Positions follow the order of ``reports``. :func:`occurrence_rounds` splits a batch that holds
    several reports of one worker into sub-batches without duplicates, in arrival order, so that
    vectorised per-worker updates see them one after the other, as sequential ``observe`` calls
    would. Small batches apply the per-report rules directly (same results, fewer calls).
    Columns are the batch's own: a policy must copy one before writing to it (read from rows,
    they are read-only views of the joined bytes).
    """

    __slots__ = ("reports", "n", "small", "_worker", "_batch", "_compute", "_tels", "_rows", "_head",
                 "_cols", "_oom", "_any_oom", "_exog", "_speed", "_speed_finite", "_overhead")

    def __init__(self, reports: Sequence[WorkerReport]) -> None:
        self.reports = reports if isinstance(reports, list) else list(reports)
        self.n = len(self.reports)
        self.small = self.n <= SMALL_BATCH
        self._worker: np.ndarray | None = None
        self._batch: np.ndarray | None = None
        self._compute: np.ndarray | None = None
        self._tels: list[Telemetry] | None = None
        self._rows: np.ndarray | None = _UNREAD
        self._head: np.ndarray | None = None
        self._cols: dict[str, np.ndarray] = {}
        self._oom: np.ndarray | None = None
        self._any_oom: bool | None = None
        self._exog: np.ndarray | None = None
        self._speed: np.ndarray | None = None
        self._speed_finite: bool | None = None
        self._overhead: np.ndarray | None = None

    @classmethod
    def with_rows(cls, reports: Sequence[WorkerReport]) -> ReportBatch | None:
        """The batch of ``reports`` with their rows read already (one pass over the objects),
        or None where it is small (per-report rules) or some report has no row."""
        batch = cls(reports)
        return batch if batch.rows is not None else None

    def __len__(self) -> int:
        return self.n

    # ----- raw columns ----------------------------------------------------------------------
    @property
    def worker(self) -> np.ndarray:
        if self._worker is None:
            if self.rows is not None:
                assert self._head is not None
                self._worker = self._head[:, 0].copy()
            else:
                self._worker = ints(self.reports, _WORKER_ID)
        return self._worker

    @property
    def batch(self) -> np.ndarray:
        """Batch sizes as float64 (exact for any realistic size)."""
        if self._batch is None:
            if self.rows is not None:
                assert self._head is not None
                self._batch = self._head[:, 2].astype(np.float64)
            else:
                self._batch = _column(self.reports, _BATCH_SIZE)
        return self._batch

    @property
    def tels(self) -> list[Telemetry]:
        if self._tels is None:
            self._tels = [r.telemetry for r in self.reports]
        return self._tels

    @property
    def rows(self) -> np.ndarray | None:
        """The reports' telemetry as one (n, fields) matrix (:data:`ROW_INDEX` names the
        columns), or None where some report has no :attr:`WorkerReport.row` (built locally, not
        received) or the batch is small (per-report rules)."""
        if self._rows is _UNREAD:
            records = None if self.small else _records_of(self.reports)
            if records is None:
                self._rows = None
            else:
                self._head, self._rows = records["head"], records["tel"]
        return self._rows

    def read_rows(self) -> tuple[np.ndarray, np.ndarray] | None:
        """(:attr:`head`, :attr:`rows`), also for a small batch, where the numpy code keeps its
        per-report rules but a compiled pass reads the rows in one call; None where some report
        has no row."""
        rows = self.rows
        if rows is not None:
            assert self._head is not None
            return self._head, rows
        records = _records_of(self.reports) if self.small and self.n else None
        return None if records is None else (records["head"], records["tel"])

    @property
    def head(self) -> np.ndarray | None:
        """(worker_id, iteration, batch_size) per report as an (n, 3) int64 matrix, where
        :attr:`rows` is not None."""
        return self._head if self.rows is not None else None

    def _field(self, name: str) -> np.ndarray:
        """float64 column of field ``name`` (None and unconvertible values: nan)."""
        rows = self.rows
        if rows is not None:
            return rows[:, ROW_INDEX[name]]
        return _tel_column(self.tels, name)

    @property
    def compute(self) -> np.ndarray:
        if self._compute is None:
            self._compute = self._field("compute_s")
        return self._compute

    def _durations(self, name: str) -> np.ndarray:
        """Field ``name`` where it counts (finite and > 0), else 0."""
        col = self._cols.get(name)
        if col is None:
            if self.small:
                get = attrgetter(name)
                col = np.array([_num_one(get(t)) for t in self.tels], dtype=np.float64)
            else:
                a = self._field(name)
                with np.errstate(invalid="ignore"):
                    col = np.where((a > 0.0) & (a < math.inf), a, 0.0)
            self._cols[name] = col
        return col

    def measured(self, name: str) -> np.ndarray:
        """Field ``name`` per report as float64, nan where not measured (None) or not finite."""
        key = "measured:" + name
        col = self._cols.get(key)
        if col is None:
            if self.small:
                get = attrgetter(name)
                col = np.array([_measured_one(get(t)) for t in self.tels], dtype=np.float64)
            else:
                a = self._field(name)
                col = np.where(np.isfinite(a), a, math.nan)
            self._cols[key] = col
        return col

    @property
    def finish(self) -> np.ndarray:
        """``finish_s`` where measured (finite and > 0), else 0."""
        return self._durations("finish_s")

    def headroom_rows(self) -> np.ndarray:
        """Positions of the reports that carry a memory headroom (empty: a C-level scan)."""
        rows = self.rows
        if rows is not None:
            return np.flatnonzero(rows[:, ROW_INDEX["mem_headroom_mb"]] == rows[:, ROW_INDEX["mem_headroom_mb"]])

        def measured() -> Any:
            return map(is_not, map(_HEADROOM, self.tels), repeat(None))
        if not any(measured()):
            return _NO_ROWS
        return np.flatnonzero(np.fromiter(measured(), dtype=bool, count=self.n))

    # ----- derived columns ------------------------------------------------------------------
    @property
    def any_oom(self) -> bool:
        """Does any report say the worker ran out of memory? (no array built when none does)"""
        if self._any_oom is None:
            rows = self.rows
            if rows is not None:
                self._any_oom = bool(rows[:, ROW_INDEX["oom"]].any())
            else:
                self._any_oom = any(map(_OOM, self.tels))
        return self._any_oom

    def known_any_oom(self, value: bool) -> None:
        """Set :attr:`any_oom` from a scan the caller made of :attr:`rows` (the manager's
        compiled one), so that it is not read again."""
        self._any_oom = bool(value)

    @property
    def oom(self) -> np.ndarray:
        """Per report: did the worker run out of memory (``Telemetry.oom``)?"""
        if self._oom is None:
            if not self.any_oom:
                self._oom = np.zeros(self.n, dtype=bool)
            elif self.rows is not None:
                self._oom = self.rows[:, ROW_INDEX["oom"]] != 0.0
            else:
                self._oom = np.fromiter(map(_OOM, self.tels), dtype=bool, count=self.n)
        return self._oom

    def speed(self) -> np.ndarray:
        """:meth:`WorkerReport.speed` per report: samples/s of compute, nan where unusable."""
        if self._speed is None:
            if self.small:
                speeds = [_speed_one(r.batch_size, r.telemetry.compute_s) for r in self.reports]
                self._speed_finite = all(v == v for v in speeds)     # nan or finite, each
                self._speed = np.array(speeds, dtype=np.float64)
            else:
                c = self.compute
                with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                    v = self.batch / c
                    # c > 0 and v > 0 imply batch > 0; c = inf gives v = 0; nan fails every test
                    ok = (v > 0) & (v < math.inf) & (c > 0)
                self._speed = np.where(ok, v, math.nan)
        return self._speed

    def speeds_finite(self) -> bool:
        """Is every report's :meth:`speed` usable? (known without a numpy call for a small batch)"""
        if self._speed_finite is None:
            self._speed_finite = bool(np.isfinite(self.speed()).all())
        return self._speed_finite

    def overhead(self) -> np.ndarray:
        """:func:`overhead_one` per report: the server-observed finish time minus compute
        where the report carries one, else data + previous push + previous pull."""
        if self._overhead is None:
            if self.small:
                self._overhead = np.array([overhead_one(t) for t in self.tels], dtype=np.float64)
            else:
                fin = self.finish                           # 0 where not seen
                comp = np.where(np.isfinite(self.compute), self.compute, 0.0)
                seen_rest = np.maximum(0.0, fin - comp)
                seen = fin > 0
                if seen.all():   # the coordinator's reports: the three own columns are not read
                    self._overhead = seen_rest
                else:
                    own = self._durations("data_s") + self._durations("prev_push_s") + self._durations("prev_pull_s")
                    self._overhead = np.where(seen, seen_rest, own)
        return self._overhead

    def exog(self) -> np.ndarray:
        """(n, len(EXOG_KEYS)) exogenous inputs, :meth:`Telemetry.exog` per row."""
        if self._exog is None:
            if self.small:
                self._exog = np.array([t.exog() for t in self.tels],
                                      dtype=np.float64).reshape(self.n, len(EXOG_KEYS))
            elif self.rows is not None:
                a = self.rows[:, _EXOG_AT]
                self._exog = np.where(np.isfinite(a), a, 0.0)
            else:
                out = np.empty((self.n, len(EXOG_KEYS)))
                for j, key in enumerate(EXOG_KEYS):
                    a = _tel_column(self.tels, key)
                    out[:, j] = np.where(np.isfinite(a), a, 0.0)
                self._exog = out
        return self._exog

    # ----- splitting ------------------------------------------------------------------------
    def take(self, idx: np.ndarray) -> ReportBatch:
        """The sub-batch at positions ``idx`` (columns already extracted are sliced, not redone)."""
        sub = ReportBatch([self.reports[i] for i in idx.tolist()])
        for name in ("_worker", "_batch", "_compute", "_oom", "_exog", "_speed", "_overhead"):
            col = getattr(self, name)
            if col is not None:
                setattr(sub, name, col[idx])
        if self._speed_finite:
            sub._speed_finite = True
        if self._tels is not None:
            sub._tels = [self._tels[i] for i in idx.tolist()]
        if self._rows is not _UNREAD and not sub.small:
            sub._rows = None if self._rows is None else self._rows[idx]
            sub._head = None if self._head is None else self._head[idx]
        sub._cols = {k: v[idx] for k, v in self._cols.items()}
        return sub


def occurrence_rounds(keys: np.ndarray, scratch: np.ndarray | None = None) -> list[np.ndarray] | None:
    """None when ``keys`` (non-negative ints, e.g. slots) are unique; otherwise the positions of
    the first occurrence of each key, then of the second, ... (each round in arrival order).

    ``scratch`` (an int array longer than max(keys)) makes the uniqueness test O(n) without a sort.
    """
    n = keys.size
    if n <= 1:
        return None
    if n <= SMALL_BATCH:
        ks = keys.tolist()
        if len(set(ks)) == n:
            return None
    pos = np.arange(n)
    if scratch is not None and keys.max() < scratch.size:
        scratch[keys] = pos
        if (scratch[keys] == pos).all():
            return None
    else:
        if len(set(keys.tolist())) == n:
            return None
    order = np.argsort(keys, kind="stable")
    sk = keys[order]
    start = np.flatnonzero(np.concatenate([[True], sk[1:] != sk[:-1]]))
    group_start = np.repeat(start, np.diff(np.concatenate([start, [n]])))
    rank = np.empty(n, dtype=np.int64)
    rank[order] = np.arange(n) - group_start
    return [np.flatnonzero(rank == r) for r in range(int(rank.max()) + 1)]
