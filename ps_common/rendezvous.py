"""Shard 0's endpoint handed over through a file: ``--server file:PATH``, ``--coordinator file:PATH``.

Why: shard 0 binds port 0 and only then knows its endpoint, so a launcher that passes the
endpoint on the command line starts every other process after shard 0 is up. Each process
spends its first 1.5-2 s importing torch and building its model, on its own core or not,
so that order costs a job about one process's start-up. With a file the launcher starts them
all at once: shard 0 writes its endpoint (``ps-server --endpoint-file PATH``, written whole
by a rename) and the others import torch first (most of their start-up), then wait for it
here. On a cluster with a shared file system (Slurm) the same file hands the endpoint from
node to node.

Who starts the processes removes an old file first: a reader cannot tell an earlier run's
endpoint from this one's. Shard 0 removes its own when it ends, so that a process started
later (a container restarted while shard 0 is down) waits for the next shard 0 instead of
dialling a dead endpoint; one killed outright leaves it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ps_common.errors import PsError, UsageError

#: The file in a run directory that launchers hand shard 0's endpoint over in.
ENDPOINT_FILE = "coordinator.endpoint"
#: An endpoint given as ``file:PATH`` is read from PATH once shard 0 has written it.
FILE_PREFIX = "file:"
ENDPOINT_SCHEMES = ("tcp://", "ipc://")


class EndpointNotWritten(PsError, TimeoutError):
    """Shard 0 wrote no endpoint into the file in time (it failed, or writes elsewhere)."""


def endpoint_file(spec: str) -> Path | None:
    """The file of a ``file:PATH`` endpoint, else None (an endpoint itself)."""
    if not spec.startswith(FILE_PREFIX):
        return None
    path = spec[len(FILE_PREFIX):]
    if not path:
        raise UsageError(f"{spec!r}: file: needs a path (file:PATH)")
    return Path(path)


def write_endpoint(path: str | os.PathLike[str], endpoint: str) -> None:
    """Write ``endpoint`` into ``path`` whole: a reader sees the old file, none, or all of it."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(endpoint + "\n")
    tmp.replace(path)


def remove_endpoint(path: str | os.PathLike[str], endpoint: str) -> None:
    """Remove ``path`` if it still holds ``endpoint`` (not a newer shard 0's)."""
    try:
        if Path(path).read_text().strip() == endpoint:
            Path(path).unlink()
    except OSError:
        pass


def resolve_endpoint(spec: str, timeout_s: float, *, poll_s: float = 0.05) -> str:
    """``spec`` itself, or for ``file:PATH`` the endpoint shard 0 writes there, waited for up to
    ``timeout_s`` (``transport.connect_timeout_s``: as long as a worker waits for an
    unreachable coordinator). Raises :class:`EndpointNotWritten` when nothing came in time and
    :class:`~ps_common.errors.UsageError` when what came is not an endpoint, both naming the file."""
    path = endpoint_file(spec)
    if path is None:
        return spec
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            text = path.read_text().strip()
        except FileNotFoundError:
            text = ""
        except OSError as exc:
            raise UsageError(f"cannot read shard 0's endpoint from {path}: {exc}") from None
        if text:
            if not text.startswith(ENDPOINT_SCHEMES) or len(text.split()) != 1:
                raise UsageError(f"{path} holds {text[:80]!r}, not an endpoint (tcp://HOST:PORT or ipc://PATH)")
            return text
        if time.monotonic() >= deadline:
            raise EndpointNotWritten(f"shard 0 wrote no endpoint into {path} within {timeout_s:g} s "
                              "(is it running with --endpoint-file there?)")
        time.sleep(poll_s)
