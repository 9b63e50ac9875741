"""A worker's report of one iteration: the one definition of what a worker measures.

:class:`Telemetry` names every field with its unit and the range a received value must lie in.
The worker (``ps_worker``), the simulation, the DDP plug-in and ps-bsm clients build it;
``ps_common.protocol`` carries it in ``Push`` and ``BsmReport`` and refuses, on decode, any field
that is unknown, of another type, not finite or out of its range; the batch-size manager, its
policies and the predictors read it by attribute (``batchsize_manager.reports`` adds whose
iteration it was). No code that handles a report spells a field as a string: metrics records
are written with :meth:`Telemetry.to_dict` and read back with :meth:`Telemetry.from_record`.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Mapping, Sequence

from ps_common.frozen import fill, plain_defaults

#: Upper bounds of the measurements (the lower bound is 0): sanity limits for what a peer may
#: send, far beyond any real value, so that no report can overflow a policy's arithmetic.
MAX_SECONDS = 1e6          # one phase of one iteration: about 11 days
MAX_CORE_PERCENT = 1e5     # % of one core: a process on 1,000 cores
MAX_MIB = 1e9              # about a pebibyte
MAX_FACTOR = 1e6           # an emulated slowdown
MAX_COUNT = 1 << 20        # burners, retries


def _measured(unit: str, high: float, default: float | None = 0.0) -> Any:
    """A measured field: its unit and the range ``[0, high]`` a received value must lie in
    (``None``, where allowed, means "not measured")."""
    return field(default=default, metadata={"unit": unit, "range": (0.0, high)})


def _counted(high: int) -> Any:
    return field(default=0, metadata={"unit": "count", "range": (0, high)})


@dataclass(frozen=True)
class Telemetry:
    """What one worker measured in one iteration (its batch size travels beside it).

    Timings of the iteration's own compute, and of the previous iteration's communication: a
    report leaves with the push, before this iteration's push, wait and pull are known.

    ``row``: every field as a little-endian float64 (:meth:`to_floats` packed), set where a
    report is received (the protocol's decoder: :meth:`from_checked`) or by :meth:`packed`,
    else None. The batch-size manager reads the columns of thousands of reports from their rows
    in one pass (:class:`batchsize_manager.reports.ReportBatch`) instead of one pass per field.
    Not a field: it is the fields' values in another form, and copies made here keep it true.
    """

    row: ClassVar[bytes | None] = None

    # ----- this iteration -----------------------------------------------------------------
    #: seconds loading the iteration's batch
    data_s: float = _measured("s", MAX_SECONDS)
    #: seconds of forward and backward over the batch (an emulated slowdown included): the
    #: policies' speed is batch size / compute_s
    compute_s: float = _measured("s", MAX_SECONDS)
    # ----- the previous iteration ---------------------------------------------------------
    #: seconds of the last finished iteration, answer to answer (the DDP plug-in: this one)
    iteration_s: float = _measured("s", MAX_SECONDS)
    #: seconds sending the previous gradient
    prev_push_s: float = _measured("s", MAX_SECONDS)
    #: seconds waiting at the barrier for the previous parameters (the imbalance LB-BSP removes)
    prev_wait_s: float = _measured("s", MAX_SECONDS)
    #: seconds receiving the previous parameters
    prev_pull_s: float = _measured("s", MAX_SECONDS)
    # ----- seen by whoever holds the barrier ----------------------------------------------
    #: seconds from the answer that started the iteration to the gradient being whole on every
    #: shard: the coordinator's measurement (a worker's own is dropped on arrival); the DDP
    #: plug-in's per rank, to its last gradient bucket. None: not measured
    finish_s: float | None = _measured("s", MAX_SECONDS, None)
    # ----- resources (``ps_worker.telemetry``: averages over the probe's last period) -----
    #: % of one core used by the worker's process
    proc_cpu: float = _measured("% of one core", MAX_CORE_PERCENT)
    #: % of all cores used on the host
    host_cpu: float = _measured("% of all cores", 100.0)
    #: % of all cores used by everything else on the host (what steals the worker's cycles)
    cotenant_cpu: float = _measured("% of all cores", 100.0)
    #: MiB resident in the worker's process
    rss_mb: float = _measured("MiB", MAX_MIB)
    #: % of the host's memory in use
    host_mem_pct: float = _measured("% of host memory", 100.0)
    #: MiB free on the worker's GPU (None: not a CUDA worker)
    gpu_mem_free_mb: float | None = _measured("MiB", MAX_MIB, None)
    #: MiB on the worker's GPU in all (None: not a CUDA worker)
    gpu_mem_total_mb: float | None = _measured("MiB", MAX_MIB, None)
    #: MiB allocated by torch on the worker's GPU (None: not a CUDA worker)
    gpu_mem_alloc_mb: float | None = _measured("MiB", MAX_MIB, None)
    #: cores the worker's own CPU cgroup may use, its CFS quota / period (None: no quota, or no
    #: readable cpu controller)
    cpu_quota: float | None = _measured("cores", MAX_CORE_PERCENT / 100, None)
    #: seconds the kernel held the worker's CPU cgroup back for spending its quota, since the
    #: worker's previous report (None: no quota, or the first report in this group)
    throttled_s: float | None = _measured("s", MAX_SECONDS, None)
    #: CPU seconds the worker's process used since its previous report, all threads: what a
    #: quota rations (None: not measured)
    cpu_s: float | None = _measured("s", MAX_SECONDS, None)
    #: the part of ``cpu_s`` spent loading the batch and in forward and backward: what grows with
    #: the batch size (None: not measured)
    compute_cpu_s: float | None = _measured("s", MAX_SECONDS, None)
    # ----- the heterogeneity lab ----------------------------------------------------------
    #: seconds slept inside compute to emulate a slowdown
    emulated_s: float = _measured("s", MAX_SECONDS)
    #: the emulated slowdown factor in force (1: none; None: no emulation)
    slowdown: float | None = _measured("factor", MAX_FACTOR, None)
    #: CPU burner processes running beside the worker
    burners: int = _counted(MAX_COUNT)
    # ----- memory (``ps_worker.memory``, under a memory limit) ----------------------------
    #: MiB the iteration could still have used under the worker's limit (None: no limit)
    mem_headroom_mb: float | None = _measured("MiB", MAX_MIB, None)
    #: MiB per sample the iteration used above the model's resting use (None: no limit)
    mem_per_sample_mb: float | None = _measured("MiB", MAX_MIB, None)
    #: MiB the worker may use (None: no limit)
    mem_limit_mb: float | None = _measured("MiB", MAX_MIB, None)
    #: times the iteration was retried with fewer samples after running out of memory
    oom_retries: int = _counted(MAX_COUNT)
    #: the iteration ran out of memory at its batch size and carries no timing (simulation, DDP
    #: plug-in, ps-bsm clients; a ps worker sends ``OutOfMemory`` instead)
    oom: bool = False

    def exog(self) -> list[float]:
        """The predictors' exogenous inputs, in :data:`EXOG_KEYS` order (non-finite: 0.0)."""
        return [_exog_one(getattr(self, k)) for k in EXOG_KEYS]

    def with_finish(self, finish_s: float | None) -> Telemetry:
        """This report with ``finish_s`` set: what ``dataclasses.replace(self, finish_s=...)``
        gives, in 0.9 µs instead of 6.5 (:mod:`ps_common.frozen`; shard 0 times the finish of
        every worker's every iteration)."""
        change: dict[str, Any] = {"finish_s": finish_s}
        row = self.row
        if row is not None:
            change["row"] = row[:_FINISH_AT] + _F64.pack(math.nan if finish_s is None else finish_s) \
                + row[_FINISH_AT + 8:]
        return fill(Telemetry, self.__dict__, change)

    def packed(self) -> bytes:
        """:attr:`row`, packed now if it was not (what a report's receiver holds; 1-3 µs).
        ``ValueError`` or ``TypeError`` for a field that is not a number (only a report built
        locally can hold one)."""
        row = self.row
        if row is None:
            row = _ROW.pack(*self.to_floats())
            object.__setattr__(self, "row", row)
        return row

    @classmethod
    def from_checked(cls, values: Mapping[str, Any]) -> Telemetry:
        """A report from the fields a decoder received and checked (the others: their
        defaults), with its :attr:`row` (the defaults' row with those fields put in)."""
        floats = list(_DEFAULT_FLOATS)
        for name, v in values.items():
            floats[ROW_INDEX[name]] = math.nan if v is None else v
        return fill(cls, _DEFAULTS, values, {"row": _ROW.pack(*floats)})

    def to_dict(self) -> dict[str, Any]:
        """The measured fields (None left out), for metrics records."""
        return {k: v for k in _NAMES if (v := getattr(self, k)) is not None}

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Telemetry:
        """A report read back from a metrics record (:meth:`to_dict`); other keys are ignored."""
        return cls(**{k: record[k] for k in _NAMES if k in record})

    def to_floats(self) -> list[float]:
        """Every field as a float, in declaration order (None: nan), for a collective's tensor."""
        return [math.nan if (v := getattr(self, k)) is None else float(v) for k in _NAMES]

    @classmethod
    def from_floats(cls, row: Sequence[float]) -> Telemetry:
        """The inverse of :meth:`to_floats` (nan in an optional field: None)."""
        return cls(**{k: conv(v) for (k, conv), v in zip(_FROM_FLOAT, row)})


_NAMES: tuple[str, ...] = tuple(f.name for f in fields(Telemetry))
_DEFAULTS: dict[str, Any] = plain_defaults(Telemetry) or {}
assert _DEFAULTS, "with_finish and the decoder fill reports without __init__"
#: :attr:`Telemetry.row`'s layout: field ``name`` is float64 number ``ROW_INDEX[name]``
ROW_INDEX: dict[str, int] = {name: i for i, name in enumerate(_NAMES)}
_ROW = struct.Struct(f"<{len(_NAMES)}d")
_F64 = struct.Struct("<d")
_FINISH_AT = 8 * ROW_INDEX["finish_s"]


def _from_float(f: Any) -> Any:
    if f.default is None:
        return lambda v: None if math.isnan(v) else v
    if isinstance(f.default, bool):
        return lambda v: v >= 0.5
    if isinstance(f.default, int):
        return int
    return float


_FROM_FLOAT = tuple((f.name, _from_float(f)) for f in fields(Telemetry))
_DEFAULT_FLOATS: tuple[float, ...] = tuple(Telemetry().to_floats())

#: The exogenous inputs the system feeds to predictors, in this order (percentages, 0-100).
EXOG_KEYS: tuple[str, ...] = ("host_cpu", "cotenant_cpu", "host_mem_pct")
assert set(EXOG_KEYS) <= set(_NAMES)


def _exog_one(raw: Any) -> float:
    """A predictor input: the value where finite, else 0.0 (unconvertible values too)."""
    try:
        v = float(raw) if raw is not None else math.nan
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return v if math.isfinite(v) else 0.0
