"""Pulls waiting for a version: bounded per connection, per member and for everyone else; scanned
only when state changes."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from ps_server.router import Refused

R = TypeVar("R")
K = TypeVar("K")


@dataclass
class PendingPull:
    ident: bytes
    worker_id: int
    min_version: int
    exact: bool = False
    after_push: bool = False  # rides on a push: async modes answer once that push is settled
    since: float = field(default_factory=time.monotonic)
    explained: bool = False  # a long wait has been logged with its reason


def _bump(counter: Counter[K], key: K, step: int) -> None:
    counter[key] += step
    if not counter[key]:
        del counter[key]


class PendingPulls:
    """Pulls waiting for an answer, with bounds a misbehaving client cannot turn against the
    members. A legitimate peer waits on one pull at a time (two while a re-pull crosses an
    answer); every connection holds at most ``per_peer``. A member's pulls (a worker id whose
    token was checked) are also bounded by ``per_peer`` per worker id, so the members' pulls are
    bounded by the membership; pulls without a worker id (the evaluator, observers: anyone with
    a credential) share ``others``, so that no flood of pulls that never come due can take the
    room the members' push-and-pulls need."""

    def __init__(self, per_peer: int, others: int) -> None:
        self.per_peer = per_peer
        self.others = others
        self._pulls: list[PendingPull] = []
        self._per_ident: Counter[bytes] = Counter()
        self._per_worker: Counter[int] = Counter()
        self._anonymous = 0

    def __len__(self) -> int:
        return len(self._pulls)

    def check_room(self, ident: bytes, worker_id: int) -> None:
        """Refuse (``too_many_pulls``) a pull that would pass a bound; checked before a push
        whose pull rides on it is held, so that a refused push holds nothing."""
        if self._per_ident[ident] >= self.per_peer:
            raise Refused("too_many_pulls", f"at most {self.per_peer} pulls may wait per connection")
        if worker_id >= 0:
            if self._per_worker[worker_id] >= self.per_peer:
                raise Refused("too_many_pulls", f"at most {self.per_peer} pulls may wait per worker")
        elif self._anonymous >= self.others:
            raise Refused("too_many_pulls", f"the server holds {self.others} waiting pulls without a "
                                            "worker id already")

    def add(self, pull: PendingPull) -> None:
        self.check_room(pull.ident, pull.worker_id)
        self._pulls.append(pull)
        self._count(pull, 1)

    def _count(self, pull: PendingPull, step: int) -> None:
        _bump(self._per_ident, pull.ident, step)
        if pull.worker_id >= 0:
            _bump(self._per_worker, pull.worker_id, step)
        else:
            self._anonymous += step

    def take_ready(self, answer: Callable[[PendingPull], R | None]) -> list[tuple[PendingPull, R]]:
        """Remove and return the pulls that ``answer`` can answer now, with their answers."""
        if not self._pulls:
            return []
        out, still = [], []
        for p in self._pulls:
            reply = answer(p)
            if reply is None:
                still.append(p)
            else:
                out.append((p, reply))
                self._count(p, -1)
        self._pulls = still
        return out

    def waiting_longer_than(self, seconds: float, now: float) -> list[PendingPull]:
        """Pulls that have waited over ``seconds`` and were not reported yet (each once)."""
        out = [p for p in self._pulls if not p.explained and now - p.since > seconds]
        for p in out:
            p.explained = True
        return out

    def clear(self) -> list[PendingPull]:
        out, self._pulls = self._pulls, []
        self._per_ident.clear()
        self._per_worker.clear()
        self._anonymous = 0
        return out
