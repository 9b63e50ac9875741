"""Pure helpers that turn real-valued shares into integer batch sizes summing exactly to X."""

from __future__ import annotations

import bisect
import math
from typing import Mapping, Sequence, Union

import numpy as np
from numpy.typing import ArrayLike


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


# ----------------------------------------------------------------------------------------------
# Bounded splits (floor and per-worker caps) for the LB-BSP policies
# ----------------------------------------------------------------------------------------------

CapsArg = Union[Mapping[int, int], int, None]


def resolve_caps(workers: Sequence[int], max_batch: CapsArg) -> dict[int, int | None]:
    """Per-worker upper bounds from an int (same cap for all), a mapping (missing = no cap) or None."""
    if max_batch is None:
        return {w: None for w in workers}
    if isinstance(max_batch, Mapping):
        return {w: (None if max_batch.get(w) is None else int(max_batch[w])) for w in workers}
    return {w: int(max_batch) for w in workers}


def check_feasible(workers: Sequence[int], total: int, min_batch: int,
                   caps: Mapping[int, int | None]) -> None:
    """Raise ``ValueError`` saying why ``total`` cannot be split within the bounds (if it cannot)."""
    n = len(workers)
    if n == 0:
        raise ValueError("no workers to split the batch over")
    if min_batch < 0:
        raise ValueError(f"min_batch must be >= 0, got {min_batch}")
    if min_batch * n > total:
        raise ValueError(f"global batch {total} cannot give {n} workers at least {min_batch} each")
    low = sorted(w for w in workers if (c := caps.get(w)) is not None and c < min_batch)
    if low:
        raise ValueError(f"workers {low} have a batch cap below min_batch={min_batch} "
                         f"(caps {[caps[w] for w in low]}): they cannot take part")
    if all(caps.get(w) is not None for w in workers):
        room = sum(int(caps[w] or 0) for w in workers)  # every cap is set here
        if room < total:
            raise ValueError(f"global batch {total} exceeds the sum of the workers' batch caps ({room})")


def equal_finish_times(speeds: ArrayLike, overheads: ArrayLike, total: float,
                       lo: ArrayLike, hi: ArrayLike) -> tuple[np.ndarray, float]:
    """Real-valued x_i = clip(v_i (T - c_i), lo_i, hi_i) with Σ x_i = total; returns (x, T).

    This is LB-BSP's analytical split (t_i(x) = x / v_i + c_i, every unclamped worker finishing
    at the same T) with water-filling for the clamped ones. The sum is a non-decreasing
    piecewise-linear function of T whose breakpoints are where a worker leaves its floor or hits
    its cap. Solved by Newton steps on it (each step is the exact root of the piece it starts on:
    T = (X - Σ_floor lo - Σ_cap hi + Σ_free v c) / Σ_free v), which end in 1-3 O(N) steps; from the
    all-free start they converge monotonically when only floors or only caps bind. If they have
    not ended after a few steps, one sort and a cumulative sweep over the breakpoints find the
    crossing exactly (O(N log N)). With zero overheads it is the bounded proportional split
    x_i ∝ v_i. ``hi`` may hold ``inf``.
    """
    v = np.asarray(speeds, dtype=np.float64)
    vmax = float(v.max()) if v.size else 1.0
    if v.size and (not vmax < math.inf or not (v >= 0).all()):
        raise ValueError("speeds must be finite and non-negative")
    # A zero speed would put its breakpoints at infinity; a tiny relative speed keeps the sweep
    # finite and still gives that worker (almost) nothing above its floor.
    v = np.maximum(v, 1e-12 * (vmax if vmax > 0 else 1.0))
    c = np.asarray(overheads, dtype=np.float64)
    lo_a = np.asarray(lo, dtype=np.float64)
    hi_a = np.asarray(hi, dtype=np.float64)
    lo_sum = float(np.add.reduce(lo_a))
    hi_sum = float(np.add.reduce(hi_a))
    if lo_sum > total + 1e-9 or hi_sum < total - 1e-9:
        raise ValueError(f"total {total} is outside [Σ lo, Σ hi] = [{lo_sum}, {hi_sum}]")
    capped = hi_sum < math.inf or not (hi_a == math.inf).all()
    t_lo = c + lo_a / v                      # below: worker sits on its floor
    t_hi = c + hi_a / v if capped else None  # above: worker sits on its cap
    t_star = _newton_crossing(v, c, total, lo_a, hi_a, t_lo, t_hi)
    if t_star is None:
        t_star = _sweep_crossing(v, total, lo_sum, t_lo, c + hi_a / v if t_hi is None else t_hi)
    x = np.maximum(v * (t_star - c), lo_a)
    if capped:
        np.minimum(x, hi_a, out=x)
    return x, t_star


