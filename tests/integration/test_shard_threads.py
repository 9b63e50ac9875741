"""``cluster.shard_threads``: a shard runs its update on that many torch threads, and says so
when the job gives it more threads than the cores it may use (the CPUs it may run on, or its
cgroup's quota), where they would only take turns."""

from __future__ import annotations

import logging
import subprocess
import sys

import torch
import zmq

from ps_common.cgroup_cpu import usable_cores
from ps_server.server import ShardServer
from ps_server.threads import sleep_between_updates
from tests.cluster_util import write_config


def _shard(tmp_path, caplog, threads: int) -> tuple[int, str]:
    """(torch threads after the shard started, the warnings it logged)."""
    _, cfg = write_config(tmp_path / str(threads), {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 64, "synthetic_test": 16},
        "cluster": {"num_shards": 1, "num_workers": 1, "shard_threads": threads},
        "evaluator": {"enabled": False},
    })
    ctx = zmq.Context()
    before = torch.get_num_threads()
    caplog.clear()
    try:
        with caplog.at_level(logging.WARNING, logger="ps_server.server"):
            ShardServer(cfg, 0, port=0, ctx=ctx).close()
        return torch.get_num_threads(), caplog.text
    finally:
        torch.set_num_threads(before)   # this test process's own setting
        ctx.term()


def test_a_shard_warns_when_given_more_threads_than_it_has_cores(tmp_path, caplog):
    cores = usable_cores()
    too_many = int(cores) + 1
    threads, said = _shard(tmp_path, caplog, too_many)
    assert threads == too_many
    assert f"cluster.shard_threads is {too_many} but shard 0 may use {cores:g} cores" in said
    for within in sorted({1, int(cores)}):   # as many as it has cores: nothing to say
        threads, said = _shard(tmp_path, caplog, within)
        assert threads == within and "shard_threads" not in said


def test_shard_threads_sleep_between_updates_unless_the_environment_says_otherwise():
    env: dict[str, str] = {}
    sleep_between_updates(env)
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"OMP_WAIT_POLICY": "ACTIVE"}
    sleep_between_updates(env)
    assert env == {"OMP_WAIT_POLICY": "ACTIVE"}, "a policy the user chose is kept"


def test_ps_server_sets_the_wait_policy_before_torch_is_loaded():
    """The runtime reads OMP_WAIT_POLICY once, when torch loads it: ps-server's module (and what
    it imports) must leave torch unloaded until main() has set the policy."""
    code = ("import sys, ps_server.cli; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", "ps_server.cli imports torch before main() runs"
