"""Shard state, BSP policy and optimizer: pure logic, no sockets."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps_common.config import OptimizerConfig
from ps_server.optimizer import SGD
from ps_server.shard import ShardState
from ps_server.sync import BSP, PushRejected, get_sync_policy


def make_shard(size=6, **opt):
    cfg = OptimizerConfig(**{"lr": 0.1, "momentum": 0.0, **opt})
    return ShardState(0, np.arange(size, dtype=np.float32), cfg, BSP())


def g(values):
    a = np.asarray(values, dtype=np.float32)
    a.flags.writeable = False
    return a


def test_bsp_applies_weighted_mean_once_all_pushed():
    s = make_shard(2)
    assert s.push(0, 0, 1, 2, 4, g([4.0, 0.0])) == []
    assert s.version == 0
    np.testing.assert_array_equal(s.params, [0, 1])
    (a,) = s.push(1, 0, 3, 2, 4, g([0.0, 4.0]))
    assert (a.iteration, a.workers, a.samples, a.lr_scale) == (0, [0, 1], 4, 1.0)
    # g = (1*[4,0] + 3*[0,4]) / 4 = [1, 3]; w -= 0.1 g
    np.testing.assert_allclose(s.params, [-0.1, 0.7], rtol=1e-6)
    assert s.version == 1


def test_aggregation_does_not_depend_on_arrival_order():
    rng = np.random.default_rng(0)
    grads = [g(rng.normal(size=1000)) for _ in range(4)]
    sizes = [3, 17, 5, 39]
    outs = []
    for order in ([0, 1, 2, 3], [3, 1, 0, 2]):
        s = make_shard(1000)
        for w in order:
            s.push(w, 0, sizes[w], 4, sum(sizes), grads[w])
        outs.append(s.params)
    np.testing.assert_array_equal(outs[0], outs[1])


@pytest.mark.parametrize(
    "push, code",
    [
        (dict(worker=0, it=1, bs=2, exp=2, X=4), "future"),
        (dict(worker=0, it=0, bs=2, exp=3, X=4), "bad_plan"),
        (dict(worker=1, it=0, bs=2, exp=2, X=5), "bad_plan"),
        (dict(worker=1, it=0, bs=3, exp=2, X=4), "bad_plan"),
        (dict(worker=1, it=0, bs=0, exp=2, X=4), "bad_plan"),
    ],
)
def test_rejected_pushes_leave_state_untouched(push, code):
    s = make_shard(2)
    s.push(2, 0, 2, 2, 4, g([1, 1]))  # worker 2 set the plan: 2 workers, global batch 4
    before = s.params.copy()
    with pytest.raises(PushRejected) as exc:
        s.push(push["worker"], push["it"], push["bs"], push["exp"], push["X"], g([9, 9]))
    assert exc.value.code == code
    np.testing.assert_array_equal(s.params, before)
    assert s.version == 0 and s.rejected[code] == 1


def test_duplicate_stale_nonfinite_and_shape():
    s = make_shard(2)
    s.push(0, 0, 2, 2, 4, g([1, 1]))
    with pytest.raises(PushRejected, match="already pushed") as e:
        s.push(0, 0, 2, 2, 4, g([1, 1]))
    assert e.value.code == "duplicate"
    for bad in ([np.nan, 0], [0, np.inf]):
        with pytest.raises(PushRejected) as e:
            s.push(1, 0, 2, 2, 4, g(bad))
        assert e.value.code == "nonfinite"
    with pytest.raises(PushRejected) as e:
        s.push(1, 0, 2, 2, 4, g([1, 1, 1]))
    assert e.value.code == "bad_shape"
    s.push(1, 0, 2, 2, 4, g([1, 1]))
    assert s.version == 1
    before = s.params.copy()
    assert s.push(1, 0, 2, 2, 4, g([5, 5])) == [], "a late push is dropped, not applied"
    assert s.dropped == 1
    np.testing.assert_array_equal(s.params, before)


@pytest.mark.parametrize("momentum, wd, nesterov", [(0.0, 0.0, False), (0.9, 0.0, False),
                                                     (0.9, 5e-4, False), (0.8, 1e-3, True)])
def test_sgd_matches_torch(momentum, wd, nesterov):
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
    with pytest.raises(ValueError, match="known: asp, backup, bsp, ssp"):
        get_sync_policy("nope")


def test_snapshots_at_multiples_are_bounded_references():
    cfg = OptimizerConfig(lr=0.1, momentum=0.0)
    s = ShardState(0, np.zeros(3, np.float32), cfg, BSP(), snapshot_every=2, max_snapshots=3)
    for it in range(8):
        s.push(0, it, 4, 1, 4, g([1, 1, 1]))
    assert s.version == 8 and sorted(s.snapshots) == [4, 6, 8]
    np.testing.assert_allclose(s.snapshots[4][0], [-0.4] * 3, rtol=1e-6)
    assert s.snapshots[8][0] is s.params, "a snapshot is a reference, not a copy"