def _newton_crossing(v: np.ndarray, c: np.ndarray, total: float, lo: np.ndarray, hi: np.ndarray,
                     t_lo: np.ndarray, t_hi: np.ndarray | None, steps: int = 8) -> float | None:
    """T with Σ clip(v (T - c), lo, hi) = total by exact piecewise Newton steps; None if they
    have not settled within ``steps`` (or the piece is flat: the caller then sweeps)."""
    dot = np.dot
    vc_sum = float(dot(v, c))
    t = (total + vc_sum) / float(np.add.reduce(v))           # every worker free
    if t_hi is None:                                         # floors only: the set only grows
        prev = None
        vc = v * c
        for _ in range(steps):
            at_lo = t <= t_lo
            if prev is None:
                if not at_lo.any():
                    return t
            elif (at_lo == prev).all():
                return t
            prev = at_lo
            free = ~at_lo
            s = float(dot(v, free))
            if not s > 0:
                return None
            t = (total - float(dot(lo, at_lo)) + float(dot(vc, free))) / s
        return None
    at_lo = np.zeros(v.size, dtype=bool)
    at_hi = at_lo
    for _ in range(steps):
        new_lo = t <= t_lo
        new_hi = t >= t_hi
        if (new_lo == at_lo).all() and (new_hi == at_hi).all():
            return t
        at_lo, at_hi = new_lo, new_hi
        free = ~(at_lo | at_hi)
        s = float(dot(v, free))
        if not s > 0:
            return None
        t = (total - float(dot(lo, at_lo)) - float(np.add.reduce(hi[at_hi]))
             + float(dot(v * c, free))) / s
    return None


def _sweep_crossing(v: np.ndarray, total: float, lo_sum: float, t_lo: np.ndarray,
                    t_hi: np.ndarray) -> float:
    """The crossing by one sort of the breakpoints and a cumulative sweep (always exact)."""
    times = np.concatenate([t_lo, t_hi])
    dslope = np.concatenate([v, -v])
    finite = np.isfinite(times)
    times, dslope = times[finite], dslope[finite]
    order = np.argsort(times, kind="stable")
    times, dslope = times[order], dslope[order]
    slope_after = np.cumsum(dslope)
    # f at each breakpoint: f(times[0]) = Σ lo, then f grows by slope * gap between breakpoints.
    gaps = np.diff(times)
    f_at = np.concatenate([[lo_sum], lo_sum + np.cumsum(slope_after[:-1] * gaps)])
    k = int(np.searchsorted(f_at, total, side="left"))
    if k == 0:
        return float(times[0]) if times.size else 0.0
    j = k - 1                                    # total lies in (f_at[j], f_at[j+1]]
    s = slope_after[j]
    return float(times[j] + (total - f_at[j]) / s) if s > 0 else float(times[j])


