"""The ROUTER loop both servers share (shard server, ps-bsm): receive, check, dispatch, reply.

It only moves messages. Each one is decoded and validated (``protocol.decode``), its sender's
role (the ``User-Id`` the ZAP handler set in the handshake) is checked against the message
type's allowed roles, and it goes to the handler for its type. A handler returns the reply, or
None when the reply comes later (a pull waiting for a version), or raises :class:`Refused`,
which becomes an ``Error`` reply. Nothing a peer sends raises out of here.

Replies never block: a peer that does not read its replies fills its pipe up to the high-water
mark and further replies to it are dropped and counted, so one stuck or hostile peer cannot
stall the loop. Every refusal is counted by its code.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import zmq

from ps_common import protocol as P
from ps_common.errors import PsError
from ps_common.transport import recv_all, send_frames
from ps_server.timings import Timings

log = logging.getLogger(__name__)

_NOBLOCK = int(zmq.NOBLOCK)

Handler = Callable[[bytes, str, Any], "P.Message | None"]


class Refused(PsError):
    """A request answered with ``Error(code, message)``; state is left unchanged."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Limits:
    """Bounds on what one message may make a server hold (transport config)."""

    max_frames: int = 4
    max_array_bytes: int = 0


class RouterLoop:
    """Dispatch for one ROUTER socket. ``permissions`` maps a message type to the roles that
    may send it; None (ps-bsm without credentials) lets every type through."""

    def __init__(self, sock: zmq.Socket, handlers: Mapping[type, Handler], *, server: str,
                 limits: Limits, permissions: Mapping[type, frozenset[str]] | None = None) -> None:
        self.sock = sock
        self.handlers = dict(handlers)
        self.server = server
        self.limits = limits
        self.permissions = permissions
        self.counters: Counter[str] = Counter()
        self.timings = Timings()
        self._refusals_logged = 0

    # ----- receive --------------------------------------------------------------------------
    def poll(self, timeout_ms: int, *, budget: int = 256) -> int:
        """Wait up to ``timeout_ms`` for input, then handle what is queued (at most ``budget``
        messages, so timers still run under a flood). Returns the number handled."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return 0
        done = 0
        while done < budget:
            try:
                frames = recv_all(self.sock, _NOBLOCK)
            except zmq.Again:
                break
            self.handle(frames)
            done += 1
        return done

    def pending(self) -> bool:
        """Is input queued right now? (Liveness is judged only when nothing is.)"""
        return bool(int(self.sock.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    def handle(self, frames: list[zmq.Frame]) -> None:
        self.counters["received"] += 1
        if len(frames) < 2:
            self.counters["malformed"] += 1
            return
        ident = frames[0].bytes
        if len(frames) - 1 > self.limits.max_frames:
            self.counters["malformed"] += 1
            self.reply(ident, P.Error(code="too_many_frames",
                                      message=f"{len(frames) - 1} frames, at most {self.limits.max_frames}"))
            return
        role = _role(frames[1])
        t0 = time.perf_counter()
        try:
            msg = P.decode(frames[1:], max_array_bytes=self.limits.max_array_bytes)
        except P.ProtocolError as exc:
            self.counters["malformed"] += 1
            self._log_refusal("malformed message: %s", exc)
            self.reply(ident, P.error_for(exc, "malformed"))
            return
        self.timings.since("decode", t0)
        kind = type(msg)
        handler = self.handlers.get(kind)
        if handler is None:
            self._refuse(ident, kind, Refused("unsupported", f"{self.server} does not accept {msg.TYPE}"))
            return
        if self.permissions is not None:
            allowed = self.permissions.get(kind, frozenset())
            if role not in allowed:
                self._refuse(ident, kind, Refused(
                    "forbidden", f"role {role or 'anonymous'!r} may not send {msg.TYPE} "
                                 f"(allowed: {', '.join(sorted(allowed)) or 'nobody'})"))
                return
        t0 = time.perf_counter()
        try:
            reply = handler(ident, role, msg)
        except Refused as exc:
            self._refuse(ident, kind, exc)
            return
        finally:
            self.timings.since(f"handle.{msg.TYPE}", t0)
        self.counters[f"ok.{msg.TYPE}"] += 1
        if reply is not None:
            self.reply(ident, reply)

    def _refuse(self, ident: bytes, kind: type, exc: Refused) -> None:
        self.counters[f"refused.{exc.code}"] += 1
        self._log_refusal("%s refused [%s]: %s", getattr(kind, "TYPE", "?"), exc.code, exc)
        self.reply(ident, P.Error(code=exc.code, message=str(exc)[:2000]))

    def _log_refusal(self, fmt: str, *args: Any) -> None:
        self._refusals_logged += 1
        n = self._refusals_logged
        if worth_logging(n):
            log.warning(fmt + (" (%d refusals so far)" % n if n > 50 else ""), *args)

    # ----- send -----------------------------------------------------------------------------
    def reply(self, ident: bytes, msg: P.Message) -> bool:
        """Send without blocking; False (and counted) when the peer is gone or not reading."""
        try:
            frames = P.encode(msg)
        except Exception as exc:  # e.g. state that msgpack cannot carry: a server bug, not a crash
            log.exception("cannot encode a %s reply", msg.TYPE)
            frames = P.encode(P.error_for(exc, "internal"))
        if isinstance(msg, P.Error):
            self.counters["errors_sent"] += 1
        return self.send_encoded(ident, frames, msg.TYPE)

    def send_encoded(self, ident: bytes, frames: list[Any], kind: str) -> bool:
        """:meth:`reply` for a message encoded already (one part of an answer sent to many)."""
        t0 = time.perf_counter()
        try:
            send_frames(self.sock, [ident, *frames], _NOBLOCK)
            self.timings.since(f"send.{kind}", t0)
            return True
        except zmq.Again:
            self.counters["replies_dropped.hwm"] += 1
        except zmq.ZMQError:  # EHOSTUNREACH (ROUTER_MANDATORY): the peer vanished
            self.counters["replies_dropped.gone"] += 1
        return False


def worth_logging(n: int, first: int = 50) -> bool:
    """Whether the ``n``-th occurrence of something peers can cause at will gets a log line: the
    first ``first``, then one per thousand. A flood of forgeries must not become a flood of log
    lines; counters keep the exact numbers."""
    return n <= first or n % 1000 == 0


def _role(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("User-Id") or "")
    except zmq.ZMQError:  # no metadata: an unauthenticated (NULL mechanism) socket
        return ""

