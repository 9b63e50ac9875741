"""CURVE encryption and authentication for the parameter server's ZeroMQ sockets.

With ``security.curve: true`` every server ROUTER is a CURVE server and every DEALER a CURVE
client: traffic is encrypted, a client must know the servers' public key, and the server only
accepts clients whose public key is in ``security.allowed_clients_dir`` (checked by a ZAP
authenticator thread, one per ZeroMQ context). With ``curve: false`` (the default) every helper
here is a no-op, so the transport calls them unconditionally.

Keys are zmq "certificate" files as written by :func:`zmq.auth.create_certificates`:
``NAME.key`` holds the public key, ``NAME.key_secret`` the public and the secret key (mode 0600).
``ps-keys generate DIR NAME`` makes a pair, ``ps-keys show FILE`` prints a file's public key,
``ps-keys init DIR`` makes a ready-to-use set for a single-host run and prints the YAML for it.

Multi-host deployment
---------------------
1. One server key pair shared by all shards: ``ps-keys generate keys server`` once; copy
   ``server.key_secret`` (secretly, mode 0600) to every server host and ``server.key`` (public,
   not secret) to every host that runs a client.
2. One key pair per client process kind and host: worker, evaluator, launcher
   (``ps-keys generate keys worker-hostA`` ...). Each secret file stays on its own host.
3. Copy every client's public ``.key`` file into ``allowed_clients_dir`` on **every** server
   host (only files ending in ``.key`` are read; secret files there are ignored). The directory
   is re-read when it changes, so a worker added between iterations needs no server restart;
   removing a file refuses *new* connections from that key (open ones stay up). A refused
   client sees only silence (its request times out) and libzmq does not retry a refused
   handshake on that socket: it must dial again with a new socket once its key is allowed.
4. Per-host settings, e.g. through the environment::

       # server hosts
       LBBSP__SECURITY__CURVE=true
       LBBSP__SECURITY__SERVER_SECRET_KEY=/etc/lbbsp/server.key_secret
       LBBSP__SECURITY__ALLOWED_CLIENTS_DIR=/etc/lbbsp/allowed
       # client hosts
       LBBSP__SECURITY__CURVE=true
       LBBSP__SECURITY__SERVER_PUBLIC_KEY=/etc/lbbsp/server.key
       LBBSP__SECURITY__CLIENT_SECRET_KEY=/etc/lbbsp/worker-hostA.key_secret

Shards are also clients of each other (registration with shard 0, shard-to-shard links). A shard
with no ``client_secret_key`` dials with the shared *server* key pair, and the servers' own
public key is always allowed, so shard hosts need nothing beyond the server settings. Likewise
a client with no ``server_public_key`` takes it from ``server_secret_key`` when set.

Security settings are per host and are *not* part of the job digest.

How the server side works
-------------------------
:func:`secure_server_socket` must run before ``bind``. It makes the socket a CURVE server with
the server key pair, sets ``ZAP_DOMAIN`` (:data:`ZAP_DOMAIN`) so the authenticator is
consulted, sets ``ZAP_ENFORCE_DOMAIN`` so the socket *fails closed* (refuses every client) if no
authenticator is running, and starts (or reuses) the context's authenticator. libzmq allows one
ZAP handler per context, so the authenticator is shared and reference counted by the sockets
that use it; :func:`close_socket` (or the returned handle's ``close()``) releases it, and the
last release stops it. Stop authenticators before ``ctx.term()``, which otherwise waits for
the authenticator's sockets: close your sockets with :func:`close_socket`, or call
:func:`stop_authenticators`.
"""

from __future__ import annotations

import argparse
import hmac
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Optional

import zmq
import zmq.auth
from pydantic import BaseModel, ConfigDict
from zmq.utils import z85

from ps_common.credentials import ROLES, CredentialError, generate_master, load_secret, write_role_secret

log = logging.getLogger(__name__)

ZAP_DOMAIN = "lbbsp-ps"
"""The ZAP domain set on CURVE server sockets; the authenticator serves it (and ``*``)."""

_KEY_Z85_LEN = 40


class SecurityError(CredentialError):
    """A security setting or key file is wrong or missing; the message names the key.

    Both a ``ValueError`` and a ``RuntimeError`` so that the existing CLIs' error handlers
    (which catch one or the other) report it cleanly.
    """


