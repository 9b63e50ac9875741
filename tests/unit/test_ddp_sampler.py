"""The DDP plug-in's parts that need no process group: the sampler's one global order under
changing per-rank sizes, and the balancer's refusal to start without a process group.
(The multi-rank checks, spawned with gloo, are in tests/system/test_ddp_plugin.py.)"""

from __future__ import annotations

import numpy as np
import pytest
import torch.distributed as dist

from batchsize_manager.integrations.torch_ddp import DDPBatchBalancer, LBBSPSampler
from ps_ml.datasets import sample_order
from ps_ml.reference import global_batch_indices


def test_sampler_every_sample_once_per_epoch_under_changing_sizes():
    n, gb, world = 50, 16, 3
    sampler = LBBSPSampler(n, gb, seed=7)
    rng = np.random.default_rng(0)
    iterations = 4 * n // gb + 1  # >4 epochs, chunks straddle epoch boundaries
    stream = []
    for t in range(iterations):
        cuts = np.sort(rng.integers(0, gb + 1, size=world - 1))
        sizes = np.diff([0, *cuts, gb]).tolist()  # may contain zeros
        parts = [sampler.rank_indices(t, dict(enumerate(sizes)), r) for r in range(world)]
        assert [len(p) for p in parts] == sizes
        batch = np.concatenate(parts)
        np.testing.assert_array_equal(batch, global_batch_indices(7, n, gb, t))
        np.testing.assert_array_equal(batch, sampler.global_indices(t))
        stream.append(batch)
    stream = np.concatenate(stream)
    for e in range(len(stream) // n):
        epoch = stream[e * n:(e + 1) * n]
        np.testing.assert_array_equal(np.sort(epoch), np.arange(n))
        np.testing.assert_array_equal(epoch, sample_order(7, e, n))
    # Stateless: an old iteration after the cache moved on gives the same answer.
    np.testing.assert_array_equal(sampler.global_indices(0), global_batch_indices(7, n, gb, 0))
    with pytest.raises(ValueError, match="sum"):
        sampler.rank_indices(0, [1, 2], 0)
    with pytest.raises(ValueError, match="ranks"):
        sampler.rank_indices(0, {0: 8, 2: 8}, 0)


def test_balancer_needs_initialised_process_group():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="initialised"):
        DDPBatchBalancer(64)
