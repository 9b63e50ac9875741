"""Speed predictors: the interface contract for every registered predictor, behaviour on synthetic
series with a known answer, and scores on the recorded contention traces (tests/fixtures/traces).

Hyper-parameters are the defaults unless a test says otherwise; all series are short so the whole
file runs in well under a minute on two shared cores. The test process owns its torch thread count
(set to 1 here, restored afterwards); the predictors themselves never change it.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from predictors import get_predictor, predictor_names
from predictors.base import PREDICTOR_REGISTRY, BaselineGate, Predictor, register_predictor
from predictors.cli import main
from predictors.evaluate import evaluate, evaluate_many, format_table
from predictors.record import burners_at, parse_schedule, random_schedule
from predictors.traces import Trace, load_trace, save_trace, trace_from_worker_metrics
from ps_common.report import EXOG_KEYS, Telemetry

FIXTURES = sorted((Path(__file__).parents[1] / "fixtures" / "traces").glob("*.csv"))
NAMES = predictor_names()
# Cheaper settings for property examples and trace replays (full defaults: see the report table).
FAST = {"arima": {"refit_every": 20}, "narx": {"epochs": 10}}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def run(pred: Predictor, speeds, exog=None) -> np.ndarray:
    """One-step forecasts p[t] of speeds[t] (p[0] = nan), updating after each forecast."""
    out = np.full(len(speeds), math.nan)
    for t, v in enumerate(speeds):
        out[t] = pred.predict()
        pred.update(float(v), None if exog is None else exog[t])
    return out


def rmse(p: np.ndarray, y: np.ndarray, start: int) -> float:
    return float(np.sqrt(np.mean((p[start:] - y[start:]) ** 2)))


# ------------------------------------------------------------------------------- registry
def test_builtins_registered():
    assert {"last", "ema", "arima", "narx"} <= set(NAMES)
    for n in NAMES:
        assert get_predictor(n).name == n


def test_unknown_name_lists_known():
    with pytest.raises(ValueError, match="unknown predictor 'nope'.*arima.*ema.*last.*narx"):
        get_predictor("nope")


@pytest.mark.parametrize("name,kwargs", [
    ("ema", {"alpha": 0.0}), ("ema", {"alpha": 1.5}), ("ema", {"beta": 1}),
    ("arima", {"order": (0, 0, 0)}), ("arima", {"order": "x"}), ("arima", {"window": 5}),
    ("arima", {"clip_low": 2.0}), ("narx", {"hidden": 0}), ("narx", {"target": "raw"}),
    ("narx", {"speed_lags": 1.5}), ("last", {"alpha": 0.3}),
])
def test_bad_kwargs_name_the_predictor(name, kwargs):
    with pytest.raises(ValueError, match=name):
        get_predictor(name, **kwargs)


def test_register_custom_and_duplicate():
    @register_predictor("_test_const")
    class Const(Predictor):
        def _update(self, value, exog):
            pass

        def _predict(self):
            return -1.0  # broken model: the base class must fall back to the last value

        def _reset(self):
            pass

    try:
        p = get_predictor("_test_const")
        p.update(7.0)
        assert p.predict() == 7.0
        with pytest.raises(ValueError, match="already registered"):
            register_predictor("_test_const")(Const)
    finally:
        PREDICTOR_REGISTRY.unregister("_test_const")


def test_exog_of_a_report():
    assert EXOG_KEYS == ("host_cpu", "cotenant_cpu", "host_mem_pct")
    tel = Telemetry(host_mem_pct=40.0, host_cpu=75.5, proc_cpu=99.0, cotenant_cpu=None)
    assert tel.exog() == [75.5, 0.0, 40.0]
    assert Telemetry(cotenant_cpu=float("nan")).exog() == [0.0, 0.0, 0.0]


# ------------------------------------------------------------------------------- contract
@pytest.mark.parametrize("name", NAMES)
def test_contract_basic(name):
    p = get_predictor(name, **FAST.get(name, {}))
    assert math.isnan(p.predict())  # documented: no estimate before the first update
    p.update(100.0, [10.0, 5.0, 50.0])  # length-1 series: the forecast is that value
    assert p.predict() == pytest.approx(100.0)
    rng = np.random.default_rng(1)
    seen = [100.0]
    for _ in range(45):
        v = float(100 * rng.lognormal(0, 0.3))
        p.update(v, rng.uniform(0, 100, 3))
        seen.append(v)
        f = p.predict()
        assert math.isfinite(f) and 0.25 * min(seen) <= f <= 4 * max(seen)
    assert p.n_updates == 46 and p.last_value == seen[-1]
    p.reset()
    assert math.isnan(p.predict()) and p.n_updates == 0
    p.update(3.0)  # exog None is accepted
    assert p.predict() == pytest.approx(3.0)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("bad", [0.0, -5.0, float("nan"), float("inf")])
def test_rejects_non_positive_or_non_finite_speed(name, bad):
    p = get_predictor(name)
    p.update(10.0)
    with pytest.raises(ValueError, match="finite and > 0"):
        p.update(bad)
    assert p.n_updates == 1 and p.predict() == pytest.approx(10.0)  # state unchanged


@pytest.mark.parametrize("name", NAMES)
def test_rejects_bad_exog(name):
    p = get_predictor(name)
    p.update(10.0, [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="exogenous"):
        p.update(10.0, [1.0, 2.0])
    with pytest.raises(ValueError, match="exogenous"):
        p.update(10.0, [1.0, float("nan"), 3.0])
    assert p.n_updates == 1


@pytest.mark.parametrize("name", NAMES)
def test_constant_series_is_exact(name):
    p = get_predictor(name)
    preds = run(p, [250.0] * 60, [[30.0, 10.0, 40.0]] * 60)
    assert np.allclose(preds[1:], 250.0, rtol=1e-9)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.floats(min_value=1e-3, max_value=1e6), min_size=1, max_size=40))
def test_forecast_always_finite_positive(name, speeds):
    """Wild series (9 orders of magnitude, jumps) never produce a bad forecast."""
    p = get_predictor(name, **FAST.get(name, {}))
    for v in speeds:
        p.update(v, [v % 100, (v * 7) % 100, 50.0])
        f = p.predict()
        assert math.isfinite(f) and f > 0


@pytest.mark.parametrize("name", NAMES)
def test_reset_gives_identical_replay(name):
    """Determinism: a reset predictor replays a series exactly like a fresh one."""
    rng = np.random.default_rng(2)
    y = 100 + 10 * np.sin(np.arange(50) / 3) + rng.normal(0, 1, 50)
    x = rng.uniform(0, 100, (50, 3))
    p = get_predictor(name, **FAST.get(name, {}))
    a = run(p, y, x)
    p.reset()
    b = run(p, y, x)
    c = run(get_predictor(name, **FAST.get(name, {})), y, x)
    assert np.array_equal(a[1:], b[1:]) and np.array_equal(a[1:], c[1:])


# ---------------------------------------------------------------------- synthetic series
def test_step_change_recovery():
    """Last recovers after one step; EMA lags (the gap shrinks by a factor 1 - alpha per step); the
    model predictors are back within 5% in a few steps (gate, clip band, ratio target)."""
    y = np.array([100.0] * 40 + [50.0] * 40)
    x = np.array([[20.0, 0.0, 40.0]] * 40 + [[80.0, 60.0, 40.0]] * 40)
    within = {}
    for name in NAMES:
        p = run(get_predictor(name), y, x)
        ok = np.abs(p[40:] - 50.0) / 50.0 < 0.05
        # steps after the change from which every later forecast is within 5%
        within[name] = next(k for k in range(len(ok) + 1) if ok[k:].all())
    assert within["last"] == 1
    ema = run(get_predictor("ema", alpha=0.3), y)
    assert ema[41] == pytest.approx(100 - 0.3 * 50)  # lags: one step after, still far off
    assert within["ema"] == 9  # 50 * 0.7**k < 2.5  <=>  k >= 9
    assert within["arima"] <= 3, within
    assert within["narx"] <= 3, within


def _ar2(seed: int, n: int = 240) -> np.ndarray:
    """Pseudo-periodic AR(2) (complex roots): y_t = 1.5 y_{t-1} - 0.75 y_{t-2} + e_t."""
    rng = np.random.default_rng(seed)
    e = np.zeros(n)
    for t in range(2, n):
        e[t] = 1.5 * e[t - 1] - 0.75 * e[t - 2] + rng.normal()
    return 100 + 3 * e


def _sine(seed: int, n: int = 240) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return 100 + 30 * np.sin(2 * np.pi * np.arange(n) / 12) + rng.normal(0, 2, n)


@pytest.mark.parametrize("series,margin", [(_ar2, 0.85), (_sine, 0.6)])
@pytest.mark.parametrize("name", ["arima", "narx"])
def test_models_beat_last_on_predictable_series(name, series, margin):
    y = series(0)
    base = rmse(run(get_predictor("last"), y), y, 40)
    model = rmse(run(get_predictor(name), y), y, 40)
    assert model < margin * base, (name, model, base)


def test_ema_smooths_noise():
    rng = np.random.default_rng(3)
    y = 100 + rng.normal(0, 5, 200)
    assert rmse(run(get_predictor("ema"), y), y, 20) < 0.85 * rmse(run(get_predictor("last"), y), y, 20)


def _exog_driven(seed: int, n: int = 240) -> tuple[np.ndarray, np.ndarray]:
    """Co-tenant load switches at random; it is measured at t and slows the worker at t+1."""
    rng = np.random.default_rng(seed)
    load = np.empty(n)
    state = 0
    for t in range(n):
        if rng.random() < 0.15:
            state = int(rng.integers(0, 3))
        load[t] = 30 * state + rng.normal(0, 2)
    exog = np.stack([load + 20, load, np.full(n, 50.0)], axis=1)
    speed = np.empty(n)
    speed[0] = 100.0
    speed[1:] = 100 / (1 + load[:-1] / 30) * (1 + rng.normal(0, 0.02, n - 1))
    return speed, exog


def test_narx_uses_exogenous_inputs():
    y, x = _exog_driven(0)
    base = rmse(run(get_predictor("last"), y, x), y, 40)
    with_exog = rmse(run(get_predictor("narx"), y, x), y, 40)
    without = rmse(run(get_predictor("narx", exog_lags=0), y, x), y, 40)
    assert with_exog < 0.5 * base, (with_exog, base)
    assert with_exog < 0.5 * without, (with_exog, without)


def test_narx_seeded_and_leaves_torch_threads_alone():
    y, x = _exog_driven(1, 80)
    a = run(get_predictor("narx", seed=3, gate=False), y, x)
    b = run(get_predictor("narx", seed=3, gate=False), y, x)
    before = torch.get_num_threads()
    c = run(get_predictor("narx", seed=4, gate=False), y, x)
    assert torch.get_num_threads() == before
    assert np.array_equal(a[1:], b[1:])
    assert not np.allclose(a[30:], c[30:])


@pytest.mark.parametrize("order", [(2, 0, 0), (1, 1, 0)])
def test_arima_recursion_matches_statsmodels_filter(order):
    """Without MA terms the cheap recursion between refits is the exact state-space forecast."""
    y = _ar2(5, 60)
    fast = run(get_predictor("arima", order=order, refit_every=25), y)
    exact = run(get_predictor("arima", order=order, refit_every=25, between="statsmodels"), y)
    assert np.allclose(fast[1:], exact[1:], rtol=1e-6)


def test_arima_with_ma_term_close_to_statsmodels():
    y = _ar2(6, 60)
    fast = run(get_predictor("arima", order=(1, 0, 1), gate=False, refit_every=25), y)
    exact = run(get_predictor("arima", order=(1, 0, 1), gate=False, refit_every=25,
                              between="statsmodels"), y)
    assert np.mean(np.abs(fast[20:] - exact[20:]) / exact[20:]) < 0.01


@pytest.mark.parametrize("name", ["arima", "narx"])
def test_refit_schedule_and_offset(name):
    """Refits every refit_every updates after the first; refit_offset staggers the schedule."""
    y = _ar2(7, 45)

    def fit_steps(**kw):
        p = get_predictor(name, **{**FAST.get(name, {}), "refit_every": 10, **kw})
        steps, n = [], 0
        for t, v in enumerate(y):
            p.update(float(v))
            if p.n_fits != n:
                steps.append(t)
                n = p.n_fits
        return steps

    a, b = fit_steps(), fit_steps(refit_offset=3)
    assert a[0] == b[0] and len(a) >= 3
    assert np.diff(a).tolist() == [10] * (len(a) - 1)
    assert b[1] - b[0] == 7 and np.diff(b[1:]).tolist() == [10] * (len(b) - 2)


def test_gate_prefers_the_better_forecaster():
    g = BaselineGate(0.5)
    for v in [10.0, 12.0, 10.0, 12.0]:
        g.observe(v, model_forecast=v * 1.01, last_forecast=v * 1.2)
    assert g.use_model()
    for v in [10.0, 12.0, 10.0, 12.0]:
        g.observe(v, model_forecast=v * 2.0, last_forecast=v * 1.01)
    assert not g.use_model()


# --------------------------------------------------------------------- traces, evaluation
def test_evaluate_scores_by_hand():
    tr = Trace(np.array([1.0, 2.0, 4.0, 8.0]), np.zeros((4, 3)), "doubling")
    r = evaluate(get_predictor("last"), tr, warmup=0)
    assert r.n == 3
    assert r.rmse == pytest.approx(math.sqrt((1 + 4 + 16) / 3))
    assert r.mape == pytest.approx(50.0)
    assert r.step_ms >= 0


def test_trace_roundtrip_and_bad_rows(tmp_path):
    tr = Trace(np.array([100.5, 90.25, 80.0]), np.array([[1.0, 2.0, 3.0]] * 3), "t",
               iteration=np.array([5, 6, 7]))
    back = load_trace(save_trace(tr, tmp_path / "t.csv"))
    assert np.allclose(back.speed, tr.speed) and np.allclose(back.exog, tr.exog)
    assert list(back.iteration) == [5, 6, 7] and back.name == "t"
    (tmp_path / "bad.csv").write_text("iteration,speed,host_cpu,cotenant_cpu,host_mem_pct\n0,-3,1,1,1\n")
    with pytest.raises(ValueError, match="bad.csv:2"):
        load_trace(tmp_path / "bad.csv")
    (tmp_path / "nospeed.csv").write_text("iteration,v\n0,1\n")
    with pytest.raises(ValueError, match="speed"):
        load_trace(tmp_path / "nospeed.csv")


def test_trace_from_worker_metrics(tmp_path):
    recs = [{"worker": 1, "iteration": 1, "batch_size": 64, "compute_s": 0.5, "host_cpu": 50.0,
             "cotenant_cpu": 20.0, "host_mem_pct": 30.0, "loss": 2.0},
            {"worker": 1, "iteration": 0, "batch_size": 32, "compute_s": 0.25, "host_cpu": 40.0},
            {"worker": 1, "iteration": 2, "batch_size": 64, "compute_s": 0.0}]  # unusable: skipped
    path = tmp_path / "worker-1.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + '\n{"worker": 1, "itera')  # torn line
    tr = trace_from_worker_metrics(path)
    assert list(tr.iteration) == [0, 1]
    assert np.allclose(tr.speed, [128.0, 128.0])
    assert np.allclose(tr.exog, [[40.0, 0.0, 0.0], [50.0, 20.0, 30.0]])
    recs[1]["cpu_quota"], recs[1]["throttled_s"] = 0.2, 0.03
    path.write_text("\n".join(json.dumps(r) for r in recs))
    more = trace_from_worker_metrics(path, extra=("cpu_quota", "throttled_s"))
    assert np.allclose(more.exog, [[40.0, 0.0, 0.0, 0.2, 0.03], [50.0, 20.0, 30.0, 0.0, 0.0]])


def test_schedules():
    s = random_schedule(300, seed=1, max_burners=2, min_len=20, max_len=60)
    assert s == random_schedule(300, seed=1, max_burners=2, min_len=20, max_len=60)
    assert s[0][0] == 0 and all(0 <= n <= 2 for _, n in s)
    assert all(20 <= b[0] - a[0] <= 60 for a, b in zip(s, s[1:]))
    assert all(a[1] != b[1] for a, b in zip(s, s[1:]))
    sched = parse_schedule("0:0, 50:2,120:1")
    assert [burners_at(sched, i) for i in (0, 49, 50, 119, 500)] == [0, 0, 2, 2, 1]
    with pytest.raises(ValueError):
        parse_schedule("10:1,5:2")


# ----------------------------------------------------------------------- recorded traces
@pytest.fixture(scope="module")
def fixture_results():
    assert len(FIXTURES) >= 3, "recorded traces missing from tests/fixtures/traces"
    traces = [load_trace(p) for p in FIXTURES]
    return evaluate_many(NAMES, traces, warmup=10, params=FAST)


def test_fixture_traces_are_real_and_small():
    for p in FIXTURES:
        assert p.stat().st_size < 50_000
        tr = load_trace(p)
        assert len(tr) >= 200
        # real contention: speed varies by more than 2x, co-tenant CPU moves with it
        assert tr.speed.max() > 2 * tr.speed.min()
        assert np.corrcoef(np.log(tr.speed), tr.exog[:, 1])[0, 1] < -0.3


def test_predictors_on_recorded_traces(fixture_results):
    print("\n" + format_table(fixture_results))
    rows = {(r.predictor, r.trace): r for r in fixture_results}
    for r in fixture_results:
        assert math.isfinite(r.rmse) and math.isfinite(r.mape) and r.n >= 190, r
    base = rows[("last", "all traces")].rmse
    # Last value is a strong baseline on these traces; the gated models must stay close to it.
    for name in ("ema", "arima", "narx"):
        assert rows[(name, "all traces")].rmse < 1.15 * base, name


def test_cli_eval_on_fixtures(capsys):
    rc = main(["eval", *map(str, FIXTURES), "--predictors", "last,ema,arima,narx", "--warmup", "10",
               "--param", "narx.epochs=10", "--param", "arima.refit_every=20",
               "--param", "arima.order=(1,0,0)"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.startswith("| predictor | trace |")
    for name in ("last", "ema", "arima", "narx"):
        assert f"| {name} | all traces |" in out
    assert len([ln for ln in out.splitlines() if ln.startswith("| ")]) == 1 + 4 * 4


def test_cli_eval_accepts_worker_metrics(tmp_path, capsys):
    recs = [{"iteration": i, "batch_size": 64, "compute_s": 0.1 + 0.01 * (i % 3), "host_cpu": 50.0}
            for i in range(20)]
    path = tmp_path / "worker-0.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    assert main(["eval", str(path), "--predictors", "last,ema", "--warmup", "2"]) == 0
    assert "| ema | worker-0 | 18 |" in capsys.readouterr().out


def test_cli_errors(capsys):
    assert main(["eval", str(FIXTURES[0]), "--predictors", "last,bogus"]) == 2
    assert main(["eval", str(FIXTURES[0]), "--param", "narx.hidden"]) == 2
    assert main(["eval", str(FIXTURES[0]), "--predictors", "ema", "--param", "ema.alpha=7"]) == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "alpha" in err
