"""FlexRR-style reassignment within an iteration: one pool of sample chunks that workers claim.

FlexRR (Harlap et al., SoCC 2016) lets a worker that is done with its share of an iteration
take over part of a straggler's remaining work, so nobody waits for it. Here the coordinator
arbitrates: each planned worker's ranges are cut into ``k`` chunks of nearly equal size; the
owner holds its first chunk from the start (it comes with its assignment) and claims every
other one, one at a time, before computing it. A worker with no unclaimed chunk of its own
helps: it is granted the *last* unclaimed chunk of the owner that needs the longest to get
through its unclaimed samples. As in FlexRR, only a helper that is ahead helps: with known
speeds (samples/s), it takes the chunk only if it would finish it before the owner would get
through what it has left. Otherwise, or when no chunk is left anywhere, it hears "none": it
pushes the sum over what it was granted.

Each chunk is granted at most once, so each sample of the iteration is computed by at most one
worker; what nobody took goes back to the data cursor with the commit
(:meth:`ChunkPool.drain_unclaimed`).

Pure bookkeeping over plain data: no sockets, no clocks.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable, Mapping

from ps_server.data_cursor import Range, ranges_size, split_ranges


def chunk_ranges(ranges: list[Range], chunks: int) -> list[list[Range]]:
    """``ranges`` cut into ``min(chunks, samples)`` consecutive pieces whose sizes differ by at
    most one (the larger first), in order."""
    total = ranges_size(ranges)
    k = max(1, min(chunks, total))
    out: list[list[Range]] = []
    rest = ranges
    for i in range(k):
        size = total // k + (1 if i < total % k else 0)
        head, rest = split_ranges(rest, size)
        out.append(head)
    return out


class ChunkPool:
    """Who computes which chunk of one iteration."""

    def __init__(self, plan: Mapping[int, list[Range]], chunks: int) -> None:
        if chunks < 1:
            raise ValueError("chunks must be >= 1")
        self._unclaimed: dict[int, deque[list[Range]]] = {}
        self._granted: dict[int, list[list[Range]]] = {}
        #: Chunks granted to a worker other than their owner, and their samples.
        self.helped_chunks = 0
        self.helped_samples = 0
        for w, ranges in plan.items():
            pieces = chunk_ranges(ranges, chunks)
            self._granted[w] = [pieces[0]]
            self._unclaimed[w] = deque(pieces[1:])

    def first(self, worker: int) -> list[Range]:
        """The chunk that comes with ``worker``'s assignment."""
        return self._granted[worker][0]

    def take(self, worker: int, speeds: Mapping[int, float] | None = None) -> tuple[int, list[Range]] | None:
        """Grant ``worker`` its next chunk: (owner, ranges), or None when none is left for it.

        ``speeds``: samples/s per worker; a worker missing from it (or at 0) counts as
        unknown, and then the owner with the most samples left is helped, by anyone."""
        own = self._unclaimed.get(worker)
        if own:
            piece = own.popleft()
            self._granted[worker].append(piece)
            return worker, piece
        speeds = speeds or {}
        mine = speeds.get(worker, 0.0)
        known = mine > 0 and all(speeds.get(o, 0.0) > 0 for o, q in self._unclaimed.items() if q)
        left = [(ranges_size(_flat(q)) / (speeds[o] if known else 1.0), o) for o, q in self._unclaimed.items() if q]
        if not left:
            return None
        owner_s, owner = max(left)  # the longest to go; ties to the higher id, deterministically
        if known and ranges_size(self._unclaimed[owner][-1]) / mine >= owner_s:
            return None  # the owner would be done with it first: no help from a slower worker
        piece = self._unclaimed[owner].pop()
        self._granted.setdefault(worker, []).append(piece)
        self.helped_chunks += 1
        self.helped_samples += ranges_size(piece)
        return owner, piece

    def last_size(self, worker: int) -> int:
        """Samples of the chunk granted to ``worker`` last (0 if none)."""
        pieces = self._granted.get(worker)
        return ranges_size(pieces[-1]) if pieces else 0

    def count(self, worker: int) -> int:
        """Samples granted to ``worker`` so far (its push carries exactly this many)."""
        return sum(ranges_size(p) for p in self._granted.get(worker, ()))

    def granted(self, worker: int) -> list[Range]:
        """Every range granted to ``worker``, in the order it was granted."""
        return list(_flat(self._granted.get(worker, ())))

    def release(self, worker: int) -> list[Range]:
        """A lost worker: what it was granted, to go back to the data cursor. Its own unclaimed
        chunks stay in the pool for the others to take."""
        return list(_flat(self._granted.pop(worker, ())))

    def everything(self) -> list[Range]:
        """Every range still in the iteration, granted or not (a stop, a checkpoint)."""
        granted = [r for pieces in self._granted.values() for r in _flat(pieces)]
        return granted + [r for q in self._unclaimed.values() for r in _flat(q)]

    def drain_unclaimed(self) -> list[Range]:
        """Remove and return every unclaimed chunk (the iteration has nobody left to do them)."""
        out = [r for q in self._unclaimed.values() for r in _flat(q)]
        self._unclaimed = {w: deque() for w in self._unclaimed}
        return out


def _flat(pieces: Iterable[list[Range]]) -> list[Range]:
    return [r for piece in pieces for r in piece]
