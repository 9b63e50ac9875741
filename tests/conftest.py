"""Shared fixtures: a process group that is always torn down, with logs shown on failure."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTHONPATH", str(ROOT))

from ps_launcher.processes import ProcessGroup  # noqa: E402


@pytest.fixture
def procs(tmp_path, request):
    """Start real processes with ``procs.start(role, module, args)``; all are killed afterwards.

    On a failed test the tail of every child's log is printed.
    """
    group = ProcessGroup(tmp_path / "logs")
    yield group
    group.stop_all(grace_s=3.0)
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for c in group.children:
            print(f"----- {c.role} (rc={c.proc.returncode}) -----\n{c.tail(40)}")


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
