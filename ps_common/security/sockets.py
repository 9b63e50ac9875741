"""What the transport calls: make a ROUTER authenticate its clients, a DEALER authenticate as a role.

Both run before ``bind``/``connect`` and do nothing when the config sets no credentials.
"""

from __future__ import annotations

import logging

import zmq

from ps_common.security.authenticator import (
    ZAP_DOMAIN,
    ServerSecurity,
    Setting,
    claim_authenticator,
    release_server_socket,
)
from ps_common.security.credentials import load_secret
from ps_common.security.keys import expand
from ps_common.security.settings import SecurityConfig

log = logging.getLogger(__name__)


def secure_server_socket(sock: zmq.Socket, cfg: SecurityConfig | None,
                         ctx: zmq.Context | None = None) -> ServerSecurity | None:
    """Make ``sock`` (a ROUTER, not yet bound) authenticate every client as a role.

    CURVE: encrypted, allow-listed keys, the key file's name gives the role. PLAIN (the job
    secret, no CURVE): username = role, password = the role's secret. Either way the context's
    ZAP handler (:mod:`~ps_common.security.authenticator`) checks the handshake before any
    message is delivered, and each message's ``User-Id`` is the role. ``ZAP_ENFORCE_DOMAIN``
    makes the socket refuse everyone if no handler runs. Returns None when ``cfg`` configures
    no credentials (open socket: only for services that need none, such as a bare ps-bsm).
    """
    if cfg is None or cfg.mechanism == "none":
        return None
    cfg.require_server()
    if cfg.curve:
        public, secret = cfg.server_keypair()
        allowed = expand(cfg.allowed_clients_dir).resolve()  # type: ignore[arg-type]
        setting: Setting = ("curve", allowed, public)
    else:
        verifier = load_secret(cfg.secret_file).verifier()  # type: ignore[arg-type]
        setting = ("plain", tuple(sorted(verifier.items())))
    handle = claim_authenticator(ctx if ctx is not None else sock.context, sock, setting)
    try:
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        try:  # without an authenticator the socket then refuses everyone instead of no one
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        except (AttributeError, zmq.ZMQError):
            log.debug("ZAP_ENFORCE_DOMAIN unsupported by this libzmq")
        if cfg.curve:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
        else:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
    except BaseException:
        handle.close()
        raise
    return handle


def secure_client_socket(sock: zmq.Socket, cfg: SecurityConfig | None, role: str = "worker") -> None:
    """Make ``sock`` (a DEALER, not yet connected) authenticate as ``role``; no-op without credentials."""
    if cfg is None or cfg.mechanism == "none":
        return
    cfg.require_client(role)
    if cfg.curve:
        public, secret = cfg.client_keypair(role)
        sock.setsockopt(zmq.CURVE_SERVERKEY, cfg.server_public())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    else:
        sock.setsockopt(zmq.PLAIN_USERNAME, role.encode())
        sock.setsockopt(zmq.PLAIN_PASSWORD, load_secret(cfg.secret_file).secret_for(role).encode())  # type: ignore[arg-type]


def close_socket(sock: zmq.Socket) -> None:
    """Close any socket with linger 0, then release its authenticator claim (if it had one)."""
    sock.close(linger=0)
    release_server_socket(sock)


def timeout_hint(cfg: SecurityConfig | None) -> str:
    """Text to append to a "no reply" error: a refused handshake looks like silence."""
    if cfg is None or cfg.mechanism == "none":
        return ""
    if cfg.curve:
        return (" (with security.curve on, a refused CURVE handshake looks like this: is this "
                "client's public key, named for its role, in the servers' allowed_clients_dir, and "
                "is security.server_public_key the servers' key?)")
    return (" (a refused job secret looks like this: do the servers and this process use the "
            "same job's security.secret_file?)")
