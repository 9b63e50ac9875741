"""Fault injection for tests and chaos runs: off unless ``LBBSP_FAULTS`` is set.

``LBBSP_FAULTS`` holds a JSON object; each key arms one fault point:

- ``"kill_in_push": {"worker": NAME, "iteration": T, "shards": [K, ...], "delay_s": 0.5}``
  (or a list of such): worker NAME, at its first push of an iteration >= T, pushes its
  gradient to the listed shards only, waits ``delay_s`` (the frames leave, or stay in flight on
  a slow link), then SIGKILLs itself: a death between two sends of one push. ">=", not "==":
  with backup workers a late worker's next assignment can skip iteration T.
- ``"nan_in_push": {"worker": NAME, "iteration": T, "shard": K}``: worker NAME's push of
  iteration T (once per process) carries a NaN in shard K's slice of its gradient, as a
  diverging loss or a bad batch would (refused ``nonfinite`` there, accepted by the others).
- ``"coordinator_stall": {"version": V, "seconds": S}``: shard 0's message loop sleeps S
  seconds once, when it reaches version V (a refit burst, a slow disk).
- ``"plan_delay": {"shard": K, "seconds": S}``: follower K takes each plan from shard 0 into
  account S seconds after it arrived (a slow link between the shards), so workers' pushes
  reach it before the plan they belong to (``plan_pending``, sent again by the worker).
- ``"drop_have": {"shard": K, "worker": W, "iteration": T}``: follower K never announces that
  it holds worker id W's gradient of iteration T (once), as if that ``Have`` were lost on the
  link to shard 0: only the follower's next beat (``ShardSync``) can make the gradient complete.

Unknown keys are an error, so a typo cannot silently disarm a test.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from typing import Any

ENV = "LBBSP_FAULTS"
_KNOWN = {"kill_in_push", "nan_in_push", "coordinator_stall", "plan_delay", "drop_have"}


@lru_cache(maxsize=1)
def _armed(raw: str) -> dict[str, dict[str, Any]]:
    if not raw:
        return {}
    try:
        faults = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{ENV} is not valid JSON: {exc}") from None
    if not isinstance(faults, dict) or not set(faults) <= _KNOWN:
        raise ValueError(f"{ENV}: expected an object with keys among {sorted(_KNOWN)}, got {raw!r}")
    return faults


def fault(name: str) -> Any:
    """The arguments of fault point ``name`` if armed, else None."""
    if name not in _KNOWN:
        raise KeyError(name)
    return _armed(os.environ.get(ENV, "")).get(name)


def nan_in_push(worker: str, iteration: int) -> int | None:
    """The shard whose slice gets a NaN in this worker's push of this iteration, if armed."""
    spec = fault("nan_in_push")
    if spec and spec.get("worker") == worker and int(spec.get("iteration", -1)) == iteration:
        return int(spec["shard"])
    return None


def kill_in_push(worker: str, iteration: int) -> dict[str, Any] | None:
    """The armed ``kill_in_push`` entry for this worker at this iteration (its T reached), if any."""
    spec = fault("kill_in_push")
    for entry in spec if isinstance(spec, list) else [spec] if spec else []:
        if entry.get("worker") == worker and 0 <= int(entry.get("iteration", -1)) <= iteration:
            return entry
    return None
