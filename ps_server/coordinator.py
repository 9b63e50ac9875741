"""The coordinator (a role of shard 0): membership, plans, the data cursor, commits, stop rules.

Pure bookkeeping with an injected clock; the server loop feeds it and carries out what it
returns. It is the one place where a commit is decided (DESIGN.md section 3):

- Shards tell it which gradients they hold (shard 0 by receiving them, followers with Have
  messages). A gradient is *complete* once every shard holds it.
- The sync policy picks, among complete gradients, the set that makes up the next version
  (:meth:`decide`). Each decision is one :class:`CommitDecision` that every shard applies in the
  same order, so versions mean the same thing on every shard.
- How the next assignment is planned is the policy's answer (``plans_rounds``). Round modes
  (BSP, LB-BSP, backup workers) have one plan per iteration: the live workers, each one's batch
  size from the batch policy and its sample ranges from the data cursor. A worker lost before
  its gradient was complete leaves the plan and its samples go back to the cursor once; a
  complete one stays and is applied. The plan for t+1 rides on t's commit. Async modes (ASP,
  SSP) cut each worker's next assignment when it asks for it; each complete gradient that
  matches an outstanding assignment is its own commit.
- Membership has one owner, this coordinator (:attr:`Coordinator.members`); the batch-size
  manager and the sync policy read it.

Samples of gradients that are not applied go back to the cursor exactly once, so every applied
sample is used exactly once per epoch.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import hmac
import itertools
import logging
import os
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Callable, NoReturn

from batchsize_manager import WorkerReport
from batchsize_manager.manager import BatchSizeManager
from batchsize_manager.membership import Membership
from batchsize_manager.memory import CannotFit
from ps_common.config import JobConfig
from ps_common.errors import PsError
from ps_common.protocol import Assignment, Chunk, Plan
from ps_server.chunks import ChunkPool
from ps_server.data_cursor import DataCursor, ranges_size, split_ranges
from ps_server.pause import EvaluatorPause
from ps_server.sync import NO_LIVE_WORKER, AsyncPolicy, RoundPolicy, SyncPolicy

log = logging.getLogger(__name__)

#: Async modes: assignments a worker may hold whose gradients are not committed yet.
MAX_OUTSTANDING = 3
#: Backup mode: for this many rounds after one committed without a worker's share, that
#: worker's out-of-memory report of the share still teaches its cap (more rounds than a fast
#: job commits while a slow worker fails and reports).
LATE_ROUNDS = 64
#: sync=flexrr: the weight of the newest chunk in a worker's average speed (about the last 5).
CHUNK_SPEED_WEIGHT = 0.2


class JoinRefused(PsError):
    """A Join the job cannot take; ``code`` goes back as the Error's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


#: Drops one commit carries at most (the rest ride on the next ones): each is up to 28 bytes of
#: msgpack, so a commit's header stays well under the 1 MiB a follower decodes.
MAX_DROPS_PER_COMMIT = 16_384


class PendingDrops:
    """Gradients every shard should forget, each once, in the order they were found: sized
    ``(worker, iteration, batch_size)`` (only where held at that size) or unsized ``(worker,
    iteration)``. A follower reports what it holds at every beat, so the same unexpected entry
    comes in again and again until a commit carries its drop: kept once, the list is bounded by
    what the shards hold, not by time (a peer that had followers hold many gradients of
    departed workers once grew it past what a commit can carry, and the follower stalled)."""

    def __init__(self) -> None:
        self._keys: dict[tuple[int, ...], None] = {}

    def add(self, key: tuple[int, ...]) -> None:
        self._keys[tuple(key)] = None

    def take(self, limit: int) -> list[list[int]]:
        """The first ``limit`` of them (removed), as a commit's ``drops``."""
        out = []
        for key in list(itertools.islice(self._keys, max(0, limit))):
            del self._keys[key]
            out.append(list(key))
        return out

    def clear(self) -> None:
        self._keys.clear()

    def __len__(self) -> int:
        return len(self._keys)


