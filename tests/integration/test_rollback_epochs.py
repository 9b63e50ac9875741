"""Rollbacks between shard 0 and a follower, with a real shard 0 in this process and the
follower's messages well-formed but written by hand (what a follower sends at the worst moment):

- a beat (ShardSync) the follower sent before a Rollback reached it carries the abandoned
  history's version; it must not be taken for a follower ahead of shard 0 (a second rollback);
- a Rollback lost with a dropped connection is sent again, and one a follower applied already
  (or an older one) is not applied twice;
- a resumed follower goes back to the newest checkpoint both hold *of one history*, and a
  follower never restores a checkpoint whose history is not shard 0's.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.security.authenticator import stop_authenticators
from ps_common.timeouts import DEFAULT_TIMEOUTS
from ps_common.transport import Connection, make_router, send
from ps_server.checkpoint import CheckpointError, checkpoint_path, load_checkpoint
from ps_server.coordinator import member_token
from ps_server.follow import MAX_RECOVERIES
from ps_server.router import Refused
from ps_server.server import ShardServer
from tests.cluster_util import in_process_shard_0, read_jsonl, small_checkpointing_job, write_config

Sent = list[tuple[bytes, P.Message]]
KEY = "00" * 16   # the member key a hand-driven coordinator gives its follower


def _recording(server: ShardServer) -> Sent:
    """Every message shard 0 sends from now on (to a follower or as a reply), with the
    connection it goes to."""
    sent: Sent = []

    def record(ident: bytes, msg: P.Message) -> bool:
        sent.append((ident, msg))
        return True
    server.router_reply = record                 # type: ignore[method-assign]
    server.role.followers._send = record
    return sent


def _rollbacks(sent: Sent) -> list[tuple[bytes, P.Rollback]]:
    return [(i, m) for i, m in sent if isinstance(m, P.Rollback)]


def _checkpoints(server: ShardServer, histories: dict[int, str]) -> None:
    """Shard 0's checkpoints at these versions, each written with this log hash."""
    for v, h in sorted(histories.items()):
        server.state.version, server.state.log_hash = v, h
        server.write_checkpoint()
    server.checkpointer.flush()


def _register(server: ShardServer, shard: int = 1, ident: bytes | None = None, **kw) -> tuple[P.Registered, Sent]:
    """Follower ``shard`` registers (its connection is named after it unless ``ident`` names it);
    shard 0's reply, and everything it sent."""
    sent = _recording(server)
    server.role._on_register_shard(ident or f"follower-{shard}".encode(), "shard", P.RegisterShard(
        shard=shard, endpoint=f"tcp://127.0.0.1:{9 + shard}", job_digest=server.job_digest, **kw))
    (reg,) = [m for _, m in sent if isinstance(m, P.Registered)]
    return reg, sent


def _sync(server: ShardServer, shard: int = 1, **kw) -> None:
    server.role._on_shard_sync(f"follower-{shard}".encode(), "shard", P.ShardSync(shard=shard, **kw))


def test_a_beat_sent_before_the_rollback_arrived_does_not_roll_the_job_back_again(tmp_path):
    cfg = small_checkpointing_job(tmp_path, num_shards=2)
    with in_process_shard_0(cfg, tmp_path / "run") as s0:
        reg, _ = _register(s0, version=0, log_hash=s0.state.log_hash)
        e = reg.rollback_epoch
        _checkpoints(s0, {10: "a10", 20: "a20"})
        s0.state.version, s0.state.log_hash = 30, "a30"
        sent = _recording(s0)
        s0.role.rollback_all(10, "a follower diverged")
        ((_, rb),) = _rollbacks(sent)
        assert (rb.version, rb.log_hash, rb.epoch) == (10, "a10", e + 1)

        _sync(s0, version=30, log_hash="a30", rollback_epoch=e)   # in flight when shard 0 rolled back
        assert s0.role.rollback_epoch == e + 1 and s0.state.version == 10, "a second rollback"
        assert len(_rollbacks(sent)) == 1

        _sync(s0, version=10, log_hash="a10", rollback_epoch=e + 1)   # the follower applied it
        assert s0.role.rollback_epoch == e + 1 and s0.state.version == 10
        assert len(_rollbacks(sent)) == 1


