"""The server side of authentication: one ZAP handler per ZeroMQ context.

A secured server socket sets ``ZAP_DOMAIN`` (:data:`ZAP_DOMAIN`), so libzmq asks the context's
ZAP handler about every handshake before a single message of the connection is delivered. The
handler answers with the client's role as the ZAP User-Id: the role its CURVE key's file name
grants (:class:`AllowList`), or the PLAIN username once its password (the role's secret) checks
out. libzmq allows one ZAP handler per context, so the handler is shared by the server sockets
of a context and reference counted by them: each holds a claim (:class:`ServerSecurity`), and
the last release stops the handler. Stop handlers before ``ctx.term()``, which otherwise waits
for the handler's sockets: close your sockets with
:func:`~ps_common.security.sockets.close_socket`, or call :func:`stop_authenticators`.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import os
import threading
import time
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.base import Authenticator
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from ps_common.security.credentials import ROLES
from ps_common.security.keys import KEY_Z85_LEN, SecurityError, expand, role_of_key_file

log = logging.getLogger(__name__)

ZAP_DOMAIN = "lbbsp-ps"
"""The ZAP domain set on secured server sockets; the handler serves it (and ``*``)."""

Setting = tuple
"""What a handler checks: ``("curve", allowed_dir, server_public_key)`` or
``("plain", ((role, secret), ...))``; one context serves one setting."""


class AllowList:
    """ZAP credentials provider: keys of ``ROLE*.key`` files in a directory, plus fixed extras.

    The directory is re-read when its modification time changes (files added, removed,
    renamed) and, at most once a second, when an unknown key knocks. Runs in the
    authenticator's thread. ``role(key)`` is the role a key's file name grants.
    """

    RESCAN_ON_MISS_S = 1.0

    def __init__(self, directory: str | os.PathLike, extra: dict[bytes, str] | None = None) -> None:
        self.directory = expand(directory)
        self.extra = dict(extra or {})
        self._roles: dict[bytes, str] = {}
        self._mtime: int | None = None
        self._scanned = 0.0
        self._denied_logged: set[bytes] = set()
        self._scan()

    def _scan(self) -> None:
        roles: dict[bytes, str] = {}
        try:
            self._mtime = self.directory.stat().st_mtime_ns
            files = sorted(self.directory.glob("*.key"))
        except OSError as exc:
            log.error("allowed_clients_dir %s unreadable: %s (no client is allowed)", self.directory, exc)
            self._mtime, files = None, []
        for f in files:
            role = role_of_key_file(f.name)
            if role is None:
                log.warning("allowed client key %s ignored: name it ROLE.key or ROLE-NAME.key with "
                            "ROLE one of %s", f, ", ".join(ROLES))
                continue
            try:
                pub, _ = zmq.auth.load_certificate(f)
            except (OSError, ValueError) as exc:
                log.warning("skipping allowed client key %s: %s", f, exc)
                continue
            if pub and len(pub) == KEY_Z85_LEN:
                roles.setdefault(pub, role)
        self._roles = roles
        self._scanned = time.monotonic()

    def keys(self) -> frozenset[bytes]:
        try:
            mtime = self.directory.stat().st_mtime_ns
        except OSError:
            mtime = None
        if mtime != self._mtime:
            self._scan()
        return frozenset(self._roles) | frozenset(self.extra)

    def allows(self, key: bytes) -> bool:
        if key in self.keys():
            return True
        if time.monotonic() - self._scanned >= self.RESCAN_ON_MISS_S:
            self._scan()
            return key in self._roles
        return False

    def role(self, key: bytes) -> str:
        return self.extra.get(key) or self._roles.get(key, "")

    def callback(self, domain: str, key: bytes) -> bool:  # the zmq.auth provider protocol
        ok = self.allows(key)
        if not ok and key not in self._denied_logged and len(self._denied_logged) < 1000:
            self._denied_logged.add(key)
            log.warning("CURVE client refused: public key %s is not in %s",
                        key.decode("ascii", "replace"), self.directory)
        return ok


ZAP_ENDPOINT = "inproc://zeromq.zap.01"
"""Where libzmq asks a context's ZAP handler (fixed by the ZAP spec, one per context)."""


