"""BatchSizeManager: the one object a training loop (ours or another framework's) talks to.

It reads membership (its own, or the coordinator's: :mod:`batchsize_manager.membership`) and owns
the bounds (x_min, x_max, per-worker memory caps), the policy, validation of every answer, and
the measurement of its own decision time (so "overhead as a fraction of the iteration" is
measured, not assumed). No sockets, no sleeps; time comes from an injected clock.

Cost: ``observe`` only checks membership and queues the report (~0.2 µs; ``observe_many`` takes
an iteration's reports in one call); the queued reports of an iteration reach the policy as one
:class:`~batchsize_manager.reports.ReportBatch` when it next
decides (or when anything reads the policy's state or adds to the memory search: ``policy``,
``caps()``, ``memory_caps``, ``probed``, ``join``/``leave``, ``state_dict``), or when
``flush_every`` of them are queued, and built-in policies decide on numpy arrays indexed by
worker slot. Queuing changes no result: reports are applied in arrival order, before any later
membership change, exactly as if each had been applied at once. Measured in
``benchmarks/bench_manager.py``.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np

from batchsize_manager.allocation import SMALL_N, check_feasible_arrays
from batchsize_manager.membership import Member, Membership
from batchsize_manager.memory import CannotFit, MemoryCaps
from batchsize_manager.policies import BatchPolicy, get_policy
from batchsize_manager.reports import ReportBatch, WorkerReport
from ps_common.report import ROW_INDEX

log = logging.getLogger(__name__)

_OOM_AT, _HEADROOM_AT = ROW_INDEX["oom"], ROW_INDEX["mem_headroom_mb"]   # in a report's row

STATE_VERSION = 1

#: Queued reports are handed to the policy in chunks of this many (see ``flush_every``).
FLUSH_EVERY = 1024


class BatchSizeManager:
    """Split a constant global batch X over the live workers, iteration after iteration.

    Usage per iteration: ``observe(report)`` for each worker's report of the finished iteration,
    then ``assign()`` for the next one. ``join``/``leave`` may come between any two calls; or
    the live set is a :class:`~batchsize_manager.membership.Membership` that someone else owns
    (:meth:`use_membership`: the coordinator's), and the manager hears each of its changes.

    Bounds: every size is in [``min_batch``, cap_i], cap_i being the smaller of ``max_batch``
    and worker i's memory cap (:mod:`batchsize_manager.memory`: ``memory_caps[name]``, a
    start-up probe, out-of-memory errors searched down to the largest size that fits with
    ``oom_margin`` to spare, reported headroom). The manager is the one place per-worker caps
    live: they are keyed by the worker's name (``join(worker_id, name)``; default: the id as a
    string), so they survive a rejoin under a new id and a checkpoint, and policies receive them
    as the ``max_batch`` of each decision. An X that cannot be split within the bounds raises
    ``ValueError`` saying why.

    Policies with background refits (``lbbsp-cpu`` with NARX or ARIMA) hold a helper process;
    :meth:`close` releases it (it also goes when the manager is garbage-collected or the process
    exits).
    """

    def __init__(self, policy: BatchPolicy | str, global_batch: int, *, min_batch: int = 1,
                 max_batch: int | None = None, policy_args: Mapping[str, Any] | None = None,
                 memory_caps: Mapping[Any, int] | None = None, oom_margin: float = 0.05,
                 clock: Callable[[], float] = time.perf_counter,
                 cpu_clock: Callable[[], float] = time.thread_time) -> None:
        if isinstance(policy, str):
            pol = get_policy(policy, **dict(policy_args or {}))
        elif isinstance(policy, BatchPolicy):
            if policy_args:
                raise ValueError("policy_args only apply when the policy is given by name")
            pol = policy
        else:
            raise TypeError(f"policy must be a BatchPolicy or a registered name, got {type(policy)}")
        if int(global_batch) < 1:
            raise ValueError(f"global_batch must be >= 1, got {global_batch}")
        if int(min_batch) < 1:
            raise ValueError(f"min_batch must be >= 1, got {min_batch}")
        if max_batch is not None and int(max_batch) < int(min_batch):
            raise ValueError(f"max_batch={max_batch} is below min_batch={min_batch}")
        self.memory = MemoryCaps(memory_caps, oom_margin, in_use=lambda name: bool(self.membership.ids_named(name)),
                                 min_batch=int(min_batch))
        self._policy = pol
        self.global_batch = int(global_batch)
        self.min_batch = int(min_batch)
        self.max_batch = None if max_batch is None else int(max_batch)
        self.clock = clock
        #: this thread's CPU seconds: a decision's cost to a busy host, where its wall time also
        #: counts the time other processes (the workers) ran while it was preempted
        self.cpu_clock = cpu_clock
        self.membership: Membership[Any] = Membership()  # live ids and names (caps are by name)
        self._owns_membership = True
        self._live = self.membership.records           # for the O(1) test on the hot path
        self.membership.subscribe(self)
        self._native = bool(getattr(pol, "native_arrays", False))
        self._last_ids = np.zeros(0, dtype=np.int64)
        self._last_x = np.zeros(0, dtype=np.int64)
        self._last_dict: dict[int, int] | None = {}
        self.last_decision_s = 0.0
        self.total_decision_s = 0.0
        self.last_decision_cpu_s = 0.0
        self.total_decision_cpu_s = 0.0
        self.decisions = 0
        self.ignored_reports = 0
        self._pending: list[WorkerReport] = []
        self._pending_s = 0.0          # observe() time since the last assign()
        self._pending_cpu_s = 0.0      # CPU of reading and applying reports since the last assign()
                                       # (flushes, observe_many's chunks; not of queuing them)
        self._caps_cache: tuple[Any, Any, np.ndarray] | None = None
        self._caps_list_of: tuple[np.ndarray, list[float]] | None = None
        self._feasible: tuple[np.ndarray, np.ndarray, int, int] | None = None  # last bounds checked
        #: reports are applied in chunks of this size: a chunk is read while its reports are still
        #: in the CPU cache (10,000 freshly received reports read at once cost twice as much)
        self.flush_every = FLUSH_EVERY

    # ----- the policy ----------------------------------------------------------------------
    @property
    def policy(self) -> BatchPolicy:
        """The batch policy, with every queued report applied (safe to inspect)."""
        self._flush(timed=True)
        return self._policy

    def close(self) -> None:
        """Release the policy's background resources (refit process); the manager stays usable."""
        self._policy.close()

    def _flush(self, timed: bool = False) -> None:
        """Hand the queued reports to the policy (and record OOM caps), in arrival order."""
        if not self._pending:
            return
        t0 = self.clock() if timed else 0.0
        c0 = self.cpu_clock()
        self._apply_pending()
        self._pending_cpu_s += self.cpu_clock() - c0
        if timed:
            self._pending_s += self.clock() - t0

    def _apply_pending(self) -> None:
        batch = ReportBatch(self._pending)
        self._pending = []
        self._apply(batch)

    def _apply(self, batch: ReportBatch) -> None:
        """Hand a batch of live workers' reports to the policy (and record OOM caps)."""
        if batch.n == 0:
            return
        self._learn_memory(batch)
        if batch.any_oom:
            batch = batch.take(np.flatnonzero(~batch.oom))   # no timing in them: the policy never sees them
        self._policy.observe_batch(batch)

    def _learn_memory(self, batch: ReportBatch) -> None:
        """Out-of-memory reports and completed iterations feed the memory search of the workers
        that have one, and any headroom estimate, in arrival order: a worker's success and then
        its failure in one batch leave the caps they would leave one report at a time (a success
        counts only for a worker with a search, which its failure may start). One vectorised
        check when the batch has no failure and nobody has a search (the usual case)."""
        k = getattr(self._policy, "kernels", None)
        if k is not None and (rows := batch.rows) is not None:    # one compiled pass
            any_oom, any_headroom = k.scan_rows(rows, _OOM_AT, _HEADROOM_AT)
            batch.known_any_oom(any_oom)
            if not (any_oom or any_headroom or self.memory.tracks_any()):
                return
        if not batch.any_oom and not self.memory.tracks_any():
            for i in batch.headroom_rows().tolist():
                self._completed(batch.reports[i])
            return
        headroom = set(batch.headroom_rows().tolist())
        oom = batch.oom.tolist()
        for i, r in enumerate(batch.reports):
            if oom[i]:
                self._out_of_memory(r.worker_id, r.batch_size)
            elif i in headroom or self.memory.tracks(self.membership.name_of(r.worker_id) or ""):
                self._completed(r)

    def _completed(self, r: WorkerReport) -> None:
        name = self.membership.name_of(r.worker_id)
        if name is not None:
            self.memory.completed(name, r.batch_size, r.telemetry)

    def _out_of_memory(self, worker_id: int, batch_size: int) -> int | None:
        name = self.membership.name_of(worker_id)
        if name is None:
            return None
        try:
            # no floor here: a report cannot send its worker away. The cap stays at min_batch
            # while only larger sizes failed; once min_batch failed too, a cap below it makes the
            # next split fail with a clear error rather than hand the size out again
            cap = self.memory.out_of_memory(name, batch_size)
        except CannotFit as exc:
            log.error("%s", exc)
            return None
        log.warning("worker %d (%s) ran out of memory at batch %d; capped at %d", worker_id, name,
                    batch_size, cap)
        return cap

    def out_of_memory(self, worker_id: int, batch_size: int) -> int:
        """Worker ``worker_id`` failed with ``batch_size`` samples: learn from it and return the
        size to retry with. Raises :class:`~batchsize_manager.memory.CannotFit` when a single
        sample failed or the new cap would be below ``min_batch`` (nothing is learned then: the
        caller sends the worker away, as the coordinator does with ``cannot_fit``), ``KeyError``
        for a worker that is not live."""
        name = self.membership.name_of(worker_id)
        if name is None:
            raise KeyError(f"worker {worker_id} is not live")
        self._flush(timed=True)
        cap = self.memory.out_of_memory(name, batch_size, refuse_below_min_batch=True)
        log.warning("worker %d (%s) ran out of memory at batch %d; retrying with %d", worker_id,
                    name, batch_size, cap)
        return cap

    def probed(self, worker_id: int, fits: int, fails: int | None = None) -> None:
        """A start-up probe of ``worker_id``'s memory: ``fits`` samples fit, ``fails`` did not."""
        name = self.membership.name_of(worker_id)
        if name is not None:
            self._flush(timed=True)           # the reports before it first, as they came
            self.memory.probed(name, fits, fails)

    def name_of(self, worker_id: int) -> str | None:
        return self.membership.name_of(worker_id)

    # ----- membership ---------------------------------------------------------------------
    @property
    def live_workers(self) -> list[int]:
        """Live worker ids, sorted."""
        return list(self.membership.ids())

    def is_live(self, worker_id: int) -> bool:
        """O(1) membership test (``live_workers`` builds a sorted list: O(N) per call)."""
        return worker_id in self._live

    def use_membership(self, members: Membership[Any]) -> None:
        """Take the live set from ``members``, which the caller owns and changes (the
        coordinator's): this manager hears every join and leave, and its own :meth:`join` and
        :meth:`leave` are refused. Only before anyone joined either side."""
        if len(self.membership) or len(members):
            raise ValueError("use_membership: both memberships must be empty")
        self.membership = members
        self._owns_membership = False
        self._live = members.records
        members.subscribe(self)

    def join(self, worker_id: int, name: str | None = None) -> None:
        """A worker became live (joining twice is a no-op). ``name`` keys its memory caps (a
        stable identity: a worker that rejoins under a new id keeps them); default ``str(id)``."""
        self._check_owner("join")
        self.membership.join(worker_id, Member(str(int(worker_id)) if name is None else str(name)))

    def leave(self, worker_id: int) -> None:
        """A worker left or was declared lost (unknown ids are ignored)."""
        self._check_owner("leave")
        self.membership.leave(worker_id)

    def _check_owner(self, what: str) -> None:
        if not self._owns_membership:
            raise RuntimeError(f"{what}: this manager reads a membership someone else owns; "
                               "change it there")

    def member_joined(self, worker_id: int, name: str) -> None:
        """(Membership listener) Reports queued before the join reach the policy first."""
        self._flush(timed=True)
        self._policy.join(worker_id)

    def member_leaving(self, worker_id: int, name: str) -> None:
        """(Membership listener) The leaver's queued reports still count (its name is still
        known), then the policy forgets it."""
        self._flush(timed=True)
        self._policy.leave(worker_id)

    # ----- decisions ----------------------------------------------------------------------
    def observe(self, report: WorkerReport) -> None:
        """Feed one worker's report; late reports of departed workers are dropped and counted."""
        clock = self.clock
        t0 = clock()
        if report.worker_id in self._live:
            pending = self._pending
            pending.append(report)
            if len(pending) >= self.flush_every:
                self._flush()                     # while the newest reports are still in cache
        else:
            self.ignored_reports += 1
        self._pending_s += clock() - t0

    def observe_many(self, reports: Sequence[WorkerReport]) -> None:
        """:meth:`observe` of each report in order, for a caller that holds an iteration's
        reports together (the coordinator, the simulation): one call and one timing for all of
        them. The reports of departed workers are dropped a chunk at a time, right before the
        chunk is handed to the policy, so that its report objects are still in the CPU cache
        when their rows are read (``benchmarks/bench_manager.py``). A whole chunk of received
        reports (:meth:`ReportBatch.with_rows`) is read in one pass over its objects, and the
        departed are found on its worker column."""
        t0 = self.clock()
        live, start, n = self._live, 0, len(reports)
        while start < n:                          # a chunk is read while it is in the CPU cache
            stop = min(n, start + max(1, self.flush_every - len(self._pending)))
            chunk = reports[start:stop]
            start = stop
            c0 = self.cpu_clock()
            # A whole chunk would be flushed now: if its reports were received, read them in one
            # pass instead. A smaller one is queued, so that the coordinator's many small feeds
            # reach the policy together at the decision (applied one by one, they cost it twice
            # the CPU at 1,000 workers).
            full = not self._pending and len(chunk) >= self.flush_every
            read = ReportBatch.with_rows(chunk) if full else None
            if read is not None:                  # received reports: one pass over the objects
                self._apply(self._live_part(read))
                self._pending_cpu_s += self.cpu_clock() - c0   # as a flush's: reading included
                continue
            kept = [r for r in chunk if r.worker_id in live]
            self.ignored_reports += len(chunk) - len(kept)
            self._pending.extend(kept)
            if len(self._pending) >= self.flush_every:
                self._flush()
        self._pending_s += self.clock() - t0

    def _live_part(self, batch: ReportBatch) -> ReportBatch:
        """The reports of live workers in ``batch`` (the others counted as ignored), tested on
        its worker column: reading the ids from the objects would touch each object once more."""
        ids, _ = self.membership.sorted_ids()
        worker = batch.worker
        if ids.size == 0:
            live = np.zeros(worker.size, dtype=bool)
        else:
            pos = np.minimum(np.searchsorted(ids, worker), ids.size - 1)
            live = ids[pos] == worker
        if live.all():
            return batch
        self.ignored_reports += int(np.count_nonzero(~live))
        return batch.take(np.flatnonzero(live))

    def caps(self) -> dict[int, int]:
        """The effective cap of every live worker that has one (absent = only bounded by X)."""
        per_worker = self.memory_caps
        if self.max_batch is None:
            return {w: c for w, c in per_worker.items() if w in self._live}
        return {w: min(self.max_batch, per_worker.get(w, self.max_batch)) for w in self._live}

    @property
    def memory_caps(self) -> dict[int, int]:
        """Per live worker id that has one: its memory cap (kept by worker name)."""
        self._flush(timed=True)
        return self._merged_caps()

    def _merged_caps(self) -> dict[int, int]:
        """Caps of live workers, from whichever is shorter: the names with a cap (usually a few)
        or the live names (after churn under new names, the departed ones' caps would otherwise
        make each decision pass over up to ``MAX_NAMES`` of them: 17-27 ms)."""
        caps: dict[int, int] = {}
        if self.memory.capped_count() <= len(self.membership):
            pairs: Iterable[tuple[str, set[int]]] = ((n, self.membership.ids_named(n))
                                                     for n in self.memory.capped_names())
        else:
            pairs = self.membership.names()
        for name, ids in pairs:
            if ids:
                c = self.memory.cap(name)
                if c is not None:
                    for w in ids:
                        caps[w] = c
        return caps

    def _caps_array(self, ids: np.ndarray) -> np.ndarray:
        """Effective caps aligned with ``ids`` (inf: only bounded by X); the same array object
        while membership and caps are unchanged (callers must not modify it)."""
        per = self._merged_caps()
        key = (self.max_batch, per)
        cached = self._caps_cache
        if cached is not None and cached[0] is ids and cached[1] == key:
            return cached[2]
        caps = np.full(ids.size, math.inf if self.max_batch is None else float(self.max_batch))
        self._caps_cache = (ids, key, caps)
        if per and ids.size:
            ks = np.fromiter(per.keys(), dtype=np.int64, count=len(per))
            vs = np.fromiter(per.values(), dtype=np.float64, count=len(per))
            pos = np.minimum(np.searchsorted(ids, ks), ids.size - 1)
            hit = ids[pos] == ks
            caps[pos[hit]] = np.minimum(caps[pos[hit]], vs[hit])
        return caps

    def _caps_list(self, caps: np.ndarray) -> list[float]:
        """``caps`` (:meth:`_caps_array`'s array) as a list, made once per caps array."""
        cached = self._caps_list_of
        if cached is None or cached[0] is not caps:
            cached = self._caps_list_of = (caps, caps.tolist())
        return cached[1]

    def assign(self) -> dict[int, int]:
        """The next {worker: batch size} for the live workers: Σ = X, each within its bounds."""
        t0 = self.clock()
        c0, flushed_cpu = self.cpu_clock(), self._pending_cpu_s  # earlier flushes' CPU, counted once
        try:
            if self._pending:             # inside this decision's own timing: no clocks of its own
                self._apply_pending()
            ids, live = self.membership.sorted_ids()
            caps = self._caps_array(ids)
            feasible = (ids, caps, self.global_batch, self.min_batch)
            known = self._feasible
            if known is None or known[0] is not ids or known[1] is not caps or known[2:] != feasible[2:]:
                check_feasible_arrays(ids, self.global_batch, self.min_batch, caps)
                self._feasible = feasible   # ids and caps are the same objects until a change
            if self._native:
                x = self._policy.assign_arrays(ids, self.global_batch, self.min_batch, caps,
                                               checked=True)
                xs = x.tolist()
                self._validate_arrays(ids, x, caps, xs)
                out = dict(zip(live, xs))
                self._last_ids, self._last_x, self._last_dict = ids, x, None
                return out
            capd = {w: int(c) for w, c in zip(live, caps.tolist()) if c != math.inf}
            sizes = self._policy.assign(live, self.global_batch, self.min_batch,
                                        max_batch=capd or None)
            self._validate(sizes, live, capd)
            self.last_assignment = dict(sizes)
            return dict(sizes)
        finally:
            self.last_decision_s = self._pending_s + (self.clock() - t0)
            self._pending_s = 0.0
            self.total_decision_s += self.last_decision_s
            self.last_decision_cpu_s = flushed_cpu + (self.cpu_clock() - c0)
            self._pending_cpu_s = 0.0
            self.total_decision_cpu_s += self.last_decision_cpu_s
            self.decisions += 1

    @property
    def last_assignment(self) -> dict[int, int]:
        """The answer of the last :meth:`assign`."""
        if self._last_dict is None:
            self._last_dict = dict(zip(self._last_ids.tolist(), self._last_x.tolist()))
        return self._last_dict

    @last_assignment.setter
    def last_assignment(self, value: Mapping[int, int]) -> None:
        self._last_dict = dict(value)

    def _validate_arrays(self, ids: np.ndarray, x: np.ndarray, caps: np.ndarray, xs: list[int]) -> None:
        """The policy's split (``x``, and ``xs`` as a list) sums to X and keeps every bound; a
        few workers are checked on the list (no numpy calls: each costs a paced decision µs)."""
        name = self._policy.name or type(self._policy).__name__
        if x.shape != ids.shape:
            raise RuntimeError(f"batch policy {name} answered {x.size} sizes for {ids.size} workers")
        lo = self.min_batch
        k = getattr(self._policy, "kernels", None)
        if x.size <= SMALL_N:
            total = sum(xs)
            bad = [i for i, (xi, ci) in enumerate(zip(xs, self._caps_list(caps))) if xi < lo or xi > ci]
        elif k is not None:                       # one compiled pass
            total, first_bad = k.check_split(k.as_int64(x), lo, k.as_float64(caps))
            bad = [] if first_bad < 0 else [first_bad]
        else:
            total = int(x.sum())
            bad = np.flatnonzero((x < lo) | (x > caps)).tolist()
        if total != self.global_batch:
            raise RuntimeError(f"batch policy {name} split sums to {total}, "
                               f"not X={self.global_batch}: {dict(zip(ids.tolist(), xs))}")
        if bad:
            i = bad[0]
            cap = caps[i]
            raise RuntimeError(f"batch policy {name} gave worker {int(ids[i])} batch {int(x[i])}, outside "
                               f"[{self.min_batch}, {int(cap) if math.isfinite(cap) else 'X'}]")

    def _validate(self, sizes: Mapping[int, int], live: list[int], caps: Mapping[int, int]) -> None:
        name = self._policy.name or type(self._policy).__name__
        if sorted(sizes) != live:
            raise RuntimeError(f"batch policy {name} answered for workers {sorted(sizes)}, live are {live}")
        if sum(sizes.values()) != self.global_batch:
            raise RuntimeError(f"batch policy {name} split sums to {sum(sizes.values())}, "
                               f"not X={self.global_batch}: {dict(sizes)}")
        for w, x in sizes.items():
            cap = caps.get(w)
            if x < self.min_batch or (cap is not None and x > cap):
                raise RuntimeError(f"batch policy {name} gave worker {w} batch {x}, outside "
                                   f"[{self.min_batch}, {cap if cap is not None else 'X'}]")

    @property
    def mean_decision_s(self) -> float:
        """Mean seconds per decision (observe of the reports + assign)."""
        return self.total_decision_s / self.decisions if self.decisions else math.nan

    @property
    def mean_decision_cpu_s(self) -> float:
        """Mean CPU seconds per decision (this thread's: what the decisions cost the host)."""
        return self.total_decision_cpu_s / self.decisions if self.decisions else math.nan

    # ----- checkpoints --------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Plain JSON-able state (str keys) for the coordinator's checkpoint."""
        policy = self.policy                     # applies the queued reports first
        return {
            "version": STATE_VERSION,
            "policy": self.policy.name,
            "global_batch": self.global_batch,
            "min_batch": self.min_batch,
            "max_batch": self.max_batch,
            "live": self.live_workers,
            "memory": self.memory.state_dict(),
            "last_assignment": {str(k): v for k, v in self.last_assignment.items()},
            "decisions": self.decisions,
            "total_decision_s": self.total_decision_s,
            "total_decision_cpu_s": self.total_decision_cpu_s,
            "policy_state": policy.state_dict(),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` output; X and the bounds stay as configured now. All or
        nothing: a state this manager cannot use (another policy, a damaged or hand-edited
        file: a value of the wrong type, an infinite size) raises ``ValueError`` and leaves the
        manager as it was, instead of half restored."""
        self._flush(timed=True)
        before = self.state_dict()
        try:
            self._load_state(state)
        except Exception as exc:
            self._load_state(before)
            if isinstance(exc, ValueError):
                raise
            raise ValueError(f"batch-size manager state not usable: {type(exc).__name__}: {exc}") from exc

    def _load_state(self, state: Mapping[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported BatchSizeManager state version {state.get('version')!r}")
        if state.get("policy") != self._policy.name:
            raise ValueError(f"checkpoint is for batch policy {state.get('policy')!r}, "
                             f"this manager runs {self._policy.name!r}")
        for key in ("global_batch", "min_batch", "max_batch"):
            if state.get(key) != getattr(self, key):
                log.info("batch-size manager: %s was %r in the checkpoint, now %r", key,
                         state.get(key), getattr(self, key))
        saved = [int(w) for w in state.get("live", [])]
        if self._owns_membership:  # the policy's own state (below) already holds these workers
            self.membership.restore({w: Member(self.membership.name_of(w) or str(w)) for w in saved})
        self.memory.load_state_dict(state.get("memory", {}))
        self.last_assignment = {int(k): int(v) for k, v in state.get("last_assignment", {}).items()}
        self.decisions = int(state.get("decisions", 0))
        self.total_decision_s = float(state.get("total_decision_s", 0.0))
        self.total_decision_cpu_s = float(state.get("total_decision_cpu_s", 0.0))
        self._policy.load_state_dict(state.get("policy_state", {}))
        if not self._owns_membership:
            # The owner's membership is the live set: the checkpoint's members who are not
            # members now have left (a resumed coordinator's workers join again), and members
            # the checkpoint does not know have joined.
            for w in saved:
                if w not in self._live:
                    self._policy.leave(w)
            for w in self.membership.ids():
                if w not in saved:
                    self._policy.join(w)