def test_a_rollback_lost_on_the_way_is_sent_again_to_that_follower_only(tmp_path):
    cfg = small_checkpointing_job(tmp_path, num_shards=3)
    with in_process_shard_0(cfg, tmp_path / "run") as s0:
        reg, _ = _register(s0, 1, version=0, log_hash=s0.state.log_hash)
        _register(s0, 2, version=0, log_hash=s0.state.log_hash)
        e = reg.rollback_epoch
        _checkpoints(s0, {10: "a10"})
        s0.state.version = 12
        s0.role.rollback_all(10, "a follower diverged")
        sent = _recording(s0)
        _sync(s0, 2, version=10, log_hash="a10", rollback_epoch=e + 1)    # follower 2 applied it
        _sync(s0, 1, version=12, log_hash="a12", rollback_epoch=e)
        assert not _rollbacks(sent), "one beat late: still in flight"
        counters = dict(s0.role.coord.counters)
        s0.role._on_have(b"follower-1", "shard", P.Have(shard=1, entries=[[5, 3, 16]], rollback_epoch=e))
        counters["have.behind_rollback"] = counters.get("have.behind_rollback", 0) + 1
        assert dict(s0.role.coord.counters) == counters, "gradients held before the Rollback were taken"
        peer = s0.role.followers.peers[1]
        peer.behind_since = time.monotonic() - 3 * cfg.transport.shard_sync_s
        s0.role._on_shard_sync(b"follower-1-reconnected", "shard", P.ShardSync(   # its connection dropped
            shard=1, version=12, log_hash="a12", rollback_epoch=e))
        ((to, again),) = _rollbacks(sent)
        assert to == b"follower-1-reconnected", "sent again where the behind beat came from"
        assert (again.version, again.log_hash, again.epoch) == (10, "a10", e + 1)
        assert peer.ident == b"follower-1", "a behind beat redirected shard 0's replies"
        assert s0.role.rollback_epoch == e + 1, "no new rollback"
        _sync(s0, 1, version=10, log_hash="a10", rollback_epoch=e + 1)
        assert peer.behind_since is None, "applied: no longer behind"


def test_a_resumed_follower_goes_back_to_the_newest_checkpoint_of_shard_0s_history(tmp_path):
    # The follower crashed before a rollback to 10 reached it, so it still holds the abandoned
    # history's 20 and 30; shard 0 went on and wrote its own 20.
    cfg = small_checkpointing_job(tmp_path, num_shards=3)
    with in_process_shard_0(cfg, tmp_path / "run") as s0:
        _checkpoints(s0, {10: "a10", 20: "b20"})
        s0.state.version, s0.state.log_hash = 24, "b24"
        other, _ = _register(s0, 2, version=24, log_hash="b24")
        reg, sent = _register(s0, version=30, log_hash="a30", resumed=True,
                              checkpoint_versions=[10, 20, 30], checkpoint_hashes=["a10", "a20", "a30"])
        assert s0.state.version == 10, "shard 0 went back to 10, not to its 20 of another history"
        (to_other, to_it) = _rollbacks(sent)
        assert to_other[0] == b"follower-2" and to_it[0] == b"follower-1"
        assert (to_other[1].version, to_other[1].log_hash) == (to_it[1].version, to_it[1].log_hash) == (10, "a10")
        assert other.rollback_epoch < to_other[1].epoch == reg.rollback_epoch < to_it[1].epoch, \
            "each newer than what its follower applied: both apply theirs"

        epoch = s0.role.rollback_epoch
        with pytest.raises(Refused, match="of the history") as refused:   # nothing in common
            _register(s0, version=30, log_hash="c30", resumed=True,
                      checkpoint_versions=[10, 30], checkpoint_hashes=["c10", "c30"])
        assert refused.value.code == "no_common_checkpoint"
        assert s0.state.version == 10 and s0.role.rollback_epoch == epoch, "a refusal changes nothing"


def test_a_resumed_follower_at_the_common_version_goes_back_to_its_checkpoint_if_its_memory_differs(tmp_path):
    """A follower that could not restore a Rollback's version registers as resumed at its own
    version with the history it holds in memory: where that version is the common checkpoint,
    shard 0 still sends it back to it unless the hashes agree."""
    cfg = small_checkpointing_job(tmp_path, num_shards=3)
    with in_process_shard_0(cfg, tmp_path / "run") as s0:
        _checkpoints(s0, {10: "a10"})
        s0.state.version, s0.state.log_hash = 12, "a12"
        _, sent = _register(s0, 1, version=10, log_hash="a10", resumed=True,
                            checkpoint_versions=[10], checkpoint_hashes=["a10"])
        assert s0.state.version == 10 and not [i for i, _ in _rollbacks(sent) if i == b"follower-1"]
        reg, sent = _register(s0, 2, version=10, log_hash="x10", resumed=True,
                              checkpoint_versions=[10], checkpoint_hashes=["a10"])
        (to_it,) = [m for i, m in _rollbacks(sent) if i == b"follower-2"]
        assert (to_it.version, to_it.log_hash) == (10, "a10")
        assert to_it.epoch > reg.rollback_epoch, "after its registration's epoch: it applies it"
        assert [type(m) for i, m in sent if i == b"follower-2"] == [P.Registered, P.Rollback]


