"""SSP's read bound on every shard, not only shard 0's, and a lost ``Have`` repaired by a beat
while commits are in flight: a real shard 0 (``Lead`` +
``ShardServer``) and a real follower ``ShardServer`` in this process, two workers driven with
well-formed messages, the link between the shards carried by hand (in order, as the real one).

Before 2026-11-28 a follower answered a worker's pull as soon as the worker's own gradient was
applied there, so with staleness 0 the fast worker got the follower's slice without the slow
worker's clock 0 (a staleness of 1 = s + 1) while shard 0 rightly held its assignment. Shard 0
now tells the followers the slowest committed clock (``Clocks``), and they hold by the same
rule: ``test_a_follower_holds_the_fast_workers_slice_until_the_slowest_is_within_the_bound``
fails without that.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest
import zmq

from ps_common import protocol as P
from ps_common.security.authenticator import stop_authenticators
from ps_server.server import ShardServer
from ps_server.shard import GENESIS_HASH
from ps_server.sync import NO_LIVE_WORKER
from tests.cluster_util import in_process_shard_0, write_config


class HandLink:
    """The follower's link to shard 0, carried by the test: what shard 0 sent, in order."""

    def __init__(self) -> None:
        self.inbox: list[P.Message] = []
        self.received: list[P.Message] = []    # everything the follower has read, in order
        self.sent: list[P.Message] = []

    def receive(self) -> list[P.Message]:
        out, self.inbox = self.inbox, []
        self.received += out
        return out

    def send(self, msg: P.Message) -> bool:
        self.sent.append(msg)
        return True

    def silent_s(self) -> float:
        return 0.0

    def close(self) -> None:
        pass


class TwoShards:
    """Shard 0 and one follower, two workers joined, every answer recorded per shard."""

    def __init__(self, s0: ShardServer, s1: ShardServer) -> None:
        self.s0, self.s1 = s0, s1
        self.lead = s0.role
        self.answers: dict[int, list[tuple[bytes, P.Params]]] = {0: [], 1: []}
        self.down: list[P.Message] = []        # shard 0 -> follower, not yet delivered
        self.replies: list[P.Message] = []     # shard 0's other replies (Welcome, Registered, ...)
        self.link = HandLink()

        def reply0(ident: Any, msg: P.Message) -> bool:
            if isinstance(msg, P.Params):
                self.answers[0].append((ident, msg))
            else:
                self.replies.append(msg)
            return True

        s0.router_reply = reply0                                     # type: ignore[method-assign]
        s0.router.reply = reply0                                     # type: ignore[method-assign]
        self.lead.followers._send = lambda _ident, msg: self.down.append(msg) or True
        s1.router.reply = lambda ident, msg: self.answers[1].append((ident, msg)) or True  # type: ignore
        self.lead._on_register_shard(b"f1", "shard", P.RegisterShard(
            shard=1, endpoint="tcp://127.0.0.1:9", job_digest=s0.job_digest, version=0,
            log_hash=s0.state.log_hash, registration="r"))
        reg = next(m for m in self.replies if isinstance(m, P.Registered))
        s1.role.member_key, s1.role.rollback_epoch = reg.member_key, reg.rollback_epoch
        s1.role.link = self.link                                     # type: ignore[assignment]
        for name in ("w0", "w1"):
            self.lead._on_join(name.encode(), "worker", P.Join(name=name, instance=name,
                                                                job_digest=s0.job_digest))
        self.token = {m.worker_id: m.token for m in self.replies if isinstance(m, P.Welcome)}
        self.deliver()
        for w in (0, 1):                        # the first pulls: clock 0 from shard 0
            s0._on_pull(f"w{w}".encode(), "worker", P.Pull(worker_id=w, token=self.token[w], min_version=0))
        s0.serve_pulls()
        self.assignment = {int(i.decode()[1:]): m.assignment for i, m in self.answers[0]}
        self.answers[0].clear()

    def deliver(self) -> None:
        """Shard 0's messages to the follower arrive, in order (the follower's own loop)."""
        self.link.inbox, self.down = self.down, []
        self.s1.role.on_link_messages()
        self.s1.serve_pulls()

    def push(self, w: int, clock: int, have: bool = True, deliver: bool = True) -> None:
        """Worker ``w``'s gradient of ``clock`` to both shards (asking for the next
        parameters), the follower's Have (unless it is lost), and shard 0's commit carried to
        the follower (unless it is still in flight)."""
        x = self.assignment[w].batch_size
        for k, s in ((0, self.s0), (1, self.s1)):
            n = self.s0.ranges[k][1] - self.s0.ranges[k][0]
            s._on_push(f"w{w}".encode(), "worker", P.Push(
                worker_id=w, token=self.token[w], iteration=clock, batch_size=x, pull=True,
                arrays=[np.zeros(n, np.float32)]))
        self.s1.role.after_messages()                          # the follower's Have goes up
        for m in self.link.sent:
            if isinstance(m, P.Have) and have:
                self.lead._on_have(b"f1", "shard", m)
        self.link.sent.clear()
        self.lead.after_messages()
        self.s0.serve_pulls()
        if deliver:
            self.deliver()

    def beat(self) -> None:
        """The follower's ShardSync reaches shard 0, which answers (and decides) at once."""
        self.s1.role._send_sync()
        for m in self.link.sent:
            assert isinstance(m, P.ShardSync)
            self.lead._on_shard_sync(b"f1", "shard", m)
        self.link.sent.clear()
        self.lead.after_messages()
        self.s0.serve_pulls()

    def answered(self, shard: int, w: int) -> list[int]:
        """Versions shard ``shard`` answered worker ``w`` with."""
        return [m.version for i, m in self.answers[shard] if i == f"w{w}".encode()]