class _Strict(BaseModel):
    # Our own strict base (not config.StrictModel): config.py imports this module.
    model_config = ConfigDict(extra="forbid", frozen=True)


class SecurityConfig(_Strict):
    """``security:`` section of the job config. Paths are checked lazily, per role."""

    curve: bool = False
    server_secret_key: Optional[str] = None
    """The servers' key pair (``.key_secret`` file); needed by shards."""
    server_public_key: Optional[str] = None
    """The servers' public key (``.key`` file); needed by clients (else taken from server_secret_key)."""
    client_secret_key: Optional[str] = None
    """This client's key pair (``.key_secret`` file); shards fall back to server_secret_key."""
    allowed_clients_dir: Optional[str] = None
    """Directory of allowed clients' public ``.key`` files; needed by shards. A file's name
    gives its role: ``worker*.key``, ``evaluator*.key``, ``operator*.key`` (``shard*.key`` for
    extra shard keys); other names are refused."""
    client_keys_dir: Optional[str] = None
    """Directory of ``ROLE.key_secret`` files: each process dials with its role's key, so one
    config serves every process of a single-host run (``ps-keys init``)."""
    secret_file: Optional[str] = None
    """Without CURVE: the job secret (``ps-keys secret FILE``): a master file on shards, a
    master or a role file on clients. ps-launch makes one per run."""

    @property
    def mechanism(self) -> str:
        """``curve``, ``plain`` (the job secret) or ``none`` (no credentials configured)."""
        if self.curve:
            return "curve"
        return "plain" if self.secret_file else "none"

    # ----- per-role validation -----------------------------------------------------------
    def require_server(self) -> None:
        """Check what a server (shard) needs: the CURVE keys, or a master job secret."""
        if not self.curve:
            if self.secret_file:
                load_secret(self.secret_file).verifier()
            return
        _require_curve_support()
        self._required("server_secret_key")
        self._required("allowed_clients_dir")
        self.server_keypair()
        d = _path(self.allowed_clients_dir)
        if not d.is_dir():
            raise SecurityError(f"security.allowed_clients_dir: {d} is not a directory")

    def require_client(self, role: str = "worker") -> None:
        """Check what a client of ``role`` needs: its CURVE key pair, or its job secret."""
        if not self.curve:
            if self.secret_file:
                load_secret(self.secret_file).secret_for(role)
            return
        _require_curve_support()
        if not (self.server_public_key or self.server_secret_key):
            raise SecurityError(
                "security.server_public_key is required when security.curve is true "
                "(the servers' public .key file)")
        self.server_public()
        self.client_keypair(role)

    def _required(self, name: str) -> str:
        value = getattr(self, name)
        if not value:
            raise SecurityError(f"security.{name} is required when security.curve is true")
        return value

    # ----- keys --------------------------------------------------------------------------
    def server_keypair(self) -> tuple[bytes, bytes]:
        """(public, secret) z85 keys of the servers."""
        return _load_pair(self._required("server_secret_key"), "security.server_secret_key")

    def server_public(self) -> bytes:
        """The servers' public z85 key, from server_public_key or else server_secret_key."""
        if self.server_public_key:
            return _load_public(self.server_public_key, "security.server_public_key")
        if self.server_secret_key:
            return _load_public(self.server_secret_key, "security.server_secret_key")
        raise SecurityError("security.server_public_key is required when security.curve is true")

    def client_keypair(self, role: str = "worker") -> tuple[bytes, bytes]:
        """(public, secret) z85 keys a process of ``role`` dials with.

        ``client_secret_key`` if set, else ``client_keys_dir/ROLE.key_secret``, else (shards,
        and single-host setups) the server pair. The servers map the key to a role; a key
        whose role is not ``role`` gets this process's messages refused.
        """
        if role == "shard" and self.server_secret_key:
            return _load_pair(self.server_secret_key, "security.server_secret_key")
        if self.client_secret_key:
            return _load_pair(self.client_secret_key, "security.client_secret_key")
        if self.client_keys_dir:
            return _load_pair(_path(self.client_keys_dir) / f"{role}.key_secret",
                              "security.client_keys_dir")
        if self.server_secret_key:
            return _load_pair(self.server_secret_key, "security.server_secret_key")
        raise SecurityError(
            "security.client_secret_key (or client_keys_dir) is required when security.curve "
            "is true (this client's .key_secret file, made by `ps-keys generate DIR NAME`)")


