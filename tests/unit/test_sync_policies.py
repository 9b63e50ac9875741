"""Sync policies as pure commit rules over complete gradients, and SSP's pull bound."""

from __future__ import annotations

import pytest

from ps_server.sync import ASP, BSP, SSP, AsyncPolicy, Backup, RoundPolicy, get_sync_policy, sync_policy_names


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


@pytest.mark.parametrize("name", sync_policy_names())
def test_contract_every_policy(name):
    """Round policies commit only complete members, each once; async ones bound pulls only."""
    args = {"backup": {"required": 2}}.get(name, {})
    p = get_sync_policy(name, **args)
    assert p.consistent_pulls == p.round_based
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
    with pytest.raises(ValueError):
        get_sync_policy(name, bogus=1)
