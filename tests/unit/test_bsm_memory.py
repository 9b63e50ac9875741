"""MemoryCaps: the binary search over out-of-memory errors, headroom, probes, state by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from batchsize_manager import BatchSizeManager, WorkerReport
from batchsize_manager.memory import MAX_HEADROOM_SAMPLES, CannotFit, MemoryCaps
from ps_common.protocol import Push, decode, encode
from ps_common.report import Telemetry


def search(limit: int, start: int, caps: MemoryCaps, name: str = "w", rounds: int = 40) -> tuple[int, int]:
    """Ask for ``start`` samples every iteration (a policy that wants more than fits); returns
    (the final cap, how many out-of-memory errors it took)."""
    failures = 0
    for _ in range(rounds):
        want = start if caps.cap(name) is None else min(start, caps.cap(name))
        while want > limit:                       # the retry path: fail, shrink, try again
            failures += 1
            want = caps.out_of_memory(name, want)
        caps.completed(name, want)
    return caps.cap(name), failures


@pytest.mark.parametrize("limit, start", [(100, 128), (37, 4096), (1000, 1001), (1, 64), (511, 512)])
def test_the_search_settles_at_most_margin_below_the_real_limit_in_log_steps(limit, start):
    caps = MemoryCaps(margin=0.05)
    cap, failures = search(limit, start, caps)
    assert cap <= limit, "the settled cap fits"
    assert cap >= min(limit, int(limit * 0.95) - 1), f"cap {cap} is more than the margin below {limit}"
    assert failures <= 2 + (start // max(limit, 1)).bit_length() + 6


def test_memory_that_shrinks_is_searched_again_and_nothing_failed_comes_back():
    caps = MemoryCaps(margin=0.05)
    search(200, 400, caps)
    assert 190 <= caps.cap("w") <= 200
    cap, _ = search(120, 400, caps)          # a co-tenant took memory: 200 fails now
    assert 114 <= cap <= 120


def test_headroom_caps_before_anything_fails_and_never_below_a_size_that_fitted():
    caps = MemoryCaps(margin=0.0)
    caps.completed("w", 100, Telemetry(mem_headroom_mb=50.0, mem_per_sample_mb=0.5))
    assert caps.cap("w") == 200
    caps.completed("w", 150, Telemetry(mem_headroom_mb=0.0, mem_per_sample_mb=0.5))
    assert caps.cap("w") == 150
    caps.completed("w", 120, Telemetry(mem_headroom_mb=0.0, mem_per_sample_mb=0.5))
    assert caps.cap("w") == 150, "150 fitted: a pessimistic estimate does not undo that"
    caps.completed("v", 10, Telemetry(mem_per_sample_mb=1.0))     # no headroom measured: nothing learned
    caps.completed("v", 10, Telemetry(mem_headroom_mb=float("nan"), mem_per_sample_mb=-1))
    assert caps.cap("v") is None


def test_a_per_sample_size_near_zero_bounds_the_estimate_instead_of_crashing_the_decision():
    """Within the report's ranges (a worker may send them): 1e9 MiB of headroom over 5e-324 MiB
    per sample overflows to infinity. It went on to ``math.floor`` inside shard 0's flush of the
    reports, and the OverflowError stopped shard 0; it now gives a cap of no use, and the split
    goes on."""
    tel = decode(encode(Push(worker_id=0, token="t", iteration=1, batch_size=8, arrays=[np.zeros(1, np.float32)],
                             telemetry=Telemetry(compute_s=0.1, mem_headroom_mb=1e9,
                                                 mem_per_sample_mb=5e-324)))).telemetry
    assert tel is not None and tel.mem_per_sample_mb == 5e-324
    m = BatchSizeManager("lbbsp-cpu", 64, policy_args={"predictor": "ema"})
    for w in range(2):
        m.join(w)
    m.assign()
    m.observe_many([WorkerReport.received(w, 0, 32, tel) for w in range(2)])
    assert sum(m.assign().values()) == 64
    assert m.memory.cap("0") == 32 + int(MAX_HEADROOM_SAMPLES)


def test_probe_configured_caps_state_round_trip_and_bad_input():
    caps = MemoryCaps({"a": 64, 3: 10}, margin=0.05)
    assert caps.cap("a") == 64 and caps.cap("3") == 10 and caps.cap("b") is None
    caps.probed("b", fits=97, fails=100)
    assert caps.cap("b") == 95
    caps.probed("c", fits=50)                              # everything it tried fitted
    assert caps.cap("c") is None
    caps.out_of_memory("d", 80)
    state = json.loads(json.dumps(caps.state_dict()))
    again = MemoryCaps({"a": 64}, margin=0.05)
    again.load_state_dict(state)
    assert again.cap("b") == 95 and again.cap("d") == 40
    with pytest.raises(CannotFit):
        caps.out_of_memory("e", 1)
    with pytest.raises(ValueError, match="oom_margin"):
        MemoryCaps(margin=1.0)
    with pytest.raises(ValueError, match=">= 1"):
        MemoryCaps({"a": 0})


def test_the_names_searched_are_bounded_and_a_live_workers_search_is_never_the_one_forgotten():
    live = {"name-0"}
    caps = MemoryCaps(max_names=3, in_use=lambda name: name in live)
    for k in range(5):                       # a client joining under ever new names
        caps.probed(f"name-{k}", fits=8)
    assert set(caps.capped_names()) == {"name-0", "name-3", "name-4"}, "the oldest departed ones went"
    caps.out_of_memory("name-3", 8)          # a known name stays where it is
    caps.completed("name-5", 4)              # nothing to learn: nothing stored, nothing evicted
    assert set(caps.capped_names()) == {"name-0", "name-3", "name-4"} and caps.cap("name-3") < 8
    live.update({"name-3", "name-4"})        # every name in use: the bound gives way, nothing is lost
    caps.probed("name-6", fits=8)
    assert set(caps.capped_names()) == {"name-0", "name-3", "name-4", "name-6"}


def test_churn_under_new_names_keeps_the_live_workers_caps():
    from batchsize_manager import BatchSizeManager

    m = BatchSizeManager("uniform", 512)
    m.memory.max_names = 8
    m.join(0, "keeper")
    m.join(1, "other")
    m.out_of_memory(0, 256)
    kept = m.memory_caps[0]
    for k in range(2, 200):                  # join, run out of memory, leave: under a new name each time
        m.join(k, f"churn-{k}")
        m.out_of_memory(k, 2)
        m.leave(k)
    assert m.memory_caps == {0: kept} and len(set(m.memory.capped_names())) <= 8
    assert m.assign() == {0: kept, 1: 512 - kept}


def test_a_failure_that_would_cap_a_worker_below_the_floor_is_refused_and_learns_nothing():
    caps = MemoryCaps(min_batch=5)
    caps.probed("a", 8)
    before = (caps.cap("a"), caps.version)
    with pytest.raises(CannotFit, match="below min_batch=5"):
        caps.out_of_memory("a", 5, refuse_below_min_batch=True)   # the retry would get 4 samples
    assert (caps.cap("a"), caps.version) == before, "the earlier search is kept as it was"
    with pytest.raises(CannotFit):
        caps.out_of_memory("fresh", 4, refuse_below_min_batch=True)
    assert caps.cap("fresh") is None and caps.capped_count() == 1
    plain = MemoryCaps()
    plain.probed("a", 8)
    assert caps.out_of_memory("a", 40, refuse_below_min_batch=True) == plain.out_of_memory("a", 40) == 24
    plain.probed("p", 21, 22)
    plain.probed("q", 12)
    assert plain.cap("p") == 20 and plain.cap("q") is None


@pytest.mark.parametrize("bad", [
    {"w0": {"fits": 0, "fails": 0}},              # nothing fits: the next split would fail
    {"w0": {"fits": 40, "fails": 30}},            # a failure below a fit: the live path never holds it
    {"w0": {"fits": -7, "fails": None}},
    {"w0": {"fits": 3.5, "fails": None}},
    {"w0": {"fits": True, "fails": 9}},
    {"w0": [1, 2]},
    {f"w{i}": {"fits": 1, "fails": None} for i in range(11)},   # more names than kept
])
def test_a_damaged_caps_state_is_refused_and_changes_nothing(bad):
    caps = MemoryCaps(margin=0.05, max_names=10)
    caps.out_of_memory("d", 80)
    good = caps.state_dict()
    with pytest.raises(ValueError, match="memory caps"):
        caps.load_state_dict(bad)
    assert caps.state_dict() == good and caps.cap("d") == 40


@pytest.mark.parametrize("margin, fitted", [(0.05, None), (0.05, 32), (0.0, None)])
def test_a_failure_just_above_min_batch_retries_at_min_batch_before_giving_up(margin, fitted):
    """min_batch = 32, out of memory at 33: the margin (or, with nothing known to fit, the
    midpoint) would cap the worker at 31 or 16, below min_batch, and it was sent away although
    32 may fit (found by a review). The retry is 32; only a failure at 32 itself gives up."""
    caps = MemoryCaps(margin=margin, min_batch=32)
    if fitted:
        caps.completed("w", fitted)
    assert caps.out_of_memory("w", 33, refuse_below_min_batch=True) == 32
    caps.probed("p", 32, 33)                       # a start-up probe: fits 32, fails 33
    assert caps.cap("w") == 32 and caps.cap("p") == 32
    before = caps.state_dict()
    with pytest.raises(CannotFit, match="below min_batch=32"):
        caps.out_of_memory("w", 32, refuse_below_min_batch=True)
    assert caps.state_dict() == before, "nothing learned from the failure that sends it away"
    assert MemoryCaps(margin=margin, min_batch=32).out_of_memory("v", 200, refuse_below_min_batch=True) == (
        MemoryCaps(margin=margin).out_of_memory("v", 200)), "far above min_batch: as before"


def test_the_report_path_keeps_a_worker_at_min_batch_until_min_batch_itself_failed():
    """ps-bsm and the DDP plug-in learn out-of-memory from reports, with no floor (a report
    cannot send its worker away): a failure at 33 with min_batch = 32 used to cap the worker at
    16 and make the next split fail; it now gets 32."""
    m = BatchSizeManager("uniform", 64, min_batch=32)
    for w in range(2):
        m.join(w)
    m.assign()
    m.observe_many([WorkerReport.received(0, 0, 33, Telemetry(compute_s=0.1, oom=True))])
    assert m.memory_caps == {0: 32} and m.assign() == {0: 32, 1: 32}
    m.observe_many([WorkerReport.received(0, 1, 32, Telemetry(compute_s=0.1, oom=True))])
    with pytest.raises(ValueError, match="min_batch"):
        m.assign()
