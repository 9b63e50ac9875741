"""Credentials on real ROUTER/DEALER pairs on loopback: CURVE and the allow-list (each key's file
name is its role), the job secret (PLAIN, one secret per role), and what the server learns of each
client (its role, in every message's User-Id). The files alone: tests/unit/test_security_files.py."""

from __future__ import annotations

import shutil

import pytest
import zmq
from pydantic import ValidationError

from ps_common.security.authenticator import ZAP_DOMAIN, authenticator_running, stop_authenticators
from ps_common.security.keys import SecurityError, generate_keypair, role_of_key_file
from ps_common.security.settings import SecurityConfig, init_local_keys
from ps_common.security.sockets import close_socket, secure_client_socket, secure_server_socket, timeout_hint

pytestmark = [
    pytest.mark.timeout(20),
    pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE"),
]

REFUSED_WAIT_MS = 1000  # how long a refused client gets to sneak a message through
OK_WAIT_MS = 5000


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """Server pair, an allowed client, a stranger; allowed/ holds only the allowed client."""
    d = tmp_path_factory.mktemp("keys")
    cfg = init_local_keys(d)
    _, stranger = generate_keypair(d, "worker-stranger")
    _, impostor = generate_keypair(d, "impostor-server")
    _, unnamed = generate_keypair(d, "laptop")
    return {"dir": d, "cfg": cfg, "stranger": str(stranger), "impostor": str(impostor),
            "worker": str(d / "worker.key_secret"), "unnamed": str(unnamed)}


_OPEN: dict[int, list[zmq.Socket]] = {}  # id(context) -> sockets the test made


@pytest.fixture
def ctx():
    c = zmq.Context()
    _OPEN[id(c)] = []
    yield c
    for s in _OPEN.pop(id(c)):
        close_socket(s)
    stop_authenticators(c)
    c.term()


