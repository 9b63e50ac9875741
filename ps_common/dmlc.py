"""The dmlc environment contract: start a job the way ps-lite jobs are started.

dmlc-tracker (``dmlc-submit``), the MXNet and BytePS launchers and the Kubernetes operators that
run parameter-server jobs start the same command on every node with its role in the environment:

- ``DMLC_ROLE``: ``scheduler``, ``server`` or ``worker``;
- ``DMLC_PS_ROOT_URI``, ``DMLC_PS_ROOT_PORT``: where the scheduler listens;
- ``DMLC_NUM_SERVER``, ``DMLC_NUM_WORKER``: how many servers and workers the job has;
- ``DMLC_NODE_HOST`` (optional): this node's address, as the others reach it.

Here the scheduler is shard 0 (the coordinator, which also holds a slice of the parameters), the
servers are the follower shards (``cluster.num_shards = DMLC_NUM_SERVER + 1``; each gets its
index from the coordinator when it starts) and the workers join through the scheduler's
address. ``ps-server`` and ``ps-worker`` read these variables when their own flags are absent,
and ``ps-server`` started with ``DMLC_ROLE=worker`` runs a worker, so one command line serves
every role.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Mapping

from ps_common.errors import PsError

ROLES = ("scheduler", "server", "worker")


class DmlcEnvError(PsError, ValueError):
    """The dmlc variables are present but incomplete or malformed."""


@dataclass(frozen=True)
class DmlcEnv:
    role: str
    root_uri: str
    root_port: int
    num_server: int
    num_worker: int
    node_host: str | None = None

    @property
    def coordinator(self) -> str:
        """Shard 0's endpoint: the scheduler's address."""
        return f"tcp://{self.root_uri}:{self.root_port}"

    def overrides(self) -> list[str]:
        """Config settings the contract fixes (``--set`` syntax)."""
        return [f"cluster.num_shards={self.num_server + 1}", f"cluster.num_workers={self.num_worker}"]

    def advertise(self) -> str:
        """This node's address as the others reach it: ``DMLC_NODE_HOST``, else the address of the
        interface that routes to the scheduler (no packet is sent)."""
        if self.node_host:
            return self.node_host
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            try:
                s.connect((self.root_uri, self.root_port or 9))
                return s.getsockname()[0]
            except OSError:
                return socket.gethostname()


def read_dmlc_env(env: Mapping[str, str]) -> DmlcEnv | None:
    """The contract's settings, or None without ``DMLC_ROLE``. Raises :class:`DmlcEnvError`
    naming the variable that is missing or wrong."""
    role = env.get("DMLC_ROLE")
    if not role:
        return None
    if role not in ROLES:
        raise DmlcEnvError(f"DMLC_ROLE={role!r}: expected one of {', '.join(ROLES)}")

    def need(name: str) -> str:
        v = env.get(name, "").strip()
        if not v:
            raise DmlcEnvError(f"DMLC_ROLE={role} but {name} is not set")
        return v

    def count(name: str, low: int) -> int:
        raw = need(name)
        try:
            n = int(raw)
        except ValueError:
            raise DmlcEnvError(f"{name}={raw!r} is not an integer") from None
        if n < low:
            raise DmlcEnvError(f"{name}={n} must be >= {low}")
        return n

    port = count("DMLC_PS_ROOT_PORT", 0 if role == "scheduler" else 1)  # a scheduler may pick one
    if port > 65535:
        raise DmlcEnvError(f"DMLC_PS_ROOT_PORT={port} is not a port")
    return DmlcEnv(role=role, root_uri=need("DMLC_PS_ROOT_URI"), root_port=port,
                   num_server=count("DMLC_NUM_SERVER", 0), num_worker=count("DMLC_NUM_WORKER", 1),
                   node_host=env.get("DMLC_NODE_HOST") or None)
