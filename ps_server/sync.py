"""Sync policies: when a shard applies gradients and when it answers a pull.

Pure decision logic over plain data (no sockets, no clocks): the server's I/O loop feeds pushes
and commits in and carries out what the policy returns. Rules (DESIGN.md section 3):

- ``bsp``: apply once every worker of iteration t's plan has pushed; pulls wait for t+1.
- ``asp``: apply each gradient on arrival, scaled by x_i / X; pulls answered at once.
- ``ssp``: as ASP, but a worker at clock c is answered only when the slowest live worker's
  clock is >= c - s (enforced by the coordinator, which knows who is live).
- ``backup``: N + b workers; the first N gradients of a version are applied, later ones are
  dropped and counted. The coordinator (shard 0) picks the N and commits that choice to the
  other shards, so every shard aggregates the same set.

Every policy weights by batch size: an update is g = sum(x_i g_i) / sum(x_i) applied with
learning-rate scale sum(x_i) / X, which is 1 whenever the accepted batches add up to X.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

import numpy as np


class PushRejected(ValueError):
    """A push that must not touch state (duplicate, inconsistent, ...); ``code`` for the reply."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass
class PendingGradient:
    worker_id: int
    batch_size: int
    grad: np.ndarray  # read-only view of the received frame


@dataclass
class Apply:
    """Aggregate these gradients (weighted by batch size) into one update."""

    iteration: int
    gradients: list[PendingGradient]
    global_batch: int

    @property
    def samples(self) -> int:
        return sum(g.batch_size for g in self.gradients)

    @property
    def lr_scale(self) -> float:
        return self.samples / self.global_batch

    @property
    def workers(self) -> list[int]:
        return [g.worker_id for g in self.gradients]


@dataclass
class PushOutcome:
    """What a push led to: updates to apply now, and gradients dropped as late."""

    applies: list[Apply] = field(default_factory=list)
    dropped: int = 0


class SyncPolicy(ABC):
    name = ""
    #: "round": one plan per global iteration (BSP, backup); "async": per-worker clocks.
    kind = "round"

    @abstractmethod
    def on_push(self, version: int, worker_id: int, iteration: int, batch_size: int,
                expected_workers: int, global_batch: int, grad: np.ndarray) -> PushOutcome:
        """Record a push; return what to apply now. Raises PushRejected for bad pushes."""

    def on_commit(self, version: int, iteration: int, accepted: Mapping[int, int],
                  global_batch: int) -> PushOutcome:
        """The coordinator fixed iteration ``iteration``'s accepted {worker: batch size}."""
        return PushOutcome()

    def pull_ready(self, version: int, worker_id: int, min_version: int) -> bool:
        """May a pull asking for ``min_version`` be answered at the current ``version``?"""
        return version >= min_version

    def set_live(self, workers: Iterable[int]) -> None:
        """Membership changed (coordinator only)."""

    @abstractmethod
    def reset(self) -> None:
        """Forget everything in flight (after a rollback to a checkpoint)."""

    def stats(self) -> dict[str, Any]:
        return {}


class _Round(SyncPolicy):
    """Shared bookkeeping of policies that aggregate one iteration at a time.

    Gradients are held (as zero-copy views) until the iteration's accepted set is known, then
    summed in worker-id order, so the result does not depend on arrival order. A commit from
    the coordinator overrides the plan (a backup-worker choice, or a lost worker left out).
    """

    def __init__(self) -> None:
        self.dropped_late = 0
        self.reset()

    def reset(self) -> None:
        self.iteration = -1
        self.expected = 0
        self.global_batch = 0
        self.pending: dict[int, PendingGradient] = {}
        self.commit: dict[int, int] | None = None
        self.future_commits: dict[int, dict[int, int]] = {}

    def _start(self, iteration: int, expected: int, global_batch: int) -> None:
        """Begin collecting ``iteration``; a plan of (0, 0) is learnt from its first push."""
        self.iteration, self.pending = iteration, {}
        self.expected, self.global_batch = expected, global_batch
        self.commit = self.future_commits.pop(iteration, None)
        self.future_commits = {t: c for t, c in self.future_commits.items() if t > iteration}

    def _check(self, version: int, worker_id: int, iteration: int, batch_size: int,
               expected_workers: int, global_batch: int) -> bool:
        """False for a late push (to drop); raises for a malformed one."""
        if batch_size <= 0 or expected_workers <= 0 or global_batch <= 0:
            raise PushRejected("bad_plan", "batch sizes and worker counts must be positive")
        if iteration < version:
            self.dropped_late += 1
            return False
        if iteration > version:
            raise PushRejected("future", f"push for iteration {iteration} at version {version}")
        if self.iteration != iteration:
            self._start(iteration, expected_workers, global_batch)
        elif self.expected == 0:
            self.expected, self.global_batch = expected_workers, global_batch
        elif (expected_workers, global_batch) != (self.expected, self.global_batch):
            raise PushRejected(
                "bad_plan",
                f"plan mismatch for iteration {iteration}: ({expected_workers}, {global_batch}) "
                f"vs ({self.expected}, {self.global_batch})")
        if worker_id in self.pending:
            raise PushRejected("duplicate", f"worker {worker_id} already pushed iteration {iteration}")
        return True

    def _apply(self, workers: Iterable[int]) -> Apply:
        # A round's update is the weighted mean over the accepted gradients at the full learning
        # rate: the whole plan (sum = X) normally, fewer samples when a commit left some out.
        grads = [self.pending[w] for w in sorted(workers)]
        a = Apply(self.iteration, grads, sum(g.batch_size for g in grads))
        self.pending, self.commit = {}, None
        return a

    def _try_commit(self) -> PushOutcome:
        if self.commit is not None and all(w in self.pending for w in self.commit):
            extra = len(self.pending) - len(self.commit)
            self.dropped_late += extra
            return PushOutcome([self._apply(self.commit)], extra)
        return PushOutcome()

    def on_commit(self, version, iteration, accepted, global_batch):
        if iteration < version:
            return PushOutcome()  # already applied (the plan completed on its own)
        if iteration > version:
            self.future_commits[iteration] = dict(accepted)
            return PushOutcome()
        if self.iteration != iteration:
            self._start(iteration, 0, 0)
        self.commit = dict(accepted)
        return self._try_commit()

    def stats(self):
        return {"dropped_late": self.dropped_late}


