"""The DDP plug-in's defaults that do not need a process group: which device its collectives
use for a backend, and what it warns about batch-norm layers."""

from __future__ import annotations

import pytest

from batchsize_manager.integrations.torch_ddp import batch_norm_warning, collectives_device


@pytest.mark.parametrize("backend, cuda, device", [
    ("nccl", True, "cuda"),
    ("gloo", True, "cpu"),                     # gloo with a CUDA model: CPU collectives
    ("cpu:gloo,cuda:nccl", True, "cpu"),       # before: "cpu" too, but the compute timed on the CPU clock
    ("cuda:nccl", True, "cuda"),
    ("undefined", True, "cuda"),               # no backend named: torch maps CUDA to NCCL only
    ("undefined", False, "cpu"),
    ("mpi", True, "cpu"),
])
def test_the_collectives_device_follows_what_the_backend_can_carry(backend, cuda, device):
    assert collectives_device(backend, cuda) == device


def test_batch_norm_warnings_say_what_is_not_exact_and_how_sync_batch_norm_becomes_exact():
    assert batch_norm_warning({}, loss_scaled=False, min_batch=1) == ""
    plain = batch_norm_warning({"BatchNorm1d": False}, loss_scaled=True, min_batch=2)
    assert "BatchNorm1d" in plain and "not exactly" in plain and "min_batch=2" in plain
    synced = batch_norm_warning({"SyncBatchNorm": True}, loss_scaled=False, min_batch=1)
    assert "SyncBatchNorm" in synced and "loss_scaled=True" in synced and "loss_scale" in synced
    assert batch_norm_warning({"SyncBatchNorm": True}, loss_scaled=True, min_batch=1) == ""
