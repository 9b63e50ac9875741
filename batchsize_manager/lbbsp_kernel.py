"""LB-BSP's per-decision work on many workers compiled (numba): a batch of received reports
observed in one pass over their rows, the estimate (forecast speeds, the tail of the server-seen
finish times) and the equal-finish-time split one call each, and the manager's reads and checks
around them.

Why: a decision paced like a real run finds the CPU's caches cold, and each distinct numpy call
then costs tens of µs whatever the array sizes (``benchmarks/bench_decision_cold.py``; see
:mod:`predictors.jit`). At 100 workers a decision was some 80 numpy calls besides the
predictor's: reading the reports' columns, the warm-up and window bookkeeping, the stall share
and two row quantiles, the Newton steps and the rounding of the split, the manager's checks.
Here each step is one compiled call over plain loops, and the row quantiles keep only the few
values at the quantile's end of the window instead of sorting it.

The numpy code in :mod:`batchsize_manager.lbbsp`, :mod:`batchsize_manager.allocation` and
:mod:`batchsize_manager.manager` stays: it is the reference the tests hold these to, the path for
everything but the steady state (workers still warming up or filling their windows, a quota
below a core, reports of unknown or repeated workers, OOM reports), and the whole path where
numba does not import (:data:`predictors.jit.AVAILABLE`). The split is
:func:`~batchsize_manager.allocation.split_small`'s algorithm step for step (its sums run in the
same order, so its integers are the same); against the numpy split of many workers, whose sums
are BLAS dot products, the real-valued shares may differ in the last bits, and the integer
split with them only at a rounding tie. Divisions follow numpy's rules
(``error_model="numpy"``: x / 0 is inf or nan).
"""

from __future__ import annotations

import math

import numpy as np

from predictors.jit import AVAILABLE, as_float64, as_int64, check_slots, jit

__all__ = ["AVAILABLE", "as_float64", "as_int64", "check_split", "estimate", "known_slots", "latest_finish",
           "observe_rows", "record_history", "scan_rows", "split", "tail_rows", "warm_up"]


@jit(error_model="numpy")
def _before(a: float, b: float) -> bool:
    """a sorts before b, NaNs last (numpy's order)."""
    return a < b or (b != b and a == a)


@jit(error_model="numpy")
def _row_quantile_full(r: np.ndarray, q: float, buf: np.ndarray) -> float:
    """``np.quantile(r, q)`` (linear) of one row: :func:`~batchsize_manager.lbbsp._row_quantile`'s
    arithmetic on the two order statistics it reads, found by keeping only the few values at
    that end of the row in ``buf`` (sorted by insertion; NaNs sort last, as numpy's): the 0.9
    quantile of 32 values needs the 5 largest. ``buf``: scratch of at least ``r.size``."""
    n = r.size
    pos = q * (n - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, n - 1)
    if hi + 1 <= n - lo:                      # keep the hi + 1 smallest, ascending
        k = hi + 1
        m = 0
        for i in range(n):
            x = r[i]
            if m == k:
                if not _before(x, buf[k - 1]):
                    continue
                j = k - 1
            else:
                j = m
                m += 1
            while j > 0 and _before(x, buf[j - 1]):
                buf[j] = buf[j - 1]
                j -= 1
            buf[j] = x
        a, b = buf[lo], buf[hi]
    else:                                     # keep the n - lo largest, descending
        k = n - lo
        m = 0
        for i in range(n):
            x = r[i]
            if m == k:
                if not _before(buf[k - 1], x):
                    continue
                j = k - 1
            else:
                j = m
                m += 1
            while j > 0 and _before(buf[j - 1], x):
                buf[j] = buf[j - 1]
                j -= 1
            buf[j] = x
        a, b = buf[k - 1], buf[k - 1 - (hi - lo)]
    return a * (1.0 - (pos - lo)) + b * (pos - lo)


