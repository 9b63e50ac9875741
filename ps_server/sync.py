"""Sync policies: when a shard applies gradients and when it answers a pull.

Pure decision logic over plain data (no sockets, no clocks): the server's I/O loop feeds pushes
in and carries out what the policy returns. Only BSP exists so far; ASP, SSP and backup
workers plug into the same interface and registry.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable

import numpy as np


class PushRejected(ValueError):
    """A push that must not touch state (stale, duplicate, inconsistent); ``code`` for the reply."""

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


class SyncPolicy(ABC):
    name = ""

    @abstractmethod
    def on_push(self, version: int, worker_id: int, iteration: int, batch_size: int,
                expected_workers: int, global_batch: int, grad: np.ndarray) -> list[Apply]:
        """Record a push; return the updates to apply now (in order). Raises PushRejected."""

    @abstractmethod
    def pull_ready(self, version: int, worker_id: int, min_version: int) -> bool:
        """May a pull asking for ``min_version`` be answered at the current ``version``?"""


class BSP(SyncPolicy):
    """Apply once every worker of iteration t's plan has pushed; pulls wait for version t+1.

    The plan (how many workers, global batch) travels with each push, so every shard knows when
    the iteration is complete without a round trip to the coordinator. Gradients are summed in
    worker-id order, so the result does not depend on arrival order (bit-reproducible runs).
    """

    name = "bsp"

    def __init__(self) -> None:
        self.iteration = -1
        self.expected = 0
        self.global_batch = 0
        self.pending: dict[int, PendingGradient] = {}

    def on_push(self, version, worker_id, iteration, batch_size, expected_workers, global_batch,
                grad):
        if iteration != version:
            kind = "stale" if iteration < version else "future"
            raise PushRejected(kind, f"push for iteration {iteration} at version {version}")
        if batch_size <= 0 or expected_workers <= 0 or global_batch <= 0:
            raise PushRejected("bad_plan", "batch sizes and worker counts must be positive")
        if self.iteration != iteration:
            self.iteration, self.pending = iteration, {}
            self.expected, self.global_batch = expected_workers, global_batch
        elif (expected_workers, global_batch) != (self.expected, self.global_batch):
            raise PushRejected(
                "bad_plan",
                f"plan mismatch for iteration {iteration}: ({expected_workers}, {global_batch}) "
                f"vs ({self.expected}, {self.global_batch})",
            )
        if worker_id in self.pending:
            raise PushRejected("duplicate", f"worker {worker_id} already pushed iteration {iteration}")
        total = sum(p.batch_size for p in self.pending.values()) + batch_size
        if total > self.global_batch or len(self.pending) + 1 > self.expected:
            raise PushRejected("bad_plan", f"iteration {iteration} over-subscribed")
        self.pending[worker_id] = PendingGradient(worker_id, batch_size, grad)
        if len(self.pending) == self.expected:
            if total != self.global_batch:
                self.pending.pop(worker_id)
                raise PushRejected("bad_plan", f"batch sizes sum to {total}, plan says {self.global_batch}")
            grads = [self.pending[w] for w in sorted(self.pending)]
            self.pending = {}
            return [Apply(iteration, grads)]
        return []

    def pull_ready(self, version, worker_id, min_version):
        return version >= min_version


_REGISTRY: dict[str, Callable[[], SyncPolicy]] = {"bsp": BSP}


def sync_policy_names() -> list[str]:
    return sorted(_REGISTRY)


def get_sync_policy(name: str) -> SyncPolicy:
    try:
        return _REGISTRY[name]()
    except KeyError:
        raise ValueError(f"unknown sync policy {name!r}; known: {', '.join(sync_policy_names())}") from None