def _pick(frac: np.ndarray, cand: np.ndarray, k: int, largest: bool) -> np.ndarray:
    """The ``k`` entries of ``cand`` (ascending indices) with the largest (or smallest) ``frac``;
    ties go to the lowest index when ``largest``, to the highest otherwise. O(n): one partition
    instead of a full sort (the same set a stable lexsort would pick first)."""
    if k >= cand.size:
        return cand
    f = frac[cand]
    if not largest:
        f = -f
        cand, f = cand[::-1], f[::-1]            # ties to the highest index come first
    thr = np.partition(f, cand.size - k)[cand.size - k]
    above = cand[f > thr]
    equal = cand[f == thr][: k - above.size]
    return np.concatenate([above, equal])


def check_rounding(left: int, n: int, total: int) -> None:
    """Shares that solve the split lose less than one sample each to flooring, so at most ``n``
    are left to hand out. More means the real-valued solve overflowed (speeds near the float
    limit, which a report may carry): refuse it rather than hand out samples ``n`` per round,
    which for shares near 1e12 took some 1e10 rounds (found by review)."""
    if abs(left) > n:
        raise ValueError(f"the shares are {left} samples from the total {total} after rounding "
                         f"down: the speeds or overheads overflowed")


def round_bounded_arrays(s: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Largest-remainder rounding of real shares ``s`` within [lo, hi] (``hi`` may hold inf), by
    position: ties go to the lower position (the lower worker id when positions follow sorted ids).

    Floors every share, then gives the leftover units to the largest fractional parts, never
    crossing a bound; float dust is absorbed by the same rule, so the result sums to ``total``
    exactly and stays in [lo_i, hi_i]. O(n) (a partition, no sort).
    """
    s = np.asarray(s, dtype=np.float64)
    lo_a = np.asarray(lo, dtype=np.float64)
    hi_a = np.asarray(hi, dtype=np.float64)
    out = np.floor(s + 1e-9)
    np.maximum(out, lo_a, out=out)
    np.minimum(out, hi_a, out=out)
    left = int(round(total - float(np.add.reduce(out))))
    check_rounding(left, out.size, total)
    all_pos = None
    while left != 0:
        frac = s - out
        if left > 0:
            room = out < hi_a
            if room.all():
                all_pos = np.arange(out.size) if all_pos is None else all_pos
                cand = all_pos
            else:
                cand = np.flatnonzero(room)
            take = _pick(frac, cand, left, largest=True)
            out[take] += 1
        else:
            take = _pick(frac, np.flatnonzero(out > lo_a), -left, largest=False)
            out[take] -= 1
        if take.size == 0:
            raise ValueError(f"cannot place {left} samples within the workers' bounds")
        left += -take.size if left > 0 else take.size
    return out.astype(np.int64)


def round_bounded(shares: Mapping[int, float], total: int, lo: Mapping[int, int],
                  hi: Mapping[int, int | None]) -> dict[int, int]:
    """:func:`round_bounded_arrays` on mappings keyed by worker id (ties to the lower id)."""
    ws = sorted(shares)
    out = round_bounded_arrays(np.array([shares[w] for w in ws], dtype=np.float64), total,
                               np.array([lo[w] for w in ws], dtype=np.float64),
                               np.array([math.inf if hi.get(w) is None else hi[w] for w in ws],
                                        dtype=np.float64))
    return dict(zip(ws, out.tolist()))


def caps_array(workers: Sequence[int], max_batch: CapsArg) -> np.ndarray:
    """Per-worker caps as a float array (inf = uncapped), from :data:`CapsArg`."""
    n = len(workers)
    if max_batch is None:
        return np.full(n, math.inf)
    if isinstance(max_batch, Mapping):
        return np.array([math.inf if (c := max_batch.get(w)) is None else float(int(c)) for w in workers],
                        dtype=np.float64)
    return np.full(n, float(int(max_batch)))


def check_feasible_arrays(ids: np.ndarray, total: int, min_batch: int, caps: np.ndarray) -> None:
    """:func:`check_feasible` on arrays (``caps`` aligned with ``ids``, inf = uncapped)."""
    n = int(ids.size)
    if n == 0:
        raise ValueError("no workers to split the batch over")
    if min_batch < 0:
        raise ValueError(f"min_batch must be >= 0, got {min_batch}")
    if min_batch * n > total:
        raise ValueError(f"global batch {total} cannot give {n} workers at least {min_batch} each")
    low = caps < min_batch
    if low.any():
        bad = np.flatnonzero(low)
        raise ValueError(f"workers {ids[bad].tolist()} have a batch cap below min_batch={min_batch} "
                         f"(caps {caps[bad].astype(np.int64).tolist()}): they cannot take part")
    if np.isfinite(caps).all():
        room = int(caps.sum())
        if room < total:
            raise ValueError(f"global batch {total} exceeds the sum of the workers' batch caps ({room})")


def finish_time_split_arrays(speeds: np.ndarray, overheads: np.ndarray | None, total: int,
                             lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """Integer equal-finish-time split by position: real solve, then bounded rounding.

    The caller has checked feasibility (Σ lo <= total <= Σ hi, lo <= hi); positions are in
    ascending worker-id order so that rounding ties go to the lower id.
    """
    c = np.zeros(speeds.size) if overheads is None else overheads
    if speeds.size <= SMALL_N:
        return np.array(split_small(speeds.tolist(), c.tolist(), total, lo.tolist(), hi.tolist()),
                        dtype=np.int64)
    x, _ = equal_finish_times(speeds, c, total, lo, hi)
    return round_bounded_arrays(x, total, lo, hi)


#: Up to this many workers the split is computed on Python floats (:func:`split_small`): for a
#: handful of workers, ~40 numpy calls cost more than the arithmetic, above all when the
#: coordinator has been idle and the CPU caches are cold.
SMALL_N = 16


def split_small(v: list[float], c: list[float], total: int, lo: list[float],
                hi: list[float]) -> list[int]:
    """:func:`equal_finish_times` + :func:`round_bounded_arrays` on Python lists: the same
    algorithm (piecewise Newton steps, sweep fallback, largest remainder with ties to the lower
    position), for small N."""
    n = len(v)
    inf = math.inf
    if n and not all(0.0 <= x < inf for x in v):
        raise ValueError("speeds must be finite and non-negative")
    vmax = max(v) if n else 1.0
    tiny = 1e-12 * (vmax if vmax > 0 else 1.0)
    v = [x if x >= tiny else tiny for x in v]
    lo_sum, hi_sum = sum(lo), sum(hi)
    if lo_sum > total + 1e-9 or hi_sum < total - 1e-9:
        raise ValueError(f"total {total} is outside [Σ lo, Σ hi] = [{lo_sum}, {hi_sum}]")
    t_lo = [ci + li / vi for vi, ci, li in zip(v, c, lo)]
    t_hi = [ci + hi_i / vi for vi, ci, hi_i in zip(v, c, hi)]
    vc = [vi * ci for vi, ci in zip(v, c)]
    t: float | None = (total + sum(vc)) / sum(v)
    at_lo = at_hi = [False] * n
    for _ in range(8):
        assert t is not None
        new_lo = [t <= a for a in t_lo]
        new_hi = [t >= b for b in t_hi]
        if new_lo == at_lo and new_hi == at_hi:
            break
        at_lo, at_hi = new_lo, new_hi
        s = sum(vi for vi, a, b in zip(v, at_lo, at_hi) if not (a or b))
        if not s > 0:
            t = None
            break
        t = (total - sum(li for li, a in zip(lo, at_lo) if a) - sum(h for h, b in zip(hi, at_hi) if b)
             + sum(x for x, a, b in zip(vc, at_lo, at_hi) if not (a or b))) / s
    else:
        t = None
    if t is None:                                  # sweep over the sorted breakpoints
        pts = sorted([(tl, i, vi) for i, (tl, vi) in enumerate(zip(t_lo, v))]
                     + [(th, n + i, -vi) for i, (th, vi) in enumerate(zip(t_hi, v)) if th < inf])
        times = [p[0] for p in pts]
        f_at, slopes, slope = [float(lo_sum)], [], 0.0
        for j, p in enumerate(pts):
            slope += p[2]
            slopes.append(slope)
            if j + 1 < len(pts):
                f_at.append(f_at[-1] + slope * (times[j + 1] - times[j]))
        k = bisect.bisect_left(f_at, total)
        if k == 0:
            t = times[0] if times else 0.0
        else:
            s = slopes[k - 1]
            t = times[k - 1] + (total - f_at[k - 1]) / s if s > 0 else times[k - 1]
    x = [min(max(vi * (t - ci), li), h) for vi, ci, li, h in zip(v, c, lo, hi)]
    out = [min(max(float(math.floor(xi + 1e-9)), li), h) for xi, li, h in zip(x, lo, hi)]
    left = int(round(total - sum(out)))
    check_rounding(left, n, total)
    while left != 0:
        if left > 0:
            cand = sorted((i for i in range(n) if out[i] < hi[i]), key=lambda i: (-(x[i] - out[i]), i))
            take = cand[:left]
            for i in take:
                out[i] += 1
            left -= len(take)
        else:
            cand = sorted((i for i in range(n) if out[i] > lo[i]), key=lambda i: (x[i] - out[i], -i))
            take = cand[:-left]
            for i in take:
                out[i] -= 1
            left += len(take)
        if not take:
            raise ValueError(f"cannot place {left} samples within the workers' bounds")
    return [int(o) for o in out]


def finish_time_split(speeds: Mapping[int, float], overheads: Mapping[int, float] | None,
                      total: int, min_batch: int = 1, max_batch: CapsArg = None, *,
                      floors: Mapping[int, int] | None = None) -> dict[int, int]:
    """Integer equal-finish-time split: the analytical LB-BSP rule with floor, caps and exact sum.

    ``floors`` optionally raises individual workers' lower bounds above ``min_batch`` (a caller
    limiting how far one decision may move a worker).
    """
    ws = sorted(speeds)
    caps = resolve_caps(ws, max_batch)
    check_feasible(ws, total, min_batch, caps)
    lo = {w: max(min_batch, (floors or {}).get(w, min_batch)) for w in ws}
    if any((c := caps[w]) is not None and lo[w] > c for w in ws) or sum(lo.values()) > total:
        raise ValueError(f"per-worker floors {lo} do not fit the caps or the total {total}")
    oh = overheads or {}
    out = finish_time_split_arrays(
        np.array([speeds[w] for w in ws], dtype=np.float64),
        np.array([oh.get(w, 0.0) for w in ws], dtype=np.float64), total,
        np.array([lo[w] for w in ws], dtype=np.float64),
        np.array([math.inf if caps[w] is None else caps[w] for w in ws], dtype=np.float64))
    return dict(zip(ws, out.tolist()))


def bounded_split_arrays(weights: np.ndarray, total: int, min_batch: int, caps: np.ndarray) -> np.ndarray:
    """:func:`bounded_split` by position (weights aligned with sorted ids, caps inf = none)."""
    w = np.asarray(weights, dtype=np.float64)
    if w.size and (not np.isfinite(w).all() or (w < 0).any()):
        raise ValueError(f"weights must be finite and non-negative: {w.tolist()}")
    if w.size and w.sum() <= 0:
        w = np.ones(w.size)
    return finish_time_split_arrays(w, None, total, np.full(w.size, float(min_batch)), caps)


def bounded_split(weights: Mapping[int, float], total: int, min_batch: int = 1,
                  max_batch: CapsArg = None) -> dict[int, int]:
    """x_i ∝ w_i with every x_i in [min_batch, cap_i] (water-filling both ways), summing to total."""
    if any(not math.isfinite(v) or v < 0 for v in weights.values()):
        raise ValueError(f"weights must be finite and non-negative: {dict(weights)}")
    if weights and sum(weights.values()) <= 0:
        weights = {w: 1.0 for w in weights}
    return finish_time_split(weights, None, total, min_batch, max_batch)