class NotReassigned(PsError):
    """A worker's request to change what it computes (an out-of-memory report, a chunk claim)
    that the coordinator cannot act on; ``code`` goes back as the Error's."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@functools.lru_cache(maxsize=1 << 14)
def member_token(member_key: str, worker_id: int) -> str:
    """A worker's membership secret; any shard that knows ``member_key`` can check it. Cached:
    every push, pull and heartbeat is checked against it (2 µs of HMAC each, 0.1 cached; 3.5% of
    shard 0's CPU in a profile with 1,000 workers), and a new incarnation's key makes new entries."""
    return hmac.new(bytes.fromhex(member_key), f"worker:{worker_id}".encode(), hashlib.sha256).hexdigest()[:32]


@dataclass
class WorkerInfo:
    worker_id: int
    name: str
    instance: str
    joined_at: float
    device: str = "cpu"
    last_seen: float = 0.0
    clock: int = 0  # async modes: gradients committed
    told_stop: bool = False


@dataclass
class _Gradient:
    """What the ledger knows of one pushed gradient: its batch size and who holds it."""

    batch_size: int
    shards: set[int] = field(default_factory=set)
    complete: bool = False


@dataclass
class CommitDecision:
    """One version: every shard applies exactly these gradients, in this order of versions."""

    version: int
    iteration: int
    entries: list[list[int]]  # [worker, batch_size], sorted by worker
    lr_scale: float
    drops: list[list[int]]    # [worker, iteration]: never to be applied
    next_plan: Plan | None
    record: "UpdateRecord"
    checkpoint: bool = False


@dataclass
class UpdateRecord:
    """What the coordinator logs for each commit (one iteration in round modes)."""

    iteration: int
    version: int
    elapsed: float
    duration: float
    batch_sizes: dict[int, int]
    ranges: dict[int, list[list[int]]]
    accepted: list[int]
    loss: float
    epoch: int
    samples: int
    applied_samples: int
    reports: list[WorkerReport] = field(default_factory=list)
    helped_samples: int | None = None  # sync=flexrr: samples computed by a worker not planned them
    paused_s: float = 0.0          # evaluator.pause_training: pauses since the previous commit
    paused_total_s: float = 0.0    # ... and since the start (left out of elapsed and duration)


class Coordinator:
    def __init__(self, cfg: JobConfig, num_samples: int, manager: BatchSizeManager,
                 policy: SyncPolicy, *, num_shards: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.cfg = cfg
        self.policy = policy
        self.num_shards = num_shards
        self.num_samples = num_samples
        self.manager = manager
        self.clock = clock
        self.cursor = DataCursor(num_samples)
        self.member_key = os.urandom(16).hex()
        #: The live workers: changed here only; the manager (and through it the batch policy)
        #: hears every change.
        self.members: Membership[WorkerInfo] = Membership()
        manager.use_membership(self.members)
        self._next_id = 0
        self.started = False
        self.start_time = 0.0
        self.last_update_time = 0.0
        self.version = 0
        self.iteration = -1
        self.plan: dict[int, Assignment] = {}
        #: sync=flexrr: who computes which chunk of the current iteration (None otherwise), when
        #: each worker was granted its current chunk, and its speed over chunks (samples/s, an
        #: average over its last few, as the servers see it: a claim's round trip included).
        self.chunks: ChunkPool | None = None
        self._chunk_started: dict[int, float] = {}
        self.chunk_speeds: dict[int, float] = {}
        self.plan_lr = 1.0
        self.outstanding: dict[int, dict[int, Assignment]] = {}  # async: worker -> clock -> assignment
        self.ledger: dict[tuple[int, int], _Gradient] = {}
        self._completed: list[tuple[int, int]] = []  # completion order, not yet decided on
        self._pending_drops = PendingDrops()
        self.stop = False
        self.stop_reason = ""
        self.stop_version = -1
        self.last_accuracy = -1.0
        self.evaluator_done = False
        #: evaluator tokens (their Welcomes'): of the one whose reports count, of those joined
        #: since that have not reported (observers join as evaluators too), of earlier reporters
        self.evaluator_token = ""
        self.joined_evaluator_tokens: collections.deque[str] = collections.deque(maxlen=64)
        self.superseded_evaluator_tokens: collections.deque[str] = collections.deque(maxlen=64)
        self.applied_samples = 0
        self.updates = 0
        self.reports: dict[int, WorkerReport] = {}
        self.losses: dict[int, float] = {}
        self.replan_pending = False
        self.resumed = False
        self.elapsed_at_resume = 0.0
        self.events: list[dict] = []  # drained and logged by the server
        self.counters: dict[str, int] = {}
        self._last_X: int | None = None
        self._ramp: tuple[int, float, float] | None = None
        self._unobserved: dict[tuple[int, int], WorkerReport] = {}  # (worker, iteration), in arrival order
        self._sent: dict[int, tuple[int, float]] = {}  # worker -> (iteration, when it was answered)
        self._ahead: tuple[tuple[int, ...], tuple[dict[int, int], int]] | None = None
        #: backup mode: worker -> {iteration: batch size} of its shares that the last
        #: LATE_ROUNDS rounds committed without, no shard holding any of them; an out-of-memory
        #: report of exactly such a share still teaches the manager its cap (:meth:`out_of_memory`)
        self._late: dict[int, dict[int, int]] = {}
        ev = cfg.evaluator
        self.pause = EvaluatorPause(ev.every_iterations, ev.pause_timeout_s, ev.enabled and ev.pause_training)

    @property
    def global_batch(self) -> int:
        return self.cfg.training.global_batch

    def count(self, what: str) -> None:
        """One more of ``what`` refused or set aside (written down at the end: ``counters``)."""
        self.counters[what] = self.counters.get(what, 0) + 1

    # ----- membership -------------------------------------------------------------------
    def join(self, name: str, instance: str, device: str = "cpu", memory_fits: int = 0,
             memory_fails: int = 0) -> int:
        """A new member; a Join from a process that already is one replaces that membership.
        Raises :class:`JoinRefused` when one more member could not be given ``min_batch``
        samples (nor its start-up probe's cap), which would leave no split of X possible."""
        self._check_admissible(name, instance, memory_fits)
        for wid, info in list(self.members.records.items()):
            if instance and info.instance == instance:
                self.leave(wid, "joined again (same process)")
        wid = self._next_id
        self._next_id += 1
        now = self.clock()
        clock = min((w.clock for w in self.members.records.values()), default=0)
        self.members.join(wid, WorkerInfo(wid, name, instance, now, device, now, clock))
        if memory_fits > 0:
            self.manager.probed(wid, memory_fits, memory_fails or None)
            self._ahead = None
            self.events.append({"event": "memory_probe", "worker": wid, "name": name, "fits": memory_fits,
                                "fails": memory_fails, "cap": self.manager.memory_caps.get(wid)})
        log.info("worker %d (%s) joined; %d live", wid, name, len(self.members))
        return wid

    def _check_admissible(self, name: str, instance: str, memory_fits: int) -> None:
        """Refuse a member no split could include: past X / min_batch members, or one whose
        memory holds fewer than min_batch samples. Without this check, enough Joins (any holder
        of the worker credential can send them) would leave the next decision no split at all.

        Refuse a name a live member of another process has: the memory caps learned about a
        worker are kept by its name (so a restart keeps them), and a second member under that
        name could set them with its probe, its out-of-memory reports and its headroom (a
        client once capped a live worker at min_batch this way). A restarted worker gets in
        once its old membership is declared lost; the worker retries for that long."""
        taken = [w for w in self.members.ids_named(name) if self.members.records[w].instance != instance]
        if name and taken:
            raise JoinRefused("name_in_use", f"worker {taken[0]} of another process is called {name!r}; "
                                             "the memory caps learned about a worker are kept by its name, "
                                             "so two live workers cannot share one")
        min_batch = self.manager.min_batch
        if 0 < memory_fits < min_batch:
            raise JoinRefused("cannot_fit", f"this worker's memory holds {memory_fits} samples, fewer "
                                            f"than min_batch={min_batch}")
        # (a probe that fits min_batch caps the worker at min_batch at least: MemoryCaps keeps a
        # search at or above it while only larger sizes failed)
        again = bool(instance) and any(i.instance == instance for i in self.members.records.values())
        n = len(self.members) + (0 if again else 1)
        total = self.policy.planned_total(self._global_batch_for(n), n)
        if n * min_batch > total:
            raise JoinRefused("job_full", f"the job has {n - 1} workers: a global batch of {total} gives "
                                          f"at most {total // min_batch} of them min_batch={min_batch} "
                                          "samples each")

    def token(self, worker_id: int) -> str:
        return member_token(self.member_key, worker_id)

    def token_ok(self, worker_id: int, token: str) -> bool:
        return worker_id in self.members and hmac.compare_digest(self.token(worker_id), token)

    def leave(self, worker_id: int, reason: str = "left") -> bool:
        """Remove a worker (graceful leave, declared lost, replaced); no barrier waits for it.
        Returns whether it was a member.

        Its gradients that are not complete will never be: they are dropped everywhere and
        their samples go back to the cursor. A complete one is still applied. Called again for
        a worker that already left, it drops what is no longer complete since (a shard that
        held its gradient started again empty), so that no round waits for it.
        """
        if self.members.leave(worker_id) is not None:
            self._sent.pop(worker_id, None)
            self._late.pop(worker_id, None)
            self.chunk_speeds.pop(worker_id, None)
            if not self.policy.plans_rounds:   # round modes start these afresh with every plan
                self.reports.pop(worker_id, None)
                self.losses.pop(worker_id, None)
            log.info("worker %d %s; %d live", worker_id, reason, len(self.members))
            member = True
        elif worker_id in self.plan or worker_id in self.outstanding:
            log.info("worker %d, gone already: %s", worker_id, reason)
            member = False
        else:
            return False
        for clock, a in sorted(self.outstanding.pop(worker_id, {}).items()):
            g = self.ledger.get((worker_id, clock))
            if g is not None and g.complete:
                self.outstanding.setdefault(worker_id, {})[clock] = a  # still committed
            else:
                self._discard((worker_id, clock))
                self.cursor.give_back(a.ranges)
        if worker_id in self.plan and not self.stop:  # round modes: it leaves the plan
            g = self.ledger.get((worker_id, self.iteration))
            if g is None or not g.complete:
                self._discard((worker_id, self.iteration))
                planned = self.plan.pop(worker_id).ranges
                # flexrr: what it was granted goes back; its unclaimed chunks stay for the others
                self.cursor.give_back(planned if self.chunks is None else self.chunks.release(worker_id))
                if not self.plan:
                    if self.chunks is not None:
                        self.cursor.give_back(self.chunks.drain_unclaimed())
                        self.chunks = None
                    self.replan_pending = True
        return member

    def silent_workers(self, timeout_s: float) -> list[int]:
        """Workers not heard from (push or heartbeat) for longer than ``timeout_s``."""
        now = self.clock()
        return [w for w, info in self.members.records.items() if now - info.last_seen > timeout_s]

    def heard_from(self, worker_id: int) -> bool:
        info = self.members.get(worker_id)
        if info is None:
            return False
        info.last_seen = self.clock()
        return True

    def live(self) -> list[int]:
        return list(self.members.ids())

    def clock_of(self, worker_id: int) -> int:
        """Async modes: the worker's committed clock (gradients applied)."""
        return self.members[worker_id].clock

    def told_stop(self, worker_id: int) -> None:
        info = self.members.get(worker_id)
        if info is not None:
            info.told_stop = True

    def everyone_knows_stop(self) -> bool:
        """Every member has been answered with stop (or left) and the evaluator is done."""
        workers_done = all(w.told_stop for w in self.members.records.values())
        return workers_done and (self.evaluator_done or not self.cfg.evaluator.enabled)

    # ----- starting and planning ----------------------------------------------------------
    def try_start(self) -> Plan | None:
        """Start once the configured number of workers has joined; re-plan an iteration whose
        every worker left once somebody is live again. Returns a new plan to announce."""
        if self.stop:
            return None
        if self.started and self.replan_pending and len(self.members):
            self.replan_pending = False
            return self._plan_current_iteration()
        if self.started or len(self.members) < self.cfg.cluster.num_workers:
            return None
        if self.pause.enabled and not self.pause.present:
            return None  # pause_training: version 0 is measured before anyone trains
        self.started = True
        now = self.clock()
        if not self.resumed:
            self.start_time = now
            self.iteration = 0
        else:  # keep the elapsed clock running across the restart
            self.start_time = now - self.elapsed_at_resume
        self.last_update_time = now
        if not self.resumed:  # a resumed job's version was measured before (or is skipped)
            self.pause.hold(self.version, now)
        return self._plan_current_iteration()

    def _plan_current_iteration(self) -> Plan | None:
        """Round modes plan the current iteration now; async modes when each worker asks."""
        return self._plan(self.iteration) if self.policy.plans_rounds else None

    def current_plan(self) -> Plan | None:
        if not self.plan or self.stop:  # no plan: an async mode, or nobody live
            return None
        ws = sorted(self.plan)
        return Plan(iteration=self.iteration, workers=ws, batch_sizes=[self.plan[w].batch_size for w in ws],
                    total=self.plan[ws[0]].global_batch)

    def current_global_batch(self) -> int:
        """X for the next plan: constant, or worker_batch x live workers (elastic.keep)."""
        return self._global_batch_for(len(self.members))

    def _global_batch_for(self, members: int) -> int:
        e = self.cfg.elastic
        if e.keep == "worker_batch" and self.policy.plans_rounds:
            wb = e.worker_batch or max(1, self.global_batch // self.cfg.cluster.num_workers)
            return wb * max(1, members)
        return self.global_batch

    def drain_events(self) -> list[dict]:
        out, self.events = self.events, []
        return out

    def _lr_factor(self, iteration: int, X: int) -> float:
        """Linear scaling to X / X_configured, ramped from the previous factor; changes logged."""
        e = self.cfg.elastic
        if e.lr_rule == "none" or e.keep == "global_batch":
            return 1.0
        target = X / self.global_batch
        if self._last_X is None:
            self._last_X = self.global_batch if self.updates == 0 else X
        if X != self._last_X:
            now = self._lr_at(iteration)
            self._ramp = (iteration, now, target)
            self.events.append({"event": "global_batch_changed", "iteration": iteration,
                                "from": self._last_X, "to": X, "lr_factor_from": now, "lr_factor_to": target,
                                "ramp_iterations": e.ramp_iterations, "rule": "linear scaling"})
            log.info("global batch %s -> %d at iteration %d: lr factor %.3f -> %.3f over %d iterations",
                     self._last_X, X, iteration, now, target, e.ramp_iterations)
            self._last_X = X
        return self._lr_at(iteration)

    def _lr_at(self, iteration: int) -> float:
        if self._ramp is None:
            return 1.0
        start, a, b = self._ramp
        ramp = self.cfg.elastic.ramp_iterations
        if ramp <= 0:
            return b
        return a + (b - a) * min(1.0, (iteration - start + 1) / ramp)

    def _split(self, live: list[int]) -> tuple[dict[int, int], int] | None:
        """Batch sizes for ``live`` (the manager's members too) and their sum, which the sync
        policy sets from X (backup workers: N + b shares of X / N). None when no split exists
        (the workers' memory caps add up to less than X, or the survivors of losses cannot
        hold it within max_batch): the job then stops at its current version, with the
        reason, instead of the coordinator failing in the middle of a commit."""
        total = self.policy.planned_total(self.current_global_batch(), len(live))
        self.manager.global_batch = total
        try:
            return self.manager.assign(), total
        except ValueError as exc:
            log.error("no split of %d samples over workers %s: %s", total, live, exc)
            self.request_stop(f"no split of the global batch possible: {exc}")
            return None

    def _planned_split(self, live: list[int]) -> tuple[dict[int, int], int] | None:
        """The split prepared ahead for these members (plan_ahead), or one decided now."""
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead[0] == tuple(live):
            return ahead[1]
        self._observe_pending()
        return self._split(live)

    def _observe_pending(self, whole_only: bool = False) -> bool:
        """Feed the queued reports to the batch policy; True if any went. ``whole_only`` holds
        back those whose gradient is still on its way to some shard, so that they reach the
        policy with their finish time (all go when a split is decided now)."""
        held: dict[tuple[int, int], WorkerReport] = {}
        fed: list[WorkerReport] = []
        for key, r in self._unobserved.items():
            g = self.ledger.get(key) if whole_only else None
            if g is not None and not g.complete:
                held[key] = r
            else:
                fed.append(r)
        if fed:
            self.manager.observe_many(fed)
        self._unobserved = held
        return bool(fed)

    def background_work(self) -> None:
        """What can wait until the workers have their answers: feed the reports to the batch
        policy and, with ``mode.plan_ahead``, decide the next split now, from what is known.

        The cost of planning ahead: the split of iteration t+1 is decided from the reports of
        t-1 and earlier, one iteration older than otherwise, so LB-BSP reacts to a change of
        speed one iteration later. In exchange no predictor fit or split ever sits between the
        last gradient of an iteration and the answers that start the next one.
        """
        fresh = self._observe_pending(whole_only=True)
        if not self.cfg.mode.plan_ahead or not self.started or self.stop:
            return
        live = self.live()
        if not live:
            return
        stale = self._ahead is None or self._ahead[0] != tuple(live)
        if stale or (fresh and not self.policy.plans_rounds):  # async: every assignment uses the newest split
            split = self._split(live)
            if split is not None:
                self._ahead = (tuple(live), split)

    def _plan(self, iteration: int) -> Plan | None:
        self.iteration = iteration
        self.reports, self.losses = {}, {}
        live = self.live()
        if not live:
            self.plan = {}
            self.replan_pending = True
            return None
        split = self._planned_split(live)
        if split is None:          # the job stops: nothing to plan
            self.plan = {}
            return None
        sizes, total = split
        self.plan_lr = self._lr_factor(iteration, self.current_global_batch())
        self.plan = {w: Assignment(iteration=iteration, batch_size=x, ranges=self.cursor.take(x),
                                   global_batch=total)
                     for w, x in sizes.items()}
        k = self.policy.reassign_chunks
        self.chunks = ChunkPool({w: a.ranges for w, a in self.plan.items()}, k) if k else None
        self._chunk_started = {}
        return self.current_plan()

    def assignment(self, worker_id: int, key: int) -> Assignment | None:
        """The assignment answering a worker's pull: ``key`` is the shard version (round modes:
        the current iteration's plan) or the worker's next clock (async modes)."""
        if self.stop or worker_id not in self.members or not self.started:
            return None
        if self.pause.held is not None:
            return None  # the evaluator is measuring: nobody starts new work (pause_training)
        policy = self.policy
        if not isinstance(policy, AsyncPolicy):  # round modes: the current iteration's plan
            a = self.plan.get(worker_id) if key == self.iteration else None
            if a is None or self.chunks is None:
                return a
            first = self.chunks.first(worker_id)  # flexrr: the rest is claimed chunk by chunk
            return replace(a, batch_size=ranges_size(first), ranges=first, chunked=True)
        mine = self.outstanding.setdefault(worker_id, {})
        a = mine.get(key)
        if a is not None:
            return a
        if len(mine) >= MAX_OUTSTANDING:
            return None  # its earlier gradients are not committed yet: back-pressure
        if not policy.admits(self.slowest_clock(), key):
            return None
        live = self.live()
        split = self._planned_split(live)
        if split is None:          # the job stops
            return None
        sizes, total = split
        if self.cfg.mode.plan_ahead:
            self._ahead = (tuple(live), split)  # holds until background_work replans
        x = sizes[worker_id]
        a = Assignment(iteration=key, batch_size=x, ranges=self.cursor.take(x), global_batch=total)
        mine[key] = a
        return a

    def slowest_clock(self) -> int:
        """The slowest member's committed clock (:data:`NO_LIVE_WORKER` when there is none):
        what SSP's reads wait for, here and, told by ``Clocks``, on the followers."""
        return min((i.clock for i in self.members.records.values()), default=NO_LIVE_WORKER)

    def waiting_reason(self, worker_id: int, key: int, version: int) -> str:
        """Why :meth:`assignment` has nothing for this worker now (a diagnostic, never a decision)."""
        if self.stop:
            return "the job is stopping"
        if worker_id not in self.members:
            return "not a member"
        if not self.started:
            evaluator = (", waiting for the evaluator (evaluator.pause_training)"
                         if self.pause.enabled and not self.pause.present else "")
            return (f"the job has not started ({len(self.members)} of {self.cfg.cluster.num_workers} "
                    f"workers joined{evaluator})")
        if self.pause.held is not None:
            return (f"training is paused while the evaluator measures version {self.pause.held} "
                    "(evaluator.pause_training)")
        if self.policy.plans_rounds:
            if key != self.iteration:
                return f"shard version {version} is not the planned iteration {self.iteration}"
            if worker_id not in self.plan:
                return (f"not in iteration {self.iteration}'s plan (planned: {sorted(self.plan)}; "
                        f"replan pending: {self.replan_pending})")
            return f"its assignment of iteration {self.iteration} is due (answered next pass)"
        mine = self.outstanding.get(worker_id, {})
        if len(mine) >= MAX_OUTSTANDING:
            return f"{len(mine)} of its gradients are not committed yet"
        clocks = [(w, i.clock) for w, i in self.members.records.items()]
        return f"the sync policy holds clock {key} back (clocks: {clocks})"

    # ----- gradients and commits ------------------------------------------------------------
    def expected(self, worker_id: int, iteration: int) -> int | None:
        """The batch size a push of (worker, iteration) must carry, or None if none is due
        (flexrr: the samples granted to it, final once it has heard that none is left)."""
        if self.chunks is not None and iteration == self.iteration and worker_id in self.plan:
            return self.chunks.count(worker_id)
        a = self._due(worker_id, iteration)
        return None if a is None else a.batch_size

    def take_chunk(self, worker_id: int, iteration: int) -> Chunk:
        """sync=flexrr: grant ``worker_id`` its next chunk of ``iteration``, its own or (once it
        has none left) a straggler's last; none left: it pushes what it was granted.

        Raises :class:`NotReassigned` for a claim that does not match what is due."""
        if self.stop:
            raise NotReassigned("stopped", "the job is stopping")
        if self.chunks is None and self.policy.reassign_chunks == 0:
            raise NotReassigned("not_supported", f"sync={self.policy.name} does not reassign chunks")
        if iteration != self.iteration or worker_id not in self.plan or self.chunks is None:
            raise NotReassigned("not_planned", f"worker {worker_id} has no share of iteration {iteration}")
        if (worker_id, iteration) in self.ledger:
            raise NotReassigned("already_pushed", f"a shard holds worker {worker_id}'s gradient of "
                                                  f"iteration {iteration}: it cannot take more")
        self._time_chunk(worker_id, iteration)
        got = self.chunks.take(worker_id, self.chunk_speeds)
        self.count("chunks.claimed" if got is not None else "chunks.none_left")
        if got is None:
            return Chunk(iteration=iteration, owner=-1, ranges=[], batch_size=self.chunks.count(worker_id))
        owner, ranges = got
        if owner != worker_id:
            self.count("chunks.helped")
        return Chunk(iteration=iteration, owner=owner, ranges=ranges, batch_size=self.chunks.count(worker_id))

    def _due(self, worker_id: int, iteration: int) -> Assignment | None:
        """The worker's assignment of ``iteration``: in the plan (round modes) or among its
        outstanding ones (async modes; the other is empty)."""
        if iteration == self.iteration and worker_id in self.plan:
            return self.plan[worker_id]
        return self.outstanding.get(worker_id, {}).get(iteration)

    def _time_chunk(self, worker_id: int, iteration: int) -> None:
        """A claim ends the worker's current chunk: one observation of its speed."""
        assert self.chunks is not None
        now = self.clock()
        sent = self._sent.get(worker_id)
        started = self._chunk_started.get(worker_id)
        if started is None and sent is not None and sent[0] == iteration:
            started = sent[1]  # its first chunk came with the assignment
        self._chunk_started[worker_id] = now
        if started is None or now <= started:
            return
        seen = self.chunks.last_size(worker_id) / (now - started)
        old = self.chunk_speeds.get(worker_id)
        self.chunk_speeds[worker_id] = seen if old is None else old + CHUNK_SPEED_WEIGHT * (seen - old)

    def out_of_memory(self, worker_id: int, iteration: int, batch_size: int) -> Assignment:
        """Worker ``worker_id`` ran out of memory on its assignment of ``iteration``: the manager
        learns a cap, and the worker retries the same iteration with the first ``cap`` samples of
        its ranges; the rest go back to the data cursor and are served first next time. Nothing
        is lost or applied twice: no shard holds any of the failed gradient (refused otherwise),
        and every shard checks the worker's push against the new size. In round modes the
        iteration then commits ``batch_size - cap`` samples fewer, as when a worker is lost.

        Raises :class:`NotReassigned` for a report that does not match what is due."""
        if self.stop:
            raise NotReassigned("stopped", "the job is stopping")
        if self.policy.reassign_chunks:
            raise NotReassigned("not_supported", f"sync={self.policy.name} computes chunk by chunk and "
                                                 "does not shrink a share after an out-of-memory error")
        a = self._due(worker_id, iteration)
        if a is None and self._late.get(worker_id, {}).get(iteration) == batch_size:
            self._learn_late_out_of_memory(worker_id, iteration, batch_size)
        if a is None or a.iteration != iteration:
            raise NotReassigned("not_planned", f"worker {worker_id} has no assignment of iteration {iteration}")
        if a.batch_size != batch_size:
            raise NotReassigned("bad_batch", f"worker {worker_id} was assigned {a.batch_size} samples "
                                             f"for iteration {iteration}, not {batch_size}")
        if (worker_id, iteration) in self.ledger:
            raise NotReassigned("already_pushed", f"a shard holds worker {worker_id}'s gradient of "
                                                  f"iteration {iteration}: it did not run out of memory")
        try:
            x = self.manager.out_of_memory(worker_id, batch_size)
        except CannotFit as exc:
            raise NotReassigned("cannot_fit", str(exc)) from None
        keep, back = split_ranges(a.ranges, x)
        self.cursor.give_back(back)
        new = Assignment(iteration=iteration, batch_size=x, ranges=keep, global_batch=a.global_batch)
        if self.plan.get(worker_id) is a:
            self.plan[worker_id] = new
        else:
            self.outstanding[worker_id][iteration] = new
        self._ahead = None           # a split planned ahead did not know the new cap
        self._sent[worker_id] = (iteration, self.clock())   # its finish time starts again
        self.count("out_of_memory")
        self.events.append({"event": "out_of_memory", "worker": worker_id, "iteration": iteration,
                            "failed": batch_size, "retry": x, "cap": self.manager.memory_caps.get(worker_id)})
        return new

    def _learn_late_out_of_memory(self, worker_id: int, iteration: int, batch_size: int) -> NoReturn:
        """Backup mode: ``iteration`` committed without this worker, whose share ran out of memory.
        Nothing is left to retry, but the failure is as real as one in time: the manager learns
        the cap (once per share), so that later splits fit, instead of the worker failing, and
        joining again, every iteration. Then refuses the report ``not_planned`` (the worker joins
        again; its caps are kept by its name); below ``min_batch``, ``cannot_fit`` and nothing
        learned, as for a report in time."""
        shares = self._late[worker_id]
        del shares[iteration]
        if not shares:     # no empty entries: the commit loop looks at _late only when it holds some
            del self._late[worker_id]
        try:
            self.manager.out_of_memory(worker_id, batch_size)
        except CannotFit as exc:
            raise NotReassigned("cannot_fit", str(exc)) from None
        self._ahead = None           # a split planned ahead did not know the new cap
        self.count("out_of_memory.late")
        cap = self.manager.memory_caps.get(worker_id)
        self.events.append({"event": "out_of_memory_late", "worker": worker_id, "iteration": iteration,
                            "failed": batch_size, "cap": cap})
        raise NotReassigned("not_planned", f"iteration {iteration} committed without worker {worker_id}; "
                                           f"its out-of-memory failure at {batch_size} samples caps it at {cap}")

    def on_gradient(self, shard: int, worker_id: int, iteration: int, batch_size: int) -> None:
        """Shard ``shard`` holds this gradient. Reports of gradients that cannot be committed
        (stale, unknown, a batch size other than assigned) are dropped and counted."""
        if not 0 <= shard < self.num_shards:
            self.count("have.bad_shard")
            return
        key = (worker_id, iteration)
        g = self.ledger.get(key)
        if g is None:
            if self.expected(worker_id, iteration) != batch_size or self.stop:
                self.count("have.unexpected")
                # Sized: the assigned gradient may reach other shards under the same key before
                # this drop does, and must survive it.
                self._pending_drops.add((worker_id, iteration, batch_size))
                return
            g = self.ledger[key] = _Gradient(batch_size)
        elif g.batch_size != batch_size:
            self.count("have.conflict")
            self._pending_drops.add((worker_id, iteration, batch_size))  # not the ledger's size
            return
        if shard in g.shards:
            return
        g.shards.add(shard)
        if len(g.shards) == self.num_shards and not g.complete:
            g.complete = True
            self._completed.append(key)
            self._note_finish(worker_id, iteration)

    def shard_started_empty(self, shard: int) -> list[int]:
        """Follower ``shard`` registered as a fresh process (no --resume) at the job's version:
        whatever an earlier process of that index held is gone, so no gradient counts as held
        there any more. Returns the workers whose uncommitted gradients it was credited with,
        in order: none of those can complete now (a worker pushes once), so the caller removes
        them and they join again. Without this, the next commit named a gradient the new
        process never received and it stopped rather than diverge, for good."""
        hit = sorted({w for (w, _), g in self.ledger.items() if shard in g.shards})
        for g in self.ledger.values():
            if shard in g.shards:
                g.shards.discard(shard)
                g.complete = False
        self._completed = [k for k in self._completed if k in self.ledger and self.ledger[k].complete]
        return hit

    def assignment_answered(self, worker_id: int, iteration: int) -> None:
        """Shard 0 has just sent ``worker_id`` its parameters with the assignment of
        ``iteration``: the start of that worker's iteration, as the barrier sees it."""
        self._sent[worker_id] = (iteration, self.clock())

    def _note_finish(self, worker_id: int, iteration: int) -> None:
        """The worker's finish time as the barrier sees it: from the answer that started its
        iteration to the moment its gradient was whole on every shard. It includes what the
        worker cannot measure itself: its parameters and its gradient crossing a slow link, a
        push held back because the process spent its CPU quota. Goes into the report as
        ``finish_s``, which the batch policies balance when present."""
        sent = self._sent.get(worker_id)
        rep = self.reports.get(worker_id)
        if sent is None or sent[0] != iteration or rep is None or rep.iteration != iteration:
            return
        timed = rep.with_telemetry(rep.telemetry.with_finish(self.clock() - sent[1]))
        self.reports[worker_id] = timed
        if self._unobserved.get((worker_id, iteration)) is rep:   # not fed to the policy yet
            self._unobserved[(worker_id, iteration)] = timed

    def _discard(self, key: tuple[int, int]) -> None:
        if self.ledger.pop(key, None) is not None:
            self._pending_drops.add(key)

    def record_report(self, report: WorkerReport, loss: float) -> None:
        """Telemetry from a worker's push to shard 0; the batch policy gets it in
        :meth:`background_work`, off the path between the last push and the answers.

        What the servers measure (``finish_s``) is the coordinator's alone: a worker's own value
        is dropped here, so no worker can steer the split with a finish time it made up."""
        if report.telemetry.finish_s is not None:
            report = report.with_telemetry(report.telemetry.with_finish(None))
        self.reports[report.worker_id] = report
        self.losses[report.worker_id] = loss
        self._unobserved[(report.worker_id, report.iteration)] = report
        self.heard_from(report.worker_id)

    def decide(self) -> list[CommitDecision]:
        """The next commit due now (a list of at most one); call again until it is empty. One at
        a time, so that each is carried out (and checkpointed) before the next is decided."""
        if not self.started or self.stop:
            return []
        if isinstance(self.policy, RoundPolicy):
            d = self._decide_round(self.policy)
            return [d] if d is not None else []
        return self._decide_async()

    def _decide_round(self, policy: RoundPolicy) -> CommitDecision | None:
        t = self.iteration
        if not self.plan:
            return None
        complete = [w for (w, it) in self._completed if it == t and w in self.plan]
        accepted = policy.accept(sorted(self.plan), complete)
        if accepted is None:
            return None
        plan, helped = self.plan, None
        if self.chunks is not None:  # flexrr: each worker computed what it was granted
            chunks, self.chunks = self.chunks, None
            self.cursor.give_back(chunks.drain_unclaimed())  # nobody faster took them
            plan = {w: replace(a, batch_size=chunks.count(w), ranges=chunks.granted(w)) for w, a in plan.items()}
            helped = chunks.helped_samples
        for w, a in plan.items():
            if w not in accepted:  # a late backup worker: its samples are served again
                self.cursor.give_back(a.ranges)
                self.count("gradients_dropped")
                if (w, t) not in self.ledger:   # it may still run out of memory on them
                    shares = self._late.setdefault(w, {})
                    shares[t] = a.batch_size
                    for old in [i for i in shares if i <= t - LATE_ROUNDS]:
                        del shares[old]
            elif self._late:
                self._late.pop(w, None)  # it computed this one: no report of an older share is true
        stale = [[w, it] for (w, it) in self.ledger if it <= t and w not in accepted]
        drops = self._pending_drops.take(MAX_DROPS_PER_COMMIT - len(stale)) + stale
        self.ledger = {k: g for k, g in self.ledger.items() if k[1] > t}
        self._completed = [k for k in self._completed if k[1] > t]
        entries = [[w, plan[w].batch_size] for w in accepted]
        lr = self.plan_lr
        self.plan = {}  # consumed: a stop below must not give its samples back
        record = self._record(t, plan, accepted)
        record.helped_samples = helped
        self._check_stop(self.clock())
        next_plan = None if self.stop else self._plan(t + 1)
        return CommitDecision(self.version, t, entries, lr, drops, next_plan, record)

    def _decide_async(self) -> list[CommitDecision]:
        """At most one commit per call, so the caller applies (and may checkpoint) each before the
        next is decided: the coordinator's state always matches the version being written."""
        while self._completed:
            key = self._completed.pop(0)
            w, c = key
            g = self.ledger.pop(key, None)
            a = self.outstanding.get(w, {}).get(c)
            if g is None or a is None or a.batch_size != g.batch_size:
                self.count("have.unexpected")
                self._pending_drops.add((w, c))
                continue
            del self.outstanding[w][c]
            if not self.outstanding[w]:
                del self.outstanding[w]
            info = self.members.get(w)
            if info is not None:
                info.clock = max(info.clock, c + 1)
            drops = self._pending_drops.take(MAX_DROPS_PER_COMMIT)
            record = self._record(c, {w: a}, [w])
            self._check_stop(self.clock())  # a stop here drops everything not yet committed
            return [CommitDecision(self.version, c, [[w, a.batch_size]], a.batch_size / a.global_batch,
                                   drops, None, record)]
        return []

    def _record(self, iteration: int, plan: dict[int, Assignment], accepted: list[int]) -> UpdateRecord:
        now = self.clock()
        samples = sum(plan[w].batch_size for w in accepted)
        self.applied_samples += samples
        self.updates += 1
        self.version += 1
        n = samples or 1
        loss = sum(self.losses.get(w, 0.0) * plan[w].batch_size for w in accepted) / n
        record = UpdateRecord(
            iteration=iteration, version=self.version, elapsed=now - self.start_time,
            duration=now - self.last_update_time,
            batch_sizes={w: a.batch_size for w, a in plan.items()},
            ranges={w: a.ranges for w, a in plan.items()}, accepted=sorted(accepted), loss=loss,
            epoch=self.cursor.epoch, samples=self.cursor.state.samples_served,
            applied_samples=self.applied_samples,
            reports=[self.reports[w] for w in accepted if w in self.reports],
            paused_s=self.pause.take_since_commit(), paused_total_s=self.pause.total_s)
        self.last_update_time = now
        self.pause.hold(self.version, now)  # a stop decided next ends it at once
        return record

    # ----- checkpoints ------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What a resumed coordinator needs: the data cursor at the end of the last commit (the
        in-flight plan's and assignments' samples count as unused), progress counters, the batch
        policy's state. Membership is not saved: workers join again after a restart."""
        cursor = DataCursor(self.num_samples)
        cursor.load_state_dict(self.cursor.state_dict())
        inflight = [a.ranges for a in self.plan.values()] if self.chunks is None else [self.chunks.everything()]
        inflight += [a.ranges for m in self.outstanding.values() for a in m.values()]
        for ranges in inflight:
            cursor.give_back(ranges)
        return {"cursor": cursor.state_dict(), "iteration": self.updates if self.policy.plans_rounds else 0,
                "version": self.version, "elapsed": self.elapsed(), "updates": self.updates,
                "applied_samples": self.applied_samples, "last_accuracy": self.last_accuracy,
                "next_id": self._next_id, "policy": self.manager.state_dict()}

    def load_state_dict(self, d: dict) -> None:
        """Resume: progress and cursor from the checkpoint; wait for the workers to join again.
        A cursor that could serve a sample twice raises ValueError before anything changes."""
        self.cursor.load_state_dict(d["cursor"])     # first: it checks, all or nothing
        self.members.clear()
        self.plan, self.outstanding, self.ledger, self.chunks = {}, {}, {}, None
        self._completed = []
        self._pending_drops.clear()
        self._unobserved, self._ahead, self._late = {}, None, {}
        self.pause.clear()
        self.iteration = int(d["iteration"])
        self.version = int(d.get("version", d["updates"]))
        self.updates = int(d["updates"])
        self.applied_samples = int(d["applied_samples"])
        self.last_accuracy = float(d["last_accuracy"])
        self.elapsed_at_resume = float(d.get("elapsed", 0.0))
        # Worker ids never repeat within this process (``_next_id`` only grows), and the members
        # are cleared: a token of before the rollback names no member and no plan. So the
        # membership key stays, as the followers rolled back over their links keep it (a new key
        # here left them refusing every worker that joined again). A restarted shard 0 has a
        # key of its own, from ``__init__``, which every follower learns when it registers.
        self._next_id = max(self._next_id, int(d["next_id"]))
        if d.get("policy") is not None:  # its members of the old incarnation have left
            try:
                self.manager.load_state_dict(d["policy"])
            except (ValueError, KeyError) as exc:  # a policy change between runs: start afresh
                log.warning("batch policy state not restored: %s", exc)
        self.started, self.stop, self.stop_reason, self.stop_version = False, False, "", -1
        # a final measurement was of the history left behind: the new one's final version needs
        # its own (the evaluator stays for it until shard 0 is gone)
        self.evaluator_done = False
        self.replan_pending = False
        self.resumed = True

    def iterations_done(self) -> float:
        """Progress in global batches: iterations in round modes, X-sample equivalents in async."""
        if self.policy.plans_rounds:
            return float(self.updates)
        return self.applied_samples / self.global_batch

    # ----- stop rules -------------------------------------------------------------------
    def _check_stop(self, now: float) -> None:
        t = self.cfg.training
        if self.stop:
            return
        if t.max_iterations is not None and self.iterations_done() >= t.max_iterations:
            self.request_stop(f"reached max_iterations={t.max_iterations}")
        elif t.epochs is not None and self.applied_samples >= t.epochs * self.num_samples:
            self.request_stop(f"reached epochs={t.epochs}")
        elif t.max_seconds is not None and now - self.start_time - self.pause.ongoing(now) >= t.max_seconds:
            self.request_stop(f"reached max_seconds={t.max_seconds}")
        elif t.target_accuracy is not None and self.last_accuracy >= t.target_accuracy:
            self.request_stop(f"reached target_accuracy={t.target_accuracy}")

    def check_time(self) -> bool:
        """The wall-clock stop rule between commits (a job with no progress still ends)."""
        if self.started and not self.stop:
            self._check_stop(self.clock())
        return self.stop

    def request_stop(self, reason: str) -> None:
        """The job ends at the current version; nothing in flight is applied after it."""
        if self.stop:
            return
        self.stop, self.stop_reason, self.stop_version = True, reason, self.version
        log.info("stopping at version %d: %s", self.version, reason)
        if self.pause.held is not None:
            self._resume(self.clock())
        if self.chunks is not None:
            self.cursor.give_back(self.chunks.everything())
        else:
            for a in self.plan.values():
                self.cursor.give_back(a.ranges)
        self.plan, self.chunks = {}, None
        for mine in self.outstanding.values():
            for a in mine.values():
                self.cursor.give_back(a.ranges)
        self.outstanding = {}
        for key in self.ledger:
            self._pending_drops.add(key)
        self.ledger, self._completed = {}, []

    def on_eval(self, accuracy: float, final: bool = False, version: int = -1) -> bool:
        """The evaluator's measurement of ``version``; True if it ended a pause (the waiting
        pulls can be answered now)."""
        self.last_accuracy = accuracy
        if final:
            self.evaluator_done = True
        now = self.clock()
        length = self.pause.reported(version, now)
        if length is None:
            return False
        self._shift_clock(length)
        return True

    # ----- evaluator pauses (evaluator.pause_training) --------------------------------------
    def evaluator_joined(self) -> str:
        """An evaluator is there to end pauses. With ``pause_training`` the job starts only once
        it has joined, so that version 0 is measured before anyone trains (the caller tries to
        start); one that joins again later misses the pause of the version training was at.
        Returns its token (see :meth:`evaluator_reports`)."""
        self.pause.present = True
        token = secrets.token_hex(16)
        self.joined_evaluator_tokens.append(token)
        return token

    def evaluator_reports(self, token: str) -> str:
        """Whose report is this? Only one evaluator's count: two would each end pauses and stop
        the job on their own measurements, and the first final report would end the job while
        the other still measured. The first report under a token joined after the counting
        evaluator's makes it the one that counts (an operator restarted the evaluator; an
        observer, which joins as an evaluator but never reports, changes nothing). Returns
        ``current``, ``superseded`` (an evaluator that joined later has reported since) or
        ``unknown`` (no token of this process, e.g. of shard 0 before a restart)."""
        t = token.encode("utf-8", "surrogateescape")

        def same(e: str) -> bool:
            return hmac.compare_digest(e.encode(), t)

        if self.evaluator_token and same(self.evaluator_token):
            return "current"
        joined = next((e for e in self.joined_evaluator_tokens if same(e)), None)
        if joined is not None:
            self.joined_evaluator_tokens.remove(joined)
            if self.evaluator_token:
                self.superseded_evaluator_tokens.append(self.evaluator_token)
            self.evaluator_token = joined
            return "current"
        if any(same(e) for e in self.superseded_evaluator_tokens):
            return "superseded"
        return "unknown"

    def check_pause(self) -> bool:
        """End a pause that has lasted ``evaluator.pause_timeout_s``; True if it did."""
        held = self.pause.held
        length = self.pause.expired(self.clock())
        if length is None:
            return False
        self._shift_clock(length)
        log.warning("no measurement of version %s from the evaluator within evaluator.pause_timeout_s=%s: "
                    "training goes on, and pauses again once the evaluator reports", held,
                    self.pause.timeout_s)
        self.events.append({"event": "evaluator_pause_timeout", "version": held,
                            "timeout_s": self.pause.timeout_s})
        return True

    def _resume(self, now: float) -> None:
        self._shift_clock(self.pause.release(now))

    def _shift_clock(self, paused: float) -> None:
        """Leave ``paused`` seconds out of elapsed time and of the current iteration's duration."""
        self.start_time += paused
        self.last_update_time += paused

    def elapsed(self) -> float:
        if not self.started:
            return 0.0
        now = self.clock()
        return now - self.start_time - self.pause.ongoing(now)
