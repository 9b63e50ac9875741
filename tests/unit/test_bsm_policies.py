"""LB-BSP batch policies (static, lbbsp-cpu, lbbsp-gpu) on hand-made reports and on the simulation."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchsize_manager import BatchSizeManager, WorkerReport, get_policy, policy_names
from batchsize_manager.simulation import SimulatedWorker, Simulation, ideal_iteration_time, simulate
from ps_common.report import Telemetry


def report(w: int, it: int, x: int, speed: float, overhead: float = 0.0, **extra: float) -> WorkerReport:
    """A report as ps_worker sends it; the whole fixed overhead is put in data_s."""
    tel = Telemetry(data_s=overhead, compute_s=x / speed, prev_push_s=0.0, prev_wait_s=0.0, prev_pull_s=0.0,
                    iteration_s=0.0, **extra)
    return WorkerReport(worker_id=w, iteration=it, batch_size=x, telemetry=tel)


def feed(policy, sizes: dict[int, int], speeds: dict[int, float], it: int = 0,
         overheads: dict[int, float] | None = None) -> None:
    for w, x in sizes.items():
        policy.observe(report(w, it, x, speeds[w], (overheads or {}).get(w, 0.0)))


CPU4 = [1.0, 1.0, 0.5, 0.25]          # the benchmark's slowdowns 1, 1, 2, 4


def cpu_workers(noise: float = 0.0, base: float = 2000.0, step: tuple[int, int, float] | None = None,
                seed: int = 0) -> list[SimulatedWorker]:
    """4 CPU-like workers; ``step=(worker, iteration, factor)`` changes one worker's speed."""
    out = []
    for i, f in enumerate(CPU4):
        sched = [(step[1], base * f * step[2])] if step and step[0] == i else []
        out.append(SimulatedWorker(base * f, overhead=0.005, noise=noise, seed=seed * 100 + i,
                                   schedule=sched))
    return out


# ------------------------------------------------------------------------------------ lbbsp-cpu
def test_cpu_cold_start_is_uniform_then_proportional_to_speed():
    p = get_policy("lbbsp-cpu")
    ws = [0, 1, 2, 3]
    first = p.assign(ws, 400)
    assert first == {0: 100, 1: 100, 2: 100, 3: 100}
    # First reports (warm-up; worker 0's initial pull waited 2 s for the job to start): ignored.
    feed(p, first, {0: 40.0, 1: 200.0, 2: 100.0, 3: 100.0}, overheads={0: 2.0, 1: 0.01, 2: 0.01, 3: 0.01})
    assert p.assign(ws, 400) == first
    speeds = {0: 400.0, 1: 200.0, 2: 100.0, 3: 100.0}
    feed(p, first, speeds, it=1, overheads={w: 0.01 for w in ws})   # equal overheads
    assert p.assign(ws, 400) == {0: 200, 1: 100, 2: 50, 3: 50}


def test_cpu_unequal_overheads_equalise_predicted_finish_times():
    p = get_policy("lbbsp-cpu", warmup=0)
    ws = [0, 1, 2]
    speeds = {0: 1000.0, 1: 600.0, 2: 300.0}
    overheads = {0: 0.20, 1: 0.05, 2: 0.10}
    feed(p, p.assign(ws, 900), speeds, overheads=overheads)
    out = p.assign(ws, 900)
    assert sum(out.values()) == 900
    fin = {w: overheads[w] + out[w] / speeds[w] for w in ws}
    one_sample = max(1 / v for v in speeds.values())
    assert max(fin.values()) - min(fin.values()) <= one_sample
    # ... and they are not simply proportional to speed (the overheads matter).
    assert out[0] < 900 * 1000 / 1900 - 20                 # not simply ∝ speed: overheads matter


def test_cpu_server_seen_finish_times_replace_the_workers_own_overhead():
    """A slow link is invisible to the worker (its push returns once queued): only the finish
    time the servers saw carries it. Worker 2 computes as fast as worker 1 but its gradients take
    60 ms longer to arrive; the split must give it fewer samples, equalising finish times."""
    p = get_policy("lbbsp-cpu", warmup=0, max_factor=None)
    ws = [0, 1, 2]
    speeds = {0: 2000.0, 1: 2000.0, 2: 2000.0}
    link = {0: 0.005, 1: 0.005, 2: 0.065}
    sizes = p.assign(ws, 600)
    for it in range(8):
        for w in ws:
            p.observe(report(w, it, sizes[w], speeds[w], finish_s=sizes[w] / speeds[w] + link[w]))
        sizes = p.assign(ws, 600)
    assert sum(sizes.values()) == 600 and sizes[0] == sizes[1] > sizes[2]
    fin = {w: sizes[w] / speeds[w] + link[w] for w in ws}
    assert max(fin.values()) - min(fin.values()) <= 2 / 2000.0
    # Without finish times the same reports (overhead only in data_s = 0) split evenly.
    q = get_policy("lbbsp-cpu", warmup=0, max_factor=None)
    even = q.assign(ws, 600)
    for it in range(8):
        feed(q, even, speeds, it=it)
        even = q.assign(ws, 600)
    assert even == {0: 200, 1: 200, 2: 200}


