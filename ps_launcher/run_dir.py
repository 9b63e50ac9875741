"""One run per run directory: a second run into a directory that holds one is refused.

Metrics files are appended to, so a second run into the same directory would mix two runs'
records, and the summary would add up both runs' worker iterations against one coordinator's
count. ``--overwrite`` replaces a previous run; it removes only what a run writes, and refuses
a directory that holds anything else (it may not be a run directory at all).
"""

from __future__ import annotations

import shutil
from pathlib import Path

from ps_common.errors import PsError

#: What ``ps-launch`` and the processes it starts write into a run directory.
RUN_ENTRIES = frozenset({"config.yaml", "final", "logs", "metrics", "secrets", "checkpoints",
                         "summary.json", "summary.md", "accuracy.png", "workers.png", "lab",
                         "job.secret",                         # Slurm runs
                         "coordinator.endpoint", "coordinator.endpoint.tmp"})  # ps_common.rendezvous


def _is_run_entry(name: str) -> bool:
    return name in RUN_ENTRIES or (name.startswith("slurm-") and name.endswith(".out"))


class RunDirInUse(PsError, RuntimeError):
    """The run directory holds a previous run (or other files)."""


def prepare_run_dir(run_dir: Path, overwrite: bool = False) -> None:
    """Make ``run_dir`` ready for a new run: created if missing; refused if it holds anything,
    unless ``overwrite`` and everything in it is a run's output, which is then removed."""
    run_dir = Path(run_dir)
    entries = sorted(p.name for p in run_dir.iterdir()) if run_dir.exists() else []
    if entries:
        if not overwrite:
            raise RunDirInUse(f"run directory {run_dir} already holds a run ({', '.join(entries[:6])}"
                              f"{', ...' if len(entries) > 6 else ''}): choose another, or pass "
                              "--overwrite to replace it")
        foreign = [e for e in entries if not _is_run_entry(e)]
        if foreign:
            raise RunDirInUse(f"run directory {run_dir} holds files a run does not write "
                              f"({', '.join(foreign[:6])}); not overwriting it")
        for e in entries:
            path = run_dir / e
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
    run_dir.mkdir(parents=True, exist_ok=True)
