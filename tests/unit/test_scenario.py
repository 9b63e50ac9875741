"""Heterogeneity scenarios: config parsing and errors, and the pure runtime's schedules."""

from __future__ import annotations

import random

import numpy as np
import pytest
import yaml
from pydantic import ValidationError

from ps_common.scenario import ScenarioConfig, WorkerScenario
from ps_worker.scenario_runtime import OnOffSchedule, ScenarioError, ScenarioRuntime, runtime_for

EXAMPLE = """
scenario:
  name: static-1-1-2-4
  workers:
    - {}
    - slowdown: 2.0
    - steps:
        - {at_iteration: 100, slowdown: 4.0}
        - {at_seconds: 30.0, slowdown: 1.0}
      bursts: {period_s: 20.0, duration_s: 5.0, slowdown: 3.0, phase_s: 0.0}
      random: {seed: 1, mean_on_s: 10.0, mean_off_s: 20.0, slowdown: 3.0}
      trace: {path: traces/x.csv, by: iteration, column: slowdown, loop: true}
      cpu_load:
        - {start_s: 10.0, stop_s: 40.0, processes: 2}
        - {random: {seed: 3, mean_on_s: 15.0, mean_off_s: 15.0}, processes: 1}
      comm_delay_ms: 5.0
"""


def parse(data) -> ScenarioConfig:
    return ScenarioConfig.model_validate(data)


def error_keys(data) -> list[str]:
    """Each error as 'dotted.key: message' (how ps_common.config formats them)."""
    with pytest.raises(ValidationError) as info:
        parse(data)
    return [".".join(str(p) for p in e["loc"]) + ": " + e["msg"] for e in info.value.errors()]


def rt(**spec):
    return ScenarioRuntime(WorkerScenario.model_validate(spec), 0)


# --- config -----------------------------------------------------------------------------------


def test_example_yaml_parses():
    sc = parse(yaml.safe_load(EXAMPLE)["scenario"])
    assert sc.name == "static-1-1-2-4"
    assert sc.for_worker(0) == WorkerScenario()
    assert sc.for_worker(1).static_slowdown == 2.0
    w2 = sc.for_worker(2)
    assert [s.at_iteration for s in w2.steps] == [100, None]
    assert len(w2.bursts) == 1 and len(w2.random) == 1  # single mappings become lists
    assert w2.trace is not None and w2.trace.loop and w2.trace.by == "iteration"
    assert [c.processes for c in w2.cpu_load] == [2, 1]
    assert w2.comm_delay_ms == 5.0
    assert sc.for_worker(7) == WorkerScenario()  # not listed: no slowdown
    assert sc.labels() == {"scenario": "static-1-1-2-4", "emulated": True,
                           "emulated_comm": True, "real_load": True,
                           "real_quota": False, "real_link": False}
    text = sc.describe()
    assert "worker 1: static x2 [emulated]" in text and "[real]" in text
    # The model round-trips (the launcher dumps configs to YAML for its children).
    assert parse(sc.model_dump(mode="json")) == sc
    with pytest.raises(ValueError, match="frozen"):
        sc.name = "x"


def test_default_scenario_is_empty():
    sc = ScenarioConfig()
    assert sc.labels() == {"scenario": "none", "emulated": False, "emulated_comm": False,
                           "real_load": False, "real_quota": False, "real_link": False}
    r = runtime_for(sc, 3)
    assert r.slowdown(10, 10.0) == 1.0 and r.cpu_processes(10.0) == 0 and r.comm_delay_s == 0.0
    assert not r.is_emulated and not r.has_real_load