def test_cpu_finish_quantile_plans_for_the_tail_not_the_mean():
    """A worker that stalls now and then (stalls charged as fixed time, as for a jittery link):
    the barrier waits for the stall, so c_i is a high quantile of what the finish times show,
    not their mean."""
    ws = [0, 1]
    speeds = {0: 1000.0, 1: 1000.0}

    def run(quantile):
        p = get_policy("lbbsp-cpu", warmup=0, max_factor=None, finish_quantile=quantile, stalls="fixed")
        sizes = p.assign(ws, 200)
        for it in range(16):
            for w in ws:
                stall = 0.08 if (w == 1 and it % 4 == 3) else 0.0     # one stall in four
                p.observe(report(w, it, sizes[w], speeds[w], finish_s=sizes[w] / speeds[w] + 0.002 + stall))
            sizes = p.assign(ws, 200)
        return sizes

    tail = run(0.9)
    median = run(0.5)
    assert median[0] == median[1] == 100          # the median ignores a 1-in-4 stall
    assert tail[1] < tail[0] - 40                 # the 0.9 quantile plans for it
    with pytest.raises(ValueError, match="finish_quantile"):
        get_policy("lbbsp-cpu", finish_quantile=0.0)
    with pytest.raises(ValueError, match="finish_tail"):
        get_policy("lbbsp-cpu", finish_tail="compute")
    with pytest.raises(ValueError, match="stalls must be one of per_sample, fixed"):
        get_policy("lbbsp-cpu", stalls="sometimes")


def mean_iteration_s(recs) -> float:
    return sum(r.iteration_s for r in recs) / len(recs)


def test_cpu_a_worker_under_a_cpu_quota_pays_its_stalls_per_sample():
    """Worker 1 is held to 0.2 of a core (the kernel's CFS quota, as a clock): it runs at full
    speed until its 20 ms of a 100 ms period are spent, then stalls to the next period. Charged
    as fixed time, the stall (one iteration in a few) dominates every split alike, no move looks
    worth the threshold and the split stays uniform: what a CI run showed for 785 iterations.
    Charged per sample, the split moves work away until the stalls shrink."""
    def run(stalls: str):
        # the clocks' stall models: the quota the simulated workers report is not used here
        m = BatchSizeManager("lbbsp-cpu", 256, policy_args={"stalls": stalls, "use_quota": False})
        workers = [SimulatedWorker(67000.0, overhead=0.004),
                   SimulatedWorker(67000.0, overhead=0.004, cpu_quota=0.2)]
        recs = simulate(m, workers, 300)
        return recs[-1].sizes, mean_iteration_s(recs[100:])

    fixed_sizes, fixed_s = run("fixed")
    sizes, per_sample_s = run("per_sample")
    assert fixed_sizes == {0: 128, 1: 128}                   # the deadlock, kept for the record
    assert sizes[1] <= 16 and sum(sizes.values()) == 256
    assert per_sample_s < 0.8 * fixed_s


def test_cpu_floor_and_caps_are_honoured():
    p = get_policy("lbbsp-cpu", warmup=0, max_factor=None)
    ws = [0, 1, 2]
    feed(p, p.assign(ws, 300, min_batch=20, max_batch={0: 120}), {0: 10000.0, 1: 100.0, 2: 1.0})
    out = p.assign(ws, 300, min_batch=20, max_batch={0: 120, 1: 150})
    assert out == {0: 120, 1: 150, 2: 30}     # 0 and 1 capped; the slow one takes what is left
    out = p.assign(ws, 300, min_batch=20, max_batch={0: 120})
    assert out[0] == 120 and out[2] == 20 and out[1] == 160


def test_cpu_stable_under_noise_yet_tracks_a_step_change():
    X = 256
    # 5% multiplicative noise on every worker's compute time for 200 iterations: few re-splits.
    m = BatchSizeManager("lbbsp-cpu", X)
    simulate(m, cpu_workers(noise=0.05, seed=1), 200)
    assert m.policy.changes <= 10
    # A real 2x slowdown of worker 0 at iteration 100, with the same noise: followed within a few.
    m = BatchSizeManager("lbbsp-cpu", X)
    recs = simulate(m, cpu_workers(noise=0.05, seed=2, step=(0, 100, 0.5)), 130)
    speeds_after = [2000 * f for f in CPU4]
    speeds_after[0] /= 2
    target = X * speeds_after[0] / sum(speeds_after)
    before = recs[99].sizes[0]
    assert abs(before - target) / target > 0.3               # the step really matters
    assert all(abs(r.sizes[0] - target) / target < 0.15 for r in recs[110:])
    ideal = ideal_iteration_time(cpu_workers(step=(0, 100, 0.5)), X, iteration=120)
    mean_after = sum(r.iteration_s for r in recs[110:]) / 20
    assert mean_after < 1.15 * ideal