def test_a_follower_at_the_jobs_version_with_another_history_is_compared_like_a_resumed_one(tmp_path):
    """A follower that missed a Rollback registers with a restarted shard 0 at the job's version,
    not resumed, with the abandoned history's hash: accepting it would leave it out of step (its
    next commit stops it). It goes through the checkpoint comparison like a resumed follower."""
    cfg = small_checkpointing_job(tmp_path, num_shards=2)
    with in_process_shard_0(cfg, tmp_path / "run") as s0:
        _checkpoints(s0, {10: "a10", 20: "a20"})
        s0.state.version, s0.state.log_hash = 24, "a24"
        _, sent = _register(s0, 1, version=24, log_hash="b24",
                            checkpoint_versions=[10, 20], checkpoint_hashes=["a10", "b20"])
        assert s0.state.version == 10, "back to the newest checkpoint both hold of one history"
        (to_it,) = [m for i, m in _rollbacks(sent) if i == b"follower-1"]
        assert (to_it.version, to_it.log_hash) == (10, "a10")
        _, sent = _register(s0, 1, version=10, log_hash="a10")   # one history: accepted as it is
        assert s0.state.version == 10 and not _rollbacks(sent)


def test_a_registration_sent_again_before_its_answer_arrived_is_answered_again_not_handled_twice(tmp_path):
    """A follower's registration attempt times out while shard 0 is busy rolling back for it,
    and the follower sends it again on a new connection: the same registration, answered again
    on the new connection with the Rollback sent since; the job goes back once. A registration
    with another id (a new process, or a new registration of the same one) is handled anew."""
    cfg = small_checkpointing_job(tmp_path, num_shards=2)
    with in_process_shard_0(cfg, tmp_path / "run") as s0:
        _checkpoints(s0, {10: "a10", 20: "a20"})
        s0.state.version, s0.state.log_hash = 24, "a24"
        resumed = dict(version=30, log_hash="x30", resumed=True, checkpoint_versions=[10, 20],
                       checkpoint_hashes=["a10", "x20"], registration="r1")
        first, sent = _register(s0, 1, **resumed)
        (_, rollback), = _rollbacks(sent)
        assert s0.state.version == 10 and rollback.epoch > first.rollback_epoch
        # Another job-wide rollback while the follower waits: the newest Rollback is the one owed.
        s0.state.version, s0.state.log_hash = 11, "a11"
        s0.role.rollback_all(10, "another follower's")
        _, newest = _rollbacks(sent)[-1]   # shard 0 sends what it sends after the first answer here too
        epoch = s0.role.rollback_epoch
        s0.state.version, s0.state.log_hash = 11, "a11"   # a commit since: nothing rolls it back again
        again, sent = _register(s0, 1, ident=b"follower-1-retry", **resumed)
        assert s0.state.version == 11 and s0.role.rollback_epoch == epoch, "the job went back twice"
        assert (again.version, again.rollback_epoch) == (first.version, first.rollback_epoch), "the same answer"
        assert [(i, type(m)) for i, m in sent] == [(b"follower-1-retry", P.Registered),
                                                   (b"follower-1-retry", P.Rollback)]
        assert sent[1][1] == newest and newest.epoch > rollback.epoch, "the newest Rollback owed, again"
        assert s0.role.followers.peers[1].ident == b"follower-1-retry"
        assert s0.role.coord.counters["register.retry"] == 1
        _, sent = _register(s0, 1, **{**resumed, "version": 11, "log_hash": "a11", "registration": "r2"})
        assert s0.role.rollback_epoch > epoch, "another registration: handled (resumed: the job goes back)"
        # A plain registration at the job's version owes no Rollback: its retry gets the answer only.
        plain = dict(version=s0.state.version, log_hash=s0.state.log_hash, registration="r3")
        first, _ = _register(s0, 1, **plain)
        again, sent = _register(s0, 1, ident=b"follower-1-retry-2", **plain)
        assert [type(m) for _, m in sent] == [P.Registered] and again.version == first.version
        # An attempt left queued behind its retry, handled after the follower was heard (a beat):
        # the connection it was heard on stays its connection.
        _sync(s0, 1, version=s0.state.version, log_hash=s0.state.log_hash, rollback_epoch=again.rollback_epoch)
        _register(s0, 1, ident=b"follower-1-stale", **plain)
        assert s0.role.followers.peers[1].ident == b"follower-1"


