"""Sync policies as pure commit rules over complete gradients, SSP's pull bound, and the
questions the rest of the system asks a mode (every registered one answers them)."""

from __future__ import annotations

import pytest

from ps_common.config import validate
from ps_server.sync import ASP, BSP, SSP, SYNC_POLICIES, AsyncPolicy, Backup, RoundPolicy, sync_policy_for


def test_bsp_waits_for_every_member_and_takes_all_of_them():
    p = BSP()
    assert p.accept([0, 1, 2], [2, 0]) is None
    assert p.accept([0, 1, 2], [2, 0, 1]) == [0, 1, 2]
    assert p.accept([0, 2], [2, 0]) == [0, 2], "a member that left is no longer waited for"
    assert p.accept([], []) is None, "nobody left: re-plan instead of committing nothing"


def test_backup_takes_the_first_n_to_complete():
    p = Backup(required=2)
    assert p.accept([0, 1, 2], [2]) is None
    assert p.accept([0, 1, 2], [2, 0]) == [0, 2]
    assert p.accept([0, 1, 2], [2, 0, 1]) == [0, 2], "later ones are not part of the iteration"
    assert p.accept([1], [1]) == [1], "after losses, all that remain"
    with pytest.raises(ValueError):
        Backup(required=0)


def test_ssp_bound_on_committed_clocks():
    p = SSP(staleness=2)
    clocks = {0: 3, 1: 0}
    assert p.pull_ready(clocks, [0, 1], 2), "clock 2 is within s of the slowest (0)"
    assert not p.pull_ready(clocks, [0, 1], 3), "clock 3 is s + 1 ahead of the slowest: must wait"
    clocks[1] = 1
    assert p.pull_ready(clocks, [0, 1], 3) and not p.pull_ready(clocks, [0, 1], 4)
    assert p.pull_ready(clocks, [0], 4), "a worker that left holds nobody back"
    assert not SSP(staleness=0).pull_ready({0: 1, 1: 0}, [0, 1], 1), "s = 0 is lockstep"


def test_asp_never_waits():
    assert ASP().pull_ready({0: 0, 1: 100}, [0, 1], 10**6)


@pytest.mark.parametrize("name", SYNC_POLICIES.names())
def test_contract_every_policy(name):
    """Round policies commit only complete members, each once; async ones bound pulls only."""
    args = {"backup": {"required": 2}}.get(name, {})
    p = SYNC_POLICIES.create(name, **args)
    assert p.name == name
    assert p.consistent_pulls == p.plans_rounds
    assert isinstance(p, RoundPolicy if p.plans_rounds else AsyncPolicy)
    if isinstance(p, RoundPolicy):
        members = [0, 1, 2, 3]
        order: list[int] = []
        for w in [3, 1, 0, 2]:
            order.append(w)
            out = p.accept(members, order)
            if out is not None:
                assert set(out) <= set(order) and len(set(out)) == len(out) and out == sorted(out)
                break
        else:
            pytest.fail("a round policy must commit once every member is complete")
    else:
        assert isinstance(p, AsyncPolicy)
        assert p.pull_ready({0: 5, 1: 5}, [0, 1], 5)
    with pytest.raises(ValueError, match=f"sync policy '{name}': bad arguments"):
        SYNC_POLICIES.create(name, bogus=1)


@pytest.mark.parametrize("name", SYNC_POLICIES.names())
def test_contract_what_the_others_ask(name):
    """Every mode is built from a config, and answers the shards' and the coordinator's
    questions: round modes key assignments by the shard's version and answer a pull once that
    version is reached; async modes key them by the worker's clock and answer at once, except
    that a worker reads its own writes after a push."""
    cfg = validate({"cluster": {"num_workers": 3}, "mode": {"sync": name, "backup_workers": 1, "staleness": 2}})
    p = sync_policy_for(cfg)
    assert type(p) is SYNC_POLICIES.get(name)
    X = 60
    assert p.planned_total(X, 3) >= X and p.planned_total(X, 1) >= 1
    if p.plans_rounds:
        assert p.assignment_key(version=7, clock=2) == 7
        assert not p.pull_answerable(version=6, min_version=7, settled=7, after_push=False)
        assert p.pull_answerable(version=7, min_version=7, settled=0, after_push=True)
    else:
        assert p.assignment_key(version=7, clock=2) == 2
        assert p.pull_answerable(version=0, min_version=7, settled=0, after_push=False)
        assert not p.pull_answerable(version=9, min_version=7, settled=6, after_push=True)
        assert p.pull_answerable(version=9, min_version=7, settled=7, after_push=True)


def test_modes_take_their_settings_from_the_config():
    def cfg(**mode):
        return validate({"cluster": {"num_workers": 4}, "mode": mode})

    assert sync_policy_for(cfg(sync="ssp", staleness=3)).staleness == 3
    backup = sync_policy_for(cfg(sync="backup", backup_workers=1))
    assert backup.required == 3
    assert backup.planned_total(60, 4) == 80, "N + b workers get a share of X / N each"
    assert backup.planned_total(60, 3) == 60 and backup.planned_total(60, 1) == 20
    assert BSP().planned_total(60, 4) == 60
    with pytest.raises(ValueError, match=r"mode\.backup_workers \(4\) must be below cluster\.num_workers \(4\)"):
        sync_policy_for(cfg(sync="backup", backup_workers=4))
    with pytest.raises(ValueError, match="unknown sync policy 'nope'; known: asp, backup, bsp, flexrr, ssp"):
        sync_policy_for(cfg(sync="nope"))