@jit(error_model="numpy")
def tail_rows(slots: np.ndarray, v: np.ndarray, ff: np.ndarray, fx: np.ndarray, fc: np.ndarray,
              fv: np.ndarray, quantile: float, base_quantile: float, per_sample: bool,
              tail_finish: bool) -> tuple[np.ndarray, np.ndarray]:
    """``LBBSPCpuPolicy._tail_rows`` for slots whose finish windows are all full (no NaN), with
    its caller's floor at 0: per slot s with speed v, (v lowered by the stall share where
    ``per_sample``, max(0, the ``quantile`` of finish_j - x_j / v_i)); with ``tail_finish``
    False, of finish_j - compute_j and v unchanged. ``ff``, ``fx``, ``fc``, ``fv``: the
    (slots x window) finish times, batch sizes, compute times and planned speeds."""
    n, w = slots.size, ff.shape[1]
    check_slots(slots, ff.shape[0])
    vr = np.empty(n)
    c = np.empty(n)
    work = np.empty(w)
    rest = np.empty(w)
    buf = np.empty(w)
    for i in range(n):
        s = slots[i]
        vi = v[i]
        if tail_finish:
            if per_sample:
                work_sum = 0.0
                finish_sum = 0.0
                for j in range(w):
                    p = fv[s, j]
                    wj = fx[s, j] / p if p > 0 else fc[s, j]
                    work[j] = wj
                    rest[j] = ff[s, j] - wj
                    work_sum += wj
                    finish_sum += ff[s, j]
                base = _row_quantile_full(rest, base_quantile, buf)
                den = finish_sum - w * base
                share = work_sum / den if den != 0.0 else 1.0   # numpy: inf or nan, then 1
                if share > 1.0:
                    share = 1.0
                if not share > 0:          # nan, 0 or less: no share known
                    share = 1.0
                vi = vi * share
            for j in range(w):
                rest[j] = ff[s, j] - fx[s, j] / vi
        else:
            for j in range(w):
                rest[j] = ff[s, j] - fc[s, j]
        vr[i] = vi
        q = _row_quantile_full(rest, quantile, buf)
        c[i] = 0.0 if q < 0.0 else q             # np.maximum(0, q): nan stays nan
    return vr, c


@jit(error_model="numpy")
def estimate(slots: np.ndarray, v: np.ndarray, plan: bool, vplan: np.ndarray, overhead: np.ndarray,
             tail: bool, fn: np.ndarray, use_quota: bool, quota: np.ndarray, ff: np.ndarray,
             fx: np.ndarray, fc: np.ndarray, fv: np.ndarray, quantile: float, base_quantile: float,
             per_sample: bool, tail_finish: bool) -> tuple[bool, np.ndarray, np.ndarray]:
    """``LBBSPCpuPolicy._estimate_arrays`` after the forecast ``v`` in the steady state, where
    every worker has a speed and (``tail``) a full finish window of at least 4 entries and no
    quota below a core (``use_quota``), or (no ``tail``) an overhead: (True, speeds, overheads).
    (False, ...) otherwise, for the numpy code, which fills in means and plans by quota. Writes
    ``vplan[slots] = v`` first where ``plan``, as the numpy code does."""
    n = slots.size
    check_slots(slots, overhead.shape[0])
    if plan:
        for i in range(n):
            vplan[slots[i]] = v[i]
    need = max(ff.shape[1], 4)
    for i in range(n):
        s = slots[i]
        if not v[i] > 0:
            return False, v, v
        if tail:
            if fn[s] < need or (use_quota and quota[s] < 1.0):
                return False, v, v
        elif overhead[s] != overhead[s]:
            return False, v, v
    if not tail:
        c = np.empty(n)
        for i in range(n):
            c[i] = overhead[slots[i]]
        return True, v, c
    vr, c = tail_rows(slots, v, ff, fx, fc, fv, quantile, base_quantile, per_sample, tail_finish)
    for i in range(n):
        if c[i] != c[i]:
            return False, v, v
    return True, vr, c


@jit(error_model="numpy")
def latest_finish(c: np.ndarray, x: np.ndarray, v: np.ndarray) -> float:
    """max_i c_i + x_i / v_i: the iteration time the model predicts for the split ``x``."""
    t = -math.inf
    for i in range(c.size):
        ti = c[i] + x[i] / v[i]
        if ti > t or ti != ti:                   # numpy's max: a nan wins
            t = ti
            if ti != ti:
                break
    return t


@jit(error_model="numpy")
def _duration(a: float) -> float:
    """A duration that counts (``ReportBatch._durations``): finite and > 0, else 0."""
    return a if 0.0 < a < math.inf else 0.0


@jit(error_model="numpy")
def _measured(a: float) -> float:
    """``ReportBatch.measured``: finite, else nan."""
    return a if math.isfinite(a) else math.nan


