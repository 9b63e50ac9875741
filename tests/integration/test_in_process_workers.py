"""Shards and workers in one process over loopback: on the CPU always, on CUDA whenever a GPU
is present (skipped otherwise)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
import zmq

from ps_ml.datasets import load_dataset
from ps_ml.reference import train_reference
from ps_server import optimizer
from ps_server.server import ShardServer
from ps_worker.worker import Worker, resolve_device
from tests.cluster_util import write_config

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")


@CUDA
def test_cuda_device_names_get_an_index():
    """torch's memory calls (the per-process fraction among them) refuse a bare "cuda"."""
    dev = resolve_device("cuda")
    assert dev.type == "cuda" and dev.index == torch.cuda.current_device()
    assert resolve_device("auto") == dev and resolve_device("cuda:0").index == 0


@pytest.fixture
def no_tf32():
    """cuDNN runs convolutions in TF32 on Ampere and later by default (10 bits of mantissa): on
    an H100 this test ended 1.2e-3 from the CPU reference with it. Off, float32 is compared with
    float32, as on a CPU: 4.0e-8 on an H100 (docs/results/gpu_h100/tests.txt)."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize("device, part_bytes", [
    ("cpu", 4 << 20), ("cpu", 16384), pytest.param("cuda", 4 << 20, marks=CUDA)], ids=["cpu", "cpu-streamed", "cuda"])
def test_in_process_workers_match_single_process_sgd(tmp_path, no_tf32, device, part_bytes, monkeypatch):
    """``cpu-streamed``: each shard sends every new slice in parts of 4,096 parameters, each as
    soon as its block of the update is done (blocks of 4,096 here), and the workers put the
    parts together: the same end as whole answers."""
    if part_bytes < 4 << 20:
        monkeypatch.setattr(optimizer, "BLOCK", part_bytes // 4)
    _, cfg = write_config(tmp_path, {
        "run": {"seed": 5}, "model": {"name": "lenet"},
        "data": {"dataset": "synthetic", "synthetic_train": 512, "synthetic_test": 128},
        "training": {"global_batch": 64, "max_iterations": 20},
        "optimizer": {"lr": 0.05, "momentum": 0.9},
        "cluster": {"num_shards": 2, "num_workers": 2},
        "mode": {"batch_policy": "fixed", "batch_policy_args": {"weights": [1, 3]}},
        "worker": {"device": device}, "evaluator": {"enabled": False},
        "transport": {"params_part_bytes": part_bytes},
    })
    ctx = zmq.Context.instance()
    s0 = ShardServer(cfg, 0, ctx=ctx)
    s1 = ShardServer(cfg, 1, coordinator=s0.endpoint, ctx=ctx)
    servers = [threading.Thread(target=s.run, daemon=True) for s in (s0, s1)]
    for t in servers:
        t.start()
    try:
        workers = [Worker(cfg, s0.endpoint, name=f"gpu{i}", ctx=ctx) for i in range(2)]
        assert all(w.device.type == device for w in workers)
        threads = [threading.Thread(target=w.run) for w in workers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert [w.iterations_done for w in workers] == [20, 20]
        final = np.concatenate([s0.state.params, s1.state.params])
        sent = [s.router.timings.as_dict()["send.params"]["n"] for s in (s0, s1)]
        answers = 20 * 2 + 2  # every iteration's answer to each worker, and the first pulls
        if part_bytes < 4 << 20:
            assert all(n >= answers * (s.state.size // 4096) for n, s in zip(sent, (s0, s1))), sent
        else:
            assert sent == [answers] * 2, sent
    finally:
        s0.stop_event.set()
        s1.stop_event.set()
    data = load_dataset("synthetic", seed=5, synthetic_train=512, synthetic_test=128)
    ref = train_reference("lenet", 5, data, 5, 64, 20, lr=0.05, momentum=0.9)
    # cuDNN's float32 kernels sum in another order than the CPU's, yet with TF32 off they ended
    # 3.9e-8 and 4.0e-8 from the CPU reference on an H100: the BSP invariant's 1e-5 holds on both
    err = float(np.linalg.norm(final - ref) / np.linalg.norm(ref))
    print(f"{device} workers against single-process SGD on the CPU: relative error {err:.2e}")
    assert err < 1e-5


def test_a_batch_that_does_not_fit_while_it_loads_gets_a_smaller_share(tmp_path):
    """Loading the inputs allocates too: worker 1's loader fails with numpy's own MemoryError for
    more than 16 samples (an allocation no host can make, as an address-space limit fails a
    large input). The worker asks for a smaller share as it does when the backward fails, and
    both train to the end (before, the loader's failure ended the worker)."""
    _, cfg = write_config(tmp_path, {
        "run": {"seed": 5}, "model": {"name": "lenet"},
        "data": {"dataset": "synthetic", "synthetic_train": 512, "synthetic_test": 128},
        "training": {"global_batch": 64, "max_iterations": 6},
        "cluster": {"num_shards": 2, "num_workers": 2},
        "mode": {"batch_policy": "fixed", "batch_policy_args": {"weights": [1, 3]}},
        "evaluator": {"enabled": False},
    })
    ctx = zmq.Context.instance()
    s0 = ShardServer(cfg, 0, ctx=ctx)
    s1 = ShardServer(cfg, 1, coordinator=s0.endpoint, ctx=ctx)
    for s in (s0, s1):
        threading.Thread(target=s.run, daemon=True).start()
    try:
        workers = [Worker(cfg, s0.endpoint, name=f"w{i}", ctx=ctx) for i in range(2)]
        workers[1].data = _SmallMemory(workers[1].data)
        threads = [threading.Thread(target=w.run) for w in workers]
        threads[0].start()
        deadline = time.monotonic() + 30
        while workers[0].worker_id < 0 and time.monotonic() < deadline:
            time.sleep(0.01)               # joins in this order: worker 1 gets the 48 samples
        threads[1].start()
        for t in threads:
            t.join(timeout=120)
        assert [w.iterations_done for w in workers] == [6, 6]
        assert workers[1].oom_retries >= 1
        assert s0.role.coord.manager.memory_caps[workers[1].worker_id] < 48, "learned below its first share"
    finally:
        s0.stop_event.set()
        s1.stop_event.set()


class _SmallMemory:
    """A worker's dataset whose batches of more than 16 samples do not fit while they load."""

    def __init__(self, data) -> None:
        self._data = data

    def __getattr__(self, name: str):
        return getattr(self._data, name)

    def train_batch(self, idx):
        if len(idx) > 16:
            np.empty(1 << 60, dtype=np.uint8)       # MemoryError: Unable to allocate 1.00 EiB
        return self._data.train_batch(idx)
