"""Atomic shard checkpoints: parameters, optimizer state, version and (shard 0) the coordinator.

One ``.npz`` file per shard and version, written to a temporary file in the same directory,
fsynced, then renamed over the final name (and the directory fsynced), so a crash leaves
either the old or the new checkpoint, never a torn one. Metadata travels as JSON bytes inside
the archive; loading never unpickles anything.
"""

from __future__ import annotations

import json
import logging
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ps_common.errors import PsError
from ps_common.timeouts import DEFAULT_TIMEOUTS, Timeouts

log = logging.getLogger(__name__)

_NAME = re.compile(r"^shard-(\d+)-v(\d+)\.npz$")


class CheckpointError(PsError, RuntimeError):
    pass


def checkpoint_path(directory: Path, shard: int, version: int) -> Path:
    return Path(directory) / f"shard-{shard}-v{version:09d}.npz"


def save_checkpoint(directory: str | Path, shard: int, version: int, arrays: dict[str, np.ndarray],
                    meta: dict[str, Any], keep: int = 3) -> Path:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(directory, shard, version)
    tmp = final.with_name(final.name + ".tmp")
    payload = {**arrays, "__meta__": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
    with open(tmp, "wb") as fh:
        np.savez(fh, **payload)  # type: ignore[arg-type]  # numpy's stub reads **kwds as its bool flag
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, final)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    for _, old in list_checkpoints(directory, shard)[:-keep] if keep > 0 else []:
        old.unlink(missing_ok=True)
    return final


def list_checkpoints(directory: str | Path, shard: int) -> list[tuple[int, Path]]:
    """(version, path) of this shard's checkpoints, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    out = []
    for p in directory.iterdir():
        m = _NAME.match(p.name)
        if m and int(m.group(1)) == shard:
            out.append((int(m.group(2)), p))
    return sorted(out)


def load_checkpoint(path: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    try:
        with np.load(path, allow_pickle=False) as z:
            arrays = {k: z[k] for k in z.files if k != "__meta__"}
            meta = json.loads(bytes(z["__meta__"]).decode())
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None
    return arrays, meta


def checkpoint_meta(path: str | Path) -> dict[str, Any]:
    """Only the metadata of a checkpoint (no arrays are read)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            return json.loads(bytes(z["__meta__"]).decode())
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from None


def checkpoint_hashes(directory: str | Path, shard: int) -> list[tuple[int, str]]:
    """(version, log hash) of this shard's readable checkpoints, oldest first: which history
    each holds (two shards' checkpoints at one version with one hash hold the same state)."""
    out = []
    for v, path in list_checkpoints(directory, shard):
        try:
            out.append((v, str(checkpoint_meta(path).get("log_hash", ""))))
        except CheckpointError as exc:
            log.warning("%s", exc)
    return out


def drop_checkpoints_after(directory: str | Path, shard: int, version: int) -> list[int]:
    """Delete this shard's checkpoints above ``version``; the versions deleted. After a rollback to
    ``version`` they hold the abandoned history, and a later ``--resume`` (which takes the
    newest file) must not load one of them."""
    dropped = []
    for v, path in list_checkpoints(directory, shard):
        if v > version:
            path.unlink(missing_ok=True)
            dropped.append(v)
    return dropped


def find_checkpoint(directory: str | Path, shard: int, version: int | None = None) -> Path:
    """The newest checkpoint of ``shard`` (or the one at ``version``)."""
    found = list_checkpoints(directory, shard)
    if version is not None:
        found = [(v, p) for v, p in found if v == version]
    if not found:
        what = "any version" if version is None else f"version {version}"
        raise CheckpointError(f"no checkpoint of shard {shard} at {what} in {directory}")
    return found[-1][1]


class CheckpointWriter:
    """Writes checkpoints on a thread of its own, so an fsync never stalls the message loop.

    The arrays handed over must not change afterwards (parameters are replaced, never mutated;
    the shard copies its momentum buffer). Writes happen in order; ``flush`` waits for them.
    """

    def __init__(self, directory: str | Path, shard: int, keep: int) -> None:
        import queue
        import threading

        self.directory = Path(directory)
        self.shard = shard
        self.keep = keep
        self.written: list[Path] = []
        self.errors: list[str] = []
        self._queue: "queue.Queue[tuple[int, dict, dict] | None]" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name=f"checkpoints-{shard}", daemon=True)
        self._thread.start()

    def submit(self, version: int, arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
        self._queue.put((version, arrays, meta))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            try:
                if job is None:
                    return
                version, arrays, meta = job
                try:
                    self.written.append(save_checkpoint(self.directory, self.shard, version, arrays, meta,
                                                        keep=self.keep))
                except Exception as exc:  # the thread must outlive any failed write, or flush() waits forever
                    self.errors.append(f"version {version}: {exc}")
                    log.error("shard %d: checkpoint of version %d not written: %s", self.shard, version, exc)
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every submitted checkpoint is on disk."""
        self._queue.join()

    def close(self, timeouts: Timeouts = DEFAULT_TIMEOUTS) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeouts.checkpoint_close_s)
        if self._thread.is_alive():
            log.warning("shard %d: checkpoint writes still running after %.0f s; exiting without them",
                        self.shard, timeouts.checkpoint_close_s)
