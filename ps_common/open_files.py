"""Room for a connection per worker: the process's open-file limit, raised before it is needed.

Every worker keeps a TCP connection to every shard, and a second one to shard 0 for its
heartbeat, each an open file in the server. Many Linux hosts start processes with a soft limit
of 1,024 open files, and a server that runs out does not fail loudly: ZeroMQ's I/O thread cannot
accept the next connection, and those workers' joins time out. The soft limit may be raised up
to the hard one without privileges, as Ray, nginx and Redis do at start.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)

#: Open files a server needs besides its workers' connections: its sockets' internals, the
#: followers, the evaluator, tools, metrics and checkpoint files.
BASE_OPEN_FILES = 256


def open_files_for(connections: int) -> int:
    """Open files for ``connections`` peers, twice over (peers that join later, reconnects)."""
    return BASE_OPEN_FILES + 2 * connections


def server_open_files(num_workers: int, shard: int) -> int:
    """Open files a shard needs for ``num_workers`` workers: a connection each, two on shard 0
    (the heartbeat has its own)."""
    return open_files_for(num_workers * (2 if shard == 0 else 1))


def ensure_open_files(needed: int, what: str) -> int:
    """Raise this process's soft open-file limit to at least ``needed`` (up to the hard limit)
    and return the limit now in force (``needed`` when unlimited); warns when the hard limit
    is lower than ``needed``. Returns -1 where the platform has no such limit."""
    try:
        import resource
    except ImportError:  # not a POSIX system
        return -1
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= needed:
        return needed if soft == resource.RLIM_INFINITY else soft
    target = needed if hard == resource.RLIM_INFINITY else min(hard, needed)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        log.warning("%s needs about %d open files and may open %d; raising the limit failed (%s)",
                    what, needed, soft, exc)
        return soft
    if target < needed:
        log.warning("%s needs about %d open files, and this process may open at most %d (the hard "
                    "limit, `ulimit -Hn`): raise it (limits.conf, systemd LimitNOFILE, the container's "
                    "ulimits), or workers beyond that will fail to join", what, needed, target)
    else:
        log.info("open-file limit raised from %d to %d for %s", soft, target, what)
    return target
