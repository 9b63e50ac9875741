"""A server raises its open-file limit for its workers' connections, and says so when it cannot.

Each case runs in a child process whose limits are lowered first, so this process keeps its own."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest

from ps_common.open_files import BASE_OPEN_FILES, server_open_files

ROOT = Path(__file__).resolve().parents[2]

CHILD = """
import logging, resource, sys
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(levelname)s %(message)s")
from ps_common.open_files import ensure_open_files
got = ensure_open_files(int(sys.argv[1]), "the test")
print(got, resource.getrlimit(resource.RLIMIT_NOFILE)[0])
"""


def run_with_limits(soft: int, hard: int, needed: int) -> tuple[int, int, str]:
    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    out = subprocess.run([sys.executable, "-c", CHILD, str(needed)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, preexec_fn=lower, check=True)
    got, now = (int(x) for x in out.stdout.split())
    return got, now, out.stderr


@pytest.fixture
def hard() -> int:
    h = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if h != resource.RLIM_INFINITY and h < 2048:
        pytest.skip(f"this host's hard open-file limit is {h}: too low to show the raise")
    return 4096 if h == resource.RLIM_INFINITY else min(h, 4096)


def test_a_low_soft_limit_is_raised_to_what_is_needed(hard):
    got, now, err = run_with_limits(128, hard, 1500)
    assert got == now == 1500
    assert "raised from 128 to 1500" in err


def test_a_soft_limit_that_suffices_is_left_alone(hard):
    got, now, err = run_with_limits(1024, hard, 600)
    assert got == now == 1024
    assert "raised" not in err


def test_a_hard_limit_below_the_need_is_used_whole_and_named():
    got, now, err = run_with_limits(128, 512, 5000)
    assert got == now == 512
    assert "needs about 5000 open files" in err and "ulimit -Hn" in err


def test_shard_0_counts_the_heartbeat_connections():
    assert server_open_files(1000, 0) == BASE_OPEN_FILES + 4000
    assert server_open_files(1000, 1) == BASE_OPEN_FILES + 2000
