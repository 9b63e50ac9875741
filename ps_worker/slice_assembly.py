"""One shard's answer put together from its parts (``Params.parts``), each copied into place as
it arrives, so the copy overlaps the transfer of the next.

A shard sends the parts of one answer back to back on one connection, so they arrive in order
and nothing else comes between them: anything else is refused as a protocol error rather than
guessed at. Each part must continue exactly where the one before ended, belong to the same
version and history, and stay inside the slice; the answer is whole when the slice is full
with exactly ``parts`` parts.
"""

from __future__ import annotations

import numpy as np

from ps_common import protocol as P


class SliceAssembly:
    """The parts of one shard's answer so far; ``head`` is its first part (offset 0)."""

    def __init__(self, shard: int, first: P.Params, out: np.ndarray) -> None:
        self.shard = shard
        self.out = out
        self.head = first
        self.filled = 0
        self.count = 0
        if first.offset != 0:
            raise P.ProtocolError(f"shard {shard}: an answer's first part starts at element {first.offset}, "
                                  "not 0 (a part of an answer not asked for)")
        self.add(first)

    def add(self, part: P.Params) -> None:
        """Copy ``part`` into place; ProtocolError if it does not continue this answer."""
        h = self.head
        if part is not h and (part.version, part.log_hash, part.parts, part.stop) != (
                h.version, h.log_hash, h.parts, h.stop):
            raise P.ProtocolError(f"shard {self.shard}: a part of version {part.version} ({part.parts} parts) "
                                  f"inside the answer of version {h.version} ({h.parts} parts)")
        if part.offset != self.filled:
            raise P.ProtocolError(f"shard {self.shard}: part at element {part.offset}, expected {self.filled}")
        a = part.arrays[0]
        end = self.filled + a.size
        if a.ndim != 1 or a.dtype != self.out.dtype or end > self.out.size:
            raise P.ProtocolError(f"shard {self.shard}: part {a.dtype}{list(a.shape)} at {part.offset} does not "
                                  f"fit its slice of {self.out.size} {self.out.dtype}")
        self.count += 1
        if self.count > h.parts or (self.count == h.parts) != (end == self.out.size):
            raise P.ProtocolError(f"shard {self.shard}: {self.count} parts of {h.parts} cover {end} of "
                                  f"{self.out.size} elements")
        self.out[self.filled:end] = a
        self.filled = end

    @property
    def complete(self) -> bool:
        return self.filled == self.out.size and self.count == self.head.parts
