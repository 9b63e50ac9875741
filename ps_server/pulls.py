"""Pulls waiting for a version: bounded per peer and overall, scanned only when state changes."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, TypeVar

from ps_server.router import Refused

R = TypeVar("R")


@dataclass
class PendingPull:
    ident: bytes
    worker_id: int
    min_version: int
    exact: bool = False
    after_push: bool = False  # rides on a push: async modes answer once that push is settled
    since: float = field(default_factory=time.monotonic)
    explained: bool = False  # a long wait has been logged with its reason


class PendingPulls:
    """A legitimate peer waits on one pull at a time (two while a re-pull crosses an answer);
    ``per_peer`` and ``total`` bound what a misbehaving one can make the server hold."""

    def __init__(self, per_peer: int, total: int) -> None:
        self.per_peer = per_peer
        self.total = total
        self._pulls: list[PendingPull] = []
        self._per_ident: Counter[bytes] = Counter()

    def __len__(self) -> int:
        return len(self._pulls)

    def add(self, pull: PendingPull) -> None:
        if self._per_ident[pull.ident] >= self.per_peer:
            raise Refused("too_many_pulls", f"at most {self.per_peer} pulls may wait per connection")
        if len(self._pulls) >= self.total:
            raise Refused("too_many_pulls", f"the server holds {self.total} waiting pulls already")
        self._pulls.append(pull)
        self._per_ident[pull.ident] += 1

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
                self._per_ident[p.ident] -= 1
                if not self._per_ident[p.ident]:
                    del self._per_ident[p.ident]
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
        return out
