"""Framework-agnostic batch-size management for LB-BSP (no ZeroMQ inside)."""

from batchsize_manager.policies import (
    BatchPolicy,
    WorkerReport,
    get_policy,
    policy_names,
    register_policy,
)

__all__ = ["BatchPolicy", "WorkerReport", "get_policy", "policy_names", "register_policy"]