def test_cpu_threshold_keeps_the_split_for_small_gains():
    p = get_policy("lbbsp-cpu", predictor="last", threshold=0.05)
    ws = [0, 1]
    feed(p, p.assign(ws, 200), {0: 100.0, 1: 100.0})
    assert p.assign(ws, 200) == {0: 100, 1: 100}
    feed(p, {0: 100, 1: 100}, {0: 103.0, 1: 100.0})         # 3% faster: < 5% gain, keep
    assert p.assign(ws, 200) == {0: 100, 1: 100}
    feed(p, {0: 100, 1: 100}, {0: 150.0, 1: 100.0})         # 50% faster: re-split
    assert p.assign(ws, 200) == {0: 120, 1: 80}


def test_cpu_trust_region_limits_one_decision():
    """A 10x speed gap measured once moves each batch by at most max_factor per decision."""
    p = get_policy("lbbsp-cpu", predictor="last", warmup=0, max_factor=2.0)
    ws = [0, 1]
    feed(p, p.assign(ws, 200), {0: 1000.0, 1: 100.0})
    assert p.assign(ws, 200) == {0: 150, 1: 50}           # 1 could only halve (from 100)
    feed(p, {0: 150, 1: 50}, {0: 1000.0, 1: 100.0}, it=1)
    assert p.assign(ws, 200) == {0: 175, 1: 25}
    feed(p, {0: 175, 1: 25}, {0: 1000.0, 1: 100.0}, it=2)
    assert p.assign(ws, 200) == {0: 182, 1: 18}           # reached the unconstrained optimum


def test_cpu_joiner_gets_provisional_mean_share():
    p = get_policy("lbbsp-cpu", predictor="last", warmup=0)
    feed(p, p.assign([0, 1], 300), {0: 300.0, 1: 100.0})
    assert p.assign([0, 1], 300) == {0: 225, 1: 75}
    p.join(2)                                                # unmeasured: mean speed 200
    assert p.assign([0, 1, 2], 600) == {0: 300, 1: 100, 2: 200}
    p.observe(report(2, 1, 200, 100.0))
    assert p.assign([0, 1, 2], 600) == {0: 360, 1: 120, 2: 120}


def test_cpu_uses_narx_with_exogenous_inputs_when_asked():
    pytest.importorskip("predictors")
    from predictors import predictor_names
    if "narx" not in predictor_names():
        pytest.skip("predictors has no narx yet")
    small = {"epochs": 3, "min_train": 4, "refit_every": 8, "hidden": 4}     # keep the test short
    m = BatchSizeManager("lbbsp-cpu", 256, policy_args={"predictor": "narx", "predictor_args": small,
                                                         "refit": "sync"})
    assert m.policy.use_exog
    recs = simulate(m, cpu_workers(noise=0.02), 12)
    assert recs[-1].sizes[0] > recs[-1].sizes[3] * 3


def test_cpu_bad_predictor_name_fails_at_start():
    with pytest.raises(ValueError, match="unknown predictor"):
        get_policy("lbbsp-cpu", predictor="nope")


# ------------------------------------------------------------------------------------ static
def test_static_profiles_then_freezes():
    X, K = 280, 5
    m = BatchSizeManager("static", X, policy_args={"profile_iterations": K})
    ws = cpu_workers(noise=0.02, step=(0, 30, 0.25))
    recs = simulate(m, ws, 60)
    assert all(r.sizes == {0: 70, 1: 70, 2: 70, 3: 70} for r in recs[:K])   # uniform while profiling
    frozen = recs[K].sizes
    assert frozen[0] == pytest.approx(X / 2.75, abs=4) and frozen[3] == pytest.approx(X / 11, abs=3)
    assert all(r.sizes == frozen for r in recs[K:])          # ... even after worker 0 slows 4x


def test_static_reprofiles_joiner_and_resplits_on_leave():
    X = 300
    m = BatchSizeManager("static", X, policy_args={"profile_iterations": 3})
    sim = Simulation(m, [SimulatedWorker(2000, 0.0), SimulatedWorker(1000, 0.0)])
    sim.run(4)
    assert m.assign() == {0: 200, 1: 100}
    sim.add_worker(2, SimulatedWorker(3000, 0.0))
    during = sim.run(3)
    assert during[0].sizes == {0: 133, 1: 67, 2: 100}        # joiner: the mean speed until profiled
    assert m.assign() == {0: 100, 1: 50, 2: 150}
    sim.remove_worker(0)
    assert m.assign() == {1: 75, 2: 225}


# ------------------------------------------------------------------------------------ lbbsp-gpu
GPU_SPEEDS = [4000.0, 3000.0, 2000.0, 1000.0]


def gpu_workers(step: tuple[int, int, float] | None = None, noise: float = 0.01,
                caps: tuple[int | None, ...] = (160, None, None, None)) -> dict[int, SimulatedWorker]:
    out = {}
    for i, v in enumerate(GPU_SPEEDS):
        sched = [(step[1], v * step[2])] if step and step[0] == i else []
        out[i] = SimulatedWorker(v, overhead=0.01, saturation_batch=48, memory_cap=caps[i],
                                 noise=noise, seed=i, schedule=sched)
    return out


