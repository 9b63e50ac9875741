"""Coordinator decisions with no sockets: elastic global batch and its learning-rate rule,
removal of a worker mid-iteration, checkpoint state."""

from __future__ import annotations

import pytest

from batchsize_manager.manager import BatchSizeManager
from ps_common.config import validate
from ps_server.coordinator import Coordinator


def coordinator(**sections):
    cfg = validate({"training": {"global_batch": 60, "max_iterations": 100}, "cluster": {"num_workers": 3},
                    **sections})
    c = Coordinator(cfg, 1000, BatchSizeManager("uniform", 60))
    for i in range(3):
        c.join(f"w{i}")
    assert c.try_start()
    return c


def step(c):
    c.on_update(c.iteration, list(c.plan), sum(a.batch_size for a in c.plan.values()))


def test_keep_global_batch_resplits_and_keeps_lr():
    c = coordinator()
    step(c)
    reduced = c.leave(2)
    assert reduced == {0: 20, 1: 20}, "the in-flight iteration completes without the lost worker"
    step(c)
    assert {w: a.batch_size for w, a in c.plan.items()} == {0: 30, 1: 30}
    assert all(a.lr_scale == 1.0 for a in c.plan.values())
    assert c.drain_events() == []


def test_keep_worker_batch_scales_lr_linearly_with_a_ramp():
    c = coordinator(elastic={"keep": "worker_batch", "ramp_iterations": 4})
    step(c)
    c.leave(2)
    factors = []
    for _ in range(6):
        step(c)
        (a, b) = c.plan.values()
        assert a.batch_size == b.batch_size == 20 and a.global_batch == 40
        factors.append(round(a.lr_scale, 4))
    assert factors == [0.9167, 0.8333, 0.75, 0.6667, 0.6667, 0.6667]
    (ev,) = c.drain_events()
    assert ev["event"] == "global_batch_changed" and (ev["from"], ev["to"]) == (60, 40)
    c.join("w3")
    step(c)
    assert c.plan[3].batch_size == 20 and c.plan[3].global_batch == 60
    assert c.plan[3].lr_scale == pytest.approx(0.6667 + (1 - 0.6667) / 4, abs=1e-3)


def test_lost_samples_return_to_the_cursor():
    c = coordinator()
    served = c.cursor.state.samples_served
    c.leave(1)
    assert c.cursor.state.samples_served == served - 20
    step(c)
    taken = [r for a in c.plan.values() for r in a.ranges]
    assert [0, 20, 40] in taken, "the lost worker's range is served again first"


def test_state_dict_round_trip_resumes_at_the_next_iteration():
    c = coordinator()
    for _ in range(5):
        step(c)
    state = c.state_dict()
    d = coordinator()
    d.load_state_dict(state)
    assert not d.started and d.iteration == 5 and d.updates == 5
    for i in range(3):
        d.join(f"again{i}")
    assert d.try_start() and d.iteration == 5
    assert [a.ranges for a in d.plan.values()] == [a.ranges for a in c.plan.values()]
