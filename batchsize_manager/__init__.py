"""Framework-agnostic batch-size management for LB-BSP (no ZeroMQ inside).

``BatchSizeManager`` is the facade; policies are registered by name (``uniform``, ``fixed``,
``static``, ``lbbsp-cpu``, ``lbbsp-gpu``) and ``simulation`` holds a pure timing model for tests
and benchmarks.
"""

from batchsize_manager.policies import (
    BatchPolicy,
    WorkerReport,
    get_policy,
    policy_names,
    register_policy,
)
from batchsize_manager import lbbsp as _lbbsp  # noqa: F401  (registers static, lbbsp-cpu, lbbsp-gpu)
from batchsize_manager.lbbsp import LBBSPCpuPolicy, LBBSPGpuPolicy, StaticPolicy
from batchsize_manager.manager import BatchSizeManager

__all__ = [
    "BatchPolicy",
    "BatchSizeManager",
    "LBBSPCpuPolicy",
    "LBBSPGpuPolicy",
    "StaticPolicy",
    "WorkerReport",
    "get_policy",
    "policy_names",
    "register_policy",
]
