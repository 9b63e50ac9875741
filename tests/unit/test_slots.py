"""SlotTable: the three ways to look ids up (one id, many ids by gather, a few ids by dict) agree."""

from __future__ import annotations

import random

import numpy as np
import pytest

from batchsize_manager.slots import SlotTable


def test_every_lookup_agrees_with_a_plain_dict_under_churn():
    """Ids inside and outside the gather table (up to int64's ends), joins, leaves and recycled
    slots: get, lookup (small and large) and lookup_list give the slots a plain dict holds."""
    grown: list[int] = []
    inited: list[list[int]] = []
    table = SlotTable(lambda cap: grown.append(cap), lambda s, ids: inited.append(ids.tolist()))
    ref: dict[int, int] = {}
    rng = random.Random(7)
    pool = [0, 1, 5, 63, 64, 4095, (1 << 22) - 1, 1 << 22, 10**12, -1, -(1 << 63), (1 << 63) - 1]
    pool += rng.sample(range(1 << 22), 40)
    for _ in range(600):
        w = rng.choice(pool)
        if w in ref and rng.random() < 0.4:
            assert table.remove(w) == ref.pop(w)
        else:
            s = table.add(w)
            assert ref.setdefault(w, s) == s
        assert len(set(ref.values())) == len(ref)            # no slot handed out twice
        ids = rng.sample(pool, rng.randint(1, len(pool)))
        want = [ref.get(w, -1) for w in ids]
        assert [table.get(w) for w in ids] == want
        assert table.lookup_list(ids).tolist() == want
        assert table.lookup(np.array(ids, dtype=np.int64)).tolist() == want   # > 16 ids: gather
        few = ids[:5]
        assert table.lookup(np.array(few, dtype=np.int64)).tolist() == want[:5]
    assert grown and inited                                  # the owner heard of growth and new slots
    assert sorted(table.ids().tolist()) == sorted(ref)


def test_lookup_list_creates_slots_in_order_and_rejects_non_integers():
    table = SlotTable(lambda cap: None, lambda s, ids: None)
    assert table.lookup_list([9, 3, 9], create=True).tolist() == [0, 1, 0]
    assert table.lookup_list([3, 4]).tolist() == [1, -1]
    assert table.add(np.int64(4)) == 2                       # numpy integers are integers
    for bad in (3.5, None, "7"):
        with pytest.raises(TypeError):
            table.add(bad)                                   # type: ignore[arg-type]