def test_a_checkpoint_of_another_history_is_not_restored(tmp_path):
    cfg = small_checkpointing_job(tmp_path, num_shards=1)
    with in_process_shard_0(cfg, tmp_path / "run") as s0:
        _checkpoints(s0, {10: "a10"})
        s0.state.version, s0.state.log_hash = 15, "a15"
        with pytest.raises(CheckpointError, match="another history"):
            s0.restore(10, expect_log_hash="b10")
        assert (s0.state.version, s0.state.log_hash) == (15, "a15"), "nothing restored"
        s0.restore(10, expect_log_hash="a10")
        assert (s0.state.version, s0.state.log_hash) == (10, "a10")


def test_a_restarted_shard_0_sends_each_follower_its_history_with_the_rollback(tmp_path):
    cfg = small_checkpointing_job(tmp_path, num_shards=2)
    ctx = zmq.Context()
    follower, endpoint = make_router(ctx, "tcp://127.0.0.1:*", security=cfg.security)  # its own socket
    got: list[P.Message] = []

    def answer() -> None:
        if follower.poll(30_000):
            ident, *frames = follower.recv_multipart()
            got.append(P.decode(frames))
            send(follower, P.Ack(what="rollback"), ident)
    try:
        with in_process_shard_0(cfg, tmp_path / "run") as first:
            first.role.shard_endpoints[1] = endpoint
            first.role.rollback_epoch = counted = 10 ** 15   # as if the clock went back before the restart
            _checkpoints(first, {10: "a10"})
        replier = threading.Thread(target=answer, daemon=True)
        replier.start()
        with in_process_shard_0(cfg, tmp_path / "run", resume="auto") as again:
            replier.join(timeout=30)
            assert again.resumed
        (rb,) = got
        assert isinstance(rb, P.Rollback) and (rb.version, rb.log_hash) == (10, "a10")
        assert rb.coordinator == again.endpoint
        assert again.role.rollback_epoch > counted, "the restarted process counts on above the last"
    finally:
        follower.close()
        stop_authenticators(ctx)
        ctx.destroy(linger=0)


@contextmanager
def _coordinator_socket(cfg) -> Iterator[tuple[zmq.Context, zmq.Socket, str]]:
    """A socket where a follower's link to shard 0 ends, driven by the test; everything closed after."""
    ctx = zmq.Context()
    coord, endpoint = make_router(ctx, "tcp://127.0.0.1:*", security=cfg.security)
    try:
        yield ctx, coord, endpoint
    finally:
        coord.close()
        stop_authenticators(ctx)
        ctx.destroy(linger=0)


@contextmanager
def _running(server: ShardServer) -> Iterator[threading.Thread]:
    """``server``'s loop in a thread; stopped and closed after."""
    loop = threading.Thread(target=server.run, daemon=True)
    loop.start()
    try:
        yield loop
    finally:
        server.stop_event.set()
        loop.join(timeout=20)
        server.close()


def _socket_rollback(ctx: zmq.Context, cfg, follower: ShardServer, msg: P.Rollback) -> None:
    """A restarted shard 0's Rollback, sent to the follower's own socket (answered once applied)."""
    own = Connection(ctx, follower.endpoint, role="shard", security=cfg.security, timeout_s=10)
    try:
        own.request(msg, P.Ack, timeout_s=10)
    finally:
        own.close()


