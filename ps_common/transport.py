"""ZeroMQ plumbing: sockets that move frames and nothing else.

Servers own a ROUTER, clients a DEALER per server. Every socket closes with linger 0, every
receive takes a timeout, and the server ROUTER caps incoming message size (ZMQ_MAXMSGSIZE), so
one oversized message cannot exhaust memory. Messages are encoded and decoded by
:mod:`ps_common.protocol`; this module never looks inside them.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Container, Sequence

import zmq

from ps_common import protocol
from ps_common.protocol import Message
from ps_common.security import (SecurityConfig, close_socket, secure_client_socket,
                                secure_server_socket, timeout_hint)

log = logging.getLogger(__name__)


class TransportTimeout(TimeoutError):
    """No reply within the allotted time: the peer is slow, gone, or never existed."""


def bind_address(host: str, port: int) -> str:
    """A bind string; port 0 means "any free port" (the bound one is read back afterwards)."""
    return f"tcp://{host}:{'*' if port == 0 else port}"


def make_router(ctx: zmq.Context, address: str, *, max_msg_bytes: int = -1,
                security: SecurityConfig | None = None) -> tuple[zmq.Socket, str]:
    """A bound ROUTER and the endpoint it actually got (port 0 resolved); CURVE if configured."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished peer raises, not drops
    if max_msg_bytes > 0:
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_bytes)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    try:
        secure_server_socket(sock, security, ctx)  # before bind
        sock.bind(address)
    except BaseException:
        close_socket(sock)
        raise
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    return sock, endpoint


def advertised(endpoint: str, host: str | None) -> str:
    """Replace the host of a bound endpoint with the one other machines should dial."""
    if not host:
        return endpoint
    return re.sub(r"^tcp://[^:]+:", f"tcp://{host}:", endpoint)


def send(sock: zmq.Socket, msg: Message, identity: bytes | None = None) -> None:
    """Send a message, zero-copy for array frames."""
    frames: list[Any] = protocol.encode(msg)
    if identity is not None:
        frames = [identity, *frames]
    sock.send_multipart(frames, copy=False)


@dataclass
class Request:
    """One message a ROUTER received: who sent it, and either the message or the answer to send
    instead of dispatching it (malformed, or a type this server does not take)."""

    ident: bytes
    msg: Message | None = None
    refusal: protocol.Error | None = None
    malformed: bool = False


def parse_request(frames: list[zmq.Frame], *, max_array_bytes: int, accepted: Container[type],
                  server: str) -> Request | None:
    """Decode a ROUTER message for dispatch; None when not even an identity came with it."""
    if len(frames) < 2:
        return None
    ident, body = frames[0].bytes, frames[1:]
    try:
        msg = protocol.decode(body, max_array_bytes=max_array_bytes)
    except protocol.ProtocolError as exc:
        log.warning("malformed message: %s", exc)
        return Request(ident, refusal=protocol.error_for(exc, "malformed"), malformed=True)
    if type(msg) not in accepted:
        return Request(ident, refusal=protocol.Error(code="unsupported",
                                                     message=f"{server} does not accept {msg.TYPE}"))
    return Request(ident, msg)


def recv_frames(sock: zmq.Socket, timeout_s: float) -> list[zmq.Frame] | None:
    """Frames of the next message, or None if nothing arrived within ``timeout_s``."""
    if sock.poll(int(timeout_s * 1000), zmq.POLLIN) == 0:
        return None
    return sock.recv_multipart(copy=False)


class Connection:
    """A DEALER to one server with request/reply helpers and hard timeouts."""

    def __init__(self, ctx: zmq.Context, endpoint: str, *, timeout_s: float = 30.0,
                 max_array_bytes: int = 1 << 32, security: SecurityConfig | None = None) -> None:
        self.endpoint = endpoint
        self.timeout_s = timeout_s
        self.max_array_bytes = max_array_bytes
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        # A DEALER with no live pipe (peer gone, handshake refused) blocks on send: bound it.
        self.sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
        self.security = security
        try:
            secure_client_socket(self.sock, security)  # before connect
        except BaseException:
            self.sock.close(linger=0)
            raise
        self.sock.connect(endpoint)

    def send(self, msg: Message) -> None:
        try:
            send(self.sock, msg)
        except zmq.Again:
            raise TransportTimeout(
                f"cannot send to {self.endpoint}: no connection{timeout_hint(self.security)}") from None

    def recv(self, timeout_s: float | None = None) -> Message:
        """The next message; a server Error is raised as :class:`RemoteError`."""
        t = self.timeout_s if timeout_s is None else timeout_s
        frames = recv_frames(self.sock, t)
        if frames is None:
            raise TransportTimeout(f"no reply from {self.endpoint} within {t:.1f}s{timeout_hint(self.security)}")
        msg = protocol.decode(frames, max_array_bytes=self.max_array_bytes)
        if isinstance(msg, protocol.Error):
            raise RemoteError(msg.code, msg.message, self.endpoint)
        return msg

    def request(self, msg: Message, expect: type[Message] | Sequence[type[Message]],
                timeout_s: float | None = None) -> Message:
        self.send(msg)
        reply = self.recv(timeout_s)
        kinds = tuple(expect) if isinstance(expect, (list, tuple)) else (expect,)
        if not isinstance(reply, kinds):
            raise protocol.ProtocolError(
                f"{self.endpoint}: expected {[k.TYPE for k in kinds]}, got {reply.TYPE}"
            )
        return reply

    def close(self, linger_ms: int = 0) -> None:
        self.sock.close(linger=linger_ms)


class RemoteError(RuntimeError):
    """The server answered with an Error message."""

    def __init__(self, code: str, message: str, endpoint: str) -> None:
        super().__init__(f"{endpoint} refused the request [{code}]: {message}")
        self.code = code
        self.remote_message = message
