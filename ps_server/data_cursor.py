"""The data cursor: hands out consecutive ranges of each epoch's global shuffled order.

Every sample is used exactly once per epoch whatever the batch sizes, because batches are cut
from one stream (``sample_order(seed, 0, n)``, then epoch 1's order, ...) instead of from fixed
per-worker shards. Ranges handed back (a lost worker's unused samples) are served again before
the stream advances.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

Range = list[int]  # [epoch, start, stop]


@dataclass
class CursorState:
    epoch: int = 0
    offset: int = 0
    samples_served: int = 0


class DataCursor:
    def __init__(self, num_samples: int, state: CursorState | None = None) -> None:
        if num_samples <= 0:
            raise ValueError("dataset is empty")
        self.n = num_samples
        self.state = state or CursorState()
        self._returned: deque[Range] = deque()

    @property
    def epoch(self) -> int:
        return self.state.epoch

    def take(self, count: int) -> list[Range]:
        """The next ``count`` samples as a list of [epoch, start, stop] ranges."""
        if count < 0:
            raise ValueError("count must be >= 0")
        out: list[Range] = []
        need = count
        while need and self._returned:
            e, a, b = self._returned.popleft()
            k = min(need, b - a)
            out.append([e, a, a + k])
            if a + k < b:
                self._returned.appendleft([e, a + k, b])
            need -= k
        while need:
            room = self.n - self.state.offset
            k = min(need, room)
            out.append([self.state.epoch, self.state.offset, self.state.offset + k])
            self.state.offset += k
            need -= k
            if self.state.offset == self.n:
                self.state.epoch += 1
                self.state.offset = 0
        self.state.samples_served += count
        return out

    def state_dict(self) -> dict:
        return {"epoch": self.state.epoch, "offset": self.state.offset,
                "samples_served": self.state.samples_served, "returned": [list(r) for r in self._returned]}

    def load_state_dict(self, d: dict) -> None:
        self.state = CursorState(int(d["epoch"]), int(d["offset"]), int(d["samples_served"]))
        self._returned = deque([int(x) for x in r] for r in d["returned"])

    def give_back(self, ranges: list[Range]) -> None:
        """Unused ranges return to the pool and are served first."""
        for r in ranges:
            self._returned.append(list(r))
            self.state.samples_served -= r[2] - r[1]


def ranges_size(ranges: list[Range]) -> int:
    return sum(b - a for _, a, b in ranges)


def split_ranges(ranges: list[Range], count: int) -> tuple[list[Range], list[Range]]:
    """The first ``count`` samples of ``ranges`` and the rest, both as ranges, in order."""
    head: list[Range] = []
    tail: list[Range] = []
    need = count
    for e, a, b in ranges:
        k = min(max(need, 0), b - a)
        if k:
            head.append([e, a, a + k])
        if a + k < b:
            tail.append([e, a + k, b])
        need -= k
    return head, tail
