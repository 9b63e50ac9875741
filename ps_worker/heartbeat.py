"""The worker's heartbeat: a thread with its own socket beating to the coordinator.

The coordinator declares a worker lost after ``heartbeat.timeout_s`` of silence; the replies
are the coordinator's own beat, so the worker also learns when the coordinator is gone
(``coordinator_silent_s``), restarted (a new ``incarnation``), or no longer counts it as a
member (``dropped``).
"""

from __future__ import annotations

import logging
import threading
import time

import zmq

from ps_common import protocol as P
from ps_common.security.settings import SecurityConfig
from ps_common.security.sockets import secure_client_socket
from ps_common.timeouts import DEFAULT_TIMEOUTS, Timeouts
from ps_common.transport import send

log = logging.getLogger(__name__)


class Heartbeat:
    def __init__(self, ctx: zmq.Context, endpoint: str, worker_id: int, interval_s: float,
                 security: SecurityConfig | None = None, token: str = "",
                 timeouts: Timeouts = DEFAULT_TIMEOUTS) -> None:
        self.token = token
        self.timeouts = timeouts
        self.security = security
        self.ctx = ctx
        self.endpoint = endpoint
        self.worker_id = worker_id
        self.interval_s = interval_s
        self.last_reply = time.monotonic()
        self.incarnation: str | None = None
        self.restarted = False
        self.dropped = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> "Heartbeat":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self.timeouts.heartbeat_stop_s)

    def coordinator_silent_s(self) -> float:
        return time.monotonic() - self.last_reply

    def _run(self) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDTIMEO, int(self.interval_s * 1000))
        secure_client_socket(sock, self.security, "worker")
        sock.connect(self.endpoint)
        try:
            while not self._stop.is_set():
                try:
                    send(sock, P.Heartbeat(worker_id=self.worker_id, token=self.token))
                except zmq.Again:  # coordinator unreachable: coordinator_silent_s() grows
                    pass
                deadline = time.monotonic() + self.interval_s
                while (left := deadline - time.monotonic()) > 0 and not self._stop.is_set():
                    if sock.poll(int(left * 1000) + 1, zmq.POLLIN):
                        self._on_reply(sock.recv_multipart())
        finally:
            sock.close(linger=0)

    def _on_reply(self, frames: list[bytes]) -> None:
        try:
            msg = P.decode(frames)
        except P.ProtocolError as exc:
            log.warning("bad heartbeat reply: %s", exc)
            return
        self.last_reply = time.monotonic()
        if isinstance(msg, P.HeartbeatReply):
            if self.incarnation is not None and msg.incarnation != self.incarnation:
                self.restarted = True
            self.incarnation = msg.incarnation
        elif isinstance(msg, P.Error) and msg.code == "unknown_worker":
            self.dropped = True