def uncapped_spread(sizes: dict[int, int], workers: dict[int, SimulatedWorker], it: int) -> float:
    """Noise-free finish-time spread between the slowest worker and the fastest one below its cap."""
    fin = {w: workers[w].time(x, it) for w, x in sizes.items()}
    room = [w for w in fin if workers[w].memory_cap is None or sizes[w] < workers[w].memory_cap]
    return (max(fin.values()) - min(fin[w] for w in room)) / max(fin.values())


def test_gpu_search_converges_within_caps_and_retriggers_after_a_step():
    X, tol = 512, 0.05
    ws = gpu_workers(step=(1, 150, 1 / 3))
    m = BatchSizeManager("lbbsp-gpu", X, memory_caps={"0": 160}, policy_args={"tolerance": tol})
    p = m.policy
    sim = Simulation(m, ws)
    recs, phases = [], []
    for _ in range(300):
        recs.append(sim.step())
        phases.append(p.phase)
    assert all(r.sizes[0] <= 160 and not r.oom for r in recs)     # the cap is never exceeded
    assert recs[0].sizes == {w: 128 for w in range(4)}
    assert p.moves > 5 and p.oscillations >= 1                    # fast approach, then fine tune
    # Converged before the step, with balanced finish times near the ideal bound.
    first = phases.index("converged")
    assert first < 100
    assert uncapped_spread(recs[149].sizes, ws, 149) <= tol
    assert recs[140].iteration_s < 1.08 * ideal_iteration_time(ws, X, 140)
    assert all(r.sizes == recs[first + 1].sizes for r in recs[first + 1:150])   # frozen: no thrash
    # Worker 1 becomes 3x slower at 150: the search restarts and converges again.
    assert p.retriggers == 1
    assert "approach" in phases[150:160] and phases[-1] == "converged"
    assert recs[-1].sizes[1] <= recs[149].sizes[1] / 2
    assert uncapped_spread(recs[-1].sizes, ws, 299) <= tol
    assert recs[-1].iteration_s < 1.08 * ideal_iteration_time(ws, X, 299)


def test_gpu_fine_tune_halves_step_and_doubles_window():
    p = get_policy("lbbsp-gpu", window=2, step=16, max_window=8)
    ws = [0, 1]
    speeds = {0: 300.0, 1: 100.0}                          # balance at 150/50 of 200
    seen = set()
    for it in range(80):
        sizes = p.assign(ws, 200)
        seen.add((p.step, p.window))
        feed(p, sizes, speeds, it)
    assert (16, 2) in seen and (8, 4) in seen and (4, 8) in seen
    assert p.phase == "converged"
    assert abs(p.assign(ws, 200)[0] - 150) <= 4


def test_gpu_oom_probing_records_a_cap_and_moves_the_excess():
    X = 512
    ws = gpu_workers(noise=0.0, caps=(100, None, None, None))      # unknown to the policy
    m = BatchSizeManager("lbbsp-gpu", X)
    sim = Simulation(m, ws)
    first = sim.step()
    assert first.oom == [0] and first.sizes[0] == 128
    cap = m.memory_caps[0]
    assert cap == 64                                               # binary search: the middle
    nxt = m.assign()
    assert nxt[0] <= cap and sum(nxt.values()) == X
    recs = sim.run(150)
    assert 95 <= m.memory_caps[0] <= 100                           # searched up to the real limit
    assert sum(1 for r in recs if r.oom) <= 6
    assert not any(r.oom for r in recs[-50:])
    assert all(sum(r.sizes.values()) == X for r in recs)


def test_gpu_converged_split_holds_under_noise():
    """5% noise per iteration must not re-trigger the search once it has converged."""
    m = BatchSizeManager("lbbsp-gpu", 512, memory_caps={"0": 160})
    recs = simulate(m, gpu_workers(noise=0.05), 300)
    assert m.policy.phase == "converged" and m.policy.retriggers == 0
    assert sum(1 for a, b in zip(recs[100:], recs[101:]) if a.sizes != b.sizes) <= 2


def test_gpu_restarts_a_crawling_fine_tune_when_a_worker_changes():
    """A step during fine tune (1-sample steps, 12-iteration windows) restarts the fast approach
    at once instead of crawling one sample per window towards the new balance."""
    p = get_policy("lbbsp-gpu", window=3, step=16, max_window=12)
    ws = [0, 1]
    speeds = {0: 300.0, 1: 100.0}
    for it in range(60):
        feed(p, p.assign(ws, 200), speeds, it)
    assert p.phase == "converged" and p.window == 12
    speeds = {0: 100.0, 1: 100.0}                          # worker 0 slows down 3x
    for it in range(60, 80):
        feed(p, p.assign(ws, 200), speeds, it)
    assert p.retriggers == 1
    assert abs(p.assign(ws, 200)[0] - 100) <= 8            # 1-sample steps would still be near 150


@pytest.mark.parametrize("name", ["uniform", "fixed", "static", "lbbsp-cpu", "lbbsp-gpu"])
def test_policies_accept_caps_as_an_int_or_a_mapping(name):
    p = get_policy(name)
    assert p.assign([0, 1, 2], 100, 1, max_batch=34) == {0: 34, 1: 33, 2: 33}
    with pytest.raises(ValueError, match="exceeds the sum of the workers' batch caps"):
        p.assign([0, 1, 2], 100, 1, max_batch=33)
    p = get_policy(name)                                   # lbbsp-gpu would keep 34:33 proportions
    assert p.assign([0, 1, 2], 100, 5, max_batch={1: 10}) == {0: 45, 1: 10, 2: 45}


