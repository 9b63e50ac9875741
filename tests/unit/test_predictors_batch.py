"""Batched predictors (one row per worker) and background refits.

* each batched predictor forecasts what the scalar predictor of the same name forecasts;
* the numpy NARX trainer takes the steps torch.optim.Adam takes;
* background refits on a thread give the synchronous forecasts once they have landed;
* a refit in progress never blocks a decision (a deliberately slow fit injected through the
  ``fit_hook`` test hook; no sleep anywhere else);
* refits are staggered over the refit period.

The same for the helper process, and its lifetime: tests/system/test_predictor_refit_process.py.
"""

from __future__ import annotations

import math
import threading
import time

import numpy as np
import pytest
import torch

from batchsize_manager import BatchSizeManager
from batchsize_manager.simulation import SimulatedWorker, Simulation
from predictors import get_predictor
from predictors.arima import BatchARIMA
from predictors.batch import POLLED_FOR_S, BatchEMA, BatchLast, ScalarPredictors, get_batch_predictor
from predictors.narx import BatchNARX, NARXConfig, design, init_weights, train

K = 6
T = 90


def _series(seed: int, n: int = T) -> np.ndarray:
    rng = np.random.default_rng(seed)
    e = np.zeros(n)
    for t in range(2, n):
        e[t] = 1.5 * e[t - 1] - 0.75 * e[t - 2] + rng.normal()
    return 100 + 3 * e + 10 * (np.arange(n) > n // 2)


YS = np.array([_series(s) for s in range(K)])                      # (K, T)
XS = np.random.default_rng(9).uniform(0, 100, (T, K, 3))             # (T, K, 3)
ALL = np.arange(K)


def run_batch(p, ys=YS, xs=XS, drain: bool = False) -> np.ndarray:
    out = np.full((T, K), math.nan)
    for t in range(T):
        out[t] = p.predict(ALL)
        p.update(ALL, ys[:, t], xs[t])
        if drain:
            assert p.drain(30)
    return out


def run_scalar(preds, ys=YS, xs=XS) -> np.ndarray:
    out = np.full((T, K), math.nan)
    for t in range(T):
        out[t] = [p.predict() for p in preds]
        for k, p in enumerate(preds):
            p.update(float(ys[k, t]), xs[t, k])
    return out


def fresh(p):
    p.reset(ALL, ALL)
    return p


# ----------------------------------------------------------------------------- = scalar
def test_last_and_ema_equal_their_scalar_predictors():
    assert np.array_equal(run_batch(fresh(BatchLast()))[1:],
                          run_scalar([get_predictor("last") for _ in range(K)])[1:])
    assert np.array_equal(run_batch(fresh(BatchEMA(alpha=0.4)))[1:],
                          run_scalar([get_predictor("ema", alpha=0.4) for _ in range(K)])[1:])


@pytest.mark.parametrize("kw", [{}, {"order": (1, 1, 0)},
                                {"order": (1, 0, 1), "gate": False, "refit_every": 20},
                                {"order": (2, 1, 1), "log_transform": True, "refit_every": 23}])
def test_batched_arima_equals_the_scalar_arima(kw):
    """Staggered by worker id: worker k refits like a scalar ARIMA with refit_offset = k."""
    every = kw.get("refit_every", 10)
    b = fresh(BatchARIMA(**kw, refit="sync", stagger=True))
    scal = [get_predictor("arima", **kw, refit_offset=k % every) for k in range(K)]
    got, exp = run_batch(b), run_scalar(scal)
    assert np.allclose(got[1:], exp[1:], rtol=1e-9, atol=0)
    assert b.n_fits(ALL).tolist() == [p.n_fits for p in scal]


def test_batched_narx_equals_the_scalar_narx():
    kw = {"epochs": 8, "refit_every": 7}
    b = fresh(BatchNARX(**kw, refit="sync", stagger=True))
    scal = [get_predictor("narx", **kw, refit_offset=k % 7) for k in range(K)]
    got, exp = run_batch(b), run_scalar(scal)
    assert np.allclose(got[1:], exp[1:], rtol=1e-9, atol=0)
    assert b.n_fits(ALL).tolist() == [p.n_fits for p in scal]
    assert b.n_fits() == sum(p.n_fits for p in scal) > 4 * K


def _failing_fit() -> None:
    raise RuntimeError("refit helper failed")


def _step_trace(p, seed: int, fail_from: int = T) -> list[np.ndarray]:
    """Updates of varying subsets, with and without exogenous rows, a reset mid-way, refits
    that fail from ``fail_from`` on; every update's counts and every forecast."""
    rng = np.random.default_rng(seed)
    out = []
    for t in range(T):
        if t == fail_from:
            p.fit_hook = _failing_fit
        sel = ALL if t % 5 else ALL[::2]
        ex = None if t % 7 == 0 else XS[t][sel]
        out.append(p.update(sel, YS[sel, t] * (1.0 + 0.02 * rng.standard_normal(sel.size)), ex))
        out.append(p.predict(ALL))
        if t == 50:
            p.reset(np.array([3]), np.array([3]))
    return out


@pytest.mark.parametrize("kw", [{"epochs": 8, "refit_every": 7},
                                {"epochs": 5, "target": "level", "gate": False, "loss": "huber"},
                                {"epochs": 5, "exog_lags": 0, "speed_lags": 3},
                                {"epochs": 5, "n_exog": 0, "refit_every": 4, "clip_high": 1.05}])
@pytest.mark.parametrize("fail_from", [T, 60])
def test_compiled_narx_steps_equal_the_numpy_steps(kw, fail_from):
    """The numba kernels (the default) against the numpy code they replace, on the same trace:
    the same counts, forecasts and state (the forecast's dot products may differ in the last bit)."""
    _assert_compiled_equals_numpy(BatchNARX, kw, 3, fail_from, (
        "_last", "_n", "_fc", "_merr", "_lerr", "_logv", "_x", "_pos", "_cnt", "_since", "_tried",
        "_busy", "_has_w", "_w1", "_sy"))


ARIMA_STATE = ("_last", "_n", "_fc", "_merr", "_lerr", "_y", "_pos", "_cnt", "_nobs", "_since",
               "_tried", "_busy", "_fitted", "_mu", "_ar", "_ma", "_w", "_wn", "_e", "_en", "_what")


@pytest.mark.parametrize("kw", [{}, {"order": (2, 1, 1), "window": 30, "clip_high": 1.05},
                                {"order": (1, 0, 1), "gate": False, "refit_every": 20}])
@pytest.mark.parametrize("fail_from", [T, 60])
def test_compiled_arima_steps_equal_the_numpy_steps(kw, fail_from):
    """The numba kernels (the default) against the numpy recursion they replace, on the same
    trace (refits, their landing, replay and failure included): the same counts, forecasts and
    state."""
    _assert_compiled_equals_numpy(BatchARIMA, kw, 4, fail_from, ARIMA_STATE)


def _assert_compiled_equals_numpy(cls, kw, seed: int, fail_from: int, state) -> None:
    """``cls`` compiled (the default) and with its numpy code on the same trace: every update's
    counts and every forecast, the refits and the final state."""
    a = cls(**kw, refit="sync", compiled=True)
    b = cls(**kw, refit="sync", compiled=False)
    assert cls(refit="sync").compiled                 # numba is a dependency: the default
    got, exp = _step_trace(fresh(a), seed, fail_from), _step_trace(fresh(b), seed, fail_from)
    for g, e in zip(got, exp):
        assert g.dtype == e.dtype
        assert np.allclose(g, e, rtol=1e-12, atol=0, equal_nan=True)
    assert a.n_fits() == b.n_fits() > 2 * K
    _assert_same_state(a, b, state)


def _assert_same_state(a, b, names) -> None:
    """Counts, clocks and flags equal; floats to 1e-12 (the kernels' logs are the C
    library's, which may differ from numpy's vectorised ones in the last bit)."""
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        if x.dtype.kind == "f":
            assert np.allclose(x, y, rtol=1e-12, atol=1e-15, equal_nan=True), name
        else:
            assert np.array_equal(x, y), name


def test_compiled_arima_log_steps_equal_the_numpy_steps_from_the_same_state():
    """With ``log_transform`` the kernel's log and exp (the C library's) may differ from numpy's
    in the last bit, and a refit on a window one bit apart can land elsewhere: so each step
    starts from the numpy predictor's state, and its results must agree to 1e-12."""
    kw = {"order": (1, 1, 1), "log_transform": True, "refit_every": 7}
    a = fresh(BatchARIMA(**kw, refit="sync", compiled=True))
    b = fresh(BatchARIMA(**kw, refit="sync", compiled=False))
    rng = np.random.default_rng(4)
    fitted_steps = 0
    for t in range(T):
        for name in ARIMA_STATE:
            getattr(a, name)[...] = getattr(b, name)
        a.updates = b.updates
        sel = ALL if t % 5 else ALL[::2]
        v = YS[sel, t] * (1.0 + 0.02 * rng.standard_normal(sel.size))
        assert np.array_equal(a.update(sel, v), b.update(sel, v))
        assert np.allclose(a.predict(ALL), b.predict(ALL), rtol=1e-12, atol=0, equal_nan=True)
        for name in ARIMA_STATE:
            assert np.allclose(getattr(a, name), getattr(b, name), rtol=1e-12, atol=1e-15,
                               equal_nan=True), (t, name)
        fitted_steps += int(b._fitted[sel].sum())
    assert fitted_steps > T * 3


@pytest.mark.parametrize("cls,kw", [(BatchNARX, {"epochs": 5}), (BatchARIMA, {})])
def test_compiled_steps_take_any_int_and_float_arrays_as_int64_and_float64(cls, kw):
    """Found by a review: int32 slots or float32 speeds compiled a new signature inside a
    decision (about 1 s) and took float32 logs. They are converted first: the same results."""
    a, b = fresh(cls(**kw, refit="sync")), fresh(cls(**kw, refit="sync"))
    for t in range(40):
        sel = ALL[::-1][: K - t % 3]                  # reversed: a strided view, not contiguous
        v = YS[sel, t].astype(np.float32)
        ex = np.asfortranarray(XS[t][sel])
        na = a.update(sel.astype(np.int32), v, ex)
        nb = b.update(sel.copy(), v.astype(np.float64), np.ascontiguousarray(ex))
        assert np.array_equal(na, nb)
        assert np.array_equal(a.predict(ALL.astype(np.int16)), b.predict(ALL), equal_nan=True)
    assert a.n_fits() == b.n_fits() > 0


def test_compiled_steps_refuse_slots_and_inputs_out_of_range():
    """Compiled code does not check indices itself: the kernels and their caller do."""
    p = fresh(BatchNARX(refit="sync", compiled=True))
    with pytest.raises(IndexError, match="slot out of range"):
        p.update(np.array([0, K]), np.ones(2), None)
    with pytest.raises(IndexError, match="slot out of range"):
        p.predict(np.array([-1]))
    with pytest.raises(ValueError, match="exogenous inputs of shape"):
        p.update(ALL, np.ones(K), np.ones((K, 2)))
    with pytest.raises(ValueError, match="speeds for"):
        p.update(ALL, np.ones(K - 1), None)
    assert (p.n_updates(ALL) == 0).all()
    q = fresh(BatchARIMA(refit="sync", compiled=True))
    with pytest.raises(IndexError, match="slot out of range"):
        q.update(np.array([K]), np.ones(1))
    with pytest.raises(ValueError, match="speeds for"):
        q.update(ALL, np.ones(K - 1))
    assert (q.n_updates(ALL) == 0).all()


def test_scalar_adapter_and_registry():
    p = get_batch_predictor("ema", {"alpha": 0.5})
    assert isinstance(p, BatchEMA)
    adapter = fresh(get_batch_predictor("arima", {"between": "statsmodels", "refit_every": 30}))
    assert isinstance(adapter, ScalarPredictors)
    exp = run_scalar([get_predictor("arima", between="statsmodels", refit_every=30) for _ in range(K)])
    assert np.allclose(run_batch(adapter)[1:], exp[1:], rtol=1e-12)
    with pytest.raises(ValueError, match="refit must be one of"):
        BatchNARX(refit="later")


def test_numpy_trainer_takes_torch_adam_steps():
    """The batched numpy network and its hand-written backward pass and Adam match torch."""
    cfg = NARXConfig(epochs=25, hidden=6, weight_decay=1e-2, lr=0.02)
    rng = np.random.default_rng(3)
    logv = np.log(100 + rng.normal(0, 5, (3, 80)).cumsum(axis=1) * 0.1 + 50)
    x = rng.uniform(0, 100, (3, 80, 3))
    X, y = design(logv, x, cfg)
    w1, b1, w2, b2 = init_weights(cfg)
    res = train(X, y, np.stack([w1] * 3), np.stack([b1] * 3), np.stack([w2] * 3),
                np.full(3, b2), cfg)
    for k in range(3):
        net = torch.nn.Sequential(torch.nn.Linear(cfg.n_inputs, cfg.hidden, dtype=torch.float64),
                                  torch.nn.Tanh(), torch.nn.Linear(cfg.hidden, 1, dtype=torch.float64))
        with torch.no_grad():
            net[0].weight.copy_(torch.from_numpy(w1))
            net[0].bias.copy_(torch.from_numpy(b1))
            net[2].weight.copy_(torch.from_numpy(w2[None, :]))
            net[2].bias.fill_(b2)
        Xk, yk = X[k], y[k]
        mx, sx = Xk.mean(axis=0), Xk.std(axis=0)
        sx = np.where(sx > 1e-9, sx, 1.0)
        sy = float(yk.std()) or 1.0
        Xn = torch.from_numpy((Xk - mx) / sx)
        yn = torch.from_numpy(yk / sy).unsqueeze(1)
        opt = torch.optim.Adam(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                               foreach=False)
        for _ in range(cfg.epochs):
            opt.zero_grad()
            torch.nn.functional.mse_loss(net(Xn), yn).backward()
            opt.step()
        assert np.allclose(res["w1"][k], net[0].weight.detach().numpy(), rtol=1e-8, atol=1e-10)
        assert np.allclose(res["w2"][k], net[2].weight.detach().numpy()[0], rtol=1e-8, atol=1e-10)
        assert res["ok"][k]


# ----------------------------------------------------------------------------- background
REFIT_CASES = [(BatchNARX, {"epochs": 8}), (BatchARIMA, {"refit_every": 8})]


def assert_background_equals_sync(cls, kw, mode: str) -> None:
    """With every refit waited for before the next update, background = sync, exactly."""
    sync = fresh(cls(**kw, refit="sync"))
    bg = fresh(cls(**kw, refit=mode))
    try:
        assert np.array_equal(run_batch(sync)[1:], run_batch(bg, drain=True)[1:])
        assert bg.n_fits() == sync.n_fits() and bg.in_flight == 0
    finally:
        bg.close()


@pytest.mark.parametrize("cls,kw", REFIT_CASES)
def test_thread_refits_equal_sync_once_landed(cls, kw):
    assert_background_equals_sync(cls, kw, "thread")


class Gate:
    """A fit hook that blocks until released (the deliberately slow fit)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.entered = threading.Event()

    def __call__(self) -> None:
        self.entered.set()
        assert self.release.wait(30)


@pytest.mark.parametrize("order", [(2, 0, 0), (1, 1, 1)])
def test_compiled_arima_replays_late_fits_like_numpy(order):
    """Fits held while observations arrive land, and each recursion is replayed through what
    came meanwhile: by the compiled replay as by the numpy one."""
    kw = {"order": order, "refit_every": 8, "gate": False}
    ps = [fresh(BatchARIMA(**kw, refit="thread", compiled=c)) for c in (True, False)]
    gates = [Gate(), Gate()]
    try:
        for t in range(30):
            for p in ps:
                p.update(ALL, YS[:, t])
                assert p.drain(30)
        for p, g in zip(ps, gates):
            p.max_jobs, p.fit_hook = 1000, g
        for t in range(30, 40):                     # fits held, observations keep coming
            for p in ps:
                p.update(ALL, YS[:, t])
        assert all(p.in_flight >= 1 for p in ps)
        for p, g in zip(ps, gates):
            g.release.set()
            assert p.drain(30)
        assert ps[0].lag_sum == ps[1].lag_sum > 0
        _assert_same_state(ps[0], ps[1], ARIMA_STATE)
        assert np.allclose(ps[0].predict(ALL), ps[1].predict(ALL), rtol=1e-12, atol=0, equal_nan=True)
    finally:
        for p, g in zip(ps, gates):
            g.release.set()
            p.close()


@pytest.mark.parametrize("cls,kw", [(BatchNARX, {"epochs": 8, "gate": False}),
                                    (BatchARIMA, {"refit_every": 8, "gate": False})])
def test_late_background_refits_catch_up_with_sync(cls, kw):
    """A refit that lands late: the old weights forecast meanwhile, and once it has landed the
    forecasts are those of a synchronous refit on the same data. (No job is throttled here:
    every refit leaves on its schedule, only later ones queue behind the held one.)"""
    sync = fresh(cls(**kw, refit="sync"))
    bg = fresh(cls(**kw, refit="thread"))
    bg.max_jobs = 1000
    hook = Gate()
    try:
        t, held = 0, False
        while not held:                                  # caught up: every refit waited for
            bg.fit_hook = hook if t >= 30 else None
            jobs = bg.submitted_jobs
            for p in (sync, bg):
                p.update(ALL, YS[:, t], XS[t])
            t += 1
            held = t > 30 and bg.submitted_jobs > jobs   # this job carries the slow hook
            if not held:
                assert bg.drain(30)
        bg.fit_hook = None
        assert hook.entered.wait(30)
        for _ in range(5):                               # a few updates while it is held
            for p in (sync, bg):
                p.update(ALL, YS[:, t], XS[t])
            t += 1
        assert bg.in_flight >= 1
        assert not np.allclose(bg._fc[:K], sync._fc[:K])  # meanwhile: the older weights
        hook.release.set()
        assert bg.drain(30)
        for t2 in range(t, T):
            for p in (sync, bg):
                p.update(ALL, YS[:, t2], XS[t2])
            assert bg.drain(30)
        assert np.allclose(bg.predict(ALL), sync.predict(ALL), rtol=1e-12, atol=0)
        assert np.allclose(bg._fc[:K], sync._fc[:K], rtol=1e-12, atol=0)
        assert bg.n_fits() == sync.n_fits()
    finally:
        hook.release.set()
        bg.close()


def test_a_refit_in_progress_never_blocks_a_decision():
    """The refit thread is stuck in the injected slow fit; decisions go on (with the previous
    weights, here: the last value), and the fit lands once released."""
    m = BatchSizeManager("lbbsp-cpu", 256, policy_args={
        "predictor": "narx", "refit": "thread", "predictor_args": {"epochs": 3, "min_train": 4}})
    pred = m.policy.predictor
    hook = Gate()
    pred.fit_hook = hook
    sim = Simulation(m, [SimulatedWorker(1000.0 * (1 + i), 0.002, noise=0.02, seed=i) for i in range(4)])
    try:
        for _ in range(8):                   # first fits are due from the 6th report on
            sim.step()
        assert hook.entered.wait(10) and pred.in_flight >= 1
        for _ in range(15):                  # every decision returns while the fit is held
            rec = sim.step()
            assert sum(rec.sizes.values()) == 256
        assert pred.in_flight >= 1 and pred.landed_fits == 0 and not hook.release.is_set()
        hook.release.set()
        assert pred.drain(30) and pred.landed_fits > 0
    finally:
        hook.release.set()
        m.close()


def _fits_per_step(stagger: bool, job_every: int | None = None, steps: int = 40) -> tuple[list[int], np.ndarray]:
    p = BatchNARX(epochs=2, min_train=4, refit_every=10, refit="sync", stagger=stagger)
    if job_every is not None:
        p.job_every = job_every
    slots = np.arange(100)
    p.reset(slots, slots)
    rng = np.random.default_rng(0)
    out, n, fits = [], 0, []
    for _ in range(steps):
        p.update(slots, 100 + rng.normal(0, 3, 100), rng.uniform(0, 100, (100, 3)))
        out.append(p.n_fits() - n)
        n = p.n_fits()
        fits.append(p.n_fits(slots).copy())
    return out, np.array(fits)


def test_refits_are_staggered_over_the_period():
    """100 workers joined together: after their first fits, about 1/refit_every of them refit
    per iteration (without staggering, all 100 at once)."""
    staggered, _ = _fits_per_step(True, job_every=1)
    together, _ = _fits_per_step(False)
    first = next(i for i, k in enumerate(staggered) if k)
    assert staggered[first] == 100 and max(staggered[first + 1:]) <= 10
    assert sorted(set(together[first + 1:])) == [0, 100]


def test_staggered_refits_leave_in_jobs_every_half_period_and_every_period_stays_whole():
    """job_every = 5 (refit_every = 10): refits leave only at every 5th update, in jobs of
    about half the workers instead of a tenth at every update; each worker's first refit after
    the initial one is late by at most 4 updates, and from then on its period is exactly 10."""
    per_step, fits = _fits_per_step(True, steps=60)
    first = next(i for i, k in enumerate(per_step) if k)
    later = per_step[first + 1:]
    jobs = [i for i, k in enumerate(later, first + 1) if k]
    assert all((i - first) % 5 == 0 for i in jobs), jobs
    assert max(later) <= 60 and sum(later) >= 4 * 100
    for w in range(100):
        when = np.flatnonzero(np.diff(fits[:, w])) + 1       # the updates at which w refitted
        assert when[0] == first
        when = when[1:]
        due = first + 10 - w % 10                             # staggered by its id
        assert when[0] == due + (-(due - first) % 5) <= due + 4, (w, when)
        assert (np.diff(when) == 10).all(), (w, when)
    unstaggered, _ = _fits_per_step(True, job_every=1, steps=60)
    assert sum(unstaggered[first + 1:]) == 10 * (59 - first), "as many refits, only in fewer jobs"


def test_a_job_that_cannot_leave_does_not_count_as_the_last_job():
    """While the helper is busy (``max_jobs`` in flight), due refits stay due and no job leaves:
    that must not count as the job update, or coalescing would hold the next job back once the
    helper is free (a mend of 2026-11-28, tested since: the first update after the helper frees
    up with refits due hands them over)."""
    p = fresh(BatchNARX(epochs=3, refit="thread"))
    p.max_jobs = 1
    gate = Gate()
    try:
        t = 0
        while p.submitted_jobs == 0:                # every worker's first fit, let through
            p.update(ALL, YS[:, t], XS[t])
            t += 1
        assert p.drain(30)
        p.fit_hook = gate
        while p.submitted_jobs == 1:                # the next job (some workers) is held
            p.update(ALL, YS[:, t], XS[t])
            t += 1
        p.fit_hook = None
        left_at, jobs = p.last_job_at, p.submitted_jobs
        assert gate.entered.wait(30)
        for _ in range(2 * p.job_every):            # refits come due while the helper is busy
            p.update(ALL, YS[:, t], XS[t])
            t += 1
        assert p.submitted_jobs == jobs and p.last_job_at == left_at
        waiting = ~p._busy[:K] & (p._since[:K] >= p.cfg.refit_every)
        assert waiting.any()                          # others are due and wait for the helper
        gate.release.set()
        assert p.drain(30)
        p.update(ALL, YS[:, t], XS[t])
        assert p.submitted_jobs == jobs + 1 and p.last_job_at == p.updates
    finally:
        gate.release.set()
        p.close()


def test_a_decision_looks_for_finished_refits_once():
    """update() polls the refit pipe; the predict() that follows it within POLLED_FOR_S (the
    same decision) does not poll again; a predict() with no update before it, or after an
    update long before it, does: results that land in between are swapped in at the next
    decision's update."""
    p = BatchEMA()
    calls = []
    p.poll = lambda: calls.append(1) or 0          # type: ignore[method-assign]
    p.resize(4)
    slots = np.arange(4)
    assert p.update(slots, np.full(4, 100.0)).tolist() == [1, 1, 1, 1]
    assert len(calls) == 1
    p.predict(slots)
    assert len(calls) == 1                          # the update's look counts for this decision
    p.predict(slots)
    assert len(calls) == 2                          # no update since: look again
    assert p.update(slots[:2], np.full(2, 50.0)).tolist() == [2, 2]
    p.predict(slots)
    assert len(calls) == 3
    p.update(slots, np.full(4, 60.0))              # reports applied well before the decision
    assert len(calls) == 4
    time.sleep(2 * POLLED_FOR_S)
    p.predict(slots)
    assert len(calls) == 5                          # too old to stand for this decision's look
