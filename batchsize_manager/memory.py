"""Per-worker batch-size caps from memory: configured, probed, learned from out-of-memory errors.

The one owner of memory caps (the BatchSizeManager holds one :class:`MemoryCaps`; policies see
the result as the caps they are given). Caps are keyed by a worker's *name*, which outlives its
membership: a worker that rejoins (new id, same name) or a job resumed from a checkpoint keeps
what was learned about its memory, where join-order ids would hand it to someone else.

Learning is a binary search per worker between the largest size known to fit (``fits``, from
iterations that completed) and the smallest known to fail (``fails``, from out-of-memory
reports). While they are far apart the cap is their midpoint, so each out-of-memory error at
least halves the unknown range; once the largest fit is within ``margin`` of the failure, the
cap settles ``margin`` below the failed size (memory use fluctuates a little between iterations,
and a cap at the edge would fail again now and then).

A *headroom* cap comes from telemetry, before anything fails: a worker that reports
``Telemetry.mem_headroom_mb`` (what the iteration could still have used under its limit) and
``Telemetry.mem_per_sample_mb`` (its peak use above the model's, per sample) would fit about
``x + headroom / per_sample`` samples; that estimate, ``margin`` lower, caps it too. lbbsp-gpu
therefore never picks as leader a worker without room for more samples.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import chain
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping

from ps_common.errors import PsError

if TYPE_CHECKING:
    from ps_common.report import Telemetry


class CannotFit(PsError, ValueError):
    """Even one sample does not fit in a worker's memory."""


@dataclass
class _Search:
    fits: int = 0               # the largest size that completed (0: none known)
    fails: int | None = None    # the smallest size that ran out of memory
    headroom_cap: int | None = None


def cap_after_oom(batch_size: int, margin: float) -> int:
    """``margin`` below a failed size, and at least one below it (0 when 1 failed)."""
    return max(0, min(batch_size - 1, math.floor(batch_size * (1.0 - margin))))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite_positive(raw: Any) -> float:
    try:
        v = float(raw)
    except (TypeError, ValueError, OverflowError):
        return 0.0
    return v if 0.0 < v < math.inf else 0.0


#: Samples a headroom estimate may add to a batch that fitted at most: a report's range checks
#: let the per-sample size be as small as 5e-324 MiB, whose quotient overflows to infinity.
MAX_HEADROOM_SAMPLES = float(1 << 40)

#: Learned searches kept at most: names come from the workers, and a client that joins and leaves
#: under ever new names must not grow this. Past it, the oldest search of a name nobody live uses
#: goes (a live worker's cap is never forgotten).
MAX_NAMES = 10_000