def _require_curve_support() -> None:
    if not zmq.has("curve"):
        raise SecurityError(
            "security.curve is true but this libzmq has no CURVE support (built without "
            "libsodium/tweetnacl): install a pyzmq wheel, which bundles it")


def _path(p: str | os.PathLike) -> Path:
    return Path(os.path.expanduser(str(p)))


# ----- key files ---------------------------------------------------------------------------
def _check_z85(key: bytes | None, what: str, path: Path) -> bytes:
    if not key or len(key) != _KEY_Z85_LEN:
        raise SecurityError(f"{what}: {path} holds a malformed key")
    try:
        z85.decode(key)
    except Exception:
        raise SecurityError(f"{what}: {path} holds a malformed key") from None
    return key


def _read_cert(path: str | os.PathLike, what: str) -> tuple[bytes | None, bytes | None]:
    p = _path(path)
    if not p.is_file():
        raise SecurityError(f"{what}: {p}: no such file")
    try:
        return zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{what}: cannot read key file {p}: {exc}") from None


def _load_pair(path: str | os.PathLike, what: str) -> tuple[bytes, bytes]:
    pub, sec = _read_cert(path, what)
    p = _path(path)
    if sec is None:
        raise SecurityError(
            f"{what}: {p} holds no secret key (give the .key_secret file, not the public .key)")
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: secret key file %s is accessible by others (mode %o); chmod 600 it",
                    what, p, stat.S_IMODE(mode))
    return _check_z85(pub, what, p), _check_z85(sec, what, p)


def _load_public(path: str | os.PathLike, what: str) -> bytes:
    pub, _ = _read_cert(path, what)
    return _check_z85(pub, what, _path(path))


def load_keypair(path: str | os.PathLike) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``.key_secret`` certificate file."""
    return _load_pair(path, str(path))


def load_public_key(path: str | os.PathLike) -> bytes:
    """The public z85 key of a certificate file (public ``.key`` or ``.key_secret``)."""
    return _load_public(path, str(path))


def generate_keypair(directory: str | os.PathLike, name: str, *,
                     overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (mode 0600); return both paths.

    The files are made in a private (0700) temporary directory and moved into place, so the
    secret key is never readable by others, not even briefly. Existing files are kept (an
    error) unless ``overwrite``.
    """
    if not name or "/" in name or os.sep in name or name.startswith("."):
        raise SecurityError(f"bad key name {name!r}: a plain file name is needed")
    d = _path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public, secret = d / f"{name}.key", d / f"{name}.key_secret"
    if not overwrite:
        for f in (public, secret):
            if f.exists():
                raise SecurityError(f"{f} exists; refusing to overwrite a key")
    tmp = Path(tempfile.mkdtemp(prefix=".ps-keys-", dir=d))
    try:
        tpub, tsec = zmq.auth.create_certificates(tmp, name)
        os.chmod(tsec, 0o600)
        os.chmod(tpub, 0o644)
        os.replace(tsec, secret)
        os.replace(tpub, public)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return public, secret


def init_local_keys(directory: str | os.PathLike) -> SecurityConfig:
    """A complete single-host key set under ``directory`` and the config that uses it.

    ``server.key[_secret]``; one pair per client role (``worker``, ``evaluator``,
    ``operator``) in ``directory`` with their public keys in ``allowed/``, so the servers know
    each key's role; every local process shares the one config (``client_keys_dir``).
    """
    d = _path(directory).resolve()
    _, server_secret = generate_keypair(d, "server")
    allowed = d / "allowed"
    allowed.mkdir(exist_ok=True)
    for role in ("worker", "evaluator", "operator"):
        public, _ = generate_keypair(d, role)
        shutil.copyfile(public, allowed / f"{role}.key")
    return SecurityConfig(curve=True, server_secret_key=str(server_secret),
                          server_public_key=str(d / "server.key"), client_keys_dir=str(d),
                          allowed_clients_dir=str(allowed))


def role_of_key_file(name: str) -> str | None:
    """The role an allowed key file grants, from its name: ``worker-hostA.key`` -> worker."""
    stem = name[:-len(".key")] if name.endswith(".key") else name
    for role in ROLES:
        if stem == role or stem.startswith((f"{role}-", f"{role}_", f"{role}.")):
            return role
    return None


