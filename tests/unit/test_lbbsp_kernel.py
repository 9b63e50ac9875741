"""The compiled LB-BSP decision (:mod:`batchsize_manager.lbbsp_kernel`) against the numpy code it
stands in for: the split against :func:`split_small` (the same algorithm, so the same integers,
ties included), the tail model against the numpy rows, and whole runs of the policy compiled
and on numpy, which must observe into the same state and decide the same splits."""

from __future__ import annotations

import json
import math
import random

import numpy as np
import pytest

from batchsize_manager import BatchSizeManager, WorkerReport
from batchsize_manager import lbbsp_kernel as K
from batchsize_manager.allocation import split_small
from batchsize_manager.lbbsp import STALL_BASE_QUANTILE, _row_quantile, _stall_share
from batchsize_manager.simulation import SimulatedWorker, Simulation
from ps_common.protocol import Push, decode, encode
from ps_common.report import Telemetry
from tests.report_util import edge_report
from tests.unit.test_bsm_speed import random_problem

pytestmark = pytest.mark.skipif(not K.AVAILABLE, reason="numba does not import here")


def test_split_is_split_small_to_the_sample():
    """Random problems of 1-80 workers with floors, caps and overheads, near ties included: the
    kernel's integers are split_small's, and it refuses what split_small refuses."""
    rng = random.Random(11)
    for _ in range(1500):
        v, c, total, lo, hi = random_problem(rng, rng.randint(1, 80))
        want = split_small(v, c, total, [float(x) for x in lo], hi)
        got = K.split(np.array(v), np.array(c), total, np.array(lo, dtype=float), np.array(hi))
        assert got.tolist() == want, (v, c, total, lo, hi)
    v = [1.0, 100.0, 1.0, 100.0, 3.0] * 8          # Newton steps that cycle: the sweep
    c = [0.0, 1.0, 2.0, 0.5, 0.1] * 8
    lo = [1.0, 30.0, 1.0, 1.0, 20.0] * 8
    hi = [50.0, 40.0, 9.0, math.inf, 25.0] * 8
    for total in (int(sum(lo)), int(sum(lo)) + 1, 1500, 2000):
        assert K.split(np.array(v), np.array(c), total, np.array(lo), np.array(hi)).tolist() == \
            split_small(v, c, total, lo, hi)
    zero = np.array([0.0, 1e3, 2e3])                 # a zero speed: kept at its floor
    assert K.split(zero, np.zeros(3), 30, np.ones(3), np.full(3, math.inf)).tolist() == \
        split_small(zero.tolist(), [0.0] * 3, 30, [1.0] * 3, [math.inf] * 3)
    with pytest.raises(ValueError, match="outside"):
        K.split(np.ones(3), np.zeros(3), 2, np.ones(3), np.full(3, math.inf))
    with pytest.raises(ValueError, match="finite"):
        K.split(np.array([1.0, math.nan]), np.zeros(2), 4, np.ones(2), np.full(2, math.inf))


def _numpy_tail(slots, v, ff, fx, fc, fv, per_sample, tail_finish):
    finish, x = ff[slots], fx[slots]
    vr = v.copy()
    with np.errstate(invalid="ignore", divide="ignore"):
        if tail_finish:
            if per_sample:
                vr = vr * _stall_share(finish, fc[slots], x, fv[slots], np.empty_like(finish),
                                       np.empty_like(finish), True)
            rest = finish - x / vr[:, None]
        else:
            rest = finish - fc[slots]
    return vr, np.maximum(0.0, _row_quantile(rest, 0.9, full=True))