def test_gpu_is_deterministic():
    runs = []
    for _ in range(2):
        m = BatchSizeManager("lbbsp-gpu", 512, memory_caps={"0": 160})
        runs.append([r.sizes for r in simulate(m, gpu_workers(), 80)])
    assert runs[0] == runs[1]


# ------------------------------------------------------------------------------------ all policies
@pytest.mark.parametrize("name", ["uniform", "fixed", "static", "lbbsp-cpu", "lbbsp-gpu"])
def test_join_and_leave_mid_run_keep_the_sum(name):
    X = 300
    m = BatchSizeManager(name, X, min_batch=2)
    sim = Simulation(m, cpu_workers(noise=0.03))
    recs = sim.run(15)
    sim.add_worker(7, SimulatedWorker(1500.0, 0.005, noise=0.03, seed=7))
    recs += sim.run(15)
    sim.remove_worker(1)
    recs += sim.run(15)
    sim.remove_worker(7)
    recs += sim.run(5)
    assert [sorted(r.sizes) for r in (recs[0], recs[15], recs[30], recs[45])] == [
        [0, 1, 2, 3], [0, 1, 2, 3, 7], [0, 2, 3, 7], [0, 2, 3]]
    assert all(sum(r.sizes.values()) == X and min(r.sizes.values()) >= 2 for r in recs)


def test_every_policy_is_registered():
    assert {"uniform", "fixed", "static", "lbbsp-cpu", "lbbsp-gpu"} <= set(policy_names())


_finite = st.floats(0.0, 10.0)
_any_float = st.one_of(_finite, st.just(float("nan")), st.just(float("inf")), st.floats(-1.0, 0.0))


@st.composite
def scenarios(draw):
    """Random membership changes and random (even garbage) reports."""
    min_batch = draw(st.integers(1, 4))
    n0 = draw(st.integers(1, 8))
    X = draw(st.integers(min_batch * 12, min_batch * 12 + 600))
    steps = draw(st.lists(st.tuples(
        st.sampled_from(["iterate", "iterate", "iterate", "join", "leave"]),
        st.lists(st.tuples(st.integers(0, 2 * X), _any_float, _any_float, st.booleans(),
                           st.integers(0, 3)), min_size=12, max_size=12)),
        min_size=3, max_size=12))
    return min_batch, n0, X, steps


CONTRACT = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", ["uniform", "fixed", "static", "lbbsp-cpu", "lbbsp-gpu"])
@CONTRACT
@given(scenario=scenarios())
def test_contract_every_policy_always_returns_a_valid_split(name, scenario):
    min_batch, n0, X, steps = scenario
    args = {"weights": [1, 2, 3]} if name == "fixed" else {}
    m = BatchSizeManager(name, X, min_batch=min_batch, max_batch=X, policy_args=args)
    next_id = 0
    for _ in range(n0):
        m.join(next_id)
        next_id += 1
    for it, (event, raw) in enumerate(steps):
        live = m.live_workers
        if event == "join" or not live:
            m.join(next_id)
            next_id += 1
        elif event == "leave" and len(live) > 1:
            m.leave(live[it % len(live)])
        live = m.live_workers
        caps = m.caps()
        try:
            sizes = m.assign()
        except ValueError:
            # Only allowed when the bounds really cannot hold X (OOM reports shrank the caps).
            assert (any(c < min_batch for c in caps.values())
                    or (len(caps) == len(live) and sum(caps.values()) < X))
            return
        assert sorted(sizes) == live and sum(sizes.values()) == X
        assert all(min_batch <= x <= caps.get(w, X) for w, x in sizes.items())
        for (w, x), (bs, compute, data, oom, jitter) in zip(sizes.items(), raw):
            tel = Telemetry(data_s=data, compute_s=compute, iteration_s=data, prev_push_s=jitter * 0.001,
                            prev_pull_s=data, prev_wait_s=compute, host_cpu=50.0 + jitter,
                            oom=bool(oom and jitter == 0))
            use = x if jitter else bs                     # sometimes a report of another size
            m.observe(WorkerReport(worker_id=w, iteration=it, batch_size=use, telemetry=tel))


def test_row_quantile_matches_numpys_nanquantile():
    """The tail planning's vectorised quantile equals np.nanquantile row by row, ragged rows
    (workers with fewer finish times than the window) and empty rows included."""
    import warnings

    import numpy as np

    from batchsize_manager.lbbsp import _row_quantile

    rng = np.random.default_rng(3)
    a = rng.random((300, 32))
    for i in range(300):
        a[i, rng.integers(0, 33):] = np.nan
    a[:, :] = a[:, rng.permutation(32)]          # NaNs anywhere in a row, not only at its end
    full = rng.random((300, 32))                  # every window full: the partial-sort path
    for q in (0.0, 0.25, 0.5, 0.8, 0.9, 1.0):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)   # all-NaN rows
            ref = np.nanquantile(a, q, axis=1)
        np.testing.assert_allclose(_row_quantile(a, q), ref, equal_nan=True)
        np.testing.assert_allclose(_row_quantile(full, q), np.quantile(full, q, axis=1))
        np.testing.assert_allclose(_row_quantile(full[:, :1], q), full[:, 0])
        assert np.array_equal(_row_quantile(full, q, full=True), _row_quantile(full, q))   # no NaN look