@jit(error_model="numpy")
def observe_rows(slots: np.ndarray, head: np.ndarray, rows: np.ndarray, cols: np.ndarray,
                 exog_cols: np.ndarray, seen: np.ndarray, warmup: int, overhead: np.ndarray,
                 alpha: float, use_overhead: bool, windows: bool, fn: np.ndarray, fx: np.ndarray,
                 ff: np.ndarray, fc: np.ndarray, fv: np.ndarray, vplan: np.ndarray, use_quota: bool,
                 fcpu: np.ndarray, fwork: np.ndarray,
                 quota: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``LBBSPCpuPolicy._observe`` of a batch read from its reports' rows, but for feeding the
    predictor: per report i of slot ``slots[i]`` (distinct), in order, the speed (batch /
    compute, kept where finite and > 0), the warm-up count, the overhead's EMA and the finish
    window's entry (with the CPU times and the quota where ``use_quota``). ``head``: the rows'
    (worker, iteration, batch size); ``rows``: their telemetry; ``cols``: the positions in a row
    of compute_s, finish_s, data_s, prev_push_s, prev_pull_s, cpu_s, compute_cpu_s and
    cpu_quota; ``exog_cols``: of the exogenous inputs the predictor takes (none: no inputs).
    Returns the positions, slots, speeds and exogenous inputs (finite, else 0: ``ReportBatch.exog``)
    of the reports to feed the predictor."""
    n = slots.size
    check_slots(slots, seen.shape[0])
    i_comp, i_fin, i_data, i_push, i_pull = cols[0], cols[1], cols[2], cols[3], cols[4]
    i_cpu, i_work, i_quota = cols[5], cols[6], cols[7]
    w = ff.shape[1]
    keep = np.empty(n, dtype=np.int64)
    keep_slots = np.empty(n, dtype=np.int64)
    keep_v = np.empty(n)
    n_exog = exog_cols.size
    keep_x = np.empty((n, n_exog))
    m = 0
    for i in range(n):
        s = slots[i]
        c = rows[i, i_comp]
        b = float(head[i, 2])
        if not c > 0:                    # nan, 0 or less: no speed
            continue
        v = b / c
        if not (0.0 < v < math.inf):
            continue
        seen[s] += 1
        if seen[s] <= warmup:
            continue
        keep[m] = i
        keep_slots[m] = s
        keep_v[m] = v
        for e in range(n_exog):
            x = rows[i, exog_cols[e]]
            keep_x[m, e] = x if math.isfinite(x) else 0.0
        m += 1
        fin = _duration(rows[i, i_fin])
        if not use_overhead:
            o = 0.0
        elif fin > 0:                    # seen by the servers: finish - compute
            o = max(0.0, fin - c)
        else:                            # the worker's own: data + previous push + pull
            o = _duration(rows[i, i_data]) + _duration(rows[i, i_push]) + _duration(rows[i, i_pull])
        prev = overhead[s]
        overhead[s] = o if prev != prev else alpha * o + (1 - alpha) * prev
        if windows and fin > 0:
            count = fn[s]
            pos = count % w
            fx[s, pos] = b
            ff[s, pos] = fin
            fc[s, pos] = c
            fv[s, pos] = vplan[s]
            if use_quota:
                fcpu[s, pos] = _measured(rows[i, i_cpu])
                fwork[s, pos] = _measured(rows[i, i_work])
            fn[s] = count + 1
        if use_quota:
            quota[s] = _measured(rows[i, i_quota])
    return keep[:m], keep_slots[:m], keep_v[:m], keep_x[:m]


@jit(error_model="numpy")
def record_history(slots: np.ndarray, counts: np.ndarray, v: np.ndarray, exog: np.ndarray,
                   hv: np.ndarray, hx: np.ndarray) -> None:
    """``LBBSPCpuPolicy._feed``'s ring of the last observations: slot s's entry number
    (counts_i - 1) mod history gets the speed and the exogenous inputs (zeros where ``exog``
    has no rows)."""
    check_slots(slots, hv.shape[0])
    h = hv.shape[1]
    n_exog = hx.shape[2]
    has_exog = exog.shape[0] > 0
    for i in range(slots.size):
        s = slots[i]
        p = (counts[i] - 1) % h
        hv[s, p] = v[i]
        for e in range(n_exog):
            hx[s, p, e] = exog[i, e] if has_exog else 0.0


@jit(error_model="numpy")
def scan_rows(rows: np.ndarray, i_oom: int, i_headroom: int) -> tuple[bool, bool]:
    """(does any report say out of memory, does any carry a memory headroom): the manager's
    ``ReportBatch.any_oom`` and ``headroom_rows().size > 0`` in one pass over the rows."""
    oom = False
    headroom = False
    for i in range(rows.shape[0]):
        if rows[i, i_oom] != 0.0:
            oom = True
        if rows[i, i_headroom] == rows[i, i_headroom]:
            headroom = True
    return oom, headroom


@jit(error_model="numpy")
def known_slots(head: np.ndarray, lut: np.ndarray, scratch: np.ndarray) -> tuple[np.ndarray, int]:
    """The slots of the reports' workers (``head[:, 0]``) by the id -> slot table ``lut``, and 0
    when each has a slot and none repeats; 1 when some id is outside the table or has no slot, 2
    when a slot repeats (the caller then takes the numpy path, which adds and splits).
    ``scratch``: an int array at least as long as the slots' range."""
    n = head.shape[0]
    slots = np.empty(n, dtype=np.int64)
    for i in range(n):
        w = head[i, 0]
        if w < 0 or w >= lut.size:
            return slots, 1
        s = lut[w]
        if s < 0 or s >= scratch.size:
            return slots, 1
        slots[i] = s
    for i in range(n):
        scratch[slots[i]] = i
    for i in range(n):
        if scratch[slots[i]] != i:
            return slots, 2
    return slots, 0


@jit(error_model="numpy")
def check_split(x: np.ndarray, lo: int, caps: np.ndarray) -> tuple[int, int]:
    """(Σ x, the first position outside [lo, caps_i] or -1): the manager's check of a split."""
    total = 0
    bad = -1
    for i in range(x.size):
        total += x[i]
        if bad < 0 and (x[i] < lo or x[i] > caps[i]):
            bad = i
    return total, bad


@jit(error_model="numpy")
def split(v: np.ndarray, c: np.ndarray, total: int, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """:func:`~batchsize_manager.allocation.split_small` on arrays: the real equal-finish-time
    split (piecewise Newton steps from the all-free start, a sweep over the sorted breakpoints
    when they do not settle in 8), then largest-remainder rounding within [lo, hi] with ties to
    the lower position when adding and to the higher when taking away. ``hi`` may hold inf."""
    n = v.size
    vmax = 1.0
    for i in range(n):
        if not (0.0 <= v[i] < math.inf):
            raise ValueError("speeds must be finite and non-negative")
        if i == 0 or v[i] > vmax:
            vmax = v[i]
    tiny = 1e-12 * (vmax if vmax > 0 else 1.0)
    vv = np.empty(n)
    lo_sum = 0.0
    hi_sum = 0.0
    for i in range(n):
        vv[i] = v[i] if v[i] >= tiny else tiny
        lo_sum += lo[i]
        hi_sum += hi[i]
    if lo_sum > total + 1e-9 or hi_sum < total - 1e-9:
        raise ValueError("total is outside [sum of lo, sum of hi]")
    t_lo = np.empty(n)
    t_hi = np.empty(n)
    vc = np.empty(n)
    v_sum = 0.0
    vc_sum = 0.0
    for i in range(n):
        t_lo[i] = c[i] + lo[i] / vv[i]
        t_hi[i] = c[i] + hi[i] / vv[i]
        vc[i] = vv[i] * c[i]
        v_sum += vv[i]
        vc_sum += vc[i]
    t = (total + vc_sum) / v_sum
    at_lo = np.zeros(n, dtype=np.bool_)
    at_hi = np.zeros(n, dtype=np.bool_)
    settled = False
    for _ in range(8):
        same = True
        for i in range(n):
            a = t <= t_lo[i]
            b = t >= t_hi[i]
            if a != at_lo[i] or b != at_hi[i]:
                same = False
            at_lo[i] = a
            at_hi[i] = b
        if same:
            settled = True
            break
        s = 0.0
        for i in range(n):
            if not (at_lo[i] or at_hi[i]):
                s += vv[i]
        if not s > 0:
            break
        lo_in = 0.0
        for i in range(n):
            if at_lo[i]:
                lo_in += lo[i]
        hi_in = 0.0
        for i in range(n):
            if at_hi[i]:
                hi_in += hi[i]
        vc_free = 0.0
        for i in range(n):
            if not (at_lo[i] or at_hi[i]):
                vc_free += vc[i]
        t = (total - lo_in - hi_in + vc_free) / s
    if not settled:                       # sweep over the sorted breakpoints
        m = n
        for i in range(n):
            if t_hi[i] < math.inf:
                m += 1
        times = np.empty(m)
        dslope = np.empty(m)
        for i in range(n):
            times[i] = t_lo[i]
            dslope[i] = vv[i]
        k = n
        for i in range(n):
            if t_hi[i] < math.inf:
                times[k] = t_hi[i]
                dslope[k] = -vv[i]
                k += 1
        order = np.argsort(times, kind="mergesort")   # ties by position: lo entries, then hi
        f_at = np.empty(m)
        slopes = np.empty(m)
        f_at[0] = lo_sum
        slope = 0.0
        for j in range(m):
            slope += dslope[order[j]]
            slopes[j] = slope
            if j + 1 < m:
                f_at[j + 1] = f_at[j] + slope * (times[order[j + 1]] - times[order[j]])
        kk, hi_k = 0, m                           # bisect_left, as split_small's: f_at is not
        while kk < hi_k:                          # monotone where huge slopes cancel
            mid = (kk + hi_k) // 2
            if f_at[mid] < total:
                kk = mid + 1
            else:
                hi_k = mid
        if kk == 0:
            t = times[order[0]] if m else 0.0
        else:
            sl = slopes[kk - 1]
            tk = times[order[kk - 1]]
            t = tk + (total - f_at[kk - 1]) / sl if sl > 0 else tk
    x = np.empty(n)
    out = np.empty(n)
    out_sum = 0.0
    for i in range(n):
        xi = min(max(vv[i] * (t - c[i]), lo[i]), hi[i])
        x[i] = xi
        if xi != xi:                              # math.floor's errors in split_small
            raise ValueError("cannot convert float NaN to integer")
        if xi + 1e-9 == math.inf:
            raise OverflowError("cannot convert float infinity to integer")
        oi = min(max(float(math.floor(xi + 1e-9)), lo[i]), hi[i])
        out[i] = oi
        out_sum += oi
    left = int(round(total - out_sum))
    if abs(left) > n:                             # see allocation.check_rounding
        raise ValueError("the shares are far from the total: the speeds or overheads overflowed")
    key = np.empty(n)
    while left != 0:
        cand = np.empty(n, dtype=np.int64)
        m = 0
        if left > 0:                      # largest remainders first, ties to the lower position
            for i in range(n):
                if out[i] < hi[i]:
                    cand[m] = i
                    key[m] = -(x[i] - out[i])
                    m += 1
        else:                             # smallest first, ties to the higher position
            for i in range(n - 1, -1, -1):
                if out[i] > lo[i]:
                    cand[m] = i
                    key[m] = x[i] - out[i]
                    m += 1
        if m == 0:
            raise ValueError("cannot place the samples within the workers' bounds")
        order = np.argsort(key[:m], kind="mergesort")
        take = min(m, abs(left))
        step = 1.0 if left > 0 else -1.0
        for j in range(take):
            out[cand[order[j]]] += step
        left += -take if left > 0 else take
    res = np.empty(n, dtype=np.int64)
    for i in range(n):
        res[i] = int(out[i])
    return res


def warm_up() -> None:
    """Load (or compile) every signature a decision calls (``tail_rows`` comes inside
    ``estimate``), now at the policy's construction, not in a decision."""
    if not AVAILABLE:
        return
    one = np.ones(1)
    no_slot = np.zeros(0, dtype=np.int64)
    split(one, np.zeros(1), 1, one, one)
    estimate(no_slot, np.zeros(0), True, np.zeros(1), np.zeros(1), True, np.zeros(1, dtype=np.int64), True,
             np.zeros(1), np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)), 0.9, 0.25,
             True, True)
    state = (np.zeros(0, dtype=np.int64), np.zeros(1, dtype=np.int64), 1, np.zeros(1), 0.3, True, True,
             np.zeros(1, dtype=np.int64), np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)), np.zeros((1, 2)),
             np.zeros(1), True, np.zeros((1, 2)), np.zeros((1, 2)), np.zeros(1))
    records = np.zeros(2, dtype=[("head", "<i8", (3,)), ("tel", "<f8", (8,))])
    records.flags.writeable = False                # as read from the joined bytes
    cols = np.arange(8, dtype=np.int64)
    # the rows as read from the joined reports (strided views) and as a sub-batch's copies
    observe_rows(no_slot, records["head"], records["tel"], cols, *state)
    observe_rows(no_slot, np.zeros((0, 3), dtype=np.int64), np.zeros((0, 8)), cols, *state)
    for n_exog in (0, 3):
        record_history(no_slot, no_slot, np.zeros(0), np.zeros((0, n_exog)), np.zeros((1, 2)),
                       np.zeros((1, 2, n_exog)))
    for head, rows in ((records["head"], records["tel"]), (np.zeros((0, 3), dtype=np.int64), np.zeros((0, 8)))):
        scan_rows(rows, 0, 1)
        known_slots(head, np.zeros(1, dtype=np.int64), np.zeros(1, dtype=np.int64))
    latest_finish(one, np.ones(1, dtype=np.int64), one)
    check_split(np.ones(1, dtype=np.int64), 1, one)