def test_tail_rows_match_the_numpy_rows():
    """Full windows with planned speeds that are missing (nan) or 0 (the measured compute stands
    in), any subset of slots, both stall models and both tails: the same speeds and overheads
    (to 1e-12: numpy sums a row as a BLAS product, in another order)."""
    rng = np.random.default_rng(0)
    for _ in range(100):
        cap, w = 50, int(rng.integers(2, 40))
        ff = rng.uniform(0.01, 0.2, (cap, w))
        fx = rng.integers(1, 64, (cap, w)).astype(float)
        fc = rng.uniform(0.005, 0.1, (cap, w))
        fv = rng.uniform(100, 2000, (cap, w))
        fv[rng.random((cap, w)) < 0.1] = np.nan
        fv[rng.random((cap, w)) < 0.05] = 0.0
        slots = np.sort(rng.choice(cap, int(rng.integers(1, cap)), replace=False)).astype(np.int64)
        v = rng.uniform(100, 3000, slots.size)
        for per_sample in (True, False):
            for tail_finish in (True, False):
                want_v, want_c = _numpy_tail(slots, v, ff, fx, fc, fv, per_sample, tail_finish)
                got_v, got_c = K.tail_rows(slots, v, ff, fx, fc, fv, 0.9, STALL_BASE_QUANTILE,
                                           per_sample, tail_finish)
                np.testing.assert_allclose(got_v, want_v, rtol=1e-12)
                np.testing.assert_allclose(got_c, want_c, rtol=1e-12, atol=1e-15)
    with pytest.raises(IndexError):
        K.tail_rows(np.array([50]), np.ones(1), ff, fx, fc, fv, 0.9, 0.25, True, True)


def test_row_quantile_reads_the_order_statistics_of_a_full_sort():
    """The quantile from the few values kept at one end of the row is, to the bit, the one from
    the whole row sorted (ties, NaNs sorting last, every q and row length up to 40)."""
    rng = np.random.default_rng(4)
    buf = np.empty(40)
    for n in range(1, 41):
        for _ in range(20):
            r = rng.choice([0.5, 1.0, 2.0, -1.0, 3.25], n) if rng.random() < 0.3 else rng.normal(size=n)
            if rng.random() < 0.2:
                r[rng.integers(0, n)] = math.nan
            for q in (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.99, 1.0):
                srt = np.sort(r)
                pos = q * (n - 1)
                lo = int(math.floor(pos))
                hi = min(lo + 1, n - 1)
                want = srt[lo] * (1.0 - (pos - lo)) + srt[hi] * (pos - lo)
                got = K._row_quantile_full(r.copy(), q, buf)
                assert got == want or (math.isnan(got) and math.isnan(want)), (r, q)


def test_latest_finish_is_numpys_max():
    c, v = np.array([0.01, 0.02, 0.0]), np.array([100.0, 200.0, 50.0])
    for x in (np.array([3, 5, 1]), np.array([0, 0, 0])):
        assert K.latest_finish(c, x, v) == float((c + x / v).max())
    assert K.latest_finish(c, np.array([1, 1, 1]), np.array([100.0, 0.0, 1.0])) == math.inf
    assert math.isnan(K.latest_finish(c, np.array([1, 0, 1]), np.array([100.0, 0.0, 1.0])))


def _fleet(seed: int, quota: bool, n: int = 40) -> list[SimulatedWorker]:
    """``n`` workers (40: above SMALL_N, the arrays path; 4: small batches of reports): speeds
    1-4x; with ``quota`` some are held to half a core (those the numpy code plans by their quota)."""
    return [SimulatedWorker(400.0 * (1 + i % 4), overhead=0.003, noise=0.05, seed=seed + i,
                            cpu_quota=0.5 if quota and i % 7 == 3 else None) for i in range(n)]


STATE = ("_overhead", "_seen", "_fx", "_ff", "_fc", "_fv", "_fcpu", "_fwork", "_quota", "_fn",
         "_hv", "_hx", "_vplan")