def test_stall_share_is_planned_work_over_time_above_the_floor():
    """The steady-state path (full windows, every batch planned) and the general one (ragged
    windows, unplanned batches timed by their compute) give sum(work) / sum(finish - floor)."""
    import numpy as np

    from batchsize_manager.lbbsp import STALL_BASE_QUANTILE, stall_share

    rng = np.random.default_rng(5)
    x = rng.integers(1, 200, (50, 32)).astype(float)
    planned = rng.uniform(1e3, 1e4, (50, 32))
    compute = x / planned
    finish = compute + rng.uniform(0.001, 0.05, (50, 32))
    work = x / planned
    floor = np.quantile(finish - work, STALL_BASE_QUANTILE, axis=1)
    ref = np.minimum(1.0, work.sum(1) / (finish - floor[:, None]).sum(1))
    np.testing.assert_allclose(stall_share(finish, compute, x, planned), ref)
    scratch = (np.full_like(finish, np.nan), np.full_like(finish, np.nan))   # reused buffers
    np.testing.assert_allclose(stall_share(finish, compute, x, planned, scratch=scratch), ref)
    ragged, unplanned = finish.copy(), planned.copy()
    ragged[:, 20:] = np.nan                       # 20 finish times per worker so far
    unplanned[:, :3] = np.nan                     # no plan yet: the measured compute stands in
    floor = np.quantile((finish - work)[:, :20], STALL_BASE_QUANTILE, axis=1)
    ref = np.minimum(1.0, work[:, :20].sum(1) / (finish[:, :20] - floor[:, None]).sum(1))
    np.testing.assert_allclose(stall_share(ragged, compute, x, unplanned), ref)


def test_stall_share_of_full_windows_skips_the_nan_look_and_changes_no_bit():
    """``full=True`` (every window full, as the policy knows from its counts) gives the same bits
    as the path that looks for windows still filling, unplanned batches included; a share that
    is nan, infinite, zero or negative is 1 (no stall charged), as before the fast path."""
    import numpy as np

    from batchsize_manager.lbbsp import _stall_share, stall_share

    rng = np.random.default_rng(11)
    x = rng.integers(1, 200, (40, 32)).astype(float)
    planned = rng.uniform(1e3, 1e4, (40, 32))
    planned[:5, :4] = np.nan                      # not planned yet: compute stands in
    compute = x / 5e3
    finish = compute + rng.uniform(0.001, 0.05, (40, 32))
    bufs = (np.empty_like(finish), np.empty_like(finish))
    with np.errstate(invalid="ignore", divide="ignore"):
        fast = _stall_share(finish, compute, x, planned, *bufs, full=True)
    assert np.array_equal(fast, stall_share(finish, compute, x, planned))
    # nan (0 / 0), inf (work over a zero denominator), zero and negative shares
    zero_x = np.zeros((1, 32))
    flat = np.ones((1, 32))
    inf_x = np.zeros((1, 32))
    inf_x[0, :4] = 1.0                            # 28 of 32 idle: floor 1, sum(finish) = 32
    neg_finish = np.ones((1, 32))
    neg_finish[0, 0] = -100.0                     # floor above the mean: denominator < 0
    cases = [(flat, zero_x, flat), (flat, inf_x, flat), (neg_finish, np.ones((1, 32)), np.full((1, 32), 1e6))]
    for f, xx, pl in cases:
        assert stall_share(f, f, xx, pl).tolist() == [1.0]


@pytest.mark.parametrize("full", [False, True], ids=["room", "no-headroom"])
def test_gpu_never_picks_a_leader_without_memory_headroom(full):
    """Worker 0 is twice as fast; with room it gets samples from worker 1, but once it reports
    no memory headroom at its size, nothing is moved to it."""
    m = BatchSizeManager("lbbsp-gpu", 200, policy_args={"window": 1})
    m.join(0, name="fast")
    m.join(1, name="slow")
    sizes = m.assign()
    for it in range(6):
        for w, x in sizes.items():
            tel = Telemetry(compute_s=x / (2000.0 if w == 0 else 1000.0))
            if w == 0 and full:
                tel = Telemetry(compute_s=tel.compute_s, mem_headroom_mb=0.0, mem_per_sample_mb=0.5)
            m.observe(WorkerReport(worker_id=w, iteration=it, batch_size=x, telemetry=tel))
        sizes = m.assign()
    if full:
        assert sizes == {0: 100, 1: 100} and m.memory_caps == {0: 100}
    else:
        assert sizes[0] > 100


# ------------------------------------------------------------------ lbbsp-cpu under CPU quotas
QUOTAS = [0.7, 0.7, 0.2, 0.2]