def test_slowdowns_shorthand_and_mapping_form():
    sc = parse({"slowdowns": [1, 1, 2, 4]})
    assert [sc.for_worker(i).static_slowdown for i in range(5)] == [1, 1, 2, 4, 1]
    assert sc.labels(4)["emulated"] and not sc.labels(2)["emulated"]
    # Combined with per-worker entries that do not set a static factor.
    sc = parse({"slowdowns": [1, 3], "workers": {1: {"comm_delay_ms": 2}, "3": {"slowdown": 5}}})
    assert sc.for_worker(1).static_slowdown == 3 and sc.for_worker(1).comm_delay_ms == 2
    assert sc.for_worker(2) == WorkerScenario() and sc.for_worker(3).static_slowdown == 5


@pytest.mark.parametrize("data, expected", [
    ({"slowdowns": [1, 0.5]}, "slowdowns.1: Input should be greater than or equal to 1"),
    ({"workers": [{}, {"slowdwn": 2}]}, "workers.1.slowdwn: Extra inputs are not permitted"),
    ({"workers": [{"slowdown": 0.9}]}, "workers.0.slowdown: Input should be greater than or equal to 1"),
    ({"workers": [{"slowdown": float("nan")}]}, "workers.0.slowdown: Input should be a finite number"),
    ({"workers": {"2": {"bursts": {"period_s": 5, "duration_s": 0, "slowdown": 2}}}},
     "workers.2.bursts.0.duration_s: Input should be greater than 0"),
    ({"workers": [{"bursts": {"period_s": 1, "duration_s": 2, "slowdown": 2}}]},
     "workers.0.bursts.0: Value error, duration_s (2.0) must not exceed period_s"),
    ({"workers": [{"random": {"seed": 1, "mean_on_s": 0, "mean_off_s": 1, "slowdown": 2}}]},
     "workers.0.random.0.mean_on_s: Input should be greater than 0"),
    ({"workers": [{"random": {"seed": 1, "mean_on_s": 1, "mean_off_s": 1, "slowdown": 2,
                              "mean": 3}}]}, "workers.0.random.0.mean: Extra inputs"),
    ({"workers": [{"steps": [{"slowdown": 2}]}]},
     "workers.0.steps.0: Value error, give exactly one of at_iteration or at_seconds"),
    ({"workers": [{"steps": [{"at_iteration": 5, "slowdown": 2}, {"at_iteration": 3, "slowdown": 1}]}]},
     "workers.0: Value error, steps.1.at_iteration (3) comes before steps.0.at_iteration (5)"),
    ({"workers": [{"steps": [{"at_seconds": 5, "slowdown": 0}]}]},
     "workers.0.steps.0.slowdown: Input should be greater than or equal to 1"),
    ({"workers": [{"trace": {"path": "t.csv", "by": "minutes"}}]},
     "workers.0.trace.by: Input should be 'iteration' or 'seconds'"),
    ({"workers": [{"cpu_load": [{"processes": 0}]}]},
     "workers.0.cpu_load.0.processes: Input should be greater than or equal to 1"),
    ({"workers": [{"cpu_load": [{"start_s": 5, "stop_s": 1}]}]},
     "workers.0.cpu_load.0: Value error, stop_s (1.0) must be after start_s"),
    ({"workers": [{"comm_delay_ms": -1}]}, "workers.0.comm_delay_ms: Input should be greater than or equal to 0"),
    ({"workers": {"x": {}}}, "workers: Value error, worker index 'x' is not an integer"),
    ({"slowdowns": [2], "workers": [{"slowdown": 3}]},
     ": Value error, workers.0.slowdown and slowdowns.0 are both set"),
    ({"scenario_name": "x"}, "scenario_name: Extra inputs are not permitted"),
])
def test_errors_name_the_key(data, expected):
    errs = error_keys(data)
    assert any(e.startswith(expected) for e in errs), errs