@pytest.mark.parametrize("n", [40, 4])
@pytest.mark.parametrize("args,quota", [
    ({"predictor": "ema", "finish_window": 6}, False),
    ({"predictor": "ema", "finish_window": 6}, True),
    ({"predictor": "last", "finish_window": 5, "warmup": 3, "stalls": "fixed", "use_quota": False}, True),
    ({"predictor": "ema", "finish_window": 4, "finish_tail": "overhead", "use_overhead": False}, False),
    ({"predictor": "narx", "refit": "sync", "finish_window": 6,
      "predictor_args": {"epochs": 2, "min_train": 4, "refit_every": 5}}, False),
])
def test_the_compiled_policy_decides_as_the_numpy_one(args, quota, n, monkeypatch):
    """The same simulated run (received reports with the servers' finish times; a worker
    leaving, one joining, so the slots stop running in one block) through the policy compiled and
    through its numpy code: every split equal, and the observed state equal to the bit. Without
    quota-held workers most decisions take the compiled estimate (counted); with them, none
    does (the numpy code plans them by their quota). Every batch of reports, 4 as well as 40,
    is observed in the compiled pass (counted)."""
    estimate, taken = K.estimate, []
    observe, observed = K.observe_rows, []

    def counted(*a):
        out = estimate(*a)
        taken.append(bool(out[0]))
        return out

    def observe_counted(*a):
        observed.append(a[1].shape[0])
        return observe(*a)
    runs = []
    for compiled in (True, False):
        m = BatchSizeManager("lbbsp-cpu", n * 32, min_batch=2,
                             policy_args={**args, "compiled": compiled})
        assert m.policy.compiled is compiled
        runs.append((m, Simulation(m, _fleet(3, quota, n))))
    monkeypatch.setattr(K, "estimate", counted)       # after the warm-up's empty call
    monkeypatch.setattr(K, "observe_rows", observe_counted)
    kernels = ("split", "estimate", "latest_finish", "observe_rows", "record_history", "known_slots",
               "scan_rows", "check_split")
    originals = {"estimate": estimate, "observe_rows": observe}
    signatures = lambda f: len(originals.get(f, getattr(K, f)).signatures)  # noqa: E731
    before = {f: signatures(f) for f in kernels}
    for step in range(40):
        if step == 15:
            for _, sim in runs:
                sim.remove_worker(6 if n > 6 else 1)   # not the quota-held one (3)
        if step == 22:
            for _, sim in runs:
                sim.add_worker(77, SimulatedWorker(900.0, overhead=0.003, seed=77))
        a, b = (sim.step() for _, sim in runs)
        assert a.sizes == b.sizes, step
    (mc, _), (mn, _) = runs
    for name in STATE:
        x, y = getattr(mc.policy, name), getattr(mn.policy, name)
        assert x.shape == y.shape and np.array_equal(x, y, equal_nan=True), name
    assert json.dumps(mc.policy.state_dict(), sort_keys=True) == json.dumps(mn.policy.state_dict(), sort_keys=True)
    assert mc.policy.changes > 0 and mc.policy.changes == mn.policy.changes
    # nothing compiled inside a decision: the construction's warm-up made every signature used
    assert {f: signatures(f) for f in before} == before
    held = quota and args.get("use_quota", True)
    assert len(taken) == 40 and (sum(taken) == 0 if held else sum(taken) >= 20), "".join("01"[t] for t in taken)
    assert len(observed) >= 39 and max(observed) == n, observed   # the first split has no reports yet
    for m, _ in runs:
        m.close()


