"""The CUDA worker path, exercised whenever a GPU is present (skipped otherwise)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import zmq

from ps_common.config import validate
from ps_ml.datasets import load_dataset
from ps_ml.reference import train_reference
from ps_server.server import ShardServer
from ps_worker.worker import Worker

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


def test_cuda_workers_match_single_process_sgd():
    cfg = validate({
        "run": {"seed": 5}, "model": {"name": "lenet"},
        "data": {"dataset": "synthetic", "synthetic_train": 512, "synthetic_test": 128},
        "training": {"global_batch": 64, "max_iterations": 20},
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "cluster": {"num_shards": 2, "num_workers": 2},
        "mode": {"batch_policy": "fixed", "batch_policy_args": {"weights": [1, 3]}},
        "worker": {"device": "cuda"}, "evaluator": {"enabled": False},
    })
    ctx = zmq.Context.instance()
    s0 = ShardServer(cfg, 0, ctx=ctx)
    s1 = ShardServer(cfg, 1, coordinator=s0.endpoint, ctx=ctx)
    servers = [threading.Thread(target=s.run, daemon=True) for s in (s0, s1)]
    for t in servers:
        t.start()
    try:
        workers = [Worker(cfg, s0.endpoint, name=f"gpu{i}", ctx=ctx) for i in range(2)]
        assert all(w.device.type == "cuda" for w in workers)
        threads = [threading.Thread(target=w.run) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [w.iterations_done for w in workers] == [20, 20]
        final = np.concatenate([s0.state.params, s1.state.params])
    finally:
        s0.stop_event.set()
        s1.stop_event.set()
    data = load_dataset("synthetic", seed=5, synthetic_train=512, synthetic_test=128)
    ref = train_reference("lenet", 5, data, 5, 64, 20, lr=0.05, momentum=0.9)
    # cuDNN kernels differ from the CPU ones, so the tolerance is looser than the CPU invariant.
    assert np.linalg.norm(final - ref) / np.linalg.norm(ref) < 1e-3
