"""Plug-ins that bring LB-BSP batch sizing to other training frameworks.

``batchsize_manager.integrations.torch_ddp`` turns PyTorch DDP (gloo or NCCL) into LB-BSP:
a weighted all-reduce communication hook, a sampler that splits one global sample order by
per-rank batch sizes, and a loop helper that reports timings and receives the next sizes.

The names are re-exported lazily so that importing this package does not import torch.
"""

from __future__ import annotations

import importlib
from typing import Any

_TORCH_DDP_NAMES = (
    "DDPBatchBalancer",
    "LBBSPHelper",
    "LBBSPSampler",
    "WeightedHookState",
    "weighted_allreduce_hook",
)

__all__ = list(_TORCH_DDP_NAMES)


def __getattr__(name: str) -> Any:
    if name in _TORCH_DDP_NAMES:
        module = importlib.import_module("batchsize_manager.integrations.torch_ddp")
        return getattr(module, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