@pytest.mark.parametrize("args", [
    {"predictor": "ema", "finish_window": 4},
    {"predictor": "last", "warmup": 0, "finish_window": 3, "stalls": "fixed"},
    {"predictor": "narx", "refit": "sync", "finish_window": 4,      # exogenous inputs, some missing
     "predictor_args": {"epochs": 2, "min_train": 4, "refit_every": 5}},
])
@pytest.mark.parametrize("n", [40, 4])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # speeds near 1e300: inf, handled
def test_reports_at_the_edges_observe_into_the_same_state(args, n):
    """Reports drawn from the edges of what the wire accepts (0, denormal, huge, missing finish
    times and quotas), some workers twice in an iteration: the compiled pass over their rows
    leaves the state the numpy columns leave (the per-report rules, for 4 workers), and the
    splits stay equal."""
    ms = [BatchSizeManager("lbbsp-cpu", 64 * n, policy_args={**args, "compiled": c}) for c in (True, False)]
    for m in ms:
        for w in range(n):
            m.join(w)
    rng = random.Random(5)
    for it in range(14):
        sizes = ms[0].assign()
        assert ms[1].assign() == sizes, it
        reports = [edge_report(rng, w, it, x) for w, x in sizes.items()]
        reports += [edge_report(rng, w, it, sizes[w]) for w in range(0, n, 9)]   # twice
        for m in ms:
            m.observe_many(reports)
        for name in STATE:
            x, y = (getattr(m.policy, name) for m in ms)
            assert np.array_equal(x, y, equal_nan=True), (it, name)
    for m in ms:
        m.close()


def test_known_slots_and_scan_rows_read_the_rows_as_the_numpy_columns():
    """Slots by the id table (0: all known, none twice; 1: an id without a slot or outside the
    table; 2: a slot twice), and the out-of-memory and headroom flags, against the numpy reads."""
    lut = np.array([3, -1, 0, 1, 2], dtype=np.int64)
    scratch = np.zeros(4, dtype=np.int64)
    head = lambda ids: np.array([[w, 0, 8] for w in ids], dtype=np.int64)   # noqa: E731
    slots, status = K.known_slots(head([0, 2, 3, 4]), lut, scratch)
    assert status == 0 and slots.tolist() == [3, 0, 1, 2]
    assert K.known_slots(head([0, 1]), lut, scratch)[1] == 1      # id 1 has no slot
    assert K.known_slots(head([0, 5]), lut, scratch)[1] == 1      # beyond the table
    assert K.known_slots(head([-1, 0]), lut, scratch)[1] == 1
    assert K.known_slots(head([2, 3, 2]), lut, scratch)[1] == 2   # worker 2 twice
    rows = np.full((5, 3), math.nan)
    rows[:, 0] = 0.0                                              # oom column
    for oom, room in ((None, None), (3, None), (None, 4), (0, 0), (None, 1)):
        r = rows.copy()
        if oom is not None:
            r[oom, 0] = 1.0
        if room is not None:
            r[room, 2] = 512.0 if room != 1 else 0.0              # none left is a headroom too
        assert K.scan_rows(r, 0, 2) == (bool(r[:, 0].any()), bool(np.flatnonzero(r[:, 2] == r[:, 2]).size))


def test_the_manager_refuses_a_bad_split_on_the_compiled_check():
    """The manager's check of a split of more than SMALL_N workers runs compiled: a split that
    does not sum to X, or one outside a worker's bounds, is refused with the worker named."""
    m = BatchSizeManager("lbbsp-cpu", 40 * 8, min_batch=2, max_batch=20)
    assert m.policy.kernels is not None
    for w in range(40):
        m.join(w)
    good = m.policy._assign
    for bad, match in (([8] * 39 + [9], "sums to 321"), ([8] * 10 + [1, 15] + [8] * 28, "worker 10 batch 1"),
                       ([8] * 20 + [21] + [7] * 13 + [8] * 6, "worker 20 batch 21")):
        m.policy._assign = lambda *a, bad=bad: np.array(bad, dtype=np.int64)   # type: ignore[method-assign]
        with pytest.raises(RuntimeError, match=match):
            m.assign()
    m.policy._assign = good                                       # type: ignore[method-assign]
    assert sum(m.assign().values()) == 320
    m.close()


