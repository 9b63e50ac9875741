"""Sync policies as pure decision logic: SSP bounds, backup workers, ASP, and a contract."""

from __future__ import annotations

import numpy as np
import pytest

from ps_server.sync import ASP, BSP, SSP, Backup, PushRejected, get_sync_policy, sync_policy_names


def g(v=1.0, n=4):
    a = np.full(n, v, np.float32)
    a.flags.writeable = False
    return a


def test_ssp_blocks_a_worker_s_plus_one_ahead_until_the_slowest_catches_up():
    s = 2
    p = SSP(staleness=s)
    p.set_live([0, 1])
    version = 0
    # worker 0 runs ahead: clocks 0..2 pushed -> it wants to start clock 3
    for c in range(3):
        p.on_push(version, 0, c, 8, 2, 16, g())
        version += 1
    assert p.pull_ready(version, 0, 2), "clock 2 is within s of the slowest (0)"
    assert not p.pull_ready(version, 0, 3), "clock 3 is s + 1 ahead of the slowest: must wait"
    p.on_push(version, 1, 0, 8, 2, 16, g())  # slowest reaches clock 1
    assert p.pull_ready(version, 0, 3), "now 3 - s = 1 <= slowest clock: may go"
    assert not p.pull_ready(version, 0, 4)


def test_ssp_zero_staleness_is_lockstep_and_leavers_do_not_block():
    p = SSP(staleness=0)
    p.set_live([0, 1, 2])
    p.on_push(0, 0, 0, 1, 3, 3, g())
    assert not p.pull_ready(1, 0, 1)
    p.set_live([0])  # 1 and 2 left: nobody holds worker 0 back any more
    assert p.pull_ready(1, 0, 1)


def test_ssp_newcomer_starts_at_slowest_clock():
    p = SSP(staleness=1)
    p.set_live([0])
    for c in range(5):
        p.on_push(c, 0, c, 1, 1, 1, g())
    p.set_live([0, 1])
    assert p.clocks[1] == 5
    assert p.pull_ready(5, 0, 6)


def test_asp_applies_every_push_at_once_scaled_by_its_share():
    p = ASP()
    out = p.on_push(0, 0, 0, 8, 4, 32, g())
    (a,) = out.applies
    assert a.workers == [0] and a.lr_scale == pytest.approx(8 / 32)
    assert p.pull_ready(0, 1, 10**6), "ASP never waits"
    with pytest.raises(PushRejected):
        p.on_push(1, 0, 0, 8, 4, 32, g())  # same clock twice


def test_backup_leader_applies_exactly_first_n_and_drops_late():
    p = Backup(required=2, leader=True)
    assert p.on_push(0, 3, 0, 10, 3, 30, g(1)).applies == []
    out = p.on_push(0, 1, 0, 10, 3, 30, g(3))
    (a,) = out.applies
    assert a.workers == [1, 3] and a.samples == 20 and a.lr_scale == 1.0
    late = p.on_push(1, 2, 0, 10, 3, 30, g(100))
    assert late.applies == [] and late.dropped == 1
    assert p.stats()["dropped_late"] == 1


def test_backup_follower_applies_the_committed_set_only():
    p = Backup(required=2, leader=False)
    assert p.on_push(0, 2, 0, 10, 3, 30, g(7)).applies == []  # arrived first here, but not chosen
    assert p.on_push(0, 1, 0, 10, 3, 30, g(1)).applies == []
    assert p.on_commit(0, 0, {0: 10, 1: 10}, 20).applies == [], "worker 0's gradient not here yet"
    out = p.on_push(0, 0, 0, 10, 3, 30, g(3))
    (a,) = out.applies
    assert a.workers == [0, 1] and out.dropped == 1


def test_commit_before_any_push_and_stale_commit():
    p = Backup(required=1, leader=False)
    assert p.on_commit(0, 0, {5: 4}, 4).applies == []
    (a,) = p.on_push(0, 5, 0, 4, 2, 8, g()).applies
    assert a.workers == [5]
    assert p.on_commit(1, 0, {5: 4}, 4).applies == [], "a commit for an applied version is a no-op"


def test_bsp_commit_leaves_a_worker_out():
    p = BSP()
    p.on_push(0, 0, 0, 4, 3, 12, g())
    p.on_push(0, 1, 0, 4, 3, 12, g())
    (a,) = p.on_commit(0, 0, {0: 4, 1: 4}, 8).applies
    assert a.workers == [0, 1] and a.samples == 8


@pytest.mark.parametrize("name", sync_policy_names())
def test_contract_every_policy(name):
    """Random valid pushes: updates weight by batch size, never apply a worker twice per round."""
    args = {"backup": {"required": 2}}.get(name, {})
    p = get_sync_policy(name, **args)
    p.set_live([0, 1, 2])
    rng = np.random.default_rng(0)
    version, clocks, applied_samples, pushed = 0, {0: 0, 1: 0, 2: 0}, 0, 0
    for _ in range(60):
        w = int(rng.integers(3))
        it = version if p.kind == "round" else clocks[w]
        if p.kind == "async" and not p.pull_ready(version, w, it):
            continue
        try:
            out = p.on_push(version, w, it, 4, 3, 12, g(float(w)))
        except PushRejected as exc:
            assert exc.code == "duplicate" and p.kind == "round"
            continue
        pushed += 1
        clocks[w] = it + 1
        for a in out.applies:
            assert len(set(a.workers)) == len(a.workers)
            assert 0 < a.lr_scale <= 1.0
            applied_samples += a.samples
            version += 1
    assert version > 0 and applied_samples > 0
    assert applied_samples <= pushed * 4
    with pytest.raises(ValueError):
        get_sync_policy(name, bogus=1)