def quota_workers(move_at: int = 0) -> list[SimulatedWorker]:
    """4 one-thread workers of 12,800 samples/s and 2.5 ms of fixed CPU per iteration, held to
    ``QUOTAS`` of a core; ``move_at``: every ``move_at`` iterations each takes the quota of the
    worker before it (the lab's rotation)."""
    return [SimulatedWorker(12800.0, overhead=0.0025, cpu_quota=QUOTAS[r],
                            quota_schedule=[(move_at * k, QUOTAS[(r - k) % 4]) for k in range(1, 4)]
                            if move_at else [])
            for r in range(4)]


def test_quota_speed_is_what_the_quota_sustains():
    """An iteration of x samples costs a + s x CPU seconds; a quota of q cores sustains one per
    L + (a + s x) / q seconds, L being the wait outside CPU (low quantile of finish - cpu: the
    kernel runs the worker at full speed until the period's share is spent)."""
    import numpy as np

    from batchsize_manager.lbbsp import quota_speed

    x = np.array([[100.0, 120.0, 80.0, 100.0, 90.0], [50.0, 50.0, 50.0, np.nan, np.nan]])
    s, a, wait = 1e-4, 0.002, 0.004
    work = s * x
    cpu = a + work
    # at full speed until the quota is spent (the clocks see cpu + wait), one stall of 30 ms
    finish = wait + cpu + np.array([[0.0, 0.03, 0.0, 0.0, 0.0], [0.0] * 5])
    finish[1, 3:] = np.nan                                         # 3 iterations so far
    v, c = quota_speed(finish, cpu, work, np.nan_to_num(x), np.array([0.5, 0.5]))
    assert v[0] == pytest.approx(0.5 / s) and c[0] == pytest.approx(wait + a / 0.5)
    assert np.isnan(v[1]) and np.isnan(c[1])                       # too few entries: the clocks stand


def test_cpu_quota_model_splits_by_what_each_quota_sustains():
    """Workers that report their quota and CPU times are split by what the quota sustains:
    the split settles where every worker uses its quota alike, and the mean iteration comes
    within 10% of the throughput bound (sum of CPU / sum of quotas). From their clocks alone
    the 0.2-core workers end up with almost nothing, and the iteration is slower."""
    def run(use_quota: bool):
        m = BatchSizeManager("lbbsp-cpu", 512, policy_args={"use_quota": use_quota})
        recs = simulate(m, quota_workers(), 300)
        return recs[-1].sizes, mean_iteration_s(recs[100:])

    sizes, quota_s = run(True)
    clock_sizes, clock_s = run(False)
    bound = (512 / 12800.0 + 4 * 0.0025) / sum(QUOTAS)
    assert sizes[0] == sizes[1] and sizes[2] == sizes[3] and 20 <= sizes[2] <= 45
    assert quota_s < 1.1 * bound
    assert clock_sizes[2] < 10 and quota_s < 0.95 * clock_s


def test_cpu_quota_model_follows_a_moved_quota_at_once():
    """The quotas move one worker along at iteration 100: the next report carries the new
    quota, and within 3 decisions the worker that lost its share gives up most of its samples
    (trust region: half per decision); from the clocks alone it keeps them for longer."""
    def run(use_quota: bool):
        m = BatchSizeManager("lbbsp-cpu", 512, policy_args={"use_quota": use_quota})
        return simulate(m, quota_workers(move_at=100), 300)

    recs, clock = run(True), run(False)
    assert recs[99].sizes[0] > 200                                # worker 0 had 0.7 of a core
    assert recs[103].sizes[0] <= 64 and recs[103].sizes[2] >= 150  # 0 now has 0.2, 2 has 0.7
    assert clock[103].sizes[0] > 200
    assert mean_iteration_s(recs[100:]) < 0.8 * mean_iteration_s(clock[100:])
    with pytest.raises(ValueError, match="quota_schedule needs cpu_quota"):
        SimulatedWorker(1000.0, quota_schedule=[(5, 0.5)])


def test_cpu_quota_windows_survive_a_checkpoint():
    """The CPU times of each worker's window are saved with its finish times: a restored policy
    decides exactly as the original."""
    m = BatchSizeManager("lbbsp-cpu", 512, policy_args={"refit": "sync"})
    recs = simulate(m, quota_workers(), 60)
    state = m.policy.state_dict()
    assert len(state["finish"]["2"][-1]) == 6 and all(v == v for v in state["finish"]["2"][-1])
    q = get_policy("lbbsp-cpu", refit="sync")
    q.load_state_dict(state)
    # The quota is the newest report's (not saved): one more iteration's reports to both.
    for w, x in recs[-1].sizes.items():
        tel = Telemetry(compute_s=x / 12800.0, finish_s=0.03, cpu_quota=QUOTAS[w],
                        cpu_s=0.0025 + x / 12800.0, compute_cpu_s=0.0005 + x / 12800.0)
        r = WorkerReport(worker_id=w, iteration=60, batch_size=x, telemetry=tel)
        m.policy.observe(r)
        q.observe(r)
    ws = sorted(recs[-1].sizes)
    assert m.policy.assign(ws, 512) == q.assign(ws, 512)


