"""Who is live: one owner changes it, everything else reads it.

The coordinator owns the job's membership (joins, leaves, rejoins, evictions); its
BatchSizeManager and its sync policy read the same object, so nothing has to be kept in step
by hand. A manager used on its own (a DDP job, the ps-bsm service, a simulation) owns one itself.

A member is a record with a ``name``: a stable identity (a worker that rejoins under a new id
keeps it; memory caps are keyed by it). Readers that hold per-worker state subscribe and hear
every change in order: a join once the member is in, a leave while it still is (so what they
keep of it can still be read). Listeners are held weakly: a membership never keeps its readers
alive (a manager whose policy runs a refit process goes as soon as it is dropped).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Generic, ItemsView, Iterator, Mapping, Protocol, TypeVar

import numpy as np


class Named(Protocol):
    @property
    def name(self) -> str: ...


@dataclass(frozen=True)
class Member:
    """The plain record of a member when the owner keeps nothing else about it."""

    name: str


class MembershipListener(Protocol):
    def member_joined(self, worker_id: int, name: str) -> None: ...

    def member_leaving(self, worker_id: int, name: str) -> None: ...


R = TypeVar("R", bound=Named)


class Membership(Generic[R]):
    """The live workers by id, each with its owner's record."""

    def __init__(self) -> None:
        self._records: dict[int, R] = {}
        self._ids_of: dict[str, set[int]] = {}
        self._sorted: tuple[np.ndarray, list[int]] | None = None
        self._listeners: list[weakref.ref[MembershipListener]] = []

    def subscribe(self, listener: MembershipListener) -> None:
        self._listeners.append(weakref.ref(listener))

    def _live_listeners(self) -> list[MembershipListener]:
        alive = [x for x in (ref() for ref in self._listeners) if x is not None]
        if len(alive) < len(self._listeners):
            self._listeners = [ref for ref in self._listeners if ref() is not None]
        return alive

    # ----- changes (the owner's) -----------------------------------------------------------
    def join(self, worker_id: int, record: R) -> bool:
        """Add a member; False (and nothing changes) if ``worker_id`` already is one."""
        w = int(worker_id)
        if w in self._records:
            return False
        self._records[w] = record
        self._ids_of.setdefault(record.name, set()).add(w)
        self._sorted = None
        for listener in self._live_listeners():
            listener.member_joined(w, record.name)
        return True

    def leave(self, worker_id: int) -> R | None:
        """Remove a member; its record, or None if ``worker_id`` was not one."""
        w = int(worker_id)
        record = self._records.get(w)
        if record is None:
            return None
        for listener in self._live_listeners():
            listener.member_leaving(w, record.name)
        del self._records[w]
        ids = self._ids_of[record.name]
        ids.discard(w)
        if not ids:
            del self._ids_of[record.name]
        self._sorted = None
        return record

    def restore(self, records: Mapping[int, R]) -> None:
        """Replace every member at once, telling no listener: for a checkpoint that restores
        the listeners' own state with them."""
        self._records.clear()
        self._ids_of.clear()
        for w, record in records.items():
            self._records[int(w)] = record
            self._ids_of.setdefault(record.name, set()).add(int(w))
        self._sorted = None

    def clear(self) -> None:
        """Everyone leaves (a resumed coordinator: workers join again)."""
        for w in list(self._records):
            self.leave(w)

    # ----- reading --------------------------------------------------------------------------
    @property
    def records(self) -> Mapping[int, R]:
        """id -> record, live (not a copy: a reader on a hot path keeps it and tests ``in``)."""
        return self._records

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._records

    def __len__(self) -> int:
        return len(self._records)

    def __iter__(self) -> Iterator[int]:
        return iter(self._records)

    def get(self, worker_id: int) -> R | None:
        return self._records.get(worker_id)

    def __getitem__(self, worker_id: int) -> R:
        return self._records[worker_id]

    def name_of(self, worker_id: int) -> str | None:
        record = self._records.get(worker_id)
        return None if record is None else record.name

    def names(self) -> ItemsView[str, set[int]]:
        """(name, its live ids) for every name a live worker has."""
        return self._ids_of.items()

    def ids_named(self, name: str) -> set[int]:
        """The live ids under ``name`` (usually one; empty if none)."""
        return self._ids_of.get(name, set())

    def ids(self) -> list[int]:
        """Live ids, sorted (cached until the next change: do not modify)."""
        return self.sorted_ids()[1]

    def sorted_ids(self) -> tuple[np.ndarray, list[int]]:
        """Live ids, sorted, as an int64 array and a list; the same objects until the next change."""
        if self._sorted is None:
            ids = sorted(self._records)
            self._sorted = (np.array(ids, dtype=np.int64), ids)
        return self._sorted
