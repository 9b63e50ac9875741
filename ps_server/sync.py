"""Sync policies: which gradients make up the next update, and when a pull may be answered.

One commit rule for every shard (DESIGN.md section 3): only the coordinator decides, and only
over *complete* gradients, those that every shard holds. A policy picks the set that makes up
the next version; every shard then applies exactly that set. A gradient that reached only some
shards is never applied anywhere.

- ``bsp``: iteration t commits once every worker still in t's plan is complete: all of them.
- ``backup``: N + b workers run; iteration t commits as soon as N of its plan's workers are
  complete (all that remain, after losses): the first N to complete. The others are dropped and
  their samples go back to the pool.
- ``flexrr``: as bsp, and within an iteration a worker done with its share takes over
  chunks of a straggler's (FlexRR, Harlap et al. 2016; :mod:`ps_server.chunks`): every worker
  then pushes the gradient of the samples it was granted, which may be more or fewer than
  planned; together they are still the iteration's X samples.
- ``asp``: every complete gradient is its own update, at learning-rate scale x_i / X; pulls
  are answered at once.
- ``ssp``: as asp, and a worker asking to start clock c waits until every live worker's
  committed clock is >= c - s.

A mode is one class in :data:`SYNC_POLICIES`. Everything outside this module that depends on
the mode asks its policy a named question (``plans_rounds``, ``consistent_pulls``,
``assignment_key``, ``pull_answerable``, ``planned_total``, ``from_config``) instead of
testing the mode's name, so adding a mode is adding a class: a round mode subclasses
:class:`RoundPolicy` (and says whom an iteration accepts), an async one :class:`AsyncPolicy`
(and says when a worker may start its next clock).

Pure decision logic over plain data: no sockets, no clocks. Every update is
g = sum(x_i g_i) / sum(x_i) over its set, so it is the mean gradient of its samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Iterable, Mapping, Sequence

from ps_common.config import JobConfig
from ps_common.registry import Registry

#: The slowest committed clock when no worker is live: no read waits for anyone.
NO_LIVE_WORKER = 1 << 62


class SyncPolicy(ABC):
    """What every part of the system may ask about the job's sync mode."""

    name: ClassVar[str] = ""

    #: How the next assignment is planned. True (round modes): one plan per global iteration
    #: gives every live worker its batch size and samples; it is cut when the iteration before
    #: it commits, the followers check each push against it, and a commit closes its iteration
    #: (what arrives for it later is late). False (async modes): each worker's next assignment
    #: is cut when it asks for it, keyed by its own clock, and every complete gradient that
    #: matches one is its own commit.
    plans_rounds: ClassVar[bool]

    #: Must a worker (or the evaluator) see one version, with one history, on every shard? Else
    #: it takes each shard's newest slice. Shard 0 tells them in its Welcome.
    consistent_pulls: ClassVar[bool]

    @classmethod
    def from_config(cls, cfg: JobConfig) -> "SyncPolicy":
        """The policy a job config asks for; ``ValueError`` naming the key for a setting that
        cannot work with this mode."""
        return cls()

    @abstractmethod
    def assignment_key(self, version: int, clock: int) -> int:
        """Which assignment answers a worker's pull (and where a joining worker starts): the
        shard's ``version`` in round modes (every worker is in the current iteration), the
        worker's own ``clock`` (its next one) in async modes."""

    @abstractmethod
    def pull_answerable(self, *, version: int, min_version: int, settled: int, after_push: bool) -> bool:
        """May a shard at ``version`` answer a pull for ``min_version`` now? ``settled``: the
        worker's own gradients this shard has applied or dropped, up to that clock;
        ``after_push``: the pull rides on a push that this shard accepted."""

    #: Round modes: chunks per worker that others may take over within an iteration (FlexRR);
    #: 0: each worker computes exactly its planned samples.
    reassign_chunks: int = 0

    #: Does :meth:`admits` ever hold a read back? (shard 0 then tells the followers the
    #: slowest clock, in ``Clocks`` messages, so that they hold by the same rule)
    gates_reads: ClassVar[bool] = False

    def admits(self, slowest: int, clock: int) -> bool:
        """May a worker read the parameters for clock ``clock`` when the slowest live worker's
        committed clock is ``slowest`` (:data:`NO_LIVE_WORKER` when none is live)? The one rule
        for shard 0's assignments and the followers' answers (async modes; round modes read at
        the barrier)."""
        return True

    def planned_total(self, global_batch: int, workers: int) -> int:
        """How many samples a split over ``workers`` workers hands out for a global batch X."""
        return global_batch

    def largest_push(self, planned: int, plan_total: int) -> int:
        """The most samples a push may carry for a worker planned ``planned`` of the plan's
        ``plan_total`` (a follower's check; the coordinator completes a gradient only at the size
        it granted, so a forged size within this bound is held and never applied)."""
        return planned


