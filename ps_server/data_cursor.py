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
        """Resume from :meth:`state_dict`. All or nothing: a state that could serve a sample
        twice, or one outside the dataset, raises ValueError and changes nothing (it can only
        come from a damaged checkpoint, and training on it would break exactly-once sampling)."""
        state, returned = self._checked(d)
        self.state, self._returned = state, deque(returned)

    def _checked(self, d: dict) -> tuple[CursorState, list[Range]]:
        try:
            state = CursorState(_exact_int(d["epoch"]), _exact_int(d["offset"]), _exact_int(d["samples_served"]))
            returned = [[_exact_int(x) for x in r] for r in d["returned"]]
        except (KeyError, TypeError) as exc:
            raise ValueError(f"data cursor state: {exc!r}") from None
        n = self.n
        if state.epoch < 0 or not 0 <= state.offset < n or state.samples_served < 0:
            raise ValueError(f"data cursor state out of range: epoch {state.epoch}, offset {state.offset} "
                             f"of {n} samples, {state.samples_served} served")
        seen: dict[int, list[tuple[int, int]]] = {}
        for r in returned:
            if len(r) != 3:
                raise ValueError(f"data cursor: a returned range must be [epoch, start, stop], got {r}")
            e, a, b = r
            end = state.offset if e == state.epoch else n
            if not (0 <= e <= state.epoch and 0 <= a < b <= end):
                raise ValueError(f"data cursor: returned range {r} was never served (epoch {state.epoch}, "
                                 f"offset {state.offset} of {n})")
            seen.setdefault(e, []).append((a, b))
        for e, spans in seen.items():
            spans.sort()
            for (_, b0), (a1, _) in zip(spans, spans[1:]):
                if a1 < b0:
                    raise ValueError(f"data cursor: returned ranges of epoch {e} overlap: their samples "
                                     "would be served twice")
        return state, returned

    def give_back(self, ranges: list[Range]) -> None:
        """Unused ranges return to the pool and are served first."""
        for r in ranges:
            self._returned.append(list(r))
            self.state.samples_served -= r[2] - r[1]


def _exact_int(v: object) -> int:
    """``v`` as an int if it is one (numpy integers included); a float, bool or string is refused."""
    if isinstance(v, bool) or not hasattr(v, "__index__"):
        raise TypeError(f"expected an integer, got {v!r}")
    return int(v.__index__())


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
