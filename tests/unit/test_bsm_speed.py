"""The vectorised BatchSizeManager: same answers as the scalar rules it replaced.

* the equal-finish-time split (Newton steps, sweep fallback, small-N Python path, O(N) rounding)
  against an exact scalar reference in rational arithmetic;
* report columns against the per-report rules;
* queued/batched reports against one-at-a-time application (also with several reports of one
  worker in a batch);
* checkpoints of the model predictors;
* large worker counts stay valid (correctness only: timings live in benchmarks/bench_manager.py).
"""

from __future__ import annotations

import json
import math
import random
import time
from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from batchsize_manager import BatchSizeManager, WorkerReport, get_policy
from batchsize_manager.allocation import (
    SMALL_N,
    bounded_split,
    equal_finish_times,
    finish_time_split_arrays,
    round_bounded_arrays,
    split_small,
)
from batchsize_manager.reports import (
    SMALL_BATCH,
    ReportBatch,
    _measured_one,
    _num_one,
    occurrence_rounds,
    overhead_one,
)
from batchsize_manager.simulation import SimulatedWorker, Simulation
from ps_common.protocol import Push, decode, encode
from ps_common.report import Telemetry
from tests.report_util import edge_report

INF = math.inf


# ----------------------------------------------------------------------------- reference split
def reference_split(v: list[float], c: list[float], total: int, lo: list[int],
                    hi: list[float]) -> tuple[list[int], list[Fraction]]:
    """The previous scalar algorithm, exactly: sort the breakpoints of f(T) = Σ clip(v (T - c),
    lo, hi), find the piece where f crosses X, solve it, then largest remainder (ties to the lower
    index) within the bounds. Rational arithmetic: no rounding anywhere."""
    n = len(v)
    V = [Fraction(x) for x in v]
    C = [Fraction(x) for x in c]
    L = [Fraction(x) for x in lo]
    H = [None if h == INF else Fraction(h) for h in hi]

    def x_at(t: Fraction) -> list[Fraction]:
        out = []
        for vi, ci, li, hi_i in zip(V, C, L, H):
            x = max(vi * (t - ci), li)
            out.append(x if hi_i is None else min(x, hi_i))
        return out

    bps = sorted({ci + li / vi for vi, ci, li in zip(V, C, L)}
                 | {ci + h / vi for vi, ci, h in zip(V, C, H) if h is not None})
    fs = [sum(x_at(t)) for t in bps]
    if fs[0] >= total:
        t = bps[0]
    else:
        k = next((i for i, f in enumerate(fs) if f >= total), None)
        if k is None:               # beyond the last breakpoint: only uncapped workers still grow
            slope = sum(vi for vi, h in zip(V, H) if h is None)
            t = bps[-1] + (total - fs[-1]) / slope
        else:
            t0, t1 = bps[k - 1], bps[k]
            t = t0 + (total - fs[k - 1]) * (t1 - t0) / (fs[k] - fs[k - 1])
    x = x_at(t)
    out = [math.floor(xi) for xi in x]
    left = total - sum(out)
    assert left >= 0
    room = sorted((i for i in range(n) if H[i] is None or out[i] < H[i]),
                  key=lambda i: (-(x[i] - out[i]), i))
    for i in room[:left]:
        out[i] += 1
    return out, x


def near_tie(x: list[Fraction]) -> bool:
    """Cases where float dust may legitimately decide the rounding: a share within 1e-6 below an
    integer, or two different fractional parts within 1e-6 of each other."""
    fr = sorted(float(xi - math.floor(xi)) for xi in x)
    if any(1 - 1e-6 < f < 1 for f in fr):
        return True
    exact = sorted(xi - math.floor(xi) for xi in x)
    return any(0 < b - a < 1e-6 for a, b in zip(exact, exact[1:]))