# ----------------------------------------------------------------------------- found by review
def test_the_split_bisects_as_split_small_where_huge_slopes_cancel():
    """Speeds near 1e300 (a report of 3 samples in 1e-300 s passes the wire's checks) make the
    running slope of the sweep cancel, so its breakpoint sums are not monotone: the crossing is
    bisect_left's, as in split_small (the review found a linear scan giving another split).
    The shares there are hundreds of samples from the total, so both now refuse them alike."""
    v = [1.0, 1.0, 7e+299, 3e+300, 3.0, 3e+300]
    c = [3.0, 0.5, 0.0, 0.0, 3.0, 0.0]
    lo, hi = [1.0] * 6, [200.0] * 5 + [64.0]
    with pytest.raises(ValueError, match="-639 samples"):
        split_small(v, c, 27, lo, hi)
    with pytest.raises(ValueError, match="overflowed"):
        K.split(np.array(v), np.array(c), 27, np.array(lo), np.array(hi))



@pytest.mark.timeout(30)
def test_shares_that_overflowed_are_refused_not_rounded_for_hours():
    """A solve that overflowed leaves shares some 1e12 samples from the total: every split
    (compiled, Python floats, numpy) refuses them at once instead of handing out n samples per
    round (1e10 rounds: the review's decision that never ended), and NaN or infinite shares
    raise in the kernel as in split_small."""
    v = np.array([3.300343645893191e+300, 2.033052169423385e-005] + [4.470776302211560e+300] * 15)
    c = np.array([0.5, 9.508128706660970e+05] + [6.410573058369033e+09] * 15)
    hi = np.array([64.0, 1.099511627777e+12] + [math.inf] * 15)
    lo = np.ones(17)
    with pytest.raises(ValueError, match="overflowed"):
        K.split(v, c, 2560, lo, hi)
    with pytest.raises(ValueError, match="overflowed"):
        split_small(v.tolist(), c.tolist(), 2560, lo.tolist(), hi.tolist())
    from batchsize_manager.allocation import round_bounded_arrays
    with pytest.raises(ValueError, match="overflowed"):
        round_bounded_arrays(np.array([1.1e12, 1.0, 1.0]), 100, np.ones(3), np.array([2e12, 9.0, 9.0]))
    nan_v = np.array([1.6e308, 1.6e308] + [1e3] * 15)
    nan_c = np.array([1.0, 1.0] + [0.001] * 15)
    for impl in (lambda: K.split(nan_v, nan_c, 17 * 64, np.ones(17), np.full(17, math.inf)),
                 lambda: split_small(nan_v.tolist(), nan_c.tolist(), 17 * 64, [1.0] * 17, [math.inf] * 17)):
        with pytest.raises((ValueError, OverflowError)):
            impl()


@pytest.mark.parametrize("compiled", [True, False])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
def test_a_decision_goes_on_when_reports_overflow_the_solve(compiled, caplog):
    """Two of 17 workers report 64 samples in 4e-307 s (a speed of 1.6e308, which the wire
    accepts): the solve overflows, and the policy keeps the previous split (or the even one)
    with a warning instead of stopping the job; splits stay valid."""
    n = 17
    m = BatchSizeManager("lbbsp-cpu", 64 * n, policy_args={"predictor": "ema", "compiled": compiled})
    for w in range(n):
        m.join(w)
    for it in range(6):
        sizes = m.assign()
        assert sum(sizes.values()) == 64 * n and min(sizes.values()) >= 1
        m.observe_many([_received(w, it, x, compute_s=4e-307 if w < 2 else 0.064, finish_s=1.0)
                        for w, x in sizes.items()])
    assert "no equal-finish split from the estimates" in caplog.text
    m.close()


def _received(w: int, it: int, x: int, **tel: float) -> WorkerReport:
    push = Push(worker_id=w, token="t", iteration=it, batch_size=x, telemetry=Telemetry(**tel),
                arrays=[np.zeros(1, dtype=np.float32)])
    got = decode(encode(push))
    return WorkerReport.received(got.worker_id, got.iteration, got.batch_size, got.telemetry)
