"""Gradient exchange for the ranks of a DDP job, through ``ps-bsm`` instead of a ring all-reduce.

Why: a ring all-reduce passes every rank's data through every rank, in 2(N-1) steps that each
need every rank. A rank throttled by a CPU quota stalls every step it is out of quota for, and
each collective costs every rank CPU it may not have; a rank behind a slow link slows every
step of the ring. Through a server each rank sends each gradient bucket once and gets the
batch-size-weighted mean once; the sum runs on the server's CPU.

The rule, per iteration ``t`` (this module is the pure state; ``bsm_service`` does the I/O):

* ``t`` has one split (``plan``), decided once by the service's manager: when a rank opens
  ``t`` at the start (or a restart), or when ``t - 1`` completes. ``ExchangeOpen`` answers
  with it and a token for the rank.
* A rank's ``ExchangePush`` of bucket ``b`` is accepted only with its token, for the open
  iteration, at its planned batch size, once per (rank, bucket), with the dtype and size of the
  bucket's other contributions, and finite. When all ranks sent ``b``, each gets
  ``sum_r x_r g_r / X`` summed in rank order (the same bytes for every rank, whatever the
  arrival order). A rank with ``x_r = 0`` adds nothing.
* When the bucket every rank marked ``last`` completes, every rank's report goes to the manager,
  the split of ``t + 1`` is decided, and it rides on that bucket's answers. A report's
  ``finish_s`` is the service's own measurement, as the parameter server's coordinator does it:
  from the moment iteration ``t`` was opened (the answers of ``t - 1`` left) to the arrival of
  the rank's last bucket. It holds what a rank cannot time itself: receiving the sum, its
  optimizer step, a slow link, and every phase a CPU quota held back. A rank's own value is
  dropped, so no rank can steer the split with a finish time it made up.
* A push that carries the rank's token but breaks the rule (a size other than planned, a
  bucket it already sent, another shape, a non-finite gradient...) fails the iteration for
  every rank: the sender gets the refusal, each waiting rank an Error, and so does each later
  push of ``t``; nothing of ``t`` is ever answered with a sum. An iteration with contributions
  and no progress for ``stale_s`` is abandoned the same way, so a job restarted after a rank
  died can open a new iteration. A push without the rank's token, or for another iteration,
  is refused and changes nothing.

What a peer can make the service hold is bounded: bucket indices below ``max_buckets``, so at
most that many open buckets, and ``max_bytes`` of held gradients.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from batchsize_manager import BatchSizeManager, WorkerReport
from ps_common import protocol as P
from ps_common.report import Telemetry
from ps_server.router import Refused

Reply = tuple[bytes, P.Message]
FLOAT_DTYPES = frozenset({np.dtype("<f4"), np.dtype("<f8")})


@dataclass
class _Bucket:
    """One bucket of the open iteration: who sent it, and who waits for its sum."""

    dtype: np.dtype
    size: int
    last: bool
    grads: dict[int, np.ndarray] = field(default_factory=dict)
    waiting: dict[int, bytes] = field(default_factory=dict)  # rank -> ident to answer


class GradientExchange:
    """The exchange of one DDP world of ``world`` ranks (ids ``0..world-1``) around ``manager``.

    Not thread-safe; one service loop drives it. Every method either returns the replies to send
    (``(ident, message)`` pairs) or raises :class:`Refused` for the sender, leaving state as it was.
    """

    def __init__(self, manager: BatchSizeManager, world: int, *, stale_s: float = 60.0,
                 max_buckets: int = 4096, max_bytes: int = 1 << 31,
                 clock: Callable[[], float] = time.monotonic,
                 new_token: Callable[[], str] = lambda: secrets.token_hex(16)) -> None:
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if not stale_s > 0:
            raise ValueError(f"stale_s must be > 0, got {stale_s}")
        self.manager = manager
        self.world = int(world)
        self.stale_s = float(stale_s)
        self.max_buckets = int(max_buckets)
        self.max_bytes = int(max_bytes)
        self.clock = clock
        self.new_token = new_token
        for r in range(self.world):
            manager.join(r)
        self.tokens: dict[int, str] = {}
        #: How many times the job started: a rank opens once per process, so a second open by a
        #: rank in the same generation means every rank's process is new (torchrun restarts all).
        self.generation = 0
        self.opened: dict[int, int] = {}   # rank -> the generation it last opened in
        self.job = ""                      # the job of the current generation (ExchangeOpen.job)
        self.iteration: int | None = None  # the open iteration, whose split is ``plan``
        self.plan: list[int] = []
        self.failed: str | None = None     # why the open iteration failed, if it did
        self.buckets: dict[int, _Bucket] = {}
        self.done: set[int] = set()        # buckets of the open iteration already answered
        self.reports: dict[int, Telemetry] = {}
        self.held_bytes = 0
        self.last_activity = clock()
        self.opened_at = clock()  # when the open iteration began, as the barrier sees it
        self.completed = 0   # iterations completed
        self.abandoned = 0   # iterations failed or abandoned

    # ----- what a rank asks ----------------------------------------------------------------
    def open(self, ident: bytes, rank: int, iteration: int, job: str = "") -> list[Reply]:
        """The split of ``iteration`` and a fresh token for ``rank`` (to ``ident``), starting
        ``iteration`` if it is not the open one.

        ``job`` names the start of the job the rank belongs to (the same on every rank of one
        start; torchrun restarts every rank, within seconds, long before ``stale_s``). An open
        under another job than the current one's starts a new generation, whichever rank of it
        opens first: every earlier token is void (a process of the old job that still pushes is
        refused), and the open iteration is abandoned at once, its waiters told, so nothing a
        dead process sent is summed with what the new ones send. Without ``job`` the restart is
        guessed: a rank opens only when its process starts, so a second open by a rank that
        opened in this generation is one (this misses a restart whose first rank to open did
        not open in the last one). An open of another iteration while this one holds buckets is
        a restart as well."""
        self._rank(rank)
        if iteration < 0:
            raise Refused("bad_request", f"iteration must be >= 0, got {iteration}")
        new_job = job != self.job if job else self.opened.get(rank) == self.generation
        restart = new_job or (self._busy() and iteration != self.iteration)
        plan = None
        if restart or iteration != self.iteration or self.failed is not None:
            plan = self._decide()       # first: a refusal here leaves everything as it was
        told = self._fail(f"iteration {self.iteration} abandoned: rank {rank} opened iteration "
                          f"{iteration} (a restarted job)") if restart and self._busy() else []
        if restart:
            self.generation += 1
            self.tokens.clear()
            self.job = job
        if plan is not None:
            self._start(iteration, plan)
        self.opened[rank] = self.generation
        self.tokens[rank] = self.new_token()
        return told + [(ident, P.ExchangePlan(iteration=iteration, batch_sizes=list(self.plan),
                                              token=self.tokens[rank]))]

    def push(self, ident: bytes, msg: P.ExchangePush) -> list[Reply]:
        """Hold one bucket of one rank; the replies once the bucket (or the iteration) is done."""
        rank, t, b = msg.worker_id, msg.iteration, msg.bucket
        self._rank(rank)
        token = self.tokens.get(rank)
        if token is None or not secrets.compare_digest(token.encode(), msg.token.encode()):
            raise Refused("unauthorized", f"wrong token for rank {rank} (open the iteration first)")
        if t != self.iteration:
            raise Refused("not_planned", f"iteration {t} is not open (open: {self.iteration})")
        if self.failed is not None:
            raise Refused("iteration_failed", self.failed)
        # The token proves this is the rank itself: a push of it that breaks the rule means the
        # rank is broken (its sizes or its model differ), and the iteration cannot complete.
        # Everybody is told now, not after ``stale_s``.
        try:
            grad, bucket = self._checked(msg)
        except Refused as exc:
            return [(ident, self._error(exc.code, str(exc)))] + self._fail(
                f"iteration {t} failed: rank {rank}'s bucket {b} was refused ({exc.code}: {exc})")
        self.last_activity = self.clock()
        if bucket is None:
            bucket = self.buckets[b] = _Bucket(dtype=grad.dtype, size=grad.size, last=msg.last)
        bucket.grads[rank] = grad
        bucket.waiting[rank] = ident
        self.held_bytes += grad.nbytes
        if msg.last:
            assert msg.telemetry is not None
            self.reports[rank] = msg.telemetry.with_finish(self.last_activity - self.opened_at)
        if len(bucket.grads) < self.world:
            return []
        return self._complete(b, bucket)

    def _checked(self, msg: P.ExchangePush) -> tuple[np.ndarray, _Bucket | None]:
        """The push's gradient (flat) and its open bucket, or :class:`Refused`."""
        rank, t, b = msg.worker_id, msg.iteration, msg.bucket
        if msg.batch_size != self.plan[rank]:
            raise Refused("bad_batch", f"rank {rank} was given {self.plan[rank]} samples in "
                                       f"iteration {t}, not {msg.batch_size}")
        if not 0 <= b < self.max_buckets:
            raise Refused("bad_request", f"bucket must be in [0, {self.max_buckets}), got {b}")
        if b in self.done:
            raise Refused("duplicate", f"bucket {b} of iteration {t} was already summed")
        (grad,) = msg.arrays
        if grad.dtype not in FLOAT_DTYPES:
            raise Refused("bad_request", f"gradients must be float32 or float64, not {grad.dtype}")
        grad = grad.reshape(-1)
        bucket = self.buckets.get(b)
        if bucket is not None:
            if rank in bucket.grads:
                raise Refused("duplicate", f"rank {rank} already sent bucket {b} of iteration {t}")
            if grad.dtype != bucket.dtype or grad.size != bucket.size or msg.last != bucket.last:
                raise Refused("bad_shape", f"bucket {b}: {grad.size} x {grad.dtype} last={msg.last}, "
                                           f"other ranks sent {bucket.size} x {bucket.dtype} "
                                           f"last={bucket.last}")
        if self.held_bytes + grad.nbytes > self.max_bytes:
            raise Refused("too_large", f"holding {self.held_bytes} bytes; {grad.nbytes} more exceed "
                                       f"the limit of {self.max_bytes}")
        if msg.last and msg.telemetry is None:
            raise Refused("bad_request", "the last bucket carries the rank's report (telemetry)")
        # one read pass in the gradient's own dtype: a sum is finite if every term is; a sum that
        # is not (a NaN, or finite terms near the dtype's limit that overflow it) is checked term
        # by term, so only a gradient that holds a non-finite value is refused
        if self.plan[rank] > 0:
            with np.errstate(over="ignore", invalid="ignore"):
                finite = np.isfinite(grad.sum())
            if not finite and not np.isfinite(grad).all():
                raise Refused("non_finite", f"rank {rank}'s gradient (bucket {b}) is not finite")
        return grad, bucket

    def expire(self) -> list[Reply]:
        """Abandon the open iteration if it has held gradients without progress for ``stale_s``."""
        if not self._busy() or self.clock() - self.last_activity < self.stale_s:
            return []
        missing = sorted(set(range(self.world)) - set(self._senders_of_all()))
        return self._fail(f"iteration {self.iteration} abandoned after {self.stale_s:g} s without "
                          f"progress (ranks {missing} have not sent every open bucket)")

    # ----- internals ------------------------------------------------------------------------
    def _rank(self, rank: int) -> None:
        if not 0 <= rank < self.world:
            raise Refused("unknown_worker", f"rank {rank} is not in this world of {self.world} ranks")

    def _busy(self) -> bool:
        return bool(self.buckets)

    def _senders_of_all(self) -> list[int]:
        """Ranks that sent every open bucket."""
        sets = [set(bk.grads) for bk in self.buckets.values()]
        return sorted(set.intersection(*sets)) if sets else []

    def _decide(self) -> list[int]:
        """The manager's next split, or :class:`Refused`: a policy that raises (a custom one's
        bug included) fails the iteration for every rank instead of leaving it half done."""
        try:
            sizes = self.manager.assign()
        except ValueError as exc:  # the bounds cannot hold X
            raise Refused("infeasible", str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - reported to every rank as the policy's error
            raise Refused("policy_error", f"{type(exc).__name__}: {exc}") from None
        return [int(sizes[r]) for r in range(self.world)]

    def _observe(self, t: int, reports: list[Telemetry]) -> None:
        """Every rank's report of iteration ``t`` to the manager (a policy that raises on them:
        :class:`Refused`, as in :meth:`_decide`)."""
        try:
            self.manager.observe_many([WorkerReport.received(r, t, self.plan[r], tel)
                                       for r, tel in enumerate(reports)])
        except Exception as exc:  # noqa: BLE001
            raise Refused("policy_error", f"{type(exc).__name__}: {exc}") from None

    def _start(self, iteration: int, plan: Sequence[int]) -> None:
        self.iteration = iteration
        self.plan = list(plan)
        self.failed = None
        self.buckets.clear()
        self.done.clear()
        self.reports.clear()
        self.held_bytes = 0
        self.last_activity = self.opened_at = self.clock()

    def _weighted_mean(self, bucket: _Bucket) -> np.ndarray:
        """A float64 sum in rank order (the same bytes whatever the arrival order), through one
        scratch buffer: no temporary per rank, though a bucket can be 25 MB. No torch here:
        ps-bsm stays free of it."""
        total = float(sum(self.plan))
        acc = np.zeros(bucket.size, dtype=np.float64)
        scratch = np.empty_like(acc)
        for r in range(self.world):
            if self.plan[r] > 0:
                # dtype: a Python float weight would leave a float32 gradient's product in float32
                np.multiply(bucket.grads[r], self.plan[r] / total, out=scratch, dtype=np.float64)
                acc += scratch
        return acc.astype(bucket.dtype, copy=False)

    def _complete(self, b: int, bucket: _Bucket) -> list[Reply]:
        t = self.iteration
        assert t is not None
        mean = self._weighted_mean(bucket)
        del self.buckets[b]
        self.done.add(b)
        self.held_bytes -= sum(g.nbytes for g in bucket.grads.values())
        next_sizes: list[int] = []
        reports: list[Telemetry] = []
        if bucket.last:
            if self.buckets:  # ranks send their buckets in order, the last one last
                reason = (f"iteration {t}: the last bucket completed while buckets "
                          f"{sorted(self.buckets)} were still open")
                return self._fail(reason) + [(ident, self._error("iteration_failed", reason))
                                             for ident in bucket.waiting.values()]
            reports = [self.reports[r] for r in range(self.world)]
            try:
                self._observe(t, reports)
                next_sizes = self._decide()
            except Refused as exc:
                waiting = list(bucket.waiting.values())
                failed = self._fail(f"iteration {t + 1} cannot be planned: {exc}")
                return failed + [(ident, self._error(exc.code, str(exc))) for ident in waiting]
            self.completed += 1
            self._start(t + 1, next_sizes)
        result = P.ExchangeResult(iteration=t, bucket=b, next_batch_sizes=next_sizes,
                                  reports=reports, arrays=[mean])
        return [(bucket.waiting[r], result) for r in range(self.world)]

    def _fail(self, reason: str) -> list[Reply]:
        """Fail the open iteration: every waiting rank is told, nothing of it is kept."""
        replies: list[Reply] = [(ident, self._error("iteration_failed", reason))
                   for bk in self.buckets.values() for ident in bk.waiting.values()]
        self.failed = reason
        self.buckets.clear()
        self.held_bytes = 0
        self.abandoned += 1
        return replies

    @staticmethod
    def _error(code: str, message: str) -> P.Error:
        return P.Error(code=code, message=message[:2000])
