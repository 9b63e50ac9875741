"""Tests for ps_ml.models (registry, FlatParameters) and ps_ml.reference training."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ps_ml.datasets import make_synthetic
from ps_ml.models import (
    MODEL_REGISTRY,
    FlatParameters,
    build_model,
    count_parameters,
    model_names,
    register_model,
)
from ps_ml.reference import flat_parameters, global_batch_indices, train_reference

PARAM_RANGES = {"mlp": (90_000, 110_000), "lenet": (75_000, 90_000), "cnn1m": (1_100_000, 1_300_000)}


@pytest.fixture
def one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def _flat(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


# ----------------------------------------------------------------------------
# registry
# ----------------------------------------------------------------------------


def test_registry_contains_expected_models() -> None:
    assert set(PARAM_RANGES) <= set(model_names())
    assert model_names() == sorted(MODEL_REGISTRY)


@pytest.mark.parametrize("name", sorted(PARAM_RANGES))
def test_parameter_counts(name: str) -> None:
    n = count_parameters(build_model(name, seed=0))
    print(f"{name}: {n:,} parameters")
    lo, hi = PARAM_RANGES[name]
    assert lo <= n <= hi


@pytest.mark.parametrize("name", sorted(PARAM_RANGES))
@pytest.mark.parametrize("num_classes", [10, 7])
def test_forward_shape_and_parameters_only(name: str, num_classes: int) -> None:
    model = build_model(name, seed=1, num_classes=num_classes)
    out = model(torch.randn(3, 1, 28, 28))
    assert out.shape == (3, num_classes) and out.dtype == torch.float32
    assert list(model.buffers()) == []
    assert all(p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.parametrize("name", sorted(PARAM_RANGES))
def test_build_is_deterministic_and_leaves_global_rng_alone(name: str) -> None:
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    a = build_model(name, seed=3)
    assert torch.equal(torch.get_rng_state(), state), "global RNG state must be untouched"
    torch.rand(5)  # perturb the global RNG: must not matter
    b = build_model(name, seed=3)
    c = build_model(name, seed=4)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(_flat(a), _flat(c))


def test_unknown_model_and_duplicate_registration() -> None:
    with pytest.raises(ValueError, match="cnn1m.*lenet.*mlp"):
        build_model("resnet50", seed=0)
    with pytest.raises(ValueError, match="already registered"):
        register_model("mlp")(lambda num_classes=10: nn.Linear(1, 1))


def test_models_with_buffers_are_rejected() -> None:
    name = "_test_bn"
    register_model(name)(lambda num_classes=10: nn.Sequential(nn.Flatten(), nn.BatchNorm1d(784)))
    try:
        with pytest.raises(ValueError, match="buffers"):
            build_model(name, seed=0)
    finally:
        MODEL_REGISTRY.unregister(name)


# ----------------------------------------------------------------------------
# FlatParameters
# ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mlp", "lenet"])
def test_flat_parameters_are_views_and_values_preserved(name: str) -> None:
    reference = build_model(name, seed=5)
    model = build_model(name, seed=5)
    flat = FlatParameters(model)
    assert flat.numel == count_parameters(model)
    assert flat.params.shape == (flat.numel,) and flat.params.is_contiguous()
    assert flat.grads.shape == (flat.numel,) and flat.params.dtype == torch.float32
    assert torch.equal(flat.params, _flat(reference))
    assert flat.is_bound()
    start, end = flat.params.data_ptr(), flat.params.data_ptr() + 4 * flat.numel
    for p in model.parameters():
        assert start <= p.data_ptr() < end
    # writing through the numpy view changes the model: no copy anywhere
    flat.params_numpy()[:] = 0.0
    assert all(torch.count_nonzero(p) == 0 for p in model.parameters())


@pytest.mark.parametrize("name", ["mlp", "lenet"])
def test_backward_accumulates_into_flat_grads(name: str) -> None:
    model = build_model(name, seed=0)
    flat = FlatParameters(model)
    gstart, gend = flat.grads.data_ptr(), flat.grads.data_ptr() + 4 * flat.numel
    x = torch.randn(4, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 1, 2, 3])
    F.cross_entropy(model(x), y).backward()
    assert torch.count_nonzero(flat.grads) > 0
    for p in model.parameters():
        assert gstart <= p.grad.data_ptr() < gend
    assert torch.equal(flat.grads, torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
    first = flat.grads.clone()
    assert np.shares_memory(flat.grads_numpy(), flat.grads.numpy())

    F.cross_entropy(model(x), y).backward()  # accumulates in place
    torch.testing.assert_close(flat.grads, 2 * first)
    assert flat.is_bound()

    flat.zero_grad_()
    assert torch.count_nonzero(flat.grads) == 0 and flat.is_bound()
    F.cross_entropy(model(x), y).backward()
    assert torch.equal(flat.grads, first)

    # the trap FlatParameters documents: optimizer/model.zero_grad() unbinds grads
    model.zero_grad()
    assert not flat.is_bound()


def test_load_accepts_read_only_numpy_and_changes_output() -> None:
    model = build_model("lenet", seed=0)
    flat = FlatParameters(model)
    other = flat_parameters(build_model("lenet", seed=1))
    x = torch.randn(2, 1, 28, 28)
    before = model(x).detach()
    buf = np.frombuffer(other.tobytes(), dtype=np.float32)
    assert not buf.flags.writeable
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flat.load_(buf)
    assert np.array_equal(flat.params_numpy(), other)
    assert torch.equal(model(x).detach(), build_model("lenet", seed=1)(x).detach())
    assert not torch.equal(model(x).detach(), before)
    flat.load_(torch.from_numpy(flat_parameters(build_model("lenet", seed=0))))
    assert torch.equal(model(x).detach(), before)
    with pytest.raises(ValueError):
        flat.load_(np.zeros(flat.numel + 1, np.float32))
    assert flat.is_bound()


def test_optimizer_updates_flat_buffer_and_host_copies() -> None:
    model = build_model("mlp", seed=0)
    flat = FlatParameters(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    x, y = torch.randn(8, 1, 28, 28), torch.arange(8) % 10
    F.cross_entropy(model(x), y).backward()
    host = flat.new_host_buffer()
    assert host.dtype == np.float32 and host.shape == (flat.numel,)
    assert flat.grads_to_host(host) is host
    np.testing.assert_array_equal(host, flat.grads_numpy())
    assert not np.shares_memory(host, flat.grads_numpy())
    before = flat.params_numpy().copy()
    opt.step()
    np.testing.assert_allclose(flat.params_numpy(), before - 0.5 * host, rtol=1e-6, atol=1e-7)
    out = np.empty(flat.numel, np.float32)
    np.testing.assert_array_equal(flat.params_to_host(out), flat.params_numpy())
    with pytest.raises(ValueError):
        flat.grads_to_host(np.empty(flat.numel, np.float64))


# ----------------------------------------------------------------------------
# reference training
# ----------------------------------------------------------------------------


def test_reference_zero_iterations_is_initial_model() -> None:
    data = make_synthetic(num_train=64, num_test=8)
    got = train_reference("mlp", 3, data, data_seed=0, global_batch=8, iterations=0, lr=0.1)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, _flat(build_model("mlp", seed=3)).numpy())


def test_reference_is_deterministic_and_restores_threads() -> None:
    data = make_synthetic(num_train=256, num_test=8)
    threads = torch.get_num_threads()
    kw = dict(global_batch=48, iterations=12, lr=0.05, momentum=0.9, weight_decay=1e-4, nesterov=True)
    a = train_reference("lenet", 0, data, 0, **kw)
    assert torch.get_num_threads() == threads
    b = train_reference("lenet", 0, data, 0, **kw)
    c = train_reference("lenet", 0, data, 1, **kw)  # other data order
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    assert not np.array_equal(a, _flat(build_model("lenet", seed=0)).numpy())


def test_weighted_bsp_equals_reference(one_thread) -> None:
    """Uneven local batches, gradients weighted by batch size, equal big-batch SGD."""
    data = make_synthetic(num_train=100, num_test=8)
    global_batch, iterations, lr, momentum, wd = 24, 15, 0.05, 0.9, 1e-3  # 15*24 > 3 epochs
    local_sizes = [3, 13, 8]
    expected = train_reference("lenet", 2, data, 7, global_batch, iterations, lr, momentum, wd)

    server = build_model("lenet", seed=2)
    server_flat = FlatParameters(server)
    opt = torch.optim.SGD(server.parameters(), lr=lr, momentum=momentum, weight_decay=wd)
    worker = build_model("lenet", seed=99)  # weights come from the server
    wflat = FlatParameters(worker)
    for it in range(iterations):
        idx = global_batch_indices(7, data.num_train, global_batch, it)
        agg = np.zeros(server_flat.numel, np.float32)
        for chunk in np.split(idx, np.cumsum(local_sizes)[:-1]):
            wflat.load_(server_flat.params_numpy())
            wflat.zero_grad_()
            x, y = data.train_batch(chunk)
            F.cross_entropy(worker(x), y).backward()
            agg += (len(chunk) / global_batch) * wflat.grads_numpy()
        server_flat.grads_numpy()[:] = agg
        opt.step()
    np.testing.assert_allclose(server_flat.params_numpy(), expected, rtol=1e-4, atol=1e-5)
    assert not np.allclose(expected, _flat(build_model("lenet", seed=2)).numpy(), atol=1e-3)
