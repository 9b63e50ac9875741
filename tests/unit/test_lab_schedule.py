"""The lab's schedules as pure functions of the config: what each worker's quota and link
should be at time t."""

from __future__ import annotations

import pytest

from ps_common.config import ConfigError, validate
from ps_launcher.lab.schedule import LinkState, link_schedules, quota_schedules


def scenario(**sc):
    return validate({"cluster": {"num_workers": 4}, "scenario": sc}).scenario


def test_static_steps_bursts_and_the_tightest_wins():
    sc = scenario(workers=[{}, {"cpu_quota": 0.5},
                           {"cpu_quota": {"fraction": 0.8, "steps": [{"at_seconds": 10, "fraction": None}],
                                          "bursts": {"period_s": 4, "duration_s": 1, "fraction": 0.1}}}])
    q = quota_schedules(sc, 4)
    assert sorted(q) == [1, 2], "only workers with a quota get a group"
    assert q[1].at(0) == q[1].at(1e6) == 0.5
    assert [q[2].at(t) for t in (0.5, 2, 4.5, 9, 10.5, 12.2)] == [0.1, 0.8, 0.1, 0.8, None, 0.1]


def test_rotation_moves_the_slow_role():
    sc = scenario(rotation={"period_s": 5, "fractions": [None, None, 0.3, 0.3]})
    q = quota_schedules(sc, 4)
    assert [q[i].at(0) for i in range(4)] == [None, None, 0.3, 0.3]
    assert [q[i].at(5.1) for i in range(4)] == [None, 0.3, 0.3, None]
    assert [q[i].at(10.1) for i in range(4)] == [0.3, 0.3, None, None]


def test_random_quota_depends_only_on_its_seed():
    spec = {"cpu_quota": {"random": {"seed": 3, "mean_on_s": 2, "mean_off_s": 3, "fraction": 0.2}}}
    a = quota_schedules(scenario(workers=[spec]), 4)[0]
    b = quota_schedules(scenario(workers=[{}, spec]), 4)[1]
    ts = [x * 0.25 for x in range(400)]
    assert [a.at(t) for t in ts] == [b.at(t) for t in ts]
    assert {a.at(t) for t in ts} == {None, 0.2}


def test_quota_trace_from_csv(tmp_path):
    (tmp_path / "q.csv").write_text("seconds,fraction\n0,1.0\n5,0.25\n8,0\n10,\n")
    sc = validate({"cluster": {"num_workers": 1},
                   "scenario": {"workers": [{"cpu_quota": {"trace": {"path": "q.csv", "loop": True}}}]}}
                  ).scenario.resolved(tmp_path)
    q = quota_schedules(sc, 1)[0]
    # 0 and an empty cell are unlimited; the loop's period is 10 + 2
    assert [q.at(t) for t in (1, 6, 9, 11, 13, 18)] == [1.0, 0.25, None, None, 1.0, 0.25]


def test_link_steps():
    sc = scenario(workers=[{}, {"link": {"rate_mbit": 50, "delay_ms": 20,
                                         "steps": [{"at_seconds": 3, "rate_mbit": 5},
                                                   {"at_seconds": 6, "unlimited": True, "delay_ms": 0}]}}])
    (l1,) = link_schedules(sc, 4).values()
    assert l1.at(0) == LinkState(50, 20) and l1.at(4) == LinkState(5, 20) and l1.at(7) == LinkState(None, 0)


def test_bad_lab_configs_name_the_key():
    with pytest.raises(ConfigError, match="rotation.fractions"):
        validate({"scenario": {"rotation": {"period_s": 5, "fractions": [0, 1]}}})
    with pytest.raises(ConfigError, match="cpu_quota"):
        validate({"scenario": {"workers": [{"cpu_quota": -1}]}})
    with pytest.raises(ConfigError, match="ipc cannot reach"):
        validate({"cluster": {"transport": "ipc"}, "scenario": {"hosts": True}})