# ----- server side: the ZAP authenticator ----------------------------------------------------
class AllowList:
    """ZAP credentials provider: keys of ``ROLE*.key`` files in a directory, plus fixed extras.

    The directory is re-read when its modification time changes (files added, removed,
    renamed) and, at most once a second, when an unknown key knocks. Runs in the
    authenticator's thread. ``role(key)`` is the role a key's file name grants.
    """

    RESCAN_ON_MISS_S = 1.0

    def __init__(self, directory: str | os.PathLike, extra: dict[bytes, str] | None = None) -> None:
        self.directory = _path(directory)
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
            if pub and len(pub) == _KEY_Z85_LEN:
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


def _make_authenticator(ctx: zmq.Context, allow_list: AllowList | None):
    """A ZAP thread whose User-Id is the client's role (CURVE key -> role; PLAIN username)."""
    from zmq.auth.thread import ThreadAuthenticator

    class RoleAuthenticator(ThreadAuthenticator):
        def curve_user_id(self, client_public_key: bytes) -> str:
            key = client_public_key if len(client_public_key) == _KEY_Z85_LEN \
                else z85.encode(client_public_key)
            return allow_list.role(key) if allow_list is not None else ""

        def _authenticate_plain(self, domain: str, username: str, password: str):
            expected = self.passwords.get(domain, self.passwords.get("*", {})).get(username)
            if expected is not None and hmac.compare_digest(expected.encode(), password.encode()):
                return True, b"OK"
            return False, b"Invalid credentials"

    return RoleAuthenticator(ctx, log=logging.getLogger(__name__ + ".zap"))


class _Auth:
    """One context's ZAP handler, configured for one mechanism (CURVE keys or PLAIN secrets)."""

    def __init__(self, ctx: zmq.Context, setting: tuple) -> None:
        self.ctx = ctx
        self.setting = setting
        self.refs = 0
        mechanism = setting[0]
        self.allow_list = None
        if mechanism == "curve":
            _, allowed_dir, server_public = setting
            self.allowed_dir = allowed_dir
            self.allow_list = AllowList(allowed_dir, extra={server_public: "shard"})
        else:
            self.allowed_dir = None
        self.authenticator = _make_authenticator(ctx, self.allow_list)
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


_lock = threading.Lock()
_auths: dict[int, _Auth] = {}  # id(ctx) -> its authenticator
_sock_handles: dict[int, "ServerSecurity"] = {}  # id(sock) -> the handle secure_server_socket made


class ServerSecurity:
    """A secured server socket's claim on its context's authenticator; ``close()`` releases it."""

    def __init__(self, sock: zmq.Socket, auth: _Auth) -> None:
        self._sock_id = id(sock)
        self._auth: _Auth | None = auth

    @property
    def allowed_clients_dir(self) -> Path | None:
        return self._auth.allowed_dir if self._auth else None

    def close(self) -> None:
        with _lock:
            auth, self._auth = self._auth, None
            if _sock_handles.get(self._sock_id) is self:
                del _sock_handles[self._sock_id]
            if auth is None:
                return
            auth.refs -= 1
            if auth.refs > 0 or _auths.get(id(auth.ctx)) is not auth:
                return
            del _auths[id(auth.ctx)]
        auth.stop()

    def __enter__(self) -> "ServerSecurity":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def secure_server_socket(sock: zmq.Socket, cfg: SecurityConfig | None,
                         ctx: zmq.Context | None = None) -> ServerSecurity | None:
    """Make ``sock`` (a ROUTER, not yet bound) authenticate every client as a role.

    CURVE: encrypted, allow-listed keys, the key file's name gives the role. PLAIN (the job
    secret, no CURVE): username = role, password = the role's secret. Either way a ZAP thread
    (one per context, reference counted by the sockets that use it) checks the handshake before
    any message is delivered, and each message's ``User-Id`` is the role. ``ZAP_ENFORCE_DOMAIN``
    makes the socket refuse everyone if no handler runs. Returns None when ``cfg`` configures
    no credentials (open socket: only for services that need none, such as a bare ps-bsm).
    """
    if cfg is None or cfg.mechanism == "none":
        return None
    cfg.require_server()
    if cfg.curve:
        public, secret = cfg.server_keypair()
        allowed = _path(cfg.allowed_clients_dir).resolve()  # type: ignore[arg-type]
        setting: tuple = ("curve", allowed, public)
    else:
        verifier = load_secret(cfg.secret_file).verifier()  # type: ignore[arg-type]
        setting = ("plain", tuple(sorted(verifier.items())))
    ctx = ctx if ctx is not None else sock.context
    with _lock:
        auth = _auths.get(id(ctx))
        if auth is not None and auth.ctx is not ctx:  # a dead context's id was reused
            auth = None
        if auth is None:
            auth = _Auth(ctx, setting)
            _auths[id(ctx)] = auth
        elif auth.setting != setting:
            raise SecurityError(
                "one ZeroMQ context serves one set of credentials (allow-list and server key, "
                "or job secret): another one is in use on this context (use another context)")
        auth.refs += 1
        handle = ServerSecurity(sock, auth)
        _sock_handles[id(sock)] = handle
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


