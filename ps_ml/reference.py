"""Single-process ground truth for the BSP invariant.

BSP with gradients aggregated weighted by local batch size must equal one
process doing plain SGD with the global batch over the same samples in the
same order. This module is that one process: it defines which samples make up
global iteration ``t`` (:func:`global_batch_indices`) and trains on them
(:func:`train_reference`) with ``torch.optim.SGD`` and mean cross-entropy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
import torch.nn.functional as F

from ps_ml.datasets import ArrayDataset, sample_order
from ps_ml.models import build_model

log = logging.getLogger(__name__)


def global_batch_indices(seed: int, num_samples: int, global_batch: int, iteration: int) -> np.ndarray:
    """Sample indices of global iteration ``iteration`` (0-based).

    The stream ``sample_order(seed, 0, n), sample_order(seed, 1, n), ...`` is
    cut into consecutive chunks of ``global_batch``; a chunk may straddle an
    epoch boundary. Only the (at most a few) epochs the chunk touches are
    generated.
    """
    if num_samples <= 0 or global_batch <= 0 or iteration < 0:
        raise ValueError(
            f"need num_samples > 0, global_batch > 0, iteration >= 0; "
            f"got {num_samples}, {global_batch}, {iteration}"
        )
    start = iteration * global_batch
    stop = start + global_batch
    pieces = []
    for epoch in range(start // num_samples, (stop - 1) // num_samples + 1):
        base = epoch * num_samples
        lo, hi = max(start, base) - base, min(stop, base + num_samples) - base
        pieces.append(sample_order(seed, epoch, num_samples)[lo:hi])
    return np.concatenate(pieces)


@contextmanager
def _torch_threads(n: int) -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def flat_parameters(model: torch.nn.Module) -> np.ndarray:
    """A float32 copy of all parameters, concatenated in ``model.parameters()`` order."""
    with torch.no_grad():
        return torch.cat([p.detach().reshape(-1).cpu() for p in model.parameters()]).numpy().copy()


def train_reference(
    model_name: str,
    model_seed: int,
    dataset: ArrayDataset,
    data_seed: int,
    global_batch: int,
    iterations: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
) -> np.ndarray:
    """Train ``iterations`` SGD steps on the global batches; return the final flat parameters.

    Runs single-threaded (restoring the thread count afterwards) so results
    are reproducible across machines with different core counts.
    """
    if iterations < 0:
        raise ValueError(f"iterations must be >= 0, got {iterations}")
    with _torch_threads(1):
        model = build_model(model_name, seed=model_seed, num_classes=dataset.num_classes)
        opt = torch.optim.SGD(
            model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov
        )
        for it in range(iterations):
            idx = global_batch_indices(data_seed, dataset.num_train, global_batch, it)
            x, y = dataset.train_batch(idx)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            log.debug("reference iteration %d loss %.6f", it, loss.item())
        return flat_parameters(model)


def train_reference_batches(
    model_name: str,
    model_seed: int,
    dataset: ArrayDataset,
    batches: list[np.ndarray],
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    lr_scales: list[float] | None = None,
    probe: Callable[[int, torch.nn.Module], None] | None = None,
) -> np.ndarray:
    """One SGD step per batch of sample indices (e.g. the samples each commit applied).

    A commit's update is sum(x_i g_i) / sum(x_i), the mean gradient over the union of its
    workers' samples, so one step on that union is the ground truth for it. ``probe(i, model)``
    is called before step ``i`` (under ``torch.no_grad``), with the parameters that step's
    gradients were meant to be computed on.
    """
    with _torch_threads(1):
        model = build_model(model_name, seed=model_seed, num_classes=dataset.num_classes)
        opt = torch.optim.SGD(
            model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov
        )
        for i, idx in enumerate(batches):
            if lr_scales is not None:
                for group in opt.param_groups:
                    group["lr"] = lr * lr_scales[i]
            if probe is not None:
                with torch.no_grad():
                    probe(i, model)
            x, y = dataset.train_batch(np.asarray(idx))
            opt.zero_grad(set_to_none=True)
            F.cross_entropy(model(x), y).backward()
            opt.step()
        return flat_parameters(model)
