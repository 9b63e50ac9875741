"""Shard state and optimizer: pure logic, no sockets. A shard holds gradients and applies
exactly the commits it is given; its log hash chains every commit it applied."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps_common.config import OptimizerConfig
from ps_server import optimizer
from ps_server.optimizer import SGD, all_finite
from ps_server.shard import GENESIS_HASH, GradientRejected, MissingGradient, ShardState, next_log_hash
from ps_server.sync import SYNC_POLICIES


def make_shard(size=6, **opt):
    cfg = OptimizerConfig(**{"lr": 0.1, "momentum": 0.0, **opt})
    return ShardState(0, np.arange(size, dtype=np.float32), cfg)


def g(values):
    a = np.asarray(values, dtype=np.float32)
    a.flags.writeable = False
    return a


def test_a_commit_applies_the_weighted_mean_of_the_named_gradients_only():
    s = make_shard(2)
    s.receive(0, 0, 1, g([4.0, 0.0]))
    s.receive(1, 0, 3, g([0.0, 4.0]))
    s.receive(2, 0, 5, g([100.0, 100.0]))  # held here, but not in the commit
    assert s.version == 0
    a = s.apply(0, [[0, 1], [1, 3]], 1.0)
    assert (a.version, a.iteration, a.samples) == (1, 0, 4)
    # g = (1*[4,0] + 3*[0,4]) / 4 = [1, 3]; w -= 0.1 g
    np.testing.assert_allclose(s.params, [-0.1, 0.7], rtol=1e-6)
    assert s.holds() == [[2, 0, 5]], "gradients not named stay held until dropped"
    assert s.drop_through(0) == 1 and s.holds() == []


def test_aggregation_does_not_depend_on_arrival_order():
    rng = np.random.default_rng(0)
    grads = [g(rng.normal(size=1000)) for _ in range(4)]
    sizes = [3, 17, 5, 39]
    outs = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        s = make_shard(1000)
        for w in order:
            s.receive(w, 0, sizes[w], grads[w])
        s.apply(0, [[w, sizes[w]] for w in range(4)], 1.0)
        outs.append(s.params)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_a_commit_naming_a_missing_gradient_changes_nothing():
    s = make_shard(2)
    s.receive(0, 0, 2, g([1, 1]))
    before = s.params.copy()
    for entries in ([[0, 2], [1, 2]], [[0, 3]]):  # worker 1 never pushed; wrong batch size
        with pytest.raises(MissingGradient):
            s.apply(0, entries, 1.0)
    np.testing.assert_array_equal(s.params, before)
    assert s.version == 0 and s.log_hash == GENESIS_HASH and s.holds() == [[0, 0, 2]]


def test_rejected_gradients_are_not_held():
    s = make_shard(2, )
    s.receive(0, 0, 2, g([1, 1]))
    cases = [((0, 0, 2, g([1, 1])), "duplicate"), ((1, 0, 2, g([np.nan, 0])), "nonfinite"),
             ((1, 0, 2, g([0, np.inf])), "nonfinite"), ((1, 0, 2, g([1, 1, 1])), "bad_shape")]
    for args, code in cases:
        with pytest.raises(GradientRejected) as exc:
            s.receive(*args)
        assert exc.value.code == code
    assert s.holds() == [[0, 0, 2]]


def test_a_worker_can_hold_only_a_few_uncommitted_gradients():
    s = ShardState(0, np.zeros(2, np.float32), OptimizerConfig(lr=0.1), max_held_per_worker=2)
    s.receive(7, 0, 1, g([1, 1]))
    s.receive(7, 1, 1, g([1, 1]))
    with pytest.raises(GradientRejected) as exc:
        s.receive(7, 2, 1, g([1, 1]))
    assert exc.value.code == "busy"
    s.apply(0, [[7, 1]], 0.5)
    s.receive(7, 2, 1, g([1, 1]))  # room again once one is committed


def test_a_drop_with_a_size_takes_only_a_gradient_held_at_that_size():
    s = make_shard(2)
    s.receive(0, 0, 4, g([1.0, 1.0]))
    assert s.drop([[0, 0, 3]]) == 0 and (0, 0) in s.held and 0 not in s.settled
    assert s.drop([[0, 0, 4]]) == 1 and not s.held and s.settled[0] == 1
    s.receive(1, 0, 4, g([1.0, 1.0]))
    assert s.drop([[1, 0]]) == 1, "without a size: whatever is held"


def test_settled_iterations_are_forgotten_least_recently_settled_first(monkeypatch):
    import ps_server.shard as shard

    monkeypatch.setattr(shard, "MAX_SETTLED", 3)
    s = make_shard(2)
    for w in range(4):
        s.drop([[w, 0]])
    s.drop([[1, 5]])                          # worker 1 settles again: the most recent now
    s.drop([[9, 0]])
    assert list(s.settled) == [3, 1, 9] and s.settled[1] == 6


def test_equal_log_hashes_mean_equal_histories():
    def history(commits):
        s = make_shard(3)
        for it, entries, lr in commits:
            for w, x in entries:
                s.receive(w, it, x, g([1, 2, 3]))
            s.apply(it, entries, lr)
        return s.version, s.log_hash

    a = history([(0, [[0, 2], [1, 2]], 1.0), (1, [[0, 2], [1, 2]], 1.0)])
    assert a == history([(0, [[0, 2], [1, 2]], 1.0), (1, [[0, 2], [1, 2]], 1.0)])
    assert a != history([(0, [[0, 2], [1, 2]], 1.0), (1, [[0, 2]], 1.0)])
    assert a != history([(0, [[0, 2], [1, 2]], 1.0), (1, [[0, 2], [1, 2]], 0.5)])
    assert next_log_hash(GENESIS_HASH, 1, 0, [[0, 1]], 1.0) != next_log_hash(GENESIS_HASH, 1, 1, [[0, 1]], 1.0)


def test_restore_drops_held_gradients_and_keeps_the_hash():
    s = make_shard(2)
    s.receive(0, 0, 2, g([1, 1]))
    s.apply(0, [[0, 2]], 1.0)
    arrays, meta = s.state_arrays(), s.state_meta()
    s.receive(0, 1, 2, g([1, 1]))
    s.apply(1, [[0, 2]], 1.0)
    s.receive(0, 2, 2, g([1, 1]))
    s.restore(arrays, meta)
    assert s.version == 1 and s.log_hash == meta["log_hash"] and s.holds() == []


@pytest.mark.parametrize("block", [1 << 19, 64])   # one block; eight blocks, the last one short
@pytest.mark.parametrize("momentum, wd, nesterov", [(0.0, 0.0, False), (0.9, 0.0, False),
                                                     (0.9, 5e-4, False), (0.8, 1e-3, True)])
def test_sgd_matches_torch(momentum, wd, nesterov, block, monkeypatch):
    monkeypatch.setattr(optimizer, "BLOCK", block)
    rng = np.random.default_rng(1)
    p0 = rng.normal(size=500).astype(np.float32)
    cfg = OptimizerConfig(lr=0.05, momentum=momentum, weight_decay=wd, nesterov=nesterov)
    opt = SGD(cfg, p0.size)
    tp = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    topt = torch.optim.SGD([tp], lr=0.05, momentum=momentum, weight_decay=wd, nesterov=nesterov)
    p = p0.copy()
    for _ in range(10):
        grad = rng.normal(size=500).astype(np.float32)
        old = p
        p = opt.step(p, grad)
        assert p is not old, "step must not mutate arrays that may still be in flight"
        tp.grad = torch.from_numpy(grad.copy())
        topt.step()
    np.testing.assert_allclose(p, tp.detach().numpy(), rtol=1e-6, atol=1e-7)


def test_unknown_sync_policy():
    with pytest.raises(ValueError, match="known: asp, backup, bsp, flexrr, ssp"):
        SYNC_POLICIES.get("nope")


def test_snapshots_at_multiples_are_bounded_references():
    cfg = OptimizerConfig(lr=0.1, momentum=0.0)
    s = ShardState(0, np.zeros(3, np.float32), cfg, snapshot_every=2, max_snapshots=3)
    hashes = {}
    for it in range(8):
        s.receive(0, it, 4, g([1, 1, 1]))
        applied = s.apply(it, [[0, 4]], 1.0)
        hashes[applied.version] = applied.log_hash
    assert s.version == 8 and sorted(s.snapshots) == [4, 6, 8]
    np.testing.assert_allclose(s.snapshots[4][0], [-0.4] * 3, rtol=1e-6)
    assert s.snapshots[8][0] is s.params, "a snapshot is a reference, not a copy"
    # each keeps its own version's log hash: a measurement of it proves which history it is of
    assert {v: snap.log_hash for v, snap in s.snapshots.items()} == {v: hashes[v] for v in (4, 6, 8)}


def test_checkpoint_arrays_do_not_change_with_later_steps():
    s = ShardState(0, np.zeros(3, np.float32), OptimizerConfig(lr=0.1, momentum=0.9))
    s.receive(0, 0, 1, g([1, 1, 1]))
    s.apply(0, [[0, 1]], 1.0)
    saved = s.state_arrays()
    copy = {k: v.copy() for k, v in saved.items()}
    s.receive(0, 1, 1, g([5, 5, 5]))
    s.apply(1, [[0, 1]], 1.0)
    for k in saved:
        np.testing.assert_array_equal(saved[k], copy[k])


def test_parameter_buffers_are_reused_only_when_nothing_holds_them():
    s = ShardState(0, np.zeros(4, np.float32), OptimizerConfig(lr=0.1, momentum=0.9))
    held = []
    for it in range(12):
        s.receive(0, it, 1, g([1, 1, 1, 1]))
        s.apply(it, [[0, 1]], 1.0)
        if it % 3 == 0:  # a zero-copy send in flight keeps this version's array referenced
            held.append((memoryview(s.params).cast("B"), s.params.copy()))
    for view, expected in held:
        np.testing.assert_array_equal(np.frombuffer(view, np.float32), expected)
    assert len(s._pool) <= s.max_buffers
    before = len({id(b) for b in s._pool})
    held.clear()
    for it in range(12, 20):
        s.receive(0, it, 1, g([1, 1, 1, 1]))
        s.apply(it, [[0, 1]], 1.0)
    assert len({id(b) for b in s._pool}) == before, "released buffers are reused, not reallocated"


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_all_finite_finds_one_bad_value_anywhere(dtype) -> None:
    a = np.random.default_rng(0).standard_normal(100_003).astype(dtype)
    assert all_finite(a)
    for bad in (np.nan, np.inf, -np.inf):
        for pos in (0, 50_000, a.size - 1):
            b = a.copy()
            b[pos] = bad
            assert not all_finite(b), (bad, pos)
    big = np.full(8, np.finfo(dtype).max, dtype=dtype)   # finite terms whose sum overflows:
    assert not all_finite(big)                            # refused, no update could use them
    assert all_finite(np.zeros(0, dtype=dtype))


@pytest.mark.parametrize("momentum, wd, nesterov", [(0.0, 0.0, False), (0.0, 5e-4, False), (0.9, 0.0, False),
                                                     (0.9, 5e-4, False), (0.8, 1e-3, True)])
def test_the_update_in_blocks_gives_the_bits_of_the_whole_slice_at_once(momentum, wd, nesterov, monkeypatch):
    """Every element goes through the same operations in the same order in any block, so the
    parameters and the momentum do not depend on the block size (whatever the number of torch
    threads: a block is split among them); one or two gradients, with and without a buffer to
    write into."""
    rng = np.random.default_rng(3)
    n = 10_007
    p0 = rng.normal(size=n).astype(np.float32)
    steps = [[(rng.normal(size=n).astype(np.float32), w) for w in ws] for ws in ([1.0], [0.25, 0.75], [0.5, 0.5])]
    cfg = OptimizerConfig(lr=0.05, momentum=momentum, weight_decay=wd, nesterov=nesterov)
    results = []
    for block in (n, 1000, 4096):
        monkeypatch.setattr(optimizer, "BLOCK", block)
        opt, p = SGD(cfg, n), p0
        for i, grads in enumerate(steps):
            p = opt.step_weighted(p, grads, lr_scale=0.5 + i, out=np.empty(n, np.float32) if i % 2 else None)
        results.append((p, None if opt.buf is None else opt.buf.copy()))
    for p, buf in results[1:]:
        np.testing.assert_array_equal(p, results[0][0])
        if buf is not None:
            np.testing.assert_array_equal(buf, results[0][1])


@pytest.mark.parametrize("momentum, wd, nesterov", [(0.9, 0.0, False), (0.8, 1e-3, True)])
def test_the_update_gives_the_same_bits_with_any_number_of_shard_threads(momentum, wd, nesterov):
    """``cluster.shard_threads`` splits the update over torch threads: element-wise work, so the
    parameters must not depend on the split (a reduction in the update would break this). 2M
    elements: torch splits element-wise work above 32K, so 4 threads really run."""
    rng = np.random.default_rng(2)
    p0 = rng.normal(size=2_000_003).astype(np.float32)
    steps = [[(rng.normal(size=p0.size).astype(np.float32), w) for w in (0.25, 0.75)] for _ in range(3)]
    cfg = OptimizerConfig(lr=0.05, momentum=momentum, weight_decay=wd, nesterov=nesterov)
    before = torch.get_num_threads()
    results = []
    try:
        for threads in (1, 4):
            torch.set_num_threads(threads)
            opt, p = SGD(cfg, p0.size), p0
            for grads in steps:
                assert all_finite(grads[0][0])
                p = opt.step_weighted(p, grads)
            results.append(p)
    finally:
        torch.set_num_threads(before)
    np.testing.assert_array_equal(results[0], results[1])