@pytest.mark.parametrize("threshold", [0.0, 0.05])
def test_a_few_workers_split_the_same_on_python_floats_as_in_numpy(monkeypatch, threshold):
    """Around a previous split, up to SMALL_N workers are split and timed on Python floats (the
    split's own small path): over 150 iterations of 4 and 8 slowed workers, the same splits and
    predicted times to the bit as the numpy path gives them (with no threshold every predicted
    gain moves the split, with 5% most are kept: both branches)."""
    import batchsize_manager.lbbsp as lbbsp

    def run(n: int) -> list[tuple[dict[int, int], float]]:
        m = BatchSizeManager("lbbsp-cpu", 64 * n, policy_args={"threshold": threshold})
        workers = [SimulatedWorker(1000.0 * (1 + i % 4), overhead=0.005, saturation_batch=0, noise=0.05,
                                   seed=i) for i in range(n)]
        sim = Simulation(m, workers)
        return [(sim.step().sizes, m.policy.predicted_s) for _ in range(150)]

    for n in (4, 8):
        small = run(n)
        monkeypatch.setattr(lbbsp, "SMALL_N", 0)
        assert run(n) == small
        monkeypatch.setattr(lbbsp, "SMALL_N", 16)


@pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning")   # numpy's times: inf
def test_a_zero_speed_forecast_is_split_by_the_numpy_rules_not_a_python_division():
    """A forecast speed of 0 (an underflow: nothing a report can produce directly) must not
    raise ZeroDivisionError on the small path: it takes the numpy path, whose split clamps the
    speed and whose times are infinite, as before the small path existed."""
    import numpy as np

    p = get_policy("lbbsp-cpu")
    ws = [0, 1, 2, 3]
    first = p.assign(ws, 256)
    speeds = iter([np.array([1e3, 2e3, 3e3, 4e3]), np.array([0.0, 2e3, 3e3, 4e3])])
    p._estimate_arrays = lambda slots, plan=False: (next(speeds), np.zeros(4))   # type: ignore[method-assign]
    second = p.assign(ws, 256)
    assert sum(second.values()) == 256 and second != first
    third = p.assign(ws, 256)                      # worker 0 at speed 0: kept at its floor
    assert sum(third.values()) == 256 and third[0] <= second[0]


def test_a_restored_finish_window_keeps_only_entries_a_report_could_have_written():
    """Saved window rows that are not finite (a hand-edited or damaged checkpoint) are dropped on
    restore, so the decision's fast path, which trusts every entry of a full window to be finite,
    never sorts a NaN into a quantile: the restored policy decides as one restored without them."""
    import math

    m = BatchSizeManager("lbbsp-cpu", 512, policy_args={"refit": "sync"})
    simulate(m, quota_workers(), 60)
    state = m.policy.state_dict()
    clean = get_policy("lbbsp-cpu", refit="sync")
    clean.load_state_dict(state)
    rows = state["finish"]["1"]
    bad = [[math.nan, 0.03, 0.01], [64, math.inf, 0.01], [64, 0.0, 0.01], ["x", 1, 2], [1.0]]
    damaged = dict(state, finish=dict(state["finish"], **{"1": rows[:10] + bad + rows[10:]}))
    q = get_policy("lbbsp-cpu", refit="sync")
    q.load_state_dict(damaged)
    assert q.state_dict()["finish"] == state["finish"]
    ws = sorted(int(w) for w in state["finish"])
    assert q.assign(ws, 512) == clean.assign(ws, 512)


def test_cpu_quota_model_takes_extreme_but_well_formed_reports():
    """A worker's quota and CPU times are its own claims, checked only for range on decode. At
    the ends of those ranges the split still sums to X within the bounds: a claim moves that
    worker's own share, and CPU times that explain nothing leave it to its clocks."""
    def run(claims: dict[int, dict[str, float]]) -> dict[int, int]:
        p = get_policy("lbbsp-cpu", warmup=0)
        ws = [0, 1, 2]
        sizes = p.assign(ws, 300, min_batch=4)
        for it in range(12):
            for w in ws:
                tel = Telemetry(compute_s=sizes[w] / 1000.0, finish_s=sizes[w] / 1000.0 + 0.002,
                                **claims.get(w, {}))
                p.observe(WorkerReport(worker_id=w, iteration=it, batch_size=sizes[w], telemetry=tel))
            sizes = p.assign(ws, 300, min_batch=4)
            assert sum(sizes.values()) == 300 and min(sizes.values()) >= 4
        return sizes

    sizes = run({0: dict(cpu_quota=1e-3, cpu_s=0.1, compute_cpu_s=0.1),     # a thousandth of a core
                 1: dict(cpu_quota=0.5, cpu_s=1e-3, compute_cpu_s=0.0)})    # no CPU in compute
    assert sizes[0] == 4 and sizes[1] == sizes[2] == 148
    # a day of CPU per iteration, and less CPU in all than in compute: sums and bounds hold
    run({0: dict(cpu_quota=0.5, cpu_s=86400.0, compute_cpu_s=1.0),
         1: dict(cpu_quota=0.5, cpu_s=0.0, compute_cpu_s=1.0)})
