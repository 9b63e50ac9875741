"""The README's multi-host instructions, run as written, on hosts made of network namespaces.

Five hosts on one bridge: A (shard 0), B (shard 1), C and D (workers), E (the evaluator). The
command lines are taken from the README's "By hand, across hosts" block and run with hostA and
hostB replaced by the hosts' addresses; once with the job secret, as the block says, and once
with CURVE: the keys made with ``ps-keys generate`` as the README describes, the README's
``security:`` block as the config's, each client's own key from the environment. Every process
must exit by itself at the stop rule, both shards at one final version, the evaluator having
measured it. The lab removes every namespace afterwards, also when the test fails.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.cluster_util import consistent_end, wait_exit

pytestmark = pytest.mark.system

ROOT = Path(__file__).resolve().parents[2]
MODULES = {"ps-server": "ps_server.cli", "ps-worker": "ps_worker.cli", "ps-evaluator": "ps_worker.evaluator_cli",
           "ps-keys": "ps_launcher.keys_cli"}
JOB = {"run": {"name": "multihost", "seed": 1}, "model": {"name": "mlp"},
       "data": {"dataset": "synthetic", "synthetic_train": 1024, "synthetic_test": 256},
       "training": {"global_batch": 64, "max_iterations": 40, "finish_timeout_s": 30},
       "cluster": {"num_shards": 2, "num_workers": 2},
       "evaluator": {"every_iterations": 20, "nice": 0},
       "heartbeat": {"interval_s": 0.3, "timeout_s": 10}, "transport": {"connect_timeout_s": 60}}


def readme_section(heading: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(heading)
    nxt = text.find("\n## ", start + len(heading))
    return text[start: nxt if nxt > 0 else len(text)]


def readme_commands() -> list[str]:
    block = re.search(r"```bash\n(.*?)```", readme_section("### By hand, across hosts"), re.S).group(1)
    return [line.strip() for line in block.splitlines() if line.strip().startswith("ps-")]


def readme_security_block() -> dict:
    block = re.search(r"```yaml\n(.*?)```", readme_section("### By hand, across hosts"), re.S).group(1)
    return yaml.safe_load(block)["security"]


def run_line(line: str, hosts: dict[str, str]) -> tuple[str, list[str]]:
    """(module, args) of a README line with hostA/hostB replaced by addresses."""
    for name, ip in hosts.items():
        line = line.replace(name, ip)
    argv = shlex.split(line)
    return MODULES[argv[0]], argv[1:]


def without_secret(args: list[str]) -> list[str]:
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a == "--secret-file":
            skip = True
        else:
            out.append(a)
    return out


@pytest.fixture
def lab():
    from ps_launcher.lab import NetLab, netns_available

    reason = netns_available()
    if reason:
        pytest.skip(f"network namespaces unavailable: {reason}")
    with NetLab() as lab:
        yield lab


@pytest.mark.timeout(300)
@pytest.mark.parametrize("curve", [False, True], ids=["job-secret", "curve"])
def test_the_readme_multi_host_instructions_work_as_written(procs, tmp_path, lab, curve):
    lines = readme_commands()
    assert [ln.split()[0] for ln in lines] == ["ps-server", "ps-keys", "ps-keys", "ps-server", "ps-worker",
                                               "ps-evaluator"], "the README's block changed: update this test"
    hosts = {h: lab.add_host(h) for h in "abcde"}
    addr = {"hostA": hosts["a"].ip, "hostB": hosts["b"].ip}
    job = dict(JOB)
    env: dict[str, dict[str, str]] = {h: {} for h in "abcde"}
    if curve:
        keys = tmp_path / "keys"
        (keys / "allowed").mkdir(parents=True)
        clients = {"c": "worker-hostC", "d": "worker-hostD", "e": "evaluator-hostE"}
        for name in ["server", *clients.values()]:
            out = subprocess.run([sys.executable, "-m", "ps_launcher.keys_cli", "generate", str(keys), name],
                                 capture_output=True, text=True, timeout=60)
            assert out.returncode == 0, out.stderr
        for name in clients.values():
            shutil.copy(keys / f"{name}.key", keys / "allowed" / f"{name}.key")
        job["security"] = readme_security_block()           # keys/... beside job.yaml
        for h, name in clients.items():                      # "this host's client key" per host
            env[h]["LBBSP__SECURITY__CLIENT_SECRET_KEY"] = str(keys / f"{name}.key_secret")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))

    def start(role: str, host: str, line: str):
        module, args = run_line(line, addr)
        if curve:
            args = without_secret(args)
        return procs.start(role, module, args, env=env[host], prefix=hosts[host].exec([]), cwd=tmp_path)

    shard0 = start("shard-0", "a", lines[0])
    procs.wait_endpoint(shard0, 60)
    if not curve:                                            # the two ps-keys lines, on host A
        for i in (1, 2):
            module, args = run_line(lines[i], addr)
            out = subprocess.run([sys.executable, "-m", module, *args], cwd=tmp_path, capture_output=True,
                                 text=True, timeout=60)
            assert out.returncode == 0, out.stderr
    shard1 = start("shard-1", "b", lines[3])
    procs.wait_endpoint(shard1, 60)
    workers = [start("worker-c", "c", lines[4]), start("worker-d", "d", lines[4])]
    evaluator = start("evaluator", "e", lines[5])
    wait_exit([*workers, evaluator, shard0, shard1], timeout_s=240)
    for ch in (*workers, evaluator, shard0, shard1):
        assert ch.proc.returncode == 0, ch.tail()
    params, version = consistent_end(tmp_path / "run", 2)
    assert version == JOB["training"]["max_iterations"]
    evals = [json.loads(ln) for ln in (tmp_path / "run" / "metrics" / "evaluator.jsonl").read_text().splitlines()]
    assert version in [e["version"] for e in evals], "the evaluator measured the final version"
    if curve:  # the servers only ever accepted CURVE: a plain client cannot get an answer
        assert "WITHOUT CURVE" not in shard0.tail()
    procs.stop_all(grace_s=2.0)  # nothing may outlive the lab's namespaces