def release_server_socket(sock: zmq.Socket) -> None:
    """Release the authenticator claim :func:`secure_server_socket` made for ``sock`` (if any)."""
    with _lock:
        handle = _sock_handles.get(id(sock))
    if handle is not None:
        handle.close()


def close_socket(sock: zmq.Socket) -> None:
    """Close any socket with linger 0, then release its authenticator claim (if it had one)."""
    sock.close(linger=0)
    release_server_socket(sock)


def stop_authenticators(ctx: zmq.Context | None = None) -> None:
    """Stop the authenticator of ``ctx`` (or all of them), whoever still holds a claim.

    Sockets still open keep refusing clients (ZAP_ENFORCE_DOMAIN). Use before ``ctx.term()``.
    """
    with _lock:
        if ctx is None:
            victims = list(_auths.values())
            _auths.clear()
        else:
            a = _auths.get(id(ctx))
            victims = [a] if a is not None and a.ctx is ctx else []
            if victims:
                del _auths[id(ctx)]
        for a in victims:
            a.refs = 0
        for k in [k for k, h in _sock_handles.items() if h._auth in victims]:
            _sock_handles[k]._auth = None
            del _sock_handles[k]
    for a in victims:
        a.stop()


def authenticator_running(ctx: zmq.Context) -> bool:
    with _lock:
        a = _auths.get(id(ctx))
        return a is not None and a.ctx is ctx and a.authenticator.is_alive()


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


# ----- CLI ---------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """``ps-keys``: make and inspect job secrets and CURVE key files."""
    ap = argparse.ArgumentParser(prog="ps-keys", description="job secrets and CURVE key files")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sec = sub.add_parser("secret", help="write a job secret file (0600): a master, or one role's "
                                        "secret derived from a master (--role R --from MASTER)")
    sec.add_argument("file")
    sec.add_argument("--role", choices=ROLES, default=None)
    sec.add_argument("--from", dest="master", default=None, help="the master secret file")
    sec.add_argument("--force", action="store_true", help="overwrite an existing file")
    g = sub.add_parser("generate", help="write DIR/NAME.key (public) and DIR/NAME.key_secret (0600)")
    g.add_argument("dir")
    g.add_argument("name", help="ROLE or ROLE-HOST: the servers read the role from the file name")
    g.add_argument("--force", action="store_true", help="overwrite existing files")
    s = sub.add_parser("show", help="print the public key (z85) of a .key or .key_secret file")
    s.add_argument("file")
    i = sub.add_parser("init", help="a server key and one key per client role for a single-host "
                                    "run; prints the YAML")
    i.add_argument("dir")
    args = ap.parse_args(argv)
    try:
        if args.cmd == "secret":
            if args.role is None:
                if args.master:
                    raise SecurityError("--from needs --role (a master is made from nothing)")
                generate_master(args.file, overwrite=args.force)
            else:
                if not args.master:
                    raise SecurityError("--role needs --from MASTER_FILE")
                write_role_secret(args.file, load_secret(args.master), args.role, overwrite=args.force)
            print(args.file)
        elif args.cmd == "generate":
            public, secret = generate_keypair(args.dir, args.name, overwrite=args.force)
            print(public)
            print(secret)
        elif args.cmd == "show":
            print(load_public_key(args.file).decode("ascii"))
        else:
            cfg = init_local_keys(args.dir)
            print("security:")
            for k, v in cfg.model_dump().items():
                if v is not None:
                    print(f"  {k}: {json.dumps(v)}")
    except (CredentialError, OSError) as exc:
        print(f"ps-keys: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