def _recv(sock: zmq.Socket, kind: type, timeout_s: float = 20.0, where=lambda m: True) -> tuple[bytes, P.Message]:
    """The next message of ``kind`` (that satisfies ``where``) the follower sends; others skipped."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if sock.poll(100):
            ident, *frames = sock.recv_multipart()
            msg = P.decode(frames)
            if isinstance(msg, kind) and where(msg):
                return ident, msg
    raise AssertionError(f"no {kind.__name__} from the follower within {timeout_s}s")


def _follower_job(tmp_path, **mode):
    """Shard 0 and one follower, checkpoints at every iteration, beats every 0.1 s."""
    return write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256, "synthetic_test": 64},
        "training": {"global_batch": 32, "max_iterations": 5}, "evaluator": {"enabled": False},
        "cluster": {"num_shards": 2, "num_workers": 1}, "checkpoint": {"every_iterations": 1},
        "transport": {"shard_sync_s": 0.1}, **({"mode": mode} if mode else {}),
    })[1]


def test_a_real_follower_echoes_the_rollback_it_applied_and_refuses_another_history(tmp_path):
    """A real follower shard against a coordinator socket driven by hand: it reports its
    checkpoints and their hashes, echoes the epoch of the last rollback it applied in its beats,
    never restores a checkpoint whose history is not shard 0's (it registers again as resumed),
    and stops after more than MAX_RECOVERIES such Rollbacks in a row."""
    cfg = _follower_job(tmp_path)
    with _coordinator_socket(cfg) as (ctx, coord, endpoint):
        s1 = ShardServer(cfg, 1, coordinator=endpoint, ctx=ctx, run_dir=tmp_path / "run")
        s1.state.version, s1.state.log_hash = 10, "h10"
        s1.write_checkpoint()
        s1.checkpointer.flush()
        s1.state.version, s1.state.log_hash = 12, "h12"
        with _running(s1) as loop:
            ident, reg = _recv(coord, P.RegisterShard)
            assert (reg.checkpoint_versions, reg.checkpoint_hashes) == ([10], ["h10"])
            send(coord, P.Registered(member_key="00" * 16, incarnation="i", version=12, rollback_epoch=3), ident)
            _, beat = _recv(coord, P.ShardSync)
            assert (beat.version, beat.rollback_epoch) == (12, 3), "the epoch of its registration"

            send(coord, P.Rollback(version=10, log_hash="h10", epoch=3), ident)   # not newer: a repeat
            send(coord, P.Rollback(version=10, log_hash="h10", epoch=2), ident)   # older
            send(coord, P.Rollback(version=10, log_hash="h10", epoch=4), ident)
            _, beat = _recv(coord, P.ShardSync, where=lambda m: m.rollback_epoch == 4)   # the link keeps order
            assert (beat.version, beat.log_hash) == (10, "h10")
            send(coord, P.Rollback(version=10, log_hash="h10", epoch=4), ident)   # sent again: applied already
            send(coord, P.Rollback(version=10, log_hash="h10", epoch=5), ident)
            _recv(coord, P.ShardSync, where=lambda m: m.rollback_epoch == 5)

            # A restarted shard 0 sends its Rollback to the follower's own socket, with its address:
            # applied whatever its epoch, then the follower registers with the new process.
            _socket_rollback(ctx, cfg, s1, P.Rollback(version=10, log_hash="h10", coordinator=endpoint))
            ident, _ = _recv(coord, P.RegisterShard)
            send(coord, P.Registered(member_key="00" * 16, incarnation="j", version=10, rollback_epoch=0), ident)
            _recv(coord, P.ShardSync, where=lambda m: m.rollback_epoch == 0)

            # Told to restore a checkpoint of another history: nothing changes, and it registers
            # again as resumed with its checkpoints, so that shard 0 picks one of its history.
            send(coord, P.Rollback(version=10, log_hash="another", epoch=1), ident)
            ident, reg = _recv(coord, P.RegisterShard)
            assert (reg.resumed, reg.version, reg.log_hash) == (True, 10, "h10")
            assert (reg.checkpoint_versions, reg.checkpoint_hashes) == ([10], ["h10"])
            send(coord, P.Registered(member_key="00" * 16, incarnation="j", version=10, rollback_epoch=2), ident)
            send(coord, P.Rollback(version=10, log_hash="h10", epoch=3), ident)
            _recv(coord, P.ShardSync, where=lambda m: m.rollback_epoch == 3)
            # Restored, so the count starts again: MAX_RECOVERIES more failures in a row are met
            # the same way, and one more stops it, unchanged.
            for epoch in range(4, 4 + MAX_RECOVERIES):
                send(coord, P.Rollback(version=10, log_hash="another", epoch=epoch), ident)
                ident, reg = _recv(coord, P.RegisterShard)
                assert reg.resumed
                send(coord, P.Registered(member_key="00" * 16, incarnation="j", version=10, rollback_epoch=epoch),
                     ident)
            send(coord, P.Rollback(version=10, log_hash="another", epoch=9), ident)
            loop.join(timeout=20)
            assert not loop.is_alive(), "a follower that cannot restore what it is told to kept running"
            assert s1.exit_code == 3 and (s1.state.version, s1.state.log_hash) == (10, "h10")
            s1.metrics.close()
            records = read_jsonl(tmp_path / "run" / "metrics" / "shard-1.jsonl")
            restored = [r for r in records if r.get("event") == "restored"]
            assert len(restored) == 4, \
                f"{len(restored)} restores, not 4 (epochs 4, 5, the socket, 3): a repeat or another history applied"



def _follower_checkpoints(cfg, run_dir, histories: dict[int, str]) -> None:
    """Follower 1's checkpoints at these versions, each with this log hash (then it exits)."""
    ctx = zmq.Context()
    s = ShardServer(cfg, 1, coordinator="tcp://127.0.0.1:9", ctx=ctx, run_dir=run_dir)
    try:
        for v, h in sorted(histories.items()):
            s.state.version, s.state.log_hash = v, h
            s.write_checkpoint()
        s.checkpointer.flush()
    finally:
        s.close()
        stop_authenticators(ctx)
        ctx.destroy(linger=0)


