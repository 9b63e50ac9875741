"""The heterogeneity lab's real mechanisms (DESIGN.md section 7).

- :mod:`.cgroups`: kernel CPU quotas per worker (a fraction of a core, changeable at run time).
- :mod:`.netns`: hosts in network namespaces on a bridge, with ``tbf`` rate limits and a
  userspace delay relay (:mod:`.delay_relay`; this kernel has no ``netem``).
- :mod:`.ownership`: run ids and owner records, so leftovers of killed runs can be removed.

Everything made here is named ``lbps-<runid>-...`` and is removed by the context managers, also
when their body raises; :func:`cleanup_stale` removes what killed runs left behind.
"""

from __future__ import annotations

from .cgroups import CpuQuotaGroup, Throttling, cpu_quota_available
from .cgroups import cleanup_stale as cleanup_stale_cgroups
from .errors import LabError, LabUnavailable
from .netns import Host, NetLab, delay_available, netns_available
from .netns import cleanup_stale as cleanup_stale_netns
from .ownership import default_run_id, new_run_id


def cleanup_stale(prefix: str = "lbps-") -> list[str]:
    """Remove every cgroup and namespace left by dead runs; returns what was removed."""
    return cleanup_stale_cgroups(prefix) + cleanup_stale_netns(prefix)


__all__ = [
    "CpuQuotaGroup",
    "Host",
    "LabError",
    "LabUnavailable",
    "NetLab",
    "Throttling",
    "cleanup_stale",
    "cleanup_stale_cgroups",
    "cleanup_stale_netns",
    "cpu_quota_available",
    "default_run_id",
    "delay_available",
    "netns_available",
    "new_run_id",
]
