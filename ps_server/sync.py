"""Sync policies: which gradients make up the next update, and when a pull may be answered.

One commit rule for every shard (DESIGN.md section 3): only the coordinator decides, and only
over *complete* gradients, those that every shard holds. A policy picks the set that makes up
the next version; every shard then applies exactly that set. A gradient that reached only some
shards is never applied anywhere.

- ``bsp``: iteration t commits once every worker still in t's plan is complete: all of them.
- ``backup``: N + b workers run; iteration t commits as soon as N of its plan's workers are
  complete (all that remain, after losses): the first N to complete. The others are dropped and
  their samples go back to the pool.
- ``asp``: every complete gradient is its own update, at learning-rate scale x_i / X; pulls
  are answered at once.
- ``ssp``: as asp, and a worker asking to start clock c waits until every live worker's
  committed clock is >= c - s.

Pure decision logic over plain data: no sockets, no clocks. Every update is
g = sum(x_i g_i) / sum(x_i) over its set, so it is the mean gradient of its samples.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Iterable, Mapping, Sequence


class SyncPolicy(ABC):
    name = ""
    #: One plan per global iteration (a barrier) rather than per-worker clocks.
    round_based = True

    @property
    def consistent_pulls(self) -> bool:
        """Must a worker see one version on every shard? (Round modes; async ones take the
        latest slice of each shard.)"""
        return self.round_based

    def stats(self) -> dict[str, Any]:
        return {}


class RoundPolicy(SyncPolicy):
    round_based = True

    @abstractmethod
    def accept(self, members: Sequence[int], complete: Sequence[int]) -> list[int] | None:
        """The workers that make up the iteration, or None to keep waiting.

        ``members``: the plan's workers still counted (a lost worker whose gradient was not
        complete is no longer one). ``complete``: the members whose gradient every shard
        holds, in the order they completed.
        """


class BSP(RoundPolicy):
    """Wait for every member; the plan's batch sizes add up to X."""

    name = "bsp"

    def accept(self, members: Sequence[int], complete: Sequence[int]) -> list[int] | None:
        if not members or not set(complete) >= set(members):
            return None
        return sorted(members)


class Backup(RoundPolicy):
    """Backup workers (Chen et al. 2016): the first ``required`` complete gradients win."""

    name = "backup"

    def __init__(self, required: int) -> None:
        if required < 1:
            raise ValueError("backup: required workers must be >= 1")
        self.required = required

    def accept(self, members: Sequence[int], complete: Sequence[int]) -> list[int] | None:
        need = min(self.required, len(members))
        if need == 0 or len(complete) < need:
            return None
        return sorted(complete[:need])


class AsyncPolicy(SyncPolicy):
    round_based = False

    def pull_ready(self, clocks: Mapping[int, int], live: Iterable[int], clock: int) -> bool:
        """May a worker start clock ``clock``, given every live worker's committed clock?"""
        return True


class ASP(AsyncPolicy):
    """Apply each gradient on its own as soon as it is complete; never wait."""

    name = "asp"


class SSP(AsyncPolicy):
    """Stale synchronous parallel (Ho et al. 2013) with staleness bound ``s``."""

    name = "ssp"

    def __init__(self, staleness: int = 5) -> None:
        if staleness < 0:
            raise ValueError("ssp: staleness must be >= 0")
        self.staleness = staleness

    def pull_ready(self, clocks: Mapping[int, int], live: Iterable[int], clock: int) -> bool:
        slowest = min((clocks.get(w, 0) for w in live), default=clock)
        return slowest >= clock - self.staleness


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
