"""Shared fixtures: a process group that is always torn down, with logs shown on failure, and a
job secret with its role files. Every test is marked with its tier, the folder it lives in."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PYTHONPATH", str(ROOT))

from ps_launcher.forked_process import ForkServer, fork_server_if_wanted  # noqa: E402
from ps_launcher.processes import ProcessGroup  # noqa: E402

TIERS = ("unit", "integration", "system")


def pytest_configure(config: pytest.Config) -> None:
    """A SIGTERM to pytest (``timeout``, a CI runner giving up) ends the run as Ctrl-C does, so
    that every fixture's teardown still runs: the ``procs`` fixture's children live in process
    groups of their own, which a signal to pytest alone never reaches."""
    def interrupt(signum: int, frame: object) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, interrupt)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """``-m "not system"`` and ``-m unit`` select by folder (tests/unit, tests/integration,
    tests/system), so a system test needs no marker of its own to be left out."""
    tests = Path(__file__).resolve().parent
    for item in items:
        path = Path(item.path).resolve()
        if path.is_relative_to(tests) and path.relative_to(tests).parts[0] in TIERS:
            item.add_marker(path.relative_to(tests).parts[0])


@pytest.fixture(scope="session")
def fork_server(tmp_path_factory) -> Iterator[Callable[[], ForkServer | None]]:
    """The session's fork server (ps_launcher.fork_server), started again if one dies: each test
    then forks its roles without importing torch again, not even once per test."""
    servers: list[ForkServer] = []

    def live() -> ForkServer | None:
        if not servers or servers[-1].lost:
            server = fork_server_if_wanted(tmp_path_factory.mktemp("fork-server") / "fork-server.log")
            if server is None:
                return None
            servers.append(server)
        return servers[-1]

    yield live
    for s in servers:
        s.close()


@pytest.fixture
def procs(tmp_path, request, fork_server):
    """Start real processes with ``procs.start(role, module, args)``; all are killed afterwards.

    On a failed test the tail of every child's log is printed.
    """
    group = ProcessGroup(tmp_path / "logs", shared_server=fork_server())
    yield group
    group.stop_all(grace_s=3.0)
    rep = getattr(request.node, "rep_call", None)
    if rep is not None and rep.failed:
        for c in group.children:
            print(f"----- {c.role} (rc={c.proc.returncode}) -----\n{c.tail(40)}")


@pytest.fixture
def secrets(tmp_path):
    """A job secret (the master), a file for each client role made from it, and an unrelated master."""
    from ps_common.security import credentials as C

    master = C.generate_master(tmp_path / "job.secret")
    files = {"master": str(tmp_path / "job.secret")}
    for role in ("worker", "evaluator", "operator"):
        C.write_role_secret(tmp_path / f"{role}.secret", master, role)
        files[role] = str(tmp_path / f"{role}.secret")
    C.generate_master(tmp_path / "other.secret")
    files["other"] = str(tmp_path / "other.secret")
    return files


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    rep = outcome.get_result()
    setattr(item, f"rep_{rep.when}", rep)