def random_problem(rng: random.Random, n: int) -> tuple[list[float], list[float], int, list[int],
                                                      list[float]]:
    v = [rng.lognormvariate(5, 1.5) for _ in range(n)]
    c = [0.0] * n if rng.random() < 0.4 else [rng.uniform(0, 0.5) for _ in range(n)]
    floor = rng.randint(1, 4)
    lo = [floor + (rng.randint(0, 30) if rng.random() < 0.2 else 0) for _ in range(n)]
    hi = [float(li + rng.randint(0, 200)) if rng.random() < 0.3 else INF for li in lo]
    room = sum(h for h in hi) if all(h < INF for h in hi) else sum(lo) + 5000
    total = rng.randint(sum(lo), int(min(room, sum(lo) + 5000)))
    return v, c, total, lo, hi


@pytest.mark.parametrize("n_range", [(1, SMALL_N), (SMALL_N + 1, 60)])
def test_vectorised_split_equals_the_scalar_reference(n_range):
    rng = random.Random(1234 + n_range[0])
    checked = 0
    for _ in range(250):
        v, c, total, lo, hi = random_problem(rng, rng.randint(*n_range))
        ref, x = reference_split(v, c, total, lo, hi)
        got = finish_time_split_arrays(np.array(v), np.array(c), total, np.array(lo, dtype=float),
                                       np.array(hi)).tolist()
        assert sum(got) == total
        assert all(li <= g <= h for g, li, h in zip(got, lo, hi))
        if near_tie(x):
            assert all(abs(g - float(xi)) < 1 + 1e-6 for g, xi in zip(got, x))
            continue
        assert got == ref, (v, c, total, lo, hi)
        checked += 1
    assert checked > 200


def test_small_python_path_and_numpy_path_agree():
    """Both implementations of the same algorithm, on the same inputs (below and above SMALL_N)."""
    rng = random.Random(7)
    for _ in range(200):
        v, c, total, lo, hi = random_problem(rng, rng.randint(1, 3 * SMALL_N))
        ref, x = reference_split(v, c, total, lo, hi)
        if near_tie(x):
            continue
        small = split_small(v, c, total, [float(li) for li in lo], hi)
        xs, _ = equal_finish_times(np.array(v), np.array(c), total, np.array(lo, dtype=float),
                                   np.array(hi))
        big = round_bounded_arrays(xs, total, np.array(lo, dtype=float), np.array(hi)).tolist()
        assert small == big == ref


def test_newton_fallback_to_the_sweep_is_exact():
    """Floors and caps that make the piecewise Newton steps cycle still give the exact split."""
    v = [1.0, 100.0, 1.0, 100.0, 3.0] * 8
    c = [0.0, 1.0, 2.0, 0.5, 0.1] * 8
    lo = [1, 30, 1, 1, 20] * 8
    hi = [50.0, 40.0, 9.0, INF, 25.0] * 8
    for total in (sum(lo), sum(lo) + 1, 1500, 2000):
        ref, x = reference_split(v, c, total, lo, hi)
        got = finish_time_split_arrays(np.array(v), np.array(c), total, np.array(lo, float),
                                       np.array(hi)).tolist()
        assert sum(got) == total
        if not near_tie(x):
            assert got == ref


