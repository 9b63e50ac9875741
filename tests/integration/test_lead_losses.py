"""Losses that meet other events inside a real shard 0 (``Lead`` + ``ShardServer``), driven with
forged, well-formed messages: a follower that starts again empty after a worker with a
complete gradient was lost, and a flexrr straggler lost after a helper took its chunks.

Both were found by a review and each wedged or wasted a round before its fix; nothing here
opens a socket to a worker (replies are recorded).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import zmq

from ps_common import protocol as P
from ps_common.security.authenticator import stop_authenticators
from ps_server.router import Refused
from ps_server.server import ShardServer
from tests.cluster_util import in_process_shard_0, write_config


def _job(tmp_path: Path, sync: str, workers: int, global_batch: int) -> Any:
    _, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256, "synthetic_test": 64},
        "training": {"global_batch": global_batch, "max_iterations": 5}, "mode": {"sync": sync},
        "cluster": {"num_shards": 2, "num_workers": workers}, "evaluator": {"enabled": False}})
    return cfg


def _recording(s0: ShardServer) -> list[P.Message]:
    sent: list[P.Message] = []

    def record(_ident: Any, msg: P.Message) -> bool:
        sent.append(msg)
        return True

    s0.router_reply = record  # type: ignore[method-assign]
    s0.role.followers._send = record
    return sent


def _register(s0: ShardServer, registration: str) -> None:
    s0.role._on_register_shard(b"f1", "shard", P.RegisterShard(
        shard=1, endpoint="tcp://127.0.0.1:9", job_digest=s0.job_digest, version=0,
        log_hash=s0.state.log_hash, registration=registration))


def _join(s0: ShardServer, name: str) -> None:
    s0.role._on_join(name.encode(), "worker", P.Join(name=name, instance=name, job_digest=s0.job_digest))


def test_a_follower_that_starts_again_empty_after_a_loss_does_not_wedge_the_round(tmp_path):
    cfg = _job(tmp_path, "bsp", 3, 30)
    with in_process_shard_0(cfg, tmp_path / "run") as s0:
        sent = _recording(s0)
        lead, coord = s0.role, s0.role.coord
        _register(s0, "first")
        for i in range(3):
            _join(s0, f"w{i}")
        token = {m.worker_id: m.token for m in sent if isinstance(m, P.Welcome)}
        n0 = s0.ranges[0][1] - s0.ranges[0][0]

        def push_everywhere(w: int) -> None:
            x = coord.plan[w].batch_size
            s0._on_push(b"w", "worker", P.Push(worker_id=w, token=token[w], iteration=0, batch_size=x,
                                               arrays=[np.zeros(n0, np.float32)]))
            lead._on_have(b"f1", "shard", P.Have(shard=1, entries=[[w, 0, x]],
                                                 rollback_epoch=lead.followers.peers[1].epoch_floor))
            lead.after_messages()

        push_everywhere(2)                    # complete on both shards
        lead.remove_worker(2, "lost (silent)")  # stays in the round: its gradient is complete
        assert 2 in coord.plan
        _register(s0, "second")               # follower 1 started again, empty
        assert 2 not in coord.plan, "nobody can push worker 2's gradient again: not waited for"
        push_everywhere(0)
        push_everywhere(1)
        assert s0.state.version == 1, "the round commits with the two workers left"
        removed = [r for r in _events(tmp_path / "run") if r.get("event") == "worker_removed"]
        assert [r["worker"] for r in removed] == [2], "one removal event for worker 2, not two"


def _events(run_dir: Path) -> list[dict[str, Any]]:
    import json

    path = run_dir / "metrics" / "coordinator.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_flexrr_helpers_push_is_held_by_a_follower_after_the_straggler_it_helped_is_lost(tmp_path):
    cfg = _job(tmp_path, "flexrr", 2, 64)
    with in_process_shard_0(cfg, tmp_path / "run0") as s0:
        sent = _recording(s0)
        lead = s0.role
        _register(s0, "r")
        _join(s0, "w0")
        _join(s0, "w1")
        token = {m.worker_id: m.token for m in sent if isinstance(m, P.Welcome)}
        epoch = [m for m in sent if isinstance(m, P.Registered)][0]
        ctx1 = zmq.Context()                          # its own: one set of credentials per context
        s1 = ShardServer(cfg, 1, coordinator="tcp://127.0.0.1:1", run_dir=tmp_path / "run1", ctx=ctx1)  # link unused
        try:
            s1.role.member_key = epoch.member_key

            def claim() -> P.Chunk:
                return lead._on_take_chunk(b"w0", "worker", P.TakeChunk(worker_id=0, token=token[0], iteration=0))

            owners = [claim().owner for _ in range(11)]     # its 8 own chunks, then 3 of worker 1's
            lead.remove_worker(1, "lost (silent)")
            while (chunk := claim()).ranges:
                owners.append(chunk.owner)
            assert 1 in owners
            x = chunk.batch_size                          # all it was granted, its own and worker 1's
            sent.clear()
            lead._on_shard_sync(b"f1", "shard", P.ShardSync(shard=1, version=0, log_hash=s0.state.log_hash,
                                                            rollback_epoch=epoch.rollback_epoch))
            (plan_msg,) = [m for m in sent if isinstance(m, P.PlanMessage)]
            assert plan_msg.plan.batch_sizes == [32] and plan_msg.plan.total == 64
            s1.role._set_plan(plan_msg.plan)

            def push(k: int, server: ShardServer) -> None:
                n = s0.ranges[k][1] - s0.ranges[k][0]
                server._on_push(b"w0", "worker", P.Push(worker_id=0, token=token[0], iteration=0,
                                                        batch_size=x, arrays=[np.zeros(n, np.float32)]))

            assert x > 32
            push(0, s0)
            try:
                push(1, s1)
            except Refused as exc:  # before the fix: bad_batch, planned 32, the push says 60
                raise AssertionError(f"the follower refused the helper's push: {exc}") from None
        finally:
            s1.close()
            stop_authenticators(ctx1)
            ctx1.destroy(linger=0)
