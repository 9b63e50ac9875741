"""Pure helpers that turn real-valued shares into integer batch sizes summing exactly to X."""

from __future__ import annotations

import math
from typing import Mapping, Sequence


def largest_remainder(shares: Mapping[int, float], total: int) -> dict[int, int]:
    """Round non-negative real ``shares`` (summing to ``total``) to integers summing to ``total``.

    Floors every share, then hands the leftover units to the largest fractional parts (ties
    broken by worker id, so the result is deterministic).
    """
    if total < 0:
        raise ValueError("total must be >= 0")
    if not shares:
        raise ValueError("no workers to split the batch over")
    s = sum(shares.values())
    if s <= 0 or any(v < 0 or not math.isfinite(v) for v in shares.values()):
        raise ValueError(f"shares must be finite, non-negative and not all zero: {dict(shares)}")
    scaled = {w: v * total / s for w, v in shares.items()}
    out = {w: math.floor(v) for w, v in scaled.items()}
    left = total - sum(out.values())
    order = sorted(scaled, key=lambda w: (-(scaled[w] - out[w]), w))
    for w in order[:left]:
        out[w] += 1
    return out


def proportional_split(weights: Mapping[int, float], total: int, min_batch: int = 1) -> dict[int, int]:
    """Split ``total`` proportionally to ``weights`` with every worker getting >= ``min_batch``.

    Workers whose share would fall below the floor are pinned to it and the rest is re-split
    over the others (water-filling), then rounded with :func:`largest_remainder`.
    """
    n = len(weights)
    if n == 0:
        raise ValueError("no workers to split the batch over")
    if min_batch * n > total:
        raise ValueError(f"global batch {total} cannot give {n} workers at least {min_batch} each")
    pinned: dict[int, int] = {}
    free = dict(weights)
    while True:
        budget = total - min_batch * len(pinned)
        s = sum(free.values())
        low = [w for w, v in free.items() if s <= 0 or v * budget / s < min_batch]
        if not low or len(low) == len(free):
            break
        for w in low:
            pinned[w] = min_batch
            del free[w]
    if not free:
        return {**pinned}
    budget = total - min_batch * len(pinned)
    if sum(free.values()) <= 0:
        free = {w: 1.0 for w in free}
    rounded = largest_remainder(free, budget)
    # Rounding can push a share just over the floor down below it; lift it from the largest.
    for w in sorted(rounded):
        while rounded[w] < min_batch:
            donor = max(rounded, key=lambda k: (rounded[k], -k))
            rounded[donor] -= 1
            rounded[w] += 1
    return {**pinned, **rounded}


def uniform_split(workers: Sequence[int], total: int) -> dict[int, int]:
    """x_i = X / N, the remainder going to the lowest worker ids."""
    return largest_remainder({w: 1.0 for w in workers}, total)
