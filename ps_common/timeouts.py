"""How long the shard server, the worker's client and the transport wait, poll and back off.

The timings a user tunes are config (``transport.timeout_s``, ``heartbeat.interval_s``...); the
ones here are built in, named once instead of written as literals in loops. A component takes
a :class:`Timeouts` (default :data:`DEFAULT_TIMEOUTS`), so a test can shorten them.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: the delay before retry ``attempt`` (0, 1, 2...).

    The ceiling is ``initial_s * factor**attempt``, at most ``max_s``; the delay is drawn
    uniformly from ``[(1 - jitter) * ceiling, ceiling]``, so processes that failed together
    (workers of a coordinator that restarted) spread their retries instead of arriving at once,
    and no delay is ever longer than the plain exponential schedule.
    """

    initial_s: float
    max_s: float
    factor: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not 0 < self.initial_s <= self.max_s:
            raise ValueError(f"backoff needs 0 < initial_s <= max_s, got {self.initial_s}, {self.max_s}")
        if self.factor < 1:
            raise ValueError(f"backoff factor must be >= 1, got {self.factor}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"backoff jitter must be in [0, 1), got {self.jitter}")

    def ceiling(self, attempt: int) -> float:
        """The delay before retry ``attempt`` without jitter."""
        if attempt < 0:
            raise ValueError(f"attempt must be >= 0, got {attempt}")
        # Past max_s the power would only grow (and overflow a float): stop at the cap.
        delay = self.initial_s
        for _ in range(attempt):
            delay *= self.factor
            if delay >= self.max_s:
                return self.max_s
        return min(delay, self.max_s)

    def delay(self, attempt: int, rng: random.Random) -> float:
        """The delay before retry ``attempt``, jittered with ``rng``."""
        return self.ceiling(attempt) * (1.0 - self.jitter * rng.random())


@dataclass(frozen=True)
class Timeouts:
    """Built-in waits, in seconds. Defaults are the values the code has always used."""

    # transport
    reply_s: float = 30.0
    """A connection's reply timeout when its owner gives none."""
    auth_check_s: float = 0.25
    """While a reply is awaited, how often the handshake monitor is read (a refused client
    fails within this, instead of at the timeout)."""

    # the worker's client
    pull_poll_s: float = 0.5
    """While parameters are awaited, how often the client checks for a refused handshake and
    asks whether to give up (membership or coordinator changed)."""
    stop_drain_s: float = 0.2
    """After a stop, how long the other shards' answers are read so none stays queued."""
    leave_s: float = 2.0
    """A goodbye on the way out; the heartbeat timeout covers a lost one."""
    rejoin: Backoff = field(default_factory=lambda: Backoff(initial_s=0.25, max_s=5.0, factor=2.0, jitter=0.2))
    """A dropped worker's wait before joining again, growing while the coordinator is away."""
    name_in_use: Backoff = field(default_factory=lambda: Backoff(initial_s=0.25, max_s=1.0, factor=2.0, jitter=0.2))
    """A restarted worker whose old membership (same name) is not declared lost yet: it joins
    again within a second of that, while the heartbeat timeout runs."""
    plan_pending_backoff: Backoff = field(default_factory=lambda: Backoff(initial_s=0.005, max_s=0.2))
    """A follower that got a push before shard 0's plan for it (``plan_pending``): the push goes
    again after 5 ms, doubling to 0.2 s, until the pull's own deadline."""
    heartbeat_stop_s: float = 5.0
    """How long stopping the heartbeat thread may take."""

    # the shard server
    loop_poll_s: float = 0.05
    """The shard loop's wait for input between rounds of its own work."""
    tick_s: float = 0.1
    """How often the shard loop runs its clock-driven work (liveness, stop, checkpoints)."""
    finish_linger_s: float = 0.2
    """After the final answers, before the sockets close (linger 0): time for them to leave."""
    register_attempt_s: float = 2.0
    """A follower's wait for the coordinator's answer to one registration attempt."""
    rollback_send_s: float = 2.0
    """A restarted coordinator's send to a follower it tells to roll back."""
    rollback_reply_s: float = 5.0
    """... and its wait for that follower's acknowledgement."""
    checkpoint_close_s: float = 60.0
    """At exit, how long a shard waits for its checkpoint writer to put the queued versions on
    disk (a large model on a slow disk); past it the process exits with a warning logged."""

    # helper threads and processes
    refit_stop_s: float = 5.0
    """How long a predictor's background refit helper (thread or process) may take to stop
    before the process is killed."""
    probe_stop_s: float = 2.0
    """How long stopping the resource probe's sampling thread may take (one psutil read)."""
    contention_stop_s: float = 10.0
    """How long stopping the contention driver's thread may take (a tick that starts burners)."""
    burner_kill_s: float = 5.0
    """After SIGKILL, how long to wait for each CPU burner to be reaped."""


DEFAULT_TIMEOUTS = Timeouts()