def _router(ctx, cfg: SecurityConfig) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.ROUTER)
    _OPEN[id(ctx)].append(sock)
    sock.setsockopt(zmq.LINGER, 0)
    secure_server_socket(sock, cfg, ctx)
    sock.bind("tcp://127.0.0.1:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _dealer(ctx, endpoint: str, cfg: SecurityConfig | None, role: str = "worker") -> zmq.Socket:
    sock = ctx.socket(zmq.DEALER)
    _OPEN[id(ctx)].append(sock)
    sock.setsockopt(zmq.LINGER, 0)
    secure_client_socket(sock, cfg, role)
    sock.connect(endpoint)
    return sock


def _client_cfg(keys, **changes) -> SecurityConfig:
    c = keys["cfg"]
    base = dict(curve=True, server_public_key=c.server_public_key, client_keys_dir=c.client_keys_dir)
    base.update(changes)
    return SecurityConfig(**base)


def _server_cfg(keys) -> SecurityConfig:
    c = keys["cfg"]
    return SecurityConfig(curve=True, server_secret_key=c.server_secret_key,
                          allowed_clients_dir=c.allowed_clients_dir)


def _round_trip(router: zmq.Socket, dealer: zmq.Socket) -> zmq.Frame:
    dealer.send(b"ping")
    assert router.poll(OK_WAIT_MS), "the allowed client's message never arrived"
    ident, body = router.recv_multipart(copy=False)
    assert body.bytes == b"ping"
    router.send_multipart([ident, b"pong"])
    assert dealer.poll(OK_WAIT_MS), "the reply never arrived"
    assert dealer.recv() == b"pong"
    return body


def _refused(router: zmq.Socket, dealer: zmq.Socket) -> None:
    dealer.send(b"let me in")
    assert router.poll(REFUSED_WAIT_MS) == 0, "a refused client got a message through"


# ----- curve on -------------------------------------------------------------------------------
def test_allowed_client_round_trip(ctx, keys):
    router, ep = _router(ctx, _server_cfg(keys))
    assert router.getsockopt(zmq.CURVE_SERVER) == 1
    assert router.getsockopt_string(zmq.ZAP_DOMAIN) == ZAP_DOMAIN
    assert authenticator_running(ctx)
    for role in ("worker", "evaluator", "operator"):
        body = _round_trip(router, _dealer(ctx, ep, _client_cfg(keys), role))
        # ZAP tells the server who the client is: the role its key's file name grants
        assert body.get("User-Id") == role
    body = _round_trip(router, _dealer(ctx, ep, _server_cfg(keys), "shard"))
    assert body.get("User-Id") == "shard", "the servers' own key is the shard role"


def test_a_key_whose_file_name_names_no_role_is_refused(ctx, keys, tmp_path):
    allowed = tmp_path / "allowed"
    shutil.copytree(keys["cfg"].allowed_clients_dir, allowed)
    shutil.copyfile(keys["dir"] / "laptop.key", allowed / "laptop.key")
    server = _server_cfg(keys).model_copy(update={"allowed_clients_dir": str(allowed)})
    router, ep = _router(ctx, server)
    _refused(router, _dealer(ctx, ep, _client_cfg(keys, client_secret_key=keys["unnamed"])))
    assert role_of_key_file("worker-hostA.key") == "worker"
    assert role_of_key_file("operator.key") == "operator"
    assert role_of_key_file("workers.key") is None and role_of_key_file("laptop.key") is None


def test_client_not_in_allowed_dir_is_refused_until_its_key_is_added(ctx, keys, tmp_path):
    allowed = tmp_path / "allowed"
    shutil.copytree(keys["cfg"].allowed_clients_dir, allowed)
    server = _server_cfg(keys).model_copy(update={"allowed_clients_dir": str(allowed)})
    router, ep = _router(ctx, server)
    dealer = _dealer(ctx, ep, _client_cfg(keys, client_secret_key=keys["stranger"]))
    _refused(router, dealer)
    # the allow-list is re-read when the directory changes: no server restart needed. (libzmq
    # does not retry a handshake the authenticator refused, so the client dials again.)
    shutil.copyfile(keys["dir"] / "worker-stranger.key", allowed / "worker-stranger.key")
    _round_trip(router, _dealer(ctx, ep, _client_cfg(keys, client_secret_key=keys["stranger"])))


def test_plain_client_is_refused(ctx, keys):
    router, ep = _router(ctx, _server_cfg(keys))
    _refused(router, _dealer(ctx, ep, None))


def test_client_with_wrong_server_key_is_refused(ctx, keys):
    router, ep = _router(ctx, _server_cfg(keys))
    _refused(router, _dealer(ctx, ep, _client_cfg(keys, server_public_key=keys["impostor"])))


def test_shard_dials_with_the_server_pair(ctx, keys):
    """A shard config (server keys only) works as a client of another shard."""
    shard_cfg = _server_cfg(keys)
    shard_cfg.require_client("shard")
    router, ep = _router(ctx, shard_cfg)
    _round_trip(router, _dealer(ctx, ep, shard_cfg, "shard"))


def test_one_authenticator_per_context_refcounted_and_fail_closed(ctx, keys, tmp_path):
    server = _server_cfg(keys)
    r1, ep1 = _router(ctx, server)
    r2, ep2 = _router(ctx, server)  # same context: the authenticator is shared
    _round_trip(r2, _dealer(ctx, ep2, _client_cfg(keys)))
    other = server.model_copy(update={"allowed_clients_dir": str(tmp_path)})
    with pytest.raises(SecurityError, match="one set of credentials"):
        secure_server_socket(ctx.socket(zmq.ROUTER), other, ctx)
    close_socket(r2)
    assert authenticator_running(ctx), "released while r1 still uses it"
    # stopped with a CURVE socket still open: that socket refuses everyone (ZAP_ENFORCE_DOMAIN)
    stop_authenticators(ctx)
    assert not authenticator_running(ctx)
    _refused(r1, _dealer(ctx, ep1, _client_cfg(keys)))
    close_socket(r1)  # releasing after a forced stop is harmless


def test_last_release_stops_the_authenticator(keys):
    c = zmq.Context()
    sock = c.socket(zmq.ROUTER)
    handle = secure_server_socket(sock, _server_cfg(keys), c)
    assert handle is not None and authenticator_running(c)
    close_socket(sock)
    assert not authenticator_running(c)
    handle.close()  # idempotent
    c.term()  # would hang if the authenticator's sockets were still open


def test_a_released_authenticator_frees_its_address_at_once(keys):
    """The last release on a context and the next claim on it, back to back, must not race.

    libzmq frees an inproc address when its reaper thread destroys the socket, after close()
    returns; a shard stopped and another started on the same context (a restart in one
    process) used to find the ZAP address still taken. Once in CI, so many rounds here.
    """
    c = zmq.Context()
    try:
        for _ in range(300):
            sock = c.socket(zmq.ROUTER)
            try:
                secure_server_socket(sock, _server_cfg(keys), c)
                assert authenticator_running(c)
            finally:
                close_socket(sock)  # also when the claim failed: term() waits for open sockets
            assert not authenticator_running(c)
    finally:
        stop_authenticators(c)
        c.term()


# ----- curve off ------------------------------------------------------------------------------
def test_curve_off_helpers_are_noops(ctx):
    off = SecurityConfig()
    off.require_server()
    off.require_client()
    router, ep = _router(ctx, off)
    assert router.getsockopt(zmq.CURVE_SERVER) == 0
    assert not authenticator_running(ctx)
    assert secure_server_socket(router, None, ctx) is None
    _round_trip(router, _dealer(ctx, ep, off))
    assert timeout_hint(off) == ""


# ----- validation -----------------------------------------------------------------------------
def test_validation_errors_name_the_key(keys, tmp_path):
    c = keys["cfg"]
    with pytest.raises(SecurityError, match=r"^security\.server_secret_key is required when security\.curve is true"):
        SecurityConfig(curve=True, allowed_clients_dir=c.allowed_clients_dir).require_server()
    with pytest.raises(SecurityError, match=r"security\.allowed_clients_dir is required"):
        SecurityConfig(curve=True, server_secret_key=c.server_secret_key).require_server()
    with pytest.raises(SecurityError, match=r"security\.allowed_clients_dir: .* is not a directory"):
        SecurityConfig(curve=True, server_secret_key=c.server_secret_key,
                       allowed_clients_dir=str(tmp_path / "nope")).require_server()
    with pytest.raises(SecurityError, match=r"security\.server_public_key is required"):
        SecurityConfig(curve=True, client_keys_dir=c.client_keys_dir).require_client()
    with pytest.raises(SecurityError, match=r"security\.client_secret_key \(or client_keys_dir\) is required"):
        SecurityConfig(curve=True, server_public_key=c.server_public_key).require_client()
    with pytest.raises(SecurityError, match=r"security\.client_secret_key: .* holds no secret key"):
        _client_cfg(keys, client_secret_key=c.server_public_key).require_client()
    with pytest.raises(SecurityError, match=r"security\.server_public_key: .*: no such file"):
        _client_cfg(keys, server_public_key=str(tmp_path / "missing.key")).require_client()
    bad = tmp_path / "bad.key"
    bad.write_text('curve\n    public-key = "tooshort"\n')
    with pytest.raises(SecurityError, match=r"security\.server_public_key: .* malformed key"):
        _client_cfg(keys, server_public_key=str(bad)).require_client()
    with pytest.raises(SecurityError, match=r"security\.client_keys_dir: .*evaluator\.key_secret: no such file"):
        _client_cfg(keys, client_keys_dir=str(tmp_path)).require_client("evaluator")
    # the helpers validate too, before touching the socket
    with zmq.Context() as c2:
        s = c2.socket(zmq.DEALER)
        with pytest.raises(SecurityError, match="client_secret_key .or client_keys_dir. is required"):
            secure_client_socket(s, SecurityConfig(curve=True, server_public_key=c.server_public_key))
        s.close(linger=0)
    with pytest.raises(ValidationError):
        SecurityConfig(curve=True, sever_secret_key="typo")  # extra keys are errors
    with pytest.raises(ValidationError):
        c.curve = False  # frozen
    assert "allowed_clients_dir" in timeout_hint(c)


# ----- the job secret (PLAIN) -----------------------------------------------------------------
def test_job_secret_authenticates_each_role(ctx, secrets):
    server = SecurityConfig(secret_file=secrets["master"])
    assert server.mechanism == "plain"
    router, ep = _router(ctx, server)
    assert router.getsockopt(zmq.PLAIN_SERVER) == 1
    for role in ("worker", "evaluator", "operator"):
        body = _round_trip(router, _dealer(ctx, ep, SecurityConfig(secret_file=secrets[role]), role))
        assert body.get("User-Id") == role
    body = _round_trip(router, _dealer(ctx, ep, server, "shard"))
    assert body.get("User-Id") == "shard", "the master acts as any role"


def test_wrong_or_missing_secrets_cannot_connect(ctx, secrets):
    router, ep = _router(ctx, SecurityConfig(secret_file=secrets["master"]))
    _refused(router, _dealer(ctx, ep, None))  # anonymous (NULL mechanism)
    _refused(router, _dealer(ctx, ep, SecurityConfig(secret_file=secrets["other"]), "worker"))
    # a worker's file claims another role: its password is the worker's, so it fails
    forged = ctx.socket(zmq.DEALER)
    _OPEN[id(ctx)].append(forged)
    forged.setsockopt(zmq.LINGER, 0)
    forged.setsockopt(zmq.PLAIN_USERNAME, b"operator")
    from ps_common.security.credentials import load_secret

    forged.setsockopt(zmq.PLAIN_PASSWORD, load_secret(secrets["worker"]).secret_for("worker").encode())
    forged.connect(ep)
    _refused(router, forged)
