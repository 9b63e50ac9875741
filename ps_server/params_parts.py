"""The pieces a shard cuts a new version's slice into, to send each while the rest is computed."""

from __future__ import annotations


class PartCutter:
    """Hands out the ``[lo, hi)`` pieces of a ``size``-element slice, ``part`` elements each
    (the last one shorter), in order, each as soon as the final prefix of the slice covers it."""

    def __init__(self, size: int, part: int) -> None:
        if size <= 0 or part <= 0:
            raise ValueError(f"a slice of {size} elements cannot be cut into parts of {part}")
        self.size = size
        self.part = part
        self.count = -(-size // part)
        self.sent = 0

    def ready(self, end: int) -> list[tuple[int, int]]:
        """The pieces that ``[0, end)`` being final completes, not handed out before."""
        out = []
        while self.sent < self.size and min(self.sent + self.part, self.size) <= end:
            hi = min(self.sent + self.part, self.size)
            out.append((self.sent, hi))
            self.sent = hi
        return out


def answer_part_elements(size: int, part_bytes: int, hwm: int) -> int:
    """Elements per part of a ``size``-element float32 slice's answers (0: whole answers), at
    most ``hwm // 2`` parts: every part is a message, and a worker's queue holds ``hwm`` (the
    rest, sent without blocking, would be dropped, and that worker would wait for its deadline)."""
    if part_bytes <= 0:
        return 0
    return max(part_bytes // 4, -(-size // max(1, hwm // 2)))