def test_uniform_and_bounded_splits_match_the_reference():
    rng = random.Random(99)
    for _ in range(100):
        n = rng.randint(1, 40)
        ws = sorted(rng.sample(range(1000), n))
        weights = {w: rng.lognormvariate(0, 1) for w in ws}
        caps = {w: rng.randint(2, 300) for w in ws if rng.random() < 0.3}
        room = sum(caps.values()) if len(caps) == n else 10**6
        total = rng.randint(2 * n, min(room, 2 * n + 4000))
        got = bounded_split(weights, total, 2, caps)
        ref, x = reference_split([weights[w] for w in ws], [0.0] * n, total, [2] * n,
                                 [float(caps[w]) if w in caps else INF for w in ws])
        if not near_tie(x):
            assert [got[w] for w in ws] == ref
    p = get_policy("uniform")
    for n, total in ((3, 10), (7, 1000), (64, 4096 + 5), (1000, 64_003)):
        ws = list(range(0, 3 * n, 3))
        out = p.assign_arrays(np.array(ws), total, 1, np.full(n, INF))
        assert out.tolist() == [total // n + (1 if i < total % n else 0) for i in range(n)]


# ----------------------------------------------------------------------------- report columns
def _random_telemetry(rng: random.Random, compute_s: Any) -> Telemetry:
    """A report built locally, so unchecked: numbers out of range and junk of other types too."""
    pool = [None, "abc", "2.5", float("nan"), float("inf"), -1.0, 0.0, True, [1, 2], 3, 0.25, 7.5]
    tel: dict[str, Any] = {"compute_s": compute_s, "oom": rng.random() < 0.3}
    for key in ("data_s", "prev_push_s", "prev_pull_s", "finish_s", "host_cpu", "cotenant_cpu", "host_mem_pct",
                "cpu_s", "compute_cpu_s", "cpu_quota"):
        r = rng.random()
        if r < 0.5:
            tel[key] = rng.uniform(-0.1, 2.0)
        elif r < 0.8:
            tel[key] = rng.choice(pool)
    return Telemetry(**tel)


@pytest.mark.parametrize("n", [SMALL_BATCH + 1, 300])
def test_overhead_when_every_report_has_a_finish_time(n):
    """The coordinator's case (every report carries the servers' finish time), where the
    workers' own times are not read: still the per-report rule, junk in those fields too."""
    rng = random.Random(n)
    reps = []
    for i in range(n):
        tel = _random_telemetry(rng, rng.choice([0.01, float("nan"), 2.5, -1.0]))
        tel = Telemetry(**{**tel.to_dict(), "finish_s": rng.uniform(1e-3, 2.0)})
        reps.append(WorkerReport(worker_id=i, iteration=0, batch_size=64, telemetry=tel))
    b = ReportBatch(reps)
    assert np.allclose(b.overhead(), [overhead_one(r.telemetry) for r in reps], rtol=0, atol=1e-15)


@pytest.mark.parametrize("n", [1, SMALL_BATCH, SMALL_BATCH + 1, 300])
def test_report_columns_follow_the_per_report_rules(n):
    rng = random.Random(n)
    reps = []
    for i in range(n):
        bs = rng.choice([64, 0, -3, 17, 10**6])
        comp = rng.choice([0.01, 0.0, -1.0, float("nan"), float("inf"), 1e-320, 2.5])
        reps.append(WorkerReport(worker_id=i, iteration=0, batch_size=bs, telemetry=_random_telemetry(rng, comp)))
    b = ReportBatch(reps)
    assert b.worker.tolist() == list(range(n))
    assert b.oom.tolist() == [r.telemetry.oom for r in reps]
    assert b.any_oom == any(r.telemetry.oom for r in reps)
    for key in ("data_s", "prev_push_s", "prev_pull_s", "finish_s"):
        assert b._durations(key).tolist() == [_num_one(getattr(r.telemetry, key)) for r in reps]
    assert b.finish.tolist() == [_num_one(r.telemetry.finish_s) for r in reps]
    for key in ("cpu_s", "compute_cpu_s", "cpu_quota", "finish_s", "compute_s"):
        got, want = b.measured(key).tolist(), [_measured_one(getattr(r.telemetry, key)) for r in reps]
        assert all(g == w or (math.isnan(g) and math.isnan(w)) for g, w in zip(got, want)), key
    assert np.allclose(b.overhead(), [overhead_one(r.telemetry) for r in reps], rtol=0, atol=1e-15)
    assert b.batch.tolist() == [float(r.batch_size) for r in reps]
    exp_v = [r.speed() for r in reps]
    got_v = b.speed()
    for g, e in zip(got_v.tolist(), exp_v):
        assert (math.isnan(g) and e is None) or g == e
    assert b.speeds_finite() == all(e is not None for e in exp_v)
    fresh = ReportBatch(reps)                     # asked before the column is read
    assert fresh.speeds_finite() == b.speeds_finite()
    usable = [i for i, e in enumerate(exp_v) if e is not None]
    if usable:
        assert b.take(np.array(usable)).speeds_finite()
    assert b.exog().tolist() == [r.telemetry.exog() for r in reps]
    sub = b.take(np.array([n - 1, 0]))
    assert sub.worker.tolist() == [n - 1, 0] and sub.oom.tolist() == [b.oom[-1], b.oom[0]]


def _packed(tel: Telemetry) -> Telemetry:
    tel.packed()
    return tel


def _received_reports(n: int, seed: int, oom: float = 0.2) -> list[WorkerReport]:
    """Reports as shard 0 holds them: sent in a Push and decoded (so checked, and each with its
    row), some given the servers' finish time afterwards."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        tel: dict[str, Any] = {"oom": rng.random() < oom, "burners": rng.choice([0, 3])}
        for key in ("compute_s", "data_s", "prev_push_s", "prev_pull_s", "finish_s", "host_cpu",
                    "cotenant_cpu", "host_mem_pct", "cpu_s", "compute_cpu_s", "cpu_quota",
                    "mem_headroom_mb"):
            r = rng.random()
            if r < 0.6:
                tel[key] = rng.uniform(0.0, 2.0)
            elif r < 0.8:
                tel[key] = 0.0
            elif Telemetry.__dataclass_fields__[key].default is None:
                tel[key] = None
        push = Push(worker_id=i, token="t", iteration=3, batch_size=rng.choice([64, 1, 17]),
                    telemetry=Telemetry(**tel), arrays=[np.zeros(2, dtype=np.float32)])
        got = decode(encode(push))
        received = got.telemetry
        assert received is not None and received.row is not None
        if rng.random() < 0.5:
            received = received.with_finish(rng.choice([None, rng.uniform(1e-3, 2.0)]))
        out.append(WorkerReport.received(got.worker_id, got.iteration, got.batch_size, received))
    return out


def test_a_received_report_keeps_its_fields_as_its_row():
    """The row a decoded report carries, and the one its copy with a finish time carries, are
    its fields (what ``packed()`` gives from the attributes of a report built locally)."""
    for r in _received_reports(200, 1):
        tel = r.telemetry
        local = Telemetry.from_record(tel.to_dict())
        assert local.row is None and tel == local
        assert tel.row == local.packed() == local.row
    sent = {"compute_s": 0.5, "cpu_quota": None, "oom": True, "burners": 2}   # None said outright
    assert Telemetry.from_checked(sent).row == Telemetry(**sent).packed()
    r = WorkerReport.received(7, 3, 64, tel)
    assert r.row is not None and ReportBatch([r] * (SMALL_BATCH + 1)).worker.tolist() == [7] * (SMALL_BATCH + 1)
    timed = r.with_telemetry(tel.with_finish(0.125))
    expected = Telemetry(**{**tel.to_dict(), "finish_s": 0.125})
    expected.packed()
    assert timed.row == WorkerReport.received(7, 3, 64, expected).row
    assert r.with_telemetry(Telemetry()).row is None                # a telemetry without a row
    assert WorkerReport.received(1 << 63, 3, 64, tel).row is None   # not int64: by attribute
    assert WorkerReport(7, 3, 64, tel).row is None                  # built locally
    t = Telemetry(compute_s=0.5).with_finish(0.25)
    assert t.row is None                                  # nothing to keep true
    p = Telemetry(compute_s=0.5)
    p.packed()
    assert p.with_finish(0.25).row == Telemetry(compute_s=0.5, finish_s=0.25).packed()


@pytest.mark.parametrize("n", [SMALL_BATCH + 1, 300])
def test_columns_from_rows_follow_the_per_report_rules(n):
    reps = _received_reports(n, n)
    b = ReportBatch(reps)
    assert b.rows is not None                             # the row path is what is tested here
    assert b.worker.tolist() == list(range(n))
    assert b.oom.tolist() == [r.telemetry.oom for r in reps]
    assert b.any_oom == any(r.telemetry.oom for r in reps)
    for key in ("data_s", "prev_push_s", "prev_pull_s", "finish_s"):
        assert b._durations(key).tolist() == [_num_one(getattr(r.telemetry, key)) for r in reps]
    for key in ("cpu_s", "compute_cpu_s", "cpu_quota", "finish_s", "compute_s"):
        got, want = b.measured(key).tolist(), [_measured_one(getattr(r.telemetry, key)) for r in reps]
        assert all(g == w or (math.isnan(g) and math.isnan(w)) for g, w in zip(got, want)), key
    assert b.overhead().tolist() == [overhead_one(r.telemetry) for r in reps]
    assert [v if v == v else None for v in b.speed().tolist()] == [r.speed() for r in reps]
    assert b.exog().tolist() == [r.telemetry.exog() for r in reps]
    assert b.headroom_rows().tolist() == [i for i, r in enumerate(reps)
                                          if r.telemetry.mem_headroom_mb is not None]
    picked = [n - 1, 0, *range(1, SMALL_BATCH)]
    sub = b.take(np.array(picked))
    assert sub.rows is not None and sub.compute.tolist() == [reps[i].telemetry.compute_s for i in picked]
    assert sub.worker.tolist() == picked and sub.batch.tolist() == [reps[i].batch_size for i in picked]
    fresh = ReportBatch(reps)
    assert fresh.rows is not None                        # read, but no column taken from it yet
    sub = fresh.take(np.array(picked))
    assert sub.worker.tolist() == picked and sub.batch.tolist() == [reps[i].batch_size for i in picked]
    assert sub.exog().tolist() == [reps[i].telemetry.exog() for i in picked]
    mixed = reps[:-1] + [reps[-1].with_telemetry(Telemetry(compute_s=0.5))]   # one built locally
    m = ReportBatch(mixed)
    assert m.rows is None and m.exog().tolist() == [r.telemetry.exog() for r in mixed]


@pytest.mark.parametrize("name,args", [
    ("uniform", {}), ("static", {"profile_iterations": 2}), ("lbbsp-gpu", {}),
    ("lbbsp-cpu", {"predictor": "ema"}), ("lbbsp-cpu", {"predictor": "last", "warmup": 0}),
    ("lbbsp-cpu", {"predictor": "arima", "refit": "sync", "predictor_args": {"refit_every": 4}}),
    ("lbbsp-cpu", {"predictor": "narx", "refit": "sync",
                   "predictor_args": {"epochs": 3, "min_train": 4, "refit_every": 3}}),
])
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # speeds near 1e300: inf, handled
def test_reports_at_the_edges_of_their_ranges_leave_every_split_valid(name, args):
    """Whatever a worker may send within the wire's checks, each decision is a valid split of X
    (no exception, no NaN), on the rows path (40 workers) and report by report (8)."""
    for n in (40, 8):
        rng = random.Random(n)
        m = BatchSizeManager(name, 64 * n, min_batch=1, policy_args=args)
        for w in range(n):
            m.join(w)
        for it in range(14):
            sizes = m.assign()
            assert sum(sizes.values()) == 64 * n and all(x >= 1 for x in sizes.values()), (it, sizes)
            m.observe_many([edge_report(rng, w, it, x) for w, x in sizes.items()])
        m.close()


@pytest.mark.parametrize("name,args", [
    ("static", {"profile_iterations": 2}), ("lbbsp-gpu", {}), ("lbbsp-cpu", {"predictor": "ema"}),
    ("lbbsp-cpu", {"predictor": "last", "warmup": 0}),
])
def test_rows_and_fields_leave_the_policy_in_the_same_state(name, args):
    """The same received reports, 45 per iteration (some workers twice, some out of memory):
    read from their rows, and rebuilt locally without rows (read field by field)."""
    rows_m, fields_m = (BatchSizeManager(name, 45 * 64, policy_args=args) for _ in range(2))
    for m in (rows_m, fields_m):
        for w in range(45):
            m.join(w)
    for it in range(10):
        sizes = rows_m.assign()
        assert fields_m.assign() == sizes
        received = [WorkerReport.received(r.worker_id % 45, it, sizes[r.worker_id % 45], r.telemetry)
                    for r in _received_reports(50, it, oom=0.02)]
        local = [WorkerReport(r.worker_id, r.iteration, r.batch_size, Telemetry.from_record(r.telemetry.to_dict()))
                 for r in received]                   # the same values, built without rows
        assert ReportBatch(received).rows is not None and ReportBatch(local).rows is None
        rows_m.observe_many(received)
        fields_m.observe_many(local)
        assert json.dumps(rows_m.policy.state_dict(), sort_keys=True) == json.dumps(
            fields_m.policy.state_dict(), sort_keys=True)
        assert rows_m.memory_caps == fields_m.memory_caps


def test_occurrence_rounds_split_duplicates_in_arrival_order():
    assert occurrence_rounds(np.array([3, 1, 2])) is None
    keys = np.array([5, 1, 5, 2, 1, 5] + list(range(10, 40)))
    rounds = occurrence_rounds(keys, np.zeros(64, dtype=np.int64))
    assert [r.tolist() for r in rounds][1:] == [[2, 4], [5]]
    assert rounds[0].tolist() == [0, 1, 3] + list(range(6, 36))


# ----------------------------------------------------------------------------- batching is exact
def _report(w: int, it: int, x: int, speed: float, oom: bool = False) -> WorkerReport:
    return WorkerReport(worker_id=w, iteration=it, batch_size=x,
                        telemetry=Telemetry(compute_s=x / speed, data_s=0.002, prev_push_s=0.001 * (w % 3),
                                            prev_pull_s=0.001, host_cpu=40.0 + w, oom=oom))


@pytest.mark.parametrize("name,args", [
    ("static", {"profile_iterations": 3}), ("lbbsp-cpu", {"predictor": "ema"}),
    ("lbbsp-cpu", {"predictor": "last", "warmup": 0}), ("lbbsp-gpu", {"window": 2, "step": 8}),
    ("lbbsp-cpu", {"predictor": "narx", "refit": "sync",
                   "predictor_args": {"epochs": 3, "min_train": 4, "refit_every": 3}}),
])
def test_batched_reports_equal_one_at_a_time(name, args):
    """A batch holding several reports per worker (and OOMs) leaves the policy in the state that
    one observe() per report leaves it in; so does the manager's queue, whatever its chunk size."""
    rng = random.Random(5)
    one, many = get_policy(name, **args), get_policy(name, **args)
    ws = list(range(20))
    for w in ws:
        one.join(w)
        many.join(w)
    for it in range(12):
        sizes = one.assign(ws, 640, 2)
        assert many.assign(ws, 640, 2) == sizes
        reps = []
        for w, x in sizes.items():
            for k in range(rng.choice([1, 1, 2])):       # some workers report twice
                reps.append(_report(w, it, x, 100.0 * (1 + w % 4) * (1 + 0.05 * k), oom=rng.random() < 0.02))
        rng.shuffle(reps)
        for r in reps:
            one.observe(r)
        many.observe_batch(ReportBatch(reps))
        assert json.dumps(one.state_dict(), sort_keys=True) == json.dumps(many.state_dict(),
                                                                          sort_keys=True)
    managers = []
    for chunk in (1, 7, 10**6):
        m = BatchSizeManager(name, 640, min_batch=2, policy_args=args)
        m.flush_every = chunk
        managers.append(m)
    sims = [Simulation(m, [SimulatedWorker(500.0 * (1 + i % 3), 0.002, noise=0.05, seed=i)
                           for i in range(9)]) for m in managers]
    for step in range(25):
        if step == 10:
            for s in sims:
                s.remove_worker(4)
        if step == 15:
            for s in sims:
                s.add_worker(20, SimulatedWorker(800.0, 0.002, seed=20))
        recs = [s.step() for s in sims]
        assert recs[0].sizes == recs[1].sizes == recs[2].sizes
    timed = ("total_decision_s", "total_decision_cpu_s")       # measured, so never equal
    states = [json.dumps({k: v for k, v in m.state_dict().items() if k not in timed},
                         sort_keys=True) for m in managers]
    assert states[0] == states[1] == states[2]


@pytest.mark.parametrize("chunk", [1, 5, 20, 1024])
def test_observe_many_is_observe_of_each_report_in_order(chunk):
    """Same policy state, caps and count of ignored reports (those of workers not live) as one
    observe() per report, whatever the chunk size; the rows path and the attribute path alike
    (chunks of 20: a whole chunk of received reports read in one pass, the rest queued)."""
    args = {"predictor": "ema"}
    one, many = (BatchSizeManager("lbbsp-cpu", 640, min_batch=2, policy_args=args) for _ in range(2))
    many.flush_every = chunk
    for m in (one, many):
        for w in range(20):
            m.join(w)
    rng = random.Random(chunk)
    for it in range(8):
        sizes = one.assign()
        assert many.assign() == sizes
        reps = [_report(w, it, x, 100.0 * (1 + w % 4), oom=(w, it) in ((5, 2), (7, 3))) for w, x in sizes.items()]
        reps += [_report(99, it, 8, 100.0)]                   # never joined: ignored
        if it % 2:                                            # as received: with rows
            reps = [WorkerReport.received(r.worker_id, it, r.batch_size, _packed(r.telemetry)) for r in reps]
            reps += _received_reports(3, it, oom=0.0)         # workers 0-2 again
            assert ReportBatch.with_rows(reps[:20]) is not None   # what chunks of 20 read in one pass
        rng.shuffle(reps)
        for r in reps:
            one.observe(r)
        many.observe_many(reps)
        assert one.memory_caps == many.memory_caps and one.ignored_reports == many.ignored_reports
        assert json.dumps(one.policy.state_dict(), sort_keys=True) == json.dumps(many.policy.state_dict(),
                                                                                 sort_keys=True)


def test_received_reports_of_departed_workers_only_are_all_ignored():
    """A chunk read as rows in which nobody is live any more (everyone left, or nobody joined):
    every report counted as ignored, none reaches the policy."""
    reps = _received_reports(40, 1, oom=0.3)
    for members in ([], [1000]):
        m = BatchSizeManager("lbbsp-cpu", 640, policy_args={"predictor": "ema"})
        m.flush_every = 20                                    # two whole chunks, read in one pass
        for w in members:
            m.join(w)
        before = json.dumps(m.policy.state_dict(), sort_keys=True)
        m.observe_many(reps)
        assert m.ignored_reports == 40 and not m.memory_caps
        assert json.dumps(m.policy.state_dict(), sort_keys=True) == before


def _as_received(reps: list[WorkerReport]) -> list[WorkerReport]:
    return [WorkerReport.received(r.worker_id, r.iteration, r.batch_size, _packed(r.telemetry)) for r in reps]


def test_memory_is_learned_in_arrival_order_within_a_batch():
    """Worker 3's success at 64, then its out-of-memory at 128, in one batch (read as rows, and
    report by report): the caps one report at a time leaves. Its success came before any search
    of its memory, so only the failure counts: cap 64, not the 96 of a search that saw both."""
    def caps(received: bool, flush_every: int, many: bool) -> dict[int, int]:
        m = BatchSizeManager("lbbsp-cpu", 64 * 20, policy_args={"predictor": "ema"})
        m.flush_every = flush_every
        for w in range(20):
            m.join(w)
        m.assign()
        reps = [_report(w, 0, 64, 100.0) for w in range(20)] + [_report(3, 0, 128, 100.0, oom=True)]
        reps = _as_received(reps) if received else reps
        if many:
            m.observe_many(reps)
        else:
            for r in reps:
                m.observe(r)
        return m.memory_caps

    one_at_a_time = caps(False, 1, False)
    assert one_at_a_time == {3: 64}
    for received in (False, True):
        for many in (False, True):
            for flush_every in (21, 1024):                # one whole chunk (one pass), or queued
                assert caps(received, flush_every, many) == one_at_a_time, (received, many, flush_every)


def test_reports_queued_by_observe_reach_the_policy_before_those_of_observe_many():
    """observe() queues; a later observe_many() of received reports (read in one pass) must not
    overtake what is queued: the policy's state equals one report at a time."""
    def state(flush_every: int) -> str:
        m = BatchSizeManager("lbbsp-cpu", 64 * 20, policy_args={"predictor": "ema", "warmup": 0})
        m.flush_every = flush_every
        for w in range(20):
            m.join(w)
        m.assign()
        for w in range(5):
            m.observe(_report(w, 0, 64, 100.0 * (1 + w)))
        m.observe_many(_as_received([_report(w, 1, 64, 50.0 * (1 + w % 4)) for w in range(20)]))
        return json.dumps(m.policy.state_dict(), sort_keys=True)

    assert state(1024) == state(25) == state(1)


def test_reading_received_reports_counts_in_the_decisions_cpu(monkeypatch):
    """observe_many's one pass over the report objects is part of the decision's CPU, as a
    flush's reading was (``last_decision_cpu_s``, the coordinator's ``decision_cpu_s``)."""
    with_rows = ReportBatch.with_rows.__func__                # type: ignore[attr-defined]

    def slow(cls, reports):
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass
        return with_rows(cls, reports)
    monkeypatch.setattr(ReportBatch, "with_rows", classmethod(slow))
    m = BatchSizeManager("uniform", 64 * 20)
    m.flush_every = 20                                        # a whole chunk: read in one pass
    for w in range(20):
        m.join(w)
    m.assign()
    m.observe_many(_as_received([_report(w, 0, 64, 100.0) for w in range(20)]))
    m.assign()
    assert m.last_decision_cpu_s >= 0.045 and m.last_decision_s >= 0.045


def test_policy_state_is_current_when_read_between_observe_and_assign():
    m = BatchSizeManager("lbbsp-gpu", 300)
    for w in range(3):
        m.join(w)
    m.assign()
    m.observe(_report(1, 0, 100, 50.0, oom=True))
    assert m.memory_caps == {1: 50}                           # applied when the caps are read
    m.observe(_report(2, 0, 100, 50.0, oom=True))
    m.leave(2)                                                # applied before the leave
    assert m.memory_caps == {1: 50} and m.memory.cap("2") == 50 and m.ignored_reports == 0


# ----------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("predictor,pargs", [
    ("narx", {"epochs": 5, "min_train": 5, "refit_every": 4}),
    ("arima", {"refit_every": 6}),
    ("ema", {}),
])
def test_model_checkpoints_round_trip(predictor, pargs):
    args = {"predictor": predictor, "predictor_args": pargs, "refit": "sync", "history": 24}
    workers = [SimulatedWorker(v, 0.004, noise=0.05, seed=i, schedule=[(20, v / 2)] if i == 1 else [])
               for i, v in enumerate([3000.0, 2000.0, 1500.0, 700.0])]
    a = BatchSizeManager("lbbsp-cpu", 512, min_batch=2, policy_args=args)
    sim = Simulation(a, workers)
    sim.run(30)
    state = json.loads(json.dumps(a.state_dict()))
    b = BatchSizeManager("lbbsp-cpu", 512, min_batch=2, policy_args=args)
    b.load_state_dict(state)
    assert json.loads(json.dumps(b.state_dict())) == state    # nothing lost or invented
    c = BatchSizeManager("lbbsp-cpu", 512, min_batch=2, policy_args=args)
    c.load_state_dict(json.loads(json.dumps(b.state_dict())))
    for _ in range(15):                                       # both rebuilt from the same history
        sb, sc = b.assign(), c.assign()
        assert sb == sc and sum(sb.values()) == 512
        for w, x in sb.items():
            r = WorkerReport(worker_id=w, iteration=0, batch_size=x,
                             telemetry=Telemetry(compute_s=x / (1000.0 + 300 * w), data_s=0.001, host_cpu=30.0))
            b.observe(r)
            c.observe(r)
    for m in (a, b, c):
        m.close()


# ----------------------------------------------------------------------------- scale
@pytest.mark.parametrize("name,args", [("lbbsp-cpu", {"predictor": "ema"}), ("lbbsp-gpu", {}),
                                       ("uniform", {}), ("static", {})])
def test_ten_thousand_workers_get_valid_splits(name, args):
    n = 10_000
    caps = {w: 40 for w in range(0, n, 7)}
    m = BatchSizeManager(name, 64 * n, min_batch=4, memory_caps=caps, policy_args=args)
    sim = Simulation(m, [SimulatedWorker(1000.0 * (1 + i % 4), 0.005, noise=0.03, seed=i)
                         for i in range(n)])
    recs = sim.run(4)
    sim.remove_worker(3)
    recs += sim.run(2)
    for r in recs:
        assert sum(r.sizes.values()) == 64 * n
        assert all(4 <= x <= caps.get(w, 64 * n) for w, x in r.sizes.items())
    if name == "lbbsp-cpu":
        last = recs[-1].sizes
        assert last[4] < last[6]                              # the 3x faster worker gets more