def test_job_config_names_scenario_keys(tmp_path):
    """Once JobConfig has a ``scenario`` section, errors come out of load_config with the key."""
    from ps_common.config import ConfigError, JobConfig, load_config

    if "scenario" not in JobConfig.model_fields:
        pytest.skip("JobConfig.scenario not wired yet")
    p = tmp_path / "c.yaml"
    p.write_text(EXAMPLE)
    assert load_config(p, env={}).scenario.for_worker(1).static_slowdown == 2.0
    p.write_text("scenario: {workers: [{}, {slowdown: 0.5}]}")
    with pytest.raises(ConfigError, match=r"scenario\.workers\.1\.slowdown: .*greater than or equal to 1"):
        load_config(p, env={})


# --- slowdown() -------------------------------------------------------------------------------


def test_static_factor():
    assert rt(slowdown=2.5).slowdown(0, 0.0) == 2.5
    assert rt(slowdown=2.5).slowdown(10_000, 1e6) == 2.5
    assert rt().slowdown(3, 3.0) == 1.0


def test_steps_by_iteration_and_seconds():
    r = rt(steps=[{"at_iteration": 10, "slowdown": 3}, {"at_iteration": 20, "slowdown": 1.5}])
    assert [r.slowdown(i, 0.0) for i in (0, 9, 10, 19, 20, 500)] == [1, 1, 3, 3, 1.5, 1.5]
    r = rt(steps=[{"at_seconds": 0, "slowdown": 2}, {"at_seconds": 5.0, "slowdown": 4}])
    assert [r.slowdown(0, t) for t in (0.0, 4.99, 5.0, 100.0)] == [2, 2, 4, 4]


def test_mixed_steps_apply_in_listed_order():
    # 4x from iteration 100; 2x from 30 s, but only once the 4x step has happened.
    r = rt(steps=[{"at_iteration": 100, "slowdown": 4}, {"at_seconds": 30.0, "slowdown": 2}])
    assert r.slowdown(50, 10.0) == 1
    assert r.slowdown(100, 10.0) == 4
    assert r.slowdown(150, 29.9) == 4
    assert r.slowdown(150, 30.0) == 2
    assert r.slowdown(50, 60.0) == 1  # 30 s reached first: the later step waits for the earlier
    assert r.slowdown(100, 60.0) == 2  # ... and follows at once when the earlier one happens


def test_bursts_periodic_with_phase():
    r = rt(bursts={"period_s": 20.0, "duration_s": 5.0, "slowdown": 3.0, "phase_s": 2.0})
    on = {t: r.slowdown(0, t) for t in (0.0, 1.99, 2.0, 6.99, 7.0, 21.99, 22.0, 26.9, 27.0, 102.5)}
    assert on == {0.0: 1, 1.99: 1, 2.0: 3, 6.99: 3, 7.0: 1, 21.99: 1, 22.0: 3, 26.9: 3, 27.0: 1,
                  102.5: 3}
    ts = np.arange(0.0, 2000.0, 0.1)
    duty = np.mean([r.slowdown(0, float(t)) > 1 for t in ts])
    assert duty == pytest.approx(5.0 / 20.0, abs=0.01)


def _duty(sched: OnOffSchedule, horizon: float, dt: float = 0.5) -> float:
    return float(np.mean([sched.is_on(float(t)) for t in np.arange(0.0, horizon, dt)]))


def test_random_onoff_reproducible_and_seed_dependent():
    spec = {"random": {"seed": 1, "mean_on_s": 10.0, "mean_off_s": 20.0, "slowdown": 3.0}}
    ts = [float(t) for t in np.arange(0.0, 600.0, 0.25)]
    a = [rt(**spec).slowdown(0, t) for t in ts]
    # Same seed, queried in another order (lazy generation must not depend on query order).
    r = rt(**spec)
    shuffled = ts[:]
    random.Random(0).shuffle(shuffled)
    got = {t: r.slowdown(0, t) for t in shuffled}
    assert [got[t] for t in ts] == a
    assert set(a) == {1.0, 3.0}
    spec["random"]["seed"] = 2
    assert [rt(**spec).slowdown(0, t) for t in ts] != a
    # Starts off by default; start_on flips the phase of the same switch times.
    s_off, s_on = OnOffSchedule(5, 1.0, 1.0), OnOffSchedule(5, 1.0, 1.0, start_on=True)
    assert not s_off.is_on(0.0) and s_on.is_on(0.0)
    assert s_off.switch_times(50.0) == s_on.switch_times(50.0)