def test_a_resumed_follower_says_resumed_only_until_it_is_at_the_jobs_version(tmp_path):
    """A follower started with --resume lost what it held, and says so when it registers (shard 0
    rolls the job back). It keeps saying so until it is at the job's version: a registration
    before the Rollback reached it still says it. Once it applied one, a registration with a
    restarted shard 0 must not: that would roll the whole job back a second time."""
    cfg = _follower_job(tmp_path)
    _follower_checkpoints(cfg, tmp_path / "run", {10: "h10", 12: "h12"})
    with _coordinator_socket(cfg) as (ctx, coord, endpoint):
        s1 = ShardServer(cfg, 1, coordinator=endpoint, ctx=ctx, run_dir=tmp_path / "run", resume="auto")
        assert (s1.state.version, s1.state.log_hash) == (12, "h12")
        with _running(s1) as loop:
            ident, reg = _recv(coord, P.RegisterShard)
            assert (reg.resumed, reg.version) == (True, 12)
            # Shard 0 went back to 10 and answers; the Rollback that follows is lost with the
            # link, and shard 0 restarts (it does not know this shard): still at 12, still resumed.
            send(coord, P.Registered(member_key=KEY, incarnation="i", version=10, rollback_epoch=3), ident)
            send(coord, P.Error(code="unregistered", message="shard 0 restarted"), ident)
            ident, reg = _recv(coord, P.RegisterShard)
            assert (reg.resumed, reg.version) == (True, 12), "not at the job's version yet: it lost what it held"
            send(coord, P.Registered(member_key=KEY, incarnation="j", version=10, rollback_epoch=3), ident)
            send(coord, P.Rollback(version=10, log_hash="h10", epoch=4), ident)
            _recv(coord, P.ShardSync, where=lambda m: m.rollback_epoch == 4 and m.version == 10)
            # Shard 0 restarts again and says so on the follower's socket: back to its version,
            # and the registration with the new process is not a resumed shard's.
            _socket_rollback(ctx, cfg, s1, P.Rollback(version=10, log_hash="h10", coordinator=endpoint))
            ident, reg = _recv(coord, P.RegisterShard)
            assert (reg.resumed, reg.version) == (False, 10), "a second job-wide rollback for nothing lost"
            # A registration at the job's version needs no Rollback: nothing is missing after it either.
            send(coord, P.Registered(member_key=KEY, incarnation="k", version=10, rollback_epoch=7), ident)
            send(coord, P.Error(code="unregistered", message="shard 0 restarted"), ident)
            ident, reg = _recv(coord, P.RegisterShard)
            assert reg.resumed is False
            send(coord, P.Error(code="no_common_checkpoint", message="refused"), ident)   # it stops
            loop.join(timeout=20)
            assert s1.exit_code == 3, "a follower shard 0 refused kept running, or crashed"


@contextmanager
def _stepped_follower(tmp_path) -> Iterator[tuple[ShardServer, zmq.Socket, bytes, str]]:
    """An async-mode follower at version 12 (h12) with a checkpoint at 10 (h10), registered
    with member key ``KEY`` and epoch 3 at a coordinator socket the test drives; its loop's
    steps are the test's to call. Yields it, that socket, its link's identity there, the
    socket's address."""
    cfg = _follower_job(tmp_path, sync="asp")
    with _coordinator_socket(cfg) as (ctx, coord, endpoint):
        s1 = ShardServer(cfg, 1, coordinator=endpoint, ctx=ctx, run_dir=tmp_path / "run")
        try:
            s1.state.version, s1.state.log_hash = 10, "h10"
            s1.write_checkpoint()
            s1.checkpointer.flush()
            s1.state.version, s1.state.log_hash = 12, "h12"
            registering = threading.Thread(target=s1.role.start, daemon=True)
            registering.start()
            ident, _ = _recv(coord, P.RegisterShard)
            send(coord, P.Registered(member_key=KEY, incarnation="i", version=12, rollback_epoch=3), ident)
            registering.join(timeout=20)
            yield s1, coord, ident, endpoint
        finally:
            s1.close()