class _UnbindingAuthenticator(Authenticator):
    """Unbinds the ZAP socket before closing it, so that the address is free when stop returns.

    libzmq frees an inproc address only when its reaper thread destroys the closed socket, some
    time after ``close()`` returns; a handler started on the same context in that gap (a shard
    stopped and another started in one process) failed to bind. Unbinding an inproc address is
    synchronous. :class:`ThreadAuthenticator` calls this ``stop`` after joining its thread, so the
    socket is this thread's to touch.
    """

    def stop(self) -> None:
        if self.zap_socket is not None:
            try:
                self.zap_socket.unbind(ZAP_ENDPOINT)
            except zmq.ZMQError:
                pass  # never bound: its bind is what failed
        super().stop()


_PIPE_NUMBERS = itertools.count()


class _RoleAuthenticator(ThreadAuthenticator, _UnbindingAuthenticator):
    """A ZAP thread whose User-Id is the client's role (CURVE key -> role; PLAIN username)."""

    def __init__(self, ctx: zmq.Context, allow_list: AllowList | None) -> None:
        super().__init__(ctx, log=logging.getLogger(__name__ + ".zap"))
        self.allow_list = allow_list
        # pyzmq names the thread's pipe by id(self), which a new authenticator reuses once the
        # last one is collected, while libzmq may not have freed that address yet (see above).
        self.pipe_endpoint = f"inproc://lbbsp-zap-pipe-{next(_PIPE_NUMBERS)}"

    def stop(self) -> None:
        if self.pipe is not None and self.thread is None:
            # start() failed between binding the pipe and starting the thread: nobody would
            # read the TERMINATE that ThreadAuthenticator.stop sends, and the send would block.
            self.pipe.close(linger=0)
            self.pipe = None
        super().stop()

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = client_public_key if len(client_public_key) == KEY_Z85_LEN else z85.encode(client_public_key)
        return self.allow_list.role(key) if self.allow_list is not None else ""

    def _authenticate_plain(self, domain: str, username: str, password: str):
        expected = self.passwords.get(domain, self.passwords.get("*", {})).get(username)
        if expected is not None and hmac.compare_digest(expected.encode(), password.encode()):
            return True, b"OK"
        return False, b"Invalid credentials"


class ZapHandler:
    """One context's running ZAP handler, configured for one setting, and the claims on it."""

    def __init__(self, ctx: zmq.Context, setting: Setting) -> None:
        self.ctx = ctx
        self.setting = setting
        self.claims: dict[int, ServerSecurity] = {}  # id(sock) -> the claim that socket holds
        mechanism = setting[0]
        self.allow_list = None
        if mechanism == "curve":
            _, allowed_dir, server_public = setting
            self.allowed_dir: Path | None = allowed_dir
            self.allow_list = AllowList(allowed_dir, extra={server_public: "shard"})
        else:
            self.allowed_dir = None
        self.authenticator = _RoleAuthenticator(ctx, self.allow_list)
        try:
            self.authenticator.start()
        except zmq.ZMQError as exc:
            self.authenticator.stop()
            raise SecurityError(
                f"cannot start the authenticator on this context ({exc}): another ZAP "
                "handler is already bound to it") from None
        if mechanism == "curve":
            for domain in (ZAP_DOMAIN, "*"):
                self.authenticator.configure_curve_callback(domain, credentials_provider=self.allow_list)
        else:
            passwords = dict(setting[1])
            for domain in (ZAP_DOMAIN, "*"):
                self.authenticator.configure_plain(domain, passwords)

    def stop(self) -> None:
        self.authenticator.stop()


