"""Where a server's time goes: cumulative seconds and counts per phase, cheap enough to keep on.

The shard server adds the time of every handler (by message type) and of each step of a commit
(decide, apply, answer, write down; the update's arithmetic is done while answering, so that its
parts can leave as they are computed, and counts under answer); the totals go into the shard's ``shutdown`` record, so a
benchmark can print a per-phase profile of a real run next to the workers' own phase times.
"""

from __future__ import annotations

import time
from collections import defaultdict


class Timings:
    """Wall seconds per phase, and the loop's CPU seconds in total (on a shared host the wall
    time of a phase includes waiting for a core; the CPU total says what the shard consumed)."""

    def __init__(self) -> None:
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.counts: defaultdict[str, int] = defaultdict(int)
        self._cpu0 = time.thread_time()

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.counts[phase] += 1

    def since(self, phase: str, t0: float) -> float:
        """Add the time since ``t0`` (a ``time.perf_counter()``) to ``phase``; return now."""
        now = time.perf_counter()
        self.add(phase, now - t0)
        return now

    def as_dict(self) -> dict[str, dict[str, float]]:
        out = {k: {"s": round(v, 6), "n": self.counts[k]} for k, v in sorted(self.seconds.items())}
        out["cpu_total"] = {"s": round(time.thread_time() - self._cpu0, 6), "n": 1}
        return out