def test_a_gradient_held_before_a_rollback_is_not_announced_after_it(tmp_path):
    """A push accepted in the same pass of the follower's loop as a Rollback: the restore drops the
    gradient, so the announcement (Have) queued for it must go too. Sent with the new epoch it
    would pass shard 0's check, and shard 0 would commit a gradient no follower holds (the
    follower then stops on the commit). The loop's steps are called by hand, in its order."""
    with _stepped_follower(tmp_path) as (s1, coord, ident, endpoint):
        push = P.Push(worker_id=0, token=member_token(KEY, 0), iteration=13, batch_size=8,
                      arrays=[np.ones(s1.state.size, dtype=np.float32)])
        s1._on_push(b"worker-0", "worker", push)
        assert s1.role.haves == [[0, 13, 8]] and s1.state.held
        send(coord, P.Rollback(version=10, log_hash="h10", epoch=4), ident)
        assert s1.role.link.sock.poll(20_000), "the Rollback did not arrive"
        s1.role.on_link_messages()
        s1.role.after_messages()
        assert (s1.state.version, s1.role.rollback_epoch) == (10, 4)
        assert not s1.state.held
        sent: list[P.Message] = []
        while coord.poll(500):
            sent.append(P.decode(coord.recv_multipart()[1:]))
        assert not [m for m in sent if isinstance(m, P.Have)], "the dropped gradient was announced"


def test_a_follower_exactly_where_the_rollback_goes_needs_no_readable_checkpoint_there(tmp_path):
    """Its checkpoint at the Rollback's version is unreadable, but it is at exactly that version
    of shard 0's history: it goes back from memory (parameters and momentum kept; what it held
    and settled dropped, as a restore drops them) and writes that checkpoint again, instead of
    registering as resumed, which would cost the job a second rollback. At another history's
    hash it still registers as resumed."""
    with _stepped_follower(tmp_path) as (s1, coord, ident, endpoint):
        grad = np.linspace(-1.0, 1.0, s1.state.size, dtype=np.float32)
        s1.state.receive(0, 13, 8, grad)             # a commit since the checkpoint at 12: momentum
        s1.state.apply(13, [[0, 8]], 1.0)            # and parameters differ from any file
        at = (s1.state.version, s1.state.log_hash)
        broken = checkpoint_path(s1.checkpoint_dir, 1, 13)
        broken.write_bytes(b"not a checkpoint")      # a torn write, a bad disk block
        with pytest.raises(CheckpointError):
            load_checkpoint(broken)
        s1._on_push(b"worker-0", "worker", P.Push(worker_id=0, token=member_token(KEY, 0), iteration=14,
                                                  batch_size=8, arrays=[np.ones(s1.state.size, np.float32)]))
        assert s1.state.held and s1.role.haves and s1.state.settled
        kept = {k: v.copy() for k, v in s1.state.state_arrays().items()}
        assert set(kept) == {"params", "momentum_buffer"} and kept["momentum_buffer"].any()
        send(coord, P.Rollback(version=at[0], log_hash=at[1], epoch=4), ident)
        assert s1.role.link.sock.poll(20_000), "the Rollback did not arrive"
        s1.role.on_link_messages()
        s1.role.after_messages()
        assert (s1.state.version, s1.state.log_hash, s1.role.rollback_epoch) == (*at, 4)
        now = s1.state.state_arrays()
        assert set(now) == set(kept)
        for k, v in now.items():
            np.testing.assert_array_equal(v, kept[k])
        assert not s1.state.held and not s1.role.haves and not s1.state.settled, "abandoned iterations'"
        assert not s1.role.lost_state and s1.role.relink_to is None and s1.role.failed_rollbacks == 0
        s1.checkpointer.flush()
        arrays, meta = load_checkpoint(broken)
        assert (meta["version"], meta["log_hash"]) == at and set(arrays) == set(kept)
        for k, v in arrays.items():
            np.testing.assert_array_equal(v, kept[k])

        send(coord, P.Rollback(version=at[0], log_hash="another", epoch=5), ident)
        assert s1.role.link.sock.poll(20_000), "the Rollback did not arrive"
        s1.role.on_link_messages()
        assert (s1.state.version, s1.state.log_hash, s1.role.rollback_epoch) == (*at, 4)
        assert s1.role.lost_state and s1.role.relink_to == endpoint, "another history: registers as resumed"
    records = read_jsonl(tmp_path / "run" / "metrics" / "shard-1.jsonl")
    assert [r["path"] for r in records if r.get("event") == "restored"] == ["memory"]


