"""Worker id -> row ("slot") of per-worker numpy state.

Vectorised policies and predictors keep one row per worker in preallocated arrays instead of one
Python object per worker, so that an iteration's reports update every worker with a handful of
numpy operations. A slot is handed out on join (or on the first sight of an id), reset by its
owner, and recycled after a leave; capacity doubles when it runs out. Looking up many ids costs one
gather for ids in [0, 2**22) (the ids this project hands out) and a dict lookup for the others; a
few ids (a small decision's reports) are looked up in the dict alone, with no numpy call.
"""

from __future__ import annotations

import operator
import weakref
from typing import Callable

import numpy as np

_LUT_MAX = 1 << 22


class SlotTable:
    """Map worker ids to reusable rows.

    ``grow(capacity)`` is called before a slot beyond the current capacity is handed out (the owner
    resizes its arrays); ``init(slots, ids)`` is called for every newly handed-out slot (the owner
    resets those rows).
    """

    def __init__(self, grow: Callable[[int], None], init: Callable[[np.ndarray, np.ndarray], None],
                 capacity: int = 16) -> None:
        # weak references: the owner holds the table, the table must not keep the owner alive
        # (a policy with a refit process is then released as soon as it is dropped)
        self._grow_ref = weakref.WeakMethod(grow) if hasattr(grow, "__self__") else (lambda: grow)
        self._init_ref = weakref.WeakMethod(init) if hasattr(init, "__self__") else (lambda: init)
        self.capacity = 0
        self._lut = np.full(0, -1, dtype=np.int64)
        self._slot_of: dict[int, int] = {}            # every id with a slot (the LUT mirrors ids < 2**22)
        self._ids = np.zeros(0, dtype=np.int64)        # slot -> worker id
        self._used = np.zeros(0, dtype=bool)
        self._free: list[int] = []
        self._next = 0                                  # slots below have been handed out once
        self.version = 0                                # bumped on every add/remove
        self._reserve(capacity)

    # ----- capacity -------------------------------------------------------------------------
    def _reserve(self, capacity: int) -> None:
        if capacity <= self.capacity:
            return
        cap = max(capacity, 2 * self.capacity, 16)
        ids = np.zeros(cap, dtype=np.int64)
        ids[:self.capacity] = self._ids
        used = np.zeros(cap, dtype=bool)
        used[:self.capacity] = self._used
        self._ids, self._used = ids, used
        self.capacity = cap
        cb = self._grow_ref()
        if cb is not None:
            cb(cap)

    def _lut_fit(self, w: int) -> bool:
        if 0 <= w < self._lut.size:
            return True
        if 0 <= w < _LUT_MAX:
            size = max(64, self._lut.size)
            while size <= w:
                size *= 2
            lut = np.full(min(size, _LUT_MAX), -1, dtype=np.int64)
            lut[:self._lut.size] = self._lut
            self._lut = lut
            return True
        return False

    @property
    def lut(self) -> np.ndarray:
        """id -> slot for ids below its size (-1: none); ids beyond it are in no array (read it,
        never write it)."""
        return self._lut

    # ----- single ids -----------------------------------------------------------------------
    def get(self, w: int) -> int:
        """The slot of ``w`` or -1."""
        return self._slot_of.get(w, -1)

    def __contains__(self, w: int) -> bool:
        return self.get(w) >= 0

    def add(self, w: int) -> int:
        """The slot of ``w``, handing out (and initialising) a fresh one if it has none."""
        w = operator.index(w)                     # an integer (numpy's too), never a float
        s = self.get(w)
        if s >= 0:
            return s
        if not (-(1 << 63) <= w < (1 << 63)):
            raise ValueError(f"worker id {w} is outside int64")
        if self._free:
            s = self._free.pop()
        else:
            s = self._next
            self._next += 1
            self._reserve(self._next)
        self._ids[s] = w
        self._used[s] = True
        if self._lut_fit(w):
            self._lut[w] = s
        self._slot_of[w] = s
        self.version += 1
        cb = self._init_ref()
        if cb is not None:
            cb(np.array([s], dtype=np.int64), np.array([w], dtype=np.int64))
        return s

    def remove(self, w: int) -> int:
        """Free the slot of ``w``; returns it (or -1 if ``w`` had none)."""
        w = int(w)
        s = self.get(w)
        if s < 0:
            return -1
        if 0 <= w < self._lut.size:
            self._lut[w] = -1
        del self._slot_of[w]
        self._used[s] = False
        self._free.append(s)
        self.version += 1
        return s

    def clear(self) -> None:
        for w in self.ids().tolist():
            self.remove(w)

    # ----- many ids -------------------------------------------------------------------------
    def lookup(self, ids: np.ndarray, create: bool = False) -> np.ndarray:
        """Slots of ``ids`` (int64 array); -1 for unknown ids unless ``create``."""
        n = ids.size
        lut = self._lut
        if n <= 16:                                    # a few ids: no array machinery
            return self.lookup_list(ids.tolist(), create)
        if n and lut.size and ids.min() >= 0 and ids.max() < lut.size:
            out = lut[ids]
        else:
            out = np.full(n, -1, dtype=np.int64)
            inr = (ids >= 0) & (ids < lut.size)
            out[inr] = lut[ids[inr]]
            for i in np.flatnonzero(~inr).tolist():
                out[i] = self._slot_of.get(int(ids[i]), -1)
        if create:
            miss = np.flatnonzero(out < 0)
            for i in miss.tolist():
                out[i] = self.add(int(ids[i]))
        return out

    def lookup_list(self, ids: list[int], create: bool = False) -> np.ndarray:
        """:meth:`lookup` of a few ids given as Python ints (dict lookups, one array at the end)."""
        if create:
            slot_of, add = self._slot_of, self.add
            return np.array([slot_of[w] if w in slot_of else add(w) for w in ids], dtype=np.int64)
        get = self._slot_of.get
        return np.array([get(w, -1) for w in ids], dtype=np.int64)

    def ids(self) -> np.ndarray:
        """Ids that hold a slot (in slot order)."""
        return self._ids[: self._next][self._used[: self._next]]

    def items(self) -> list[tuple[int, int]]:
        """(worker id, slot) pairs, by id."""
        used = np.flatnonzero(self._used[: self._next])
        pairs = sorted(zip(self._ids[used].tolist(), used.tolist()))
        return pairs

    def __len__(self) -> int:
        return int(self._used[: self._next].sum())
