"""Processes started by hand keep one run per run directory: a shard or worker refuses a
metrics file that holds an earlier run's records (the summary would add both runs up), unless
the run goes on (``--resume``) or the user replaces it (``--overwrite``)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import zmq

from ps_common.metrics import MetricsInUse, MetricsWriter, read_jsonl
from ps_server.server import ShardServer
from ps_worker.worker import Worker
from tests.cluster_util import write_config

ITERATIONS = 6


def test_a_metrics_writer_appends_refuses_or_replaces(tmp_path):
    path = tmp_path / "m" / "x.jsonl"
    MetricsWriter(path).write(a=1)
    MetricsWriter(path, "append").write(a=2)
    assert [r["a"] for r in read_jsonl(path)] == [1, 2]
    with pytest.raises(MetricsInUse, match="--overwrite"):
        MetricsWriter(path, "refuse")
    assert [r["a"] for r in read_jsonl(path)] == [1, 2], "a refusal loses nothing"
    MetricsWriter(path, "replace").write(a=3)
    assert [r["a"] for r in read_jsonl(path)] == [3]
    (tmp_path / "empty.jsonl").touch()
    MetricsWriter(tmp_path / "empty.jsonl", "refuse").write(a=4)  # an empty file holds no run


def _job(tmp_path: Path, name: str):
    _, cfg = write_config(tmp_path / name, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256, "synthetic_test": 64},
        "training": {"global_batch": 32, "max_iterations": ITERATIONS},
        "cluster": {"num_shards": 1, "num_workers": 1}, "evaluator": {"enabled": False},
    })
    return cfg


def _serve(server: ShardServer) -> threading.Thread:
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    return t


def test_hand_started_roles_refuse_an_earlier_runs_records(tmp_path):
    ctx = zmq.Context.instance()
    for name in "abc":
        (tmp_path / name).mkdir()
    shard_dir, worker_dir = tmp_path / "shard-run", tmp_path / "worker-run"
    cfg = _job(tmp_path, "a")
    first = ShardServer(cfg, 0, ctx=ctx, run_dir=shard_dir)
    t = _serve(first)
    try:
        assert Worker(cfg, first.endpoint, name="w", ctx=ctx, run_dir=worker_dir).run() == ITERATIONS
    finally:
        first.stop_event.set()
        t.join(timeout=30)
    shard_records = (shard_dir / "metrics" / "shard-0.jsonl").read_bytes()

    with pytest.raises(MetricsInUse, match="shard-0.jsonl"):
        ShardServer(cfg, 0, ctx=ctx, run_dir=shard_dir)
    assert (shard_dir / "metrics" / "shard-0.jsonl").read_bytes() == shard_records, "nothing lost"

    # A second job replaces the first job's worker records when asked to...
    second = ShardServer(_job(tmp_path, "b"), 0, ctx=ctx, run_dir=tmp_path / "second-run")
    t = _serve(second)
    try:
        w = Worker(second.cfg, second.endpoint, name="w", ctx=ctx, run_dir=worker_dir, overwrite=True)
        assert w.run() == ITERATIONS and w.worker_id == 0
    finally:
        second.stop_event.set()
        t.join(timeout=30)
    mine = [r for r in read_jsonl(worker_dir / "metrics" / "worker-0.jsonl") if "iteration" in r]
    assert len(mine) == ITERATIONS, "the replaced file holds one run's iterations"

    # ... and a third one's worker, not asked, joins (only then does it know its id), finds
    # worker-0.jsonl taken and leaves at once, so that no barrier waits for it.
    third = ShardServer(_job(tmp_path, "c"), 0, ctx=ctx, run_dir=tmp_path / "third-run")
    t = _serve(third)
    try:
        with pytest.raises(MetricsInUse, match="worker-0.jsonl"):
            Worker(third.cfg, third.endpoint, name="w", ctx=ctx, run_dir=worker_dir).run()
        assert not third.role.coord.members.records, "the refused worker left the job"
    finally:
        third.stop_event.set()
        t.join(timeout=30)
    assert len([r for r in read_jsonl(worker_dir / "metrics" / "worker-0.jsonl") if "iteration" in r]) == ITERATIONS

    again = ShardServer(cfg, 0, ctx=ctx, run_dir=shard_dir, overwrite=True)
    again.close()
    assert (shard_dir / "metrics" / "shard-0.jsonl").read_bytes() != shard_records
