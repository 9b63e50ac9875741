"""Training paused while the evaluator measures a version (``evaluator.pause_training``).

Why: on a host that training saturates, an evaluator running beside the workers slows them
(6-27% on LeNet on 2 cores, even at SCHED_IDLE: it shares their caches and fills their gaps).
A training loop that evaluates between steps, as DDP scripts do, stops its clock meanwhile
instead. This is that loop's rule for the parameter server: at every measured version shard 0
answers no pull until the evaluator has reported the version, and the coordinator's clock leaves
the pause out of elapsed time, iteration durations and time to accuracy.

Pure bookkeeping with the caller's clock: the coordinator decides when a version is committed
and when a report arrives; this says whether to hold and for how long it held.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EvaluatorPause:
    every: int                  #: the evaluator measures versions 0, every, 2 every, ...
    timeout_s: float            #: the longest pause (the evaluator may be gone)
    enabled: bool
    present: bool = False       #: an evaluator has joined (nobody would end a pause otherwise)
    broken: bool = False        #: a pause timed out: none until a report arrives again
    held: int | None = None     #: the version being measured while training waits
    since: float = 0.0
    total_s: float = 0.0        #: every pause so far
    since_commit_s: float = 0.0  #: the pauses since the last commit (its iteration's)
    pauses: int = 0
    timeouts: int = 0

    def hold(self, version: int, now: float) -> bool:
        """Pause at ``version`` if it is one the evaluator measures; True if a pause began."""
        if (not self.enabled or not self.present or self.broken or self.held is not None
                or version % self.every):
            return False
        self.held, self.since = version, now
        return True

    def ongoing(self, now: float) -> float:
        """Seconds of the pause under way (0 when training runs)."""
        return max(0.0, now - self.since) if self.held is not None else 0.0

    def release(self, now: float) -> float:
        """End the pause under way; its length (0 when there was none)."""
        length = self.ongoing(now)
        if self.held is not None:
            self.held = None
            self.pauses += 1
            self.total_s += length
            self.since_commit_s += length
        return length

    def reported(self, version: int, now: float) -> float | None:
        """A measurement of ``version`` arrived: the pause's length if it ended one. A report
        mends a timed-out pause rule: the evaluator is back."""
        self.broken = False
        if self.held is None or version < self.held:
            return None
        return self.release(now)

    def expired(self, now: float) -> float | None:
        """If the pause under way has lasted ``timeout_s``: end it, take no more until the
        evaluator reports again, and return its length."""
        if self.held is None or now - self.since < self.timeout_s:
            return None
        self.broken = True
        self.timeouts += 1
        return self.release(now)

    def take_since_commit(self) -> float:
        """The pauses since the last commit, for the commit's record (counted once)."""
        s, self.since_commit_s = self.since_commit_s, 0.0
        return s

    def clear(self) -> None:
        """A rollback or resume: no pause is under way (the workers join again)."""
        self.held = None
        self.since_commit_s = 0.0