class MemoryCaps:
    """Configured, probed and learned caps per worker name (see the module docstring)."""

    def __init__(self, configured: Mapping[Any, int] | None = None, margin: float = 0.05,
                 max_names: int = MAX_NAMES, in_use: Callable[[str], bool] = lambda name: False,
                 min_batch: int = 1) -> None:
        if not (0.0 <= margin < 1.0):
            raise ValueError(f"oom_margin must be in [0, 1), got {margin}")
        self.margin = float(margin)
        self.configured: dict[str, int] = {}
        for k, v in (configured or {}).items():
            if int(v) < 1:
                raise ValueError(f"memory cap of worker {k!r} must be >= 1, got {v}")
            self.configured[str(k)] = int(v)
        self._search: dict[str, _Search] = {}
        self.max_names = max_names
        #: is a live worker called this? (the manager's membership answers)
        self.in_use = in_use
        self.version = 0        #: bumped whenever any cap may have changed (callers cache on it)
        #: the job's min_batch: a search never settles below it unless a size at or below it
        #: failed (below it, no split could include the worker)
        self.min_batch = max(1, int(min_batch))

    def _entry(self, name: str) -> _Search:
        """``name``'s search, made if new; with ``max_names`` of them, the oldest one whose name
        no live worker has goes first."""
        s = self._search.get(name)
        if s is None:
            if len(self._search) >= self.max_names:
                gone = next((n for n in self._search if not self.in_use(n)), None)
                if gone is not None:
                    del self._search[gone]
            s = self._search[name] = _Search()
        return s

    # ----- what is known ----------------------------------------------------------------------
    def cap(self, name: str) -> int | None:
        """The largest batch this worker should get (None: memory does not bound it)."""
        caps = [c for c in (self.configured.get(name), self._learned(name)) if c is not None]
        return min(caps) if caps else None

    def _learned(self, name: str) -> int | None:
        s = self._search.get(name)
        if s is None:
            return None
        fits = s.fits if s.fails is None else min(s.fits, s.fails - 1)
        head = None if s.headroom_cap is None else max(s.headroom_cap, fits)  # never below a fit
        if s.fails is None:
            return head
        safe = max(1, cap_after_oom(s.fails, self.margin))
        search = safe if fits >= safe else max(1, min(safe, max(fits, (fits + s.fails) // 2)))
        if s.fails > self.min_batch:
            # Try min_batch before giving up on the worker: a margin below a failure just above
            # it (or the midpoint, with nothing known to fit) would leave no size to hand out.
            search = max(search, self.min_batch)
        return search if head is None else min(search, head)     # head: never below a size that fitted

    def capped_count(self) -> int:
        """How many names :meth:`capped_names` gives (a name may count twice)."""
        return len(self.configured) + len(self._search)

    def capped_names(self) -> Iterator[str]:
        """Every name with a configured or learned cap, without a copy (a name may repeat)."""
        return chain(self.configured, self._search)

    def tracks_any(self) -> bool:
        return bool(self._search)

    def tracks(self, name: str) -> bool:
        """Is a search or estimate under way for ``name`` (its completed sizes matter)?"""
        return name in self._search

    def known(self) -> dict[str, dict[str, int | None]]:
        """Every worker's search state, for logs and status."""
        return {n: {"fits": s.fits, "fails": s.fails, "cap": self.cap(n)} for n, s in self._search.items()}

    # ----- what is learned ----------------------------------------------------------------------
    def out_of_memory(self, name: str, batch_size: int, *, refuse_below_min_batch: bool = False) -> int:
        """``batch_size`` failed: the size to retry with (the new cap). The cap stays at or above
        :attr:`min_batch` while only sizes above it failed. Raises :class:`CannotFit` when one
        sample failed, or, with ``refuse_below_min_batch``, when the new cap would fall below
        min_batch (a size at or below it failed: no split could include the worker, and every
        split would fail), and then learns nothing: the worker cannot take part, the job goes on
        without it. Without it (a report, which cannot send its worker away) the cap is learned."""
        if batch_size <= 1:
            raise CannotFit(f"worker {name!r} ran out of memory with a single sample")
        before = self._search.get(name)
        kept = None if before is None else replace(before)
        s = self._entry(name)
        s.fails = batch_size if s.fails is None else min(s.fails, batch_size)
        if s.fits >= s.fails:
            s.fits = 0          # what fitted before fails now: the memory shrank, search again
        if s.headroom_cap is not None and s.headroom_cap >= batch_size:
            s.headroom_cap = None   # the estimate was wrong: trust the failure
        cap = self.cap(name)
        assert cap is not None and cap < batch_size
        if refuse_below_min_batch and cap < self.min_batch:
            if kept is None:
                del self._search[name]
            else:
                self._search[name] = kept
            raise CannotFit(f"worker {name!r} ran out of memory at {batch_size} samples: its cap would "
                            f"be {cap}, below min_batch={self.min_batch}")
        self.version += 1
        return cap

    def completed(self, name: str, batch_size: int, telemetry: Telemetry | None = None) -> None:
        """An iteration of ``batch_size`` fitted; its telemetry may carry a headroom estimate."""
        headroom = telemetry if telemetry is not None and telemetry.mem_headroom_mb is not None else None
        s = self._search.get(name)
        if s is None:
            if headroom is None:
                return          # the common case: nothing to learn, nothing stored
            s = self._entry(name)
        before = (s.fits, s.headroom_cap)
        if batch_size > s.fits and (s.fails is None or batch_size < s.fails):
            s.fits = batch_size
        if headroom is not None:
            head = _finite_positive(headroom.mem_headroom_mb)
            per = _finite_positive(headroom.mem_per_sample_mb)
            if per > 0:   # a per-sample size near 0 gives an estimate of no use, not a crash
                more = min(head * (1.0 - self.margin) / per, MAX_HEADROOM_SAMPLES)   # inf: bounded
                s.headroom_cap = batch_size + math.floor(more)
        if (s.fits, s.headroom_cap) != before:
            self.version += 1

    def probed(self, name: str, fits: int, fails: int | None = None) -> None:
        """A start-up probe found that ``fits`` samples fit (and ``fails`` did not)."""
        s = self._entry(name)
        s.fits = max(0, int(fits))
        s.fails = None if fails is None or fails <= s.fits else int(fails)
        self.version += 1

    # ----- checkpoints --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {n: {"fits": s.fits, "fails": s.fails} for n, s in self._search.items()
                if s.fits or s.fails is not None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`. All or nothing: what the live path could never hold (more
        than ``max_names`` names, a negative size, a failed size not above the fitted one) raises
        ValueError and changes nothing."""
        if len(state) > self.max_names:
            raise ValueError(f"memory caps: {len(state)} names, more than the {self.max_names} kept")
        search: dict[str, _Search] = {}
        for n, d in state.items():
            if not isinstance(n, str) or not isinstance(d, Mapping):
                raise ValueError(f"memory caps: entry {n!r} is not a name with fits and fails")
            fits, fails = d.get("fits", 0), d.get("fails")
            if not _is_int(fits) or fits < 0 or not (fails is None or (_is_int(fails) and fails > max(fits, 0))):
                raise ValueError(f"memory caps of {n!r}: need fits >= 0 and fails above it or none, "
                                 f"got fits={fits!r}, fails={fails!r}")
            search[n] = _Search(fits=int(fits), fails=None if fails is None else int(fails))
        self._search = search
        self.version += 1