def test_random_onoff_duty_cycle():
    sched = OnOffSchedule(7, mean_on_s=10.0, mean_off_s=20.0)
    sw = np.diff([0.0] + sched.switch_times(300_000.0))
    assert sw[0::2].mean() == pytest.approx(20.0, rel=0.05)  # first interval is off
    assert sw[1::2].mean() == pytest.approx(10.0, rel=0.05)
    assert _duty(sched, 60_000.0, dt=1.0) == pytest.approx(1 / 3, abs=0.04)


def _write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_trace_by_iteration_hold_and_loop(tmp_path):
    _write(tmp_path, "t.csv", "iteration,slowdown\n0,1\n10,2\n20,4\n")
    r = ScenarioRuntime(WorkerScenario.model_validate({"trace": {"path": "t.csv"}}), 0, tmp_path)
    assert [r.slowdown(i, 0.0) for i in (0, 9, 10, 19, 20, 29, 30, 1000)] == [1, 1, 2, 2, 4, 4, 4, 4]
    r = ScenarioRuntime(WorkerScenario.model_validate({"trace": {"path": "t.csv", "loop": True}}), 0, tmp_path)
    # Period = 20 + (20 - 10) = 30 iterations.
    assert [r.slowdown(i, 0.0) for i in (29, 30, 39, 40, 50, 65)] == [4, 1, 1, 2, 4, 1]


def test_trace_by_seconds_custom_columns_and_speed(tmp_path):
    _write(tmp_path, "s.csv", "t,speed,f\n1.0,100,1.5\n2.0,50,3\n")
    r = ScenarioRuntime(WorkerScenario.model_validate(
        {"trace": {"path": str(tmp_path / "s.csv"), "by": "seconds", "key_column": "t", "column": "f"}}
    ), 0)
    assert [r.slowdown(99, t) for t in (0.0, 0.99, 1.0, 1.5, 2.0, 9.0)] == [1, 1, 1.5, 1.5, 3, 3]
    r = ScenarioRuntime(WorkerScenario.model_validate(
        {"trace": {"path": "s.csv", "by": "seconds", "key_column": "t", "column": "speed",
                   "values": "speed"}}), 0, tmp_path)
    assert r.slowdown(0, 1.0) == 1.0 and r.slowdown(0, 2.0) == 2.0


def test_trace_errors_name_the_key(tmp_path):
    sc = parse({"workers": [{}, {"trace": {"path": "missing.csv"}}]})
    with pytest.raises(ScenarioError, match=r"scenario\.workers\.1\.trace\.path: cannot read"):
        runtime_for(sc, 1, tmp_path)
    _write(tmp_path, "bad.csv", "iteration,slowdown\n0,1\n5,0.5\n")
    sc = parse({"workers": [{"trace": {"path": "bad.csv"}}]})
    with pytest.raises(ScenarioError, match=r"trace\.column: .*line 3: slowdown 0.5 < 1"):
        runtime_for(sc, 0, tmp_path)
    _write(tmp_path, "nocol.csv", "iteration,x\n0,1\n")
    sc = parse({"workers": [{"trace": {"path": "nocol.csv"}}]})
    with pytest.raises(ScenarioError, match=r"trace\.column: .*no column 'slowdown'"):
        runtime_for(sc, 0, tmp_path)
    _write(tmp_path, "order.csv", "iteration,slowdown\n5,1\n5,2\n")
    sc = parse({"workers": [{"trace": {"path": "order.csv"}}]})
    with pytest.raises(ScenarioError, match="strictly increasing"):
        runtime_for(sc, 0, tmp_path)


