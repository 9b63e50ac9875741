"""The job config as the servers read it: what ps_common's schema cannot check itself.

``ps_common`` is the bottom layer and knows no model, sync mode or batch policy; their registries
live in ``ps_ml``, here and in ``batchsize_manager``. Whoever loads a config to run servers (``ps-server``,
``ps-launch``, ``ps-compare``) passes :func:`check_job_config` to
:func:`ps_common.config.load_config`, so a bad name still fails at load time, naming the key
and the known names, and so does a setting the chosen mode cannot work with.
"""

from __future__ import annotations

from typing import Any, Mapping

from batchsize_manager import BATCH_POLICIES
from ps_common.config import ConfigError, JobConfig, check_names
from ps_common.registry import Registry
from ps_server.sync import SYNC_POLICIES, sync_policy_for

#: Config keys whose values name an entry of a server-side registry (models: see below).
REGISTERED_NAMES: Mapping[str, Registry[Any]] = {"mode.sync": SYNC_POLICIES, "mode.batch_policy": BATCH_POLICIES}

#: The models ``ps_ml.models`` registers, known here without importing torch (1.5 s of every
#: ps-launch start on the critical path); any other name is checked against the registry itself.
BUILTIN_MODELS = frozenset({"cnn1m", "lenet", "mlp", "mlp10m"})


def check_job_config(cfg: JobConfig, source: str = "config") -> JobConfig:
    """Raise :class:`ConfigError` for an unknown model, sync mode or batch policy, or mode settings the
    sync policy refuses (backup: b < N); return ``cfg``."""
    registries = dict(REGISTERED_NAMES)
    if cfg.model.name not in BUILTIN_MODELS:
        from ps_ml.models import MODEL_REGISTRY

        registries["model.name"] = MODEL_REGISTRY
    check_names(cfg, registries, source=source)
    try:
        sync_policy_for(cfg)
    except ValueError as exc:
        raise ConfigError(f"invalid configuration ({source}):\n  {exc}") from None
    return cfg