@contextlib.contextmanager
def two_shards(tmp_path: Path, sync: str) -> Iterator[TwoShards]:
    _, cfg = write_config(tmp_path, {
        "model": {"name": "mlp"}, "data": {"dataset": "synthetic", "synthetic_train": 256, "synthetic_test": 64},
        "training": {"global_batch": 32, "max_iterations": 50}, "mode": {"sync": sync, "staleness": 0},
        "cluster": {"num_shards": 2, "num_workers": 2}, "evaluator": {"enabled": False}})
    with in_process_shard_0(cfg, tmp_path / "run0") as s0:
        ctx = zmq.Context()
        s1 = ShardServer(cfg, 1, coordinator="tcp://127.0.0.1:1", run_dir=tmp_path / "run1", ctx=ctx)
        try:
            yield TwoShards(s0, s1)
        finally:
            s1.close()
            stop_authenticators(ctx)
            ctx.destroy(linger=0)


def test_a_follower_holds_the_fast_workers_slice_until_the_slowest_is_within_the_bound(tmp_path):
    with two_shards(tmp_path, "ssp") as job:
        job.push(0, 0)        # the fast worker's clock 0 commits (v1); the slow one has none
        assert job.s1.state.version == 1
        assert job.answered(0, 0) == []       # shard 0 holds its clock 1: 0 < 1 - 0
        assert job.answered(1, 0) == []       # so does the follower (it answered v1 before)
        job.push(1, 0)        # the slow worker's clock 0 commits (v2)
        assert job.answered(0, 0) == [2] and job.answered(1, 0) == [2]
        assert job.answered(0, 1) == [2] and job.answered(1, 1) == [2]
        commits = [m for m in job.link.received if isinstance(m, P.Commit)]
        assert [(c.version, c.slowest_clock) for c in commits] == [(1, 0), (2, 1)]
        assert job.s1.role.slowest_clock == 1


def test_the_slowest_workers_departure_releases_the_followers_answer(tmp_path):
    """Nothing else would: the fast worker, held, sends no gradient, so no commit comes."""
    with two_shards(tmp_path, "ssp") as job:
        job.push(0, 0)
        assert job.answered(1, 0) == []
        job.lead.remove_worker(1, "left (test)")
        job.s0.serve_pulls()
        assert job.answered(0, 0) == [1]
        assert [m for m in job.down if isinstance(m, P.Clocks)] == [
            P.Clocks(version=1, slowest_clock=1)]
        job.deliver()
        assert job.answered(1, 0) == [1]


def test_a_follower_takes_the_clock_only_at_the_version_it_was_sent_at(tmp_path):
    """A follower behind shard 0 (commits still to apply) keeps holding; its beat gets the
    value again, after the commits it missed."""
    with two_shards(tmp_path, "ssp") as job:
        job.push(0, 0)
        job.push(1, 0)
        assert job.s1.role.slowest_clock == 1
        job.link.inbox = [P.Clocks(version=5, slowest_clock=40)]      # not at version 5
        job.s1.role.on_link_messages()
        assert job.s1.role.slowest_clock == 1
        job.lead._on_shard_sync(b"f1", "shard", P.ShardSync(
            shard=1, version=2, log_hash=job.s1.state.log_hash, rollback_epoch=job.s1.role.rollback_epoch))
        assert [m for m in job.down if isinstance(m, P.Clocks)] == [P.Clocks(version=2, slowest_clock=1)]
        job.s1.role._forget_iterations()        # the job went back: hold until told again
        assert job.s1.role.slowest_clock == 0


@pytest.mark.parametrize("sync", ["asp"])
def test_asp_followers_answer_at_once_and_nobody_sends_clocks(tmp_path, sync):
    with two_shards(tmp_path, sync) as job:
        job.push(0, 0)
        assert job.answered(0, 0) == [1] and job.answered(1, 0) == [1]
        assert any(isinstance(m, P.Commit) for m in job.link.received)
        assert not any(isinstance(m, P.Clocks) for m in job.link.received)
        assert all(m.slowest_clock == 0 for m in job.link.received if isinstance(m, P.Commit))