class ServerSecurity:
    """A secured server socket's claim on its context's handler; ``close()`` releases it."""

    def __init__(self, sock: zmq.Socket, handler: ZapHandler) -> None:
        self.sock_id = id(sock)
        self.handler: ZapHandler | None = handler

    @property
    def allowed_clients_dir(self) -> Path | None:
        return self.handler.allowed_dir if self.handler else None

    def close(self) -> None:
        _HANDLERS.release(self)

    def __enter__(self) -> "ServerSecurity":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Handlers:
    """The ZAP handler of each context in this process, by context.

    The one process-global of the security package, and it must be one: libzmq binds one ZAP
    handler per context, so every secured server socket on a context, whoever made it (two
    shards of an in-process test cluster on ``zmq.Context.instance()``, a shard beside ps-bsm),
    must share that context's handler and can find it only from the context (pyzmq contexts
    and sockets take no attributes of ours). Each handler owns the claims on it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_ctx: dict[int, ZapHandler] = {}  # id(ctx) -> its handler

    def _of(self, ctx: zmq.Context) -> ZapHandler | None:
        handler = self._by_ctx.get(id(ctx))
        return handler if handler is not None and handler.ctx is ctx else None  # else: a dead context's id

    def claim(self, ctx: zmq.Context, sock: zmq.Socket, setting: Setting) -> ServerSecurity:
        """A claim for ``sock`` on the handler of ``ctx``, started with ``setting`` if none runs."""
        with self._lock:
            handler = self._of(ctx)
            if handler is None:
                handler = ZapHandler(ctx, setting)
                self._by_ctx[id(ctx)] = handler
            elif handler.setting != setting:
                raise SecurityError(
                    "one ZeroMQ context serves one set of credentials (allow-list and server key, "
                    "or job secret): another one is in use on this context (use another context)")
            handle = ServerSecurity(sock, handler)
            handler.claims[handle.sock_id] = handle
            return handle

    def release(self, handle: ServerSecurity) -> None:
        """Drop one claim (again: nothing); the last claim on a handler stops it."""
        with self._lock:
            handler, handle.handler = handle.handler, None
            if handler is None:
                return
            if handler.claims.get(handle.sock_id) is handle:
                del handler.claims[handle.sock_id]
            if handler.claims or self._by_ctx.get(id(handler.ctx)) is not handler:
                return
            del self._by_ctx[id(handler.ctx)]
        handler.stop()

    def release_socket(self, sock: zmq.Socket) -> None:
        with self._lock:
            handle = next((h.claims[id(sock)] for h in self._by_ctx.values() if id(sock) in h.claims), None)
        if handle is not None:
            self.release(handle)

    def stop(self, ctx: zmq.Context | None) -> None:
        with self._lock:
            if ctx is None:
                victims = list(self._by_ctx.values())
                self._by_ctx.clear()
            else:
                handler = self._of(ctx)
                victims = [handler] if handler is not None else []
                if victims:
                    del self._by_ctx[id(ctx)]
            for handler in victims:
                for handle in handler.claims.values():
                    handle.handler = None
                handler.claims.clear()
        for handler in victims:
            handler.stop()

    def running(self, ctx: zmq.Context) -> bool:
        with self._lock:
            handler = self._of(ctx)
            return handler is not None and handler.authenticator.is_alive()


_HANDLERS = _Handlers()


def claim_authenticator(ctx: zmq.Context, sock: zmq.Socket, setting: Setting) -> ServerSecurity:
    """Have the ZAP handler of ``ctx`` check ``sock``'s clients against ``setting``."""
    return _HANDLERS.claim(ctx, sock, setting)


def release_server_socket(sock: zmq.Socket) -> None:
    """Release the claim :func:`~ps_common.security.sockets.secure_server_socket` made for
    ``sock`` (if any)."""
    _HANDLERS.release_socket(sock)


def stop_authenticators(ctx: zmq.Context | None = None) -> None:
    """Stop the handler of ``ctx`` (or all of them), whoever still holds a claim.

    Sockets still open keep refusing clients (ZAP_ENFORCE_DOMAIN). Use before ``ctx.term()``.
    """
    _HANDLERS.stop(ctx)


def authenticator_running(ctx: zmq.Context) -> bool:
    return _HANDLERS.running(ctx)