class RoundPolicy(SyncPolicy):
    """One plan per global iteration; the policy says which complete members make it up."""

    plans_rounds = True
    consistent_pulls = True

    def assignment_key(self, version: int, clock: int) -> int:
        return version

    def pull_answerable(self, *, version: int, min_version: int, settled: int, after_push: bool) -> bool:
        return version >= min_version  # the barrier: the iteration before it has committed

    @abstractmethod
    def accept(self, members: Sequence[int], complete: Sequence[int]) -> list[int] | None:
        """The workers that make up the iteration, or None to keep waiting.

        ``members``: the plan's workers still counted (a lost worker whose gradient was not
        complete is no longer one). ``complete``: the members whose gradient every shard
        holds, in the order they completed.
        """


class AsyncPolicy(SyncPolicy):
    """Per-worker clocks; the policy says when a worker may start its next one."""

    plans_rounds = False
    consistent_pulls = False

    def assignment_key(self, version: int, clock: int) -> int:
        return clock

    def pull_answerable(self, *, version: int, min_version: int, settled: int, after_push: bool) -> bool:
        return not after_push or settled >= min_version  # a worker reads its own writes

    def pull_ready(self, clocks: Mapping[int, int], live: Iterable[int], clock: int) -> bool:
        """May a worker start clock ``clock``, given every live worker's committed clock?"""
        return self.admits(min((clocks.get(w, 0) for w in live), default=NO_LIVE_WORKER), clock)


#: Every sync mode, by the name ``mode.sync`` gives.
SYNC_POLICIES: Registry[type[SyncPolicy]] = Registry("sync policy", base=SyncPolicy)


@SYNC_POLICIES.register("bsp")
class BSP(RoundPolicy):
    """Wait for every member; the plan's batch sizes add up to X."""

    def accept(self, members: Sequence[int], complete: Sequence[int]) -> list[int] | None:
        if not members or not set(complete) >= set(members):
            return None
        return sorted(members)


@SYNC_POLICIES.register("flexrr")
class FlexRR(BSP):
    """BSP with FlexRR-style reassignment: helpers take a straggler's unclaimed chunks."""

    def __init__(self, chunks: int = 8) -> None:
        if chunks < 2:
            raise ValueError("flexrr: reassign_chunks must be >= 2")
        self.reassign_chunks = chunks

    @classmethod
    def from_config(cls, cfg: JobConfig) -> "FlexRR":
        return cls(chunks=cfg.mode.reassign_chunks)

    def largest_push(self, planned: int, plan_total: int) -> int:
        return plan_total  # a helper may have computed chunks of every other worker


@SYNC_POLICIES.register("backup")
class Backup(RoundPolicy):
    """Backup workers (Chen et al. 2016): the first ``required`` complete gradients win."""

    def __init__(self, required: int) -> None:
        if required < 1:
            raise ValueError("backup: required workers must be >= 1")
        self.required = required

    @classmethod
    def from_config(cls, cfg: JobConfig) -> "Backup":
        b, n = cfg.mode.backup_workers, cfg.cluster.num_workers
        if b >= n:
            raise ValueError(f"mode.backup_workers ({b}) must be below cluster.num_workers ({n}): "
                             "N + b workers run, N are waited for")
        return cls(required=n - b)

    def planned_total(self, global_batch: int, workers: int) -> int:
        """Each of the N + b workers gets a share of X / N, so the first N add up to X."""
        return max(workers, round(global_batch * workers / self.required))

    def accept(self, members: Sequence[int], complete: Sequence[int]) -> list[int] | None:
        need = min(self.required, len(members))
        if need == 0 or len(complete) < need:
            return None
        return sorted(complete[:need])


@SYNC_POLICIES.register("asp")
class ASP(AsyncPolicy):
    """Apply each gradient on its own as soon as it is complete; never wait."""


@SYNC_POLICIES.register("ssp")
class SSP(AsyncPolicy):
    """Stale synchronous parallel (Ho et al. 2013) with staleness bound ``s``."""

    def __init__(self, staleness: int = 5) -> None:
        if staleness < 0:
            raise ValueError("ssp: staleness must be >= 0")
        self.staleness = staleness

    @classmethod
    def from_config(cls, cfg: JobConfig) -> "SSP":
        return cls(staleness=cfg.mode.staleness)

    gates_reads = True

    def admits(self, slowest: int, clock: int) -> bool:
        return slowest >= clock - self.staleness


def sync_policy_for(cfg: JobConfig) -> SyncPolicy:
    """The sync policy of a job (``mode.sync`` with the mode's own settings)."""
    return SYNC_POLICIES.get(cfg.mode.sync).from_config(cfg)