class BSP(_Round):
    """Apply once every worker of iteration t's plan has pushed; pulls wait for version t+1.

    The plan (how many workers, global batch) travels with each push, so every shard knows when
    the iteration is complete without a round trip to the coordinator.
    """

    name = "bsp"

    def on_push(self, version, worker_id, iteration, batch_size, expected_workers, global_batch, grad):
        if not self._check(version, worker_id, iteration, batch_size, expected_workers, global_batch):
            return PushOutcome(dropped=1)
        total = sum(p.batch_size for p in self.pending.values()) + batch_size
        if self.commit is None and (total > self.global_batch or len(self.pending) + 1 > self.expected):
            raise PushRejected("bad_plan", f"iteration {iteration} over-subscribed")
        self.pending[worker_id] = PendingGradient(worker_id, batch_size, grad)
        if self.commit is not None:
            return self._try_commit()
        if len(self.pending) == self.expected:
            if total != self.global_batch:
                self.pending.pop(worker_id)
                raise PushRejected("bad_plan", f"batch sizes sum to {total}, plan says {self.global_batch}")
            return PushOutcome([self._apply(self.pending)])
        return PushOutcome()


class Backup(_Round):
    """Backup workers (Chen et al. 2016): the first ``required`` gradients of a version win.

    On the coordinator's shard (``leader``) the first ``required`` pushes are applied at once and
    the applied set (the update's gradients) is what the server commits to the other shards;
    followers wait for that commit. Later pushes for an applied version are dropped and counted.
    """

    name = "backup"

    def __init__(self, required: int, leader: bool = True) -> None:
        super().__init__()
        if required < 1:
            raise ValueError("backup: required workers must be >= 1")
        self.required = required
        self.leader = leader

    def on_push(self, version, worker_id, iteration, batch_size, expected_workers, global_batch, grad):
        if not self._check(version, worker_id, iteration, batch_size, expected_workers, global_batch):
            return PushOutcome(dropped=1)
        self.pending[worker_id] = PendingGradient(worker_id, batch_size, grad)
        if self.commit is not None:
            return self._try_commit()
        if self.leader and len(self.pending) >= min(self.required, self.expected):
            return PushOutcome([self._apply(self.pending)])
        return PushOutcome()


class ASP(SyncPolicy):
    """Apply each gradient on arrival with learning-rate scale x_i / X; never wait."""

    name = "asp"
    kind = "async"

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.clocks: dict[int, int] = {}

    def on_push(self, version, worker_id, iteration, batch_size, expected_workers, global_batch, grad):
        if batch_size <= 0 or global_batch <= 0:
            raise PushRejected("bad_plan", "batch sizes must be positive")
        if iteration < self.clocks.get(worker_id, 0):
            raise PushRejected("duplicate", f"worker {worker_id} already pushed clock {iteration}")
        self.clocks[worker_id] = iteration + 1
        return PushOutcome([Apply(iteration, [PendingGradient(worker_id, batch_size, grad)], global_batch)])

    def pull_ready(self, version, worker_id, min_version):
        return True


class SSP(ASP):
    """Stale synchronous parallel (Ho et al. 2013) with staleness bound ``s``.

    A worker asking to start clock c waits until every live worker has clock >= c - s. Only the
    coordinator knows who is live (``set_live``); shards without that knowledge answer at once,
    which is safe because a worker cannot start before the coordinator has answered it too.
    """

    name = "ssp"

    def __init__(self, staleness: int = 5) -> None:
        super().__init__()
        if staleness < 0:
            raise ValueError("ssp: staleness must be >= 0")
        self.staleness = staleness

    def reset(self) -> None:
        super().reset()
        self.live: set[int] | None = None

    def set_live(self, workers):
        """A newcomer starts at the slowest live worker's clock (as the coordinator assigns)."""
        old = self.live or set()
        base = min((self.clocks.get(w, 0) for w in old), default=0)
        self.live = set(workers)
        for w in self.live - old:
            self.clocks.setdefault(w, base)

    def pull_ready(self, version, worker_id, min_version):
        if self.live is None or worker_id < 0:
            return True
        slowest = min((self.clocks.get(w, 0) for w in self.live), default=min_version)
        return slowest >= min_version - self.staleness


_REGISTRY: dict[str, Callable[..., SyncPolicy]] = {"bsp": BSP, "asp": ASP, "ssp": SSP, "backup": Backup}


def sync_policy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_sync_policy(name: str, **args: Any) -> SyncPolicy:
    try:
        cls = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown sync policy {name!r}; known: {', '.join(sync_policy_names())}") from None
    try:
        return cls(**args)
    except TypeError as exc:
        raise ValueError(f"sync policy {name!r}: bad arguments {args}: {exc}") from None
