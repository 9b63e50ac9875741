"""Framework-agnostic batch-size management for LB-BSP (no ZeroMQ inside).

``BatchSizeManager`` is the facade; policies are registered by name in ``BATCH_POLICIES``
(``uniform``, ``fixed``, ``static``, ``lbbsp-cpu``, ``lbbsp-gpu``); the live set is a
``Membership`` (the manager's own, or its owner's: the coordinator's); ``simulation`` holds a
pure timing model for tests and benchmarks. What a worker reports is defined once, in
``ps_common.report``. The built-in policies keep per-worker state in numpy arrays indexed by
worker slot (``slots``) and take an iteration's reports as one batch (``reports``), so a
decision costs about a microsecond per worker (``benchmarks/bench_manager.py``).
"""

from batchsize_manager import lbbsp as _lbbsp  # noqa: F401  (registers static, lbbsp-cpu, lbbsp-gpu)
from batchsize_manager.lbbsp import LBBSPCpuPolicy, LBBSPGpuPolicy, StaticPolicy
from batchsize_manager.manager import BatchSizeManager
from batchsize_manager.membership import Membership
from batchsize_manager.policies import (
    BATCH_POLICIES,
    BatchPolicy,
    get_policy,
    policy_names,
    register_policy,
)
from batchsize_manager.reports import WorkerReport

__all__ = [
    "BATCH_POLICIES",
    "BatchPolicy",
    "BatchSizeManager",
    "LBBSPCpuPolicy",
    "LBBSPGpuPolicy",
    "Membership",
    "StaticPolicy",
    "WorkerReport",
    "get_policy",
    "policy_names",
    "register_policy",
]