def test_a_beat_from_a_follower_behind_repairs_a_lost_have(tmp_path):
    """ASP: the fast worker's Have is lost, and the follower's beats are always a commit or two
    behind (they are in flight on its link). Before 2026-11-28 only a beat at shard 0's version
    counted what the follower holds, so that gradient waited for the worker's transport timeout."""
    with two_shards(tmp_path, "asp") as job:
        job.push(1, 0)                           # v1 (w1), on both shards
        job.push(0, 0, have=False)               # shard 0 never hears that the follower has it
        job.push(1, 1, deliver=False)            # v2 commits w1 again; the follower is at v1
        assert job.s0.state.version == 2 and job.s1.state.version == 1
        unexpected = job.lead.coord.counters.get("have.unexpected", 0)
        job.beat()
        assert job.s0.state.version == 3         # w0's gradient is complete: it commits
        assert job.answered(0, 0) == [3]
        assert job.lead.coord.counters.get("have.unexpected", 0) == unexpected
        job.deliver()                            # v2, v3, then the repeat the beat asked for
        assert job.s1.state.version == 3 and job.s1.state.log_hash == job.s0.state.log_hash
        assert job.answered(1, 0) == [3]


def test_a_beat_behind_of_another_history_credits_nothing(tmp_path):
    """Shard 0 credits a beat from behind only where its log says the follower's version and
    history hash are this history's (a forged hash here)."""
    with two_shards(tmp_path, "asp") as job:
        job.push(1, 0)
        job.push(0, 0, have=False)
        job.push(1, 1, deliver=False)
        job.s1.role._send_sync()
        (sync,) = job.link.sent
        job.link.sent.clear()
        forged = P.ShardSync(shard=1, version=1, log_hash="0" * 16, entries=sync.entries,
                             rollback_epoch=sync.rollback_epoch)
        job.lead._on_shard_sync(b"f1", "shard", forged)
        job.lead.after_messages()
        assert job.s0.state.version == 2
        job.lead._on_shard_sync(b"f1", "shard", sync)
        job.lead.after_messages()
        assert job.s0.state.version == 3


@pytest.mark.parametrize("forged", [False, True])
def test_a_beat_at_the_version_before_the_first_logged_commit_repairs_a_lost_have(tmp_path, forged):
    """The follower is still at the job's start (version 0), the one state the commit log holds
    no commit of. Before 2026-11-29 shard 0 could not check such a beat's history hash, so it
    credited nothing and the gradient waited for the worker's transport timeout. A forged hash
    still credits nothing."""
    with two_shards(tmp_path, "asp") as job:
        job.push(1, 0, deliver=False)            # v1 commits w1; the follower is still at v0
        job.push(0, 0, have=False, deliver=False)
        assert job.s0.state.version == 1 and job.s1.state.version == 0
        job.s1.role._send_sync()
        (sync,) = job.link.sent
        job.link.sent.clear()
        assert sync.version == 0
        if forged:
            assert sync.log_hash == GENESIS_HASH
            sync = P.ShardSync(shard=1, version=0, log_hash="f" * 16, entries=sync.entries,
                               rollback_epoch=sync.rollback_epoch)
        job.lead._on_shard_sync(b"f1", "shard", sync)
        job.lead.after_messages()
        job.s0.serve_pulls()
        assert job.s0.state.version == (1 if forged else 2)
        if not forged:
            job.deliver()
            assert job.s1.state.version == 2 and job.s1.state.log_hash == job.s0.state.log_hash


def test_a_lost_clocks_when_workers_join_an_empty_job_never_outlives_a_commit(tmp_path):
    """Found by a review: the slowest clock falls when workers join a job everyone had left
    (shard 0 had said: nobody to wait for). Before every commit carried it, a lost Clocks there
    let the follower answer outside the bound until its next beat."""
    with two_shards(tmp_path, "ssp") as job:
        job.push(0, 0)
        job.push(1, 0)
        job.lead.remove_worker(0, "left")
        job.lead.remove_worker(1, "left")
        job.deliver()
        assert job.s1.role.slowest_clock == NO_LIVE_WORKER
        job.replies.clear()
        for name in ("w2", "w3"):
            job.lead._on_join(name.encode(), "worker", P.Join(name=name, instance=name,
                                                                job_digest=job.s0.job_digest))
        assert [m for m in job.down if isinstance(m, P.Clocks)] == [P.Clocks(version=2, slowest_clock=0)]
        job.down = [m for m in job.down if not isinstance(m, P.Clocks)]      # that send failed
        job.deliver()
        job.token.update({m.worker_id: m.token for m in job.replies if isinstance(m, P.Welcome)})
        for w in (2, 3):
            job.s0._on_pull(f"w{w}".encode(), "worker", P.Pull(worker_id=w, token=job.token[w], min_version=0))
        job.s0.serve_pulls()
        job.assignment.update({int(i.decode()[1:]): m.assignment for i, m in job.answers[0]})
        job.answers[0].clear()
        job.answers[1].clear()
        job.push(2, 0)                    # w2's clock 0 commits (v3); w3 has committed nothing
        assert job.s1.role.slowest_clock == 0
        assert job.answered(0, 2) == [] and job.answered(1, 2) == []
