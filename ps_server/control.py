"""The control plane between the coordinator (shard 0) and the follower shards.

Each follower keeps one DEALER connection to the coordinator, authenticated as the ``shard``
role. Up it go RegisterShard, Have (gradients that arrived whole) and a ShardSync every second;
down the same connection, in order, come Commit (with the next plan), Plan, Stop, Clocks (SSP's
slowest clock), Rollback and Finish. Nothing here is lost for good: the coordinator keeps its recent commits, and a
follower that misses one (a dropped connection, a full pipe) sends a ShardSync and is sent
what it lacks. A follower that cannot be caught up, or whose history differs (``log_hash``),
is rolled back to a checkpoint or stops; it never applies anything the coordinator did not
commit.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

import zmq

from ps_common import protocol as P
from ps_common.security.settings import SecurityConfig
from ps_common.timeouts import DEFAULT_TIMEOUTS, Timeouts
from ps_common.transport import Connection, TransportTimeout

log = logging.getLogger(__name__)

#: Commits the coordinator keeps to catch a follower up without a rollback.
COMMIT_LOG = 1024


# ----- follower side ------------------------------------------------------------------------
class CoordinatorLink:
    """A follower's connection to the coordinator (shard 0)."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, security: SecurityConfig | None,
                 hwm: int, timeout_s: float, timeouts: Timeouts = DEFAULT_TIMEOUTS) -> None:
        self.ctx = ctx
        self.timeouts = timeouts
        self.endpoint = endpoint
        self.security = security
        self.hwm = hwm
        self.timeout_s = timeout_s
        self.conn = self._connect()
        self.last_heard = time.monotonic()

    def _connect(self) -> Connection:
        return Connection(self.ctx, self.endpoint, role="shard", security=self.security,
                          timeout_s=self.timeout_s, hwm=self.hwm, timeouts=self.timeouts)

    @property
    def sock(self) -> zmq.Socket:
        return self.conn.sock

    def register(self, msg: P.RegisterShard, deadline_s: float) -> P.Registered:
        """Register, retrying until ``deadline_s`` (the coordinator may start after us)."""
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                reply = self.conn.request(msg, P.Registered, timeout_s=self.timeouts.register_attempt_s)
                assert isinstance(reply, P.Registered)
                self.last_heard = time.monotonic()
                return reply
            except TransportTimeout:
                self.conn.check_auth()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"coordinator {self.endpoint} did not answer within "
                                       f"{deadline_s:.0f}s") from None
                self.conn.close()
                self.conn = self._connect()

    def send(self, msg: P.Message) -> bool:
        try:
            self.conn.send(msg)
            return True
        except TransportTimeout as exc:
            log.warning("%s to the coordinator not sent: %s", msg.TYPE, exc)
            return False

    def receive(self) -> list[P.Message]:
        """Everything the coordinator sent that is queued now (without waiting)."""
        out: list[P.Message] = []
        while True:
            try:
                frames = self.conn.sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return out
            try:
                out.append(P.decode(frames))
                self.last_heard = time.monotonic()
            except P.ProtocolError as exc:
                log.error("malformed message from the coordinator: %s", exc)

    def silent_s(self) -> float:
        return time.monotonic() - self.last_heard

    def close(self) -> None:
        self.conn.close()


# ----- coordinator side -----------------------------------------------------------------------
@dataclass
class Follower:
    shard: int
    ident: bytes
    endpoint: str
    version: int = 0
    last_seen: float = 0.0
    #: the rollback epoch its registration gave it, the last Rollback sent to it since, and since
    #: when its beats have carried an older epoch than that (see Lead._on_shard_sync)
    epoch_floor: int = 0
    rollback: P.Rollback | None = None
    behind_since: float | None = None
    registration: str = ""   # the id of the registration that made it (RegisterShard.registration)
    answered_version: int = 0   # the version its Registered said (a retry is answered the same)
    heard: bool = False   # a message of it arrived since its registration (on ``ident``)

    def rollback_epoch(self) -> int:
        """The epoch this follower's beats carry once it has applied what it was sent."""
        return self.rollback.epoch if self.rollback is not None else self.epoch_floor


class Followers:
    """The coordinator's view of the follower shards and the recent commits it sent them."""

    def __init__(self, send: Callable[[bytes, P.Message], bool]) -> None:
        self._send = send
        self.peers: dict[int, Follower] = {}
        self.log: deque[P.Commit] = deque(maxlen=COMMIT_LOG)
        #: (version, log hash) of this history just before the oldest logged commit: the state a
        #: follower is in when the log's first commit is all it lacks (the job's start, right
        #: after a restore), whose beat could not be checked against the log alone
        self.base: tuple[int, str] | None = None
        self.undelivered = 0

    def register(self, shard: int, ident: bytes, endpoint: str, version: int, epoch_floor: int = 0,
                 registration: str = "", answered_version: int = 0) -> None:
        self.peers[shard] = Follower(shard, ident, endpoint, version, time.monotonic(), epoch_floor,
                                     registration=registration, answered_version=answered_version)

    def behind(self, shard: int, rollback_epoch: int) -> Follower | None:
        """Follower ``shard`` if a message of it that carries ``rollback_epoch`` was sent before
        it applied the last Rollback sent to it (else None)."""
        peer = self.peers.get(shard)
        return peer if peer is not None and rollback_epoch < peer.rollback_epoch() else None

    def seen(self, shard: int, ident: bytes, version: int | None = None) -> Follower | None:
        """A message from follower ``shard`` arrived on ``ident`` (its connection may be new)."""
        peer = self.peers.get(shard)
        if peer is None:
            return None
        peer.ident = ident
        peer.last_seen = time.monotonic()
        peer.heard = True
        if version is not None:
            peer.version = version
        return peer

    def broadcast(self, msg: P.Message, prev_hash: str | None = None) -> None:
        """Send ``msg`` to every follower. A ``Commit`` is logged: ``prev_hash`` is this history's
        log hash just before it (shard 0 sends a commit before applying it)."""
        if isinstance(msg, P.Commit):
            log = self.log
            if len(log) == log.maxlen:           # the oldest leaves: the state after it is the base
                self.base = (log[0].version, log[0].log_hash)
            elif not log:
                self.base = (msg.version - 1, prev_hash) if prev_hash is not None else None
            log.append(msg)
        for peer in self.peers.values():
            if not self._send(peer.ident, msg):
                self.undelivered += 1  # the follower's next ShardSync repairs it

    def send(self, shard: int, msg: P.Message) -> None:
        peer = self.peers.get(shard)
        if peer is not None and not self._send(peer.ident, msg):
            self.undelivered += 1

    def commits_after(self, version: int) -> list[P.Commit] | None:
        """The logged commits after ``version`` in order; None when the log no longer has them."""
        if not self.log or version >= self.log[-1].version:
            return []
        if self.log[0].version > version + 1:
            return None
        return [c for c in self.log if c.version > version]

    def hash_of(self, version: int) -> str | None:
        """This history's log hash at ``version`` if the commit log still holds it (the log is
        cleared when the job goes back to a checkpoint, so what it holds is this history's)."""
        if not self.log:
            return None
        i = version - self.log[0].version     # the logged versions are consecutive
        if i == -1 and self.base is not None and self.base[0] == version:
            return self.base[1]
        return self.log[i].log_hash if 0 <= i < len(self.log) else None

    def clear_log(self) -> None:
        self.log.clear()    # and with it the base: the next commit logged sets it
