"""System tests through the real CLIs: separate processes, real sockets on loopback.

The invariant: BSP training with 2 shards and 3 workers, with weighted aggregation, ends with
the same parameters as one process doing SGD with the global batch over the same samples in
the same order, for uniform and uneven per-worker batch sizes.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from ps_common.metrics import read_jsonl
from ps_ml.datasets import load_dataset, sample_order
from ps_ml.reference import train_reference
from tests.cluster_util import consistent_end, start_job, start_servers, start_workers, status, wait_exit, write_config

pytestmark = pytest.mark.system

ITERATIONS = 24
JOB = {
    "run": {"name": "invariant", "seed": 11},
    "model": {"name": "lenet"},
    "data": {"dataset": "synthetic", "synthetic_train": 500, "synthetic_test": 200},
    # 100 is not divisible by 3 and 24 x 100 samples cross 4 epoch boundaries of 500.
    "training": {"global_batch": 100, "max_iterations": ITERATIONS},
    "optimizer": {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-4, "nesterov": False},
    "cluster": {"num_shards": 2, "num_workers": 3},
    "evaluator": {"enabled": False},
}


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


PLAN_DELAY = {"LBBSP_FAULTS": '{"plan_delay": {"shard": 1, "seconds": 0.03}}'}


@pytest.mark.parametrize("policy, args, env", [
    ("uniform", {}, None), ("fixed", {"weights": [1, 3, 6]}, None),
    # Shard 1 takes every plan into account 30 ms late: the workers' pushes get there first, are
    # refused with plan_pending, and are sent again; nothing is lost or applied twice.
    ("uniform", {}, PLAN_DELAY)], ids=["uniform", "fixed", "uniform-plans-late"])
def test_bsp_equals_single_process_sgd(procs, tmp_path, policy, args, env):
    job = {**JOB, "mode": {"sync": "bsp", "batch_policy": policy, "batch_policy_args": args}}
    if policy == "fixed":  # shards that split their update over three threads end the same,
        job["cluster"] = {**JOB["cluster"], "shard_threads": 3}
        job["transport"] = {"params_part_bytes": 8192}  # and send each new slice in parts
    cfg_path, cfg = write_config(tmp_path, job)
    run_dir = tmp_path / "run"
    eps, workers = start_job(procs, cfg_path, 2, 3, run_dir, env=env)
    wait_exit(workers, timeout_s=180)
    # Every process ends by itself once the stop rule is met, the shards after saving the final
    # version, which must be the same on both.
    wait_exit([c for c in procs.children if c.role.startswith("shard")], timeout_s=60)
    params, version = consistent_end(run_dir, 2)
    assert version == ITERATIONS
    data = load_dataset("synthetic", seed=11, synthetic_train=500, synthetic_test=200)
    ref = train_reference("lenet", 11, data, 11, 100, ITERATIONS, lr=0.05, momentum=0.9, weight_decay=1e-4)
    init = train_reference("lenet", 11, data, 11, 100, 0, lr=0.05)
    assert rel_err(params, init) > 1e-2, "training must have moved the parameters"
    assert rel_err(params, ref) < 1e-5, f"PS result differs from single-process SGD: {rel_err(params, ref):.2e}"
    shutdown = [[r for r in read_jsonl(run_dir / "metrics" / f"shard-{k}.jsonl") if r.get("event") == "shutdown"][-1]
                for k in range(2)]
    for rec in shutdown:  # each shard ran its update on the threads the job gave it (3 is no default)
        assert rec["torch_threads"] == (3 if policy == "fixed" else 1), rec
        # ps-server lets the update threads sleep between updates, unless the environment chose
        assert rec["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
        answers, sent = ITERATIONS * 3 + 3, rec["timings"]["send.params"]["n"]  # and the first pulls
        assert sent >= answers * 4 if policy == "fixed" else answers <= sent < 2 * answers, (sent, answers)
    if env is not None:
        refused = shutdown[1]["counters"].get("refused.plan_pending", 0)
        assert refused > 0, f"no push reached shard 1 before its plan: {shutdown[1]['counters']}"
        print(f"\nshard 1 refused {refused} pushes with plan_pending; the workers sent them again")

    # The coordinator's assignment log: batch sizes as the policy says, samples exactly once per epoch.
    recs = [r for r in read_jsonl(run_dir / "metrics" / "coordinator.jsonl") if "event" not in r]
    assert [r["iteration"] for r in recs] == list(range(ITERATIONS))
    expected = {"uniform": {"0": 34, "1": 33, "2": 33}, "fixed": {"0": 10, "1": 30, "2": 60}}[policy]
    seen: dict[int, list[int]] = {}
    stream = []
    for r in recs:
        assert r["batch_sizes"] == expected
        for w in sorted(r["ranges"], key=int):
            for e, a, b in r["ranges"][w]:
                stream.append((e, a, b))
                seen.setdefault(e, []).extend(sample_order(11, e, 500)[a:b].tolist())
    for e in range(ITERATIONS * 100 // 500):
        assert sorted(seen[e]) == list(range(500)), f"epoch {e}: a sample missing or repeated"
    # Workers logged the batch sizes they trained on.
    for w, x in expected.items():
        wrecs = list(read_jsonl(run_dir / "metrics" / f"worker-{w}.jsonl"))
        assert len(wrecs) == ITERATIONS and all(r["batch_size"] == x for r in wrecs)
        assert all(r["compute_s"] > 0 and r["rss_mb"] > 0 for r in wrecs)


def test_worker_with_different_config_is_refused(procs, tmp_path):
    job = {**JOB, "cluster": {"num_shards": 1, "num_workers": 1}}
    cfg_path, cfg = write_config(tmp_path, job)
    eps = start_servers(procs, cfg_path, 1, tmp_path / "run")
    bad = tmp_path / "other.yaml"
    bad.write_text(cfg_path.read_text().replace("0.05", "0.07"))
    (w,) = start_workers(procs, bad, eps[0], 1, tmp_path / "run")
    assert w.proc.wait(timeout=60) == 2
    assert "config_mismatch" in w.tail() and "digest" in w.tail()
    assert status(eps[0]).workers == 0