def test_resumed_ends_at_a_registration_at_its_version_and_starts_again_when_a_restore_fails(tmp_path):
    """A resumed follower answered at its own version needs no Rollback: it is at the job's
    version, and its next registration does not say resumed. A restarted shard 0's Rollback to a
    checkpoint of another history (on the follower's socket) changes nothing, and the follower
    registers with the new process as resumed, with its checkpoints."""
    cfg = _follower_job(tmp_path)
    _follower_checkpoints(cfg, tmp_path / "run", {10: "h10", 12: "h12"})
    with _coordinator_socket(cfg) as (ctx, coord, endpoint):
        again, again_endpoint = make_router(ctx, "tcp://127.0.0.1:*", security=cfg.security)   # shard 0 restarted
        s1 = ShardServer(cfg, 1, coordinator=endpoint, ctx=ctx, run_dir=tmp_path / "run", resume="auto",
                         timeouts=dataclasses.replace(DEFAULT_TIMEOUTS, register_attempt_s=0.3))
        try:
            with _running(s1):
                unanswered, reg = _recv(coord, P.RegisterShard)
                assert (reg.resumed, reg.version) == (True, 12)
                # Not answered in time: the same registration again, on a new connection.
                ident, retry = _recv(coord, P.RegisterShard)
                assert ident != unanswered and retry.registration == reg.registration != ""
                send(coord, P.Registered(member_key=KEY, incarnation="i", version=12, rollback_epoch=3), ident)
                _recv(coord, P.ShardSync, where=lambda m: m.rollback_epoch == 3)
                send(coord, P.Error(code="unregistered", message="shard 0 restarted"), ident)
                first_id = reg.registration
                ident, reg = _recv(coord, P.RegisterShard)
                assert (reg.resumed, reg.version) == (False, 12), "at the job's version: nothing lost"
                assert first_id and reg.registration and reg.registration != first_id, "each registration its id"
                send(coord, P.Registered(member_key=KEY, incarnation="j", version=12, rollback_epoch=4), ident)
                _recv(coord, P.ShardSync, where=lambda m: m.rollback_epoch == 4)

                _socket_rollback(ctx, cfg, s1, P.Rollback(version=10, log_hash="another", coordinator=again_endpoint))
                ident, reg = _recv(again, P.RegisterShard)
                assert (reg.resumed, reg.version, reg.log_hash) == (True, 12, "h12"), "unchanged, and resumed"
                assert (reg.checkpoint_versions, reg.checkpoint_hashes) == ([10, 12], ["h10", "h12"])
                send(again, P.Registered(member_key=KEY, incarnation="k", version=12, rollback_epoch=1), ident)
                _recv(again, P.ShardSync)
            assert s1.exit_code == 0
        finally:
            again.close()


def test_after_a_restore_that_failed_the_rest_of_the_links_messages_are_dropped_and_so_is_what_it_held(tmp_path):
    """A Rollback this follower cannot restore, and a Commit right behind it on the link (shard 0
    went on from the Rollback's version): the Commit is of the new history and must not be
    applied to the old one (that stopped the shard on its first commit); the gradients the shard
    held belong to abandoned iterations and go, and it registers again as resumed. The loop's
    steps are called by hand, in its order, so that both messages arrive in one batch."""
    with _stepped_follower(tmp_path) as (s1, coord, ident, endpoint):
        s1._on_push(b"worker-0", "worker", P.Push(worker_id=0, token=member_token(KEY, 0), iteration=13,
                                                  batch_size=8, arrays=[np.ones(s1.state.size, np.float32)]))
        send(coord, P.Rollback(version=10, log_hash="another", epoch=4), ident)
        send(coord, P.Commit(version=13, iteration=13, entries=[[0, 8]], log_hash="n13"), ident)
        assert s1.role.link.sock.poll(20_000), "nothing arrived"
        time.sleep(0.3)   # the Commit right behind it, on the same connection
        s1.role.on_link_messages()
        assert not s1.role.link.sock.poll(0), "the Commit came in a later batch: the test proves nothing"
        assert s1.exit_code == 0 and (s1.state.version, s1.state.log_hash) == (12, "h12")
        assert not s1.state.held and not s1.role.haves
        assert s1.role.relink_to == endpoint and s1.role.lost_state
        registering = threading.Thread(target=s1.role.link_socket, daemon=True)
        registering.start()
        ident, reg = _recv(coord, P.RegisterShard)
        assert (reg.resumed, reg.version) == (True, 12)
        send(coord, P.Registered(member_key=KEY, incarnation="j", version=10, rollback_epoch=5), ident)
        registering.join(timeout=20)