def test_resolved_makes_trace_paths_absolute(tmp_path):
    _write(tmp_path, "t.csv", "iteration,slowdown\n0,2\n")
    sc = parse({"workers": [{"trace": {"path": "t.csv"}}]}).resolved(tmp_path)
    assert sc.workers[0].trace.path == str((tmp_path / "t.csv").resolve())
    assert runtime_for(sc, 0).slowdown(0, 0.0) == 2.0  # no base dir needed any more


def test_factors_multiply(tmp_path):
    _write(tmp_path, "t.csv", "iteration,slowdown\n0,1.5\n")
    r = ScenarioRuntime(WorkerScenario.model_validate({
        "slowdown": 2.0,
        "steps": [{"at_iteration": 5, "slowdown": 3.0}],
        "bursts": [{"period_s": 10.0, "duration_s": 1.0, "slowdown": 5.0},
                   {"period_s": 4.0, "duration_s": 1.0, "slowdown": 7.0}],
        "random": {"seed": 0, "mean_on_s": 1.0, "mean_off_s": 1.0, "slowdown": 11.0, "start_on": True},
        "trace": {"path": "t.csv"},
    }), 0, tmp_path)
    # t=0: both bursts and the random entry are on; iteration 5: the step is in force.
    assert r.slowdown(5, 0.0) == pytest.approx(2 * 3 * 5 * 7 * 11 * 1.5)
    assert r.slowdown(0, 0.0) == pytest.approx(2 * 5 * 7 * 11 * 1.5)
    for t in np.arange(0.0, 50.0, 0.37):
        f = r.slowdown(7, float(t))
        expect = (2 * 3 * 1.5 * r.burst_factor(float(t)) * r.random_factor(float(t)))
        assert f == pytest.approx(expect) and f >= 2 * 3 * 1.5


# --- cpu_processes() and communication ---------------------------------------------------------


def test_cpu_processes_intervals_add_up():
    r = rt(cpu_load=[{"start_s": 10.0, "stop_s": 40.0, "processes": 2},
                     {"start_s": 30.0, "processes": 1}])
    assert [r.cpu_processes(t) for t in (0.0, 9.9, 10.0, 29.9, 30.0, 39.9, 40.0, 1e6)] == \
        [0, 0, 2, 2, 3, 3, 1, 1]
    assert r.has_real_load and not r.is_emulated
    assert rt(cpu_load={"processes": 4}).cpu_processes(0.0) == 4  # default window: always


def test_cpu_processes_random_schedule():
    spec = {"random": {"seed": 3, "mean_on_s": 15.0, "mean_off_s": 15.0}, "processes": 2}
    r = rt(cpu_load=[spec])
    sched = OnOffSchedule(3, 15.0, 15.0)
    ts = [float(t) for t in np.arange(0.0, 3000.0, 1.0)]
    counts = [r.cpu_processes(t) for t in ts]
    assert counts == [2 * sched.is_on(t) for t in ts]
    assert set(counts) == {0, 2}
    assert np.mean(counts) / 2 == pytest.approx(0.5, abs=0.15)
    # A window masks the random schedule.
    r = rt(cpu_load=[{**spec, "start_s": 100.0, "stop_s": 200.0}])
    assert all(r.cpu_processes(t) == 0 for t in ts if t < 100 or t >= 200)
    assert any(r.cpu_processes(t) == 2 for t in ts if 100 <= t < 200)


def test_comm_delay():
    r = rt(comm_delay_ms=5.0, comm_bandwidth_mb_s=100.0)
    assert r.comm_delay_s == pytest.approx(0.005)
    assert r.message_delay_s(0) == pytest.approx(0.005)
    assert r.message_delay_s(10_000_000) == pytest.approx(0.005 + 0.1)
    assert r.is_emulated and not r.has_real_load
    assert "comm +5ms/msg at 100 MB/s" in r.describe()
