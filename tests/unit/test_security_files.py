"""Credential files without a socket: CURVE key pairs and their CLI, the job secret and the
per-role files made from it. (What a server learns of each client over real sockets is in
tests/integration/test_security.py.)"""

from __future__ import annotations

import stat

import pytest
import zmq

from ps_common.security.keys import SecurityError, generate_keypair, load_keypair, load_public_key
from ps_common.security.settings import SecurityConfig
from ps_launcher.keys_cli import main as keys_main

pytestmark = [
    pytest.mark.timeout(20),
    pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CURVE"),
]


# ----- keys and CLI ---------------------------------------------------------------------------
def test_generate_load_round_trip_and_cli(tmp_path, capsys):
    public, secret = generate_keypair(tmp_path, "w1")
    assert (public.name, secret.name) == ("w1.key", "w1.key_secret")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = load_keypair(secret)
    assert len(pub) == len(sec) == 40
    assert load_public_key(public) == pub == load_public_key(secret)
    assert zmq.curve_public(sec) == pub
    assert not list(tmp_path.glob(".ps-keys-*")), "temporary directory left behind"
    with pytest.raises(SecurityError, match="refusing to overwrite"):
        generate_keypair(tmp_path, "w1")
    with pytest.raises(SecurityError, match="no secret key"):
        load_keypair(public)

    assert keys_main(["generate", str(tmp_path / "cli"), "w2"]) == 0
    out = capsys.readouterr().out.split()
    assert out == [str(tmp_path / "cli" / "w2.key"), str(tmp_path / "cli" / "w2.key_secret")]
    assert stat.S_IMODE((tmp_path / "cli" / "w2.key_secret").stat().st_mode) == 0o600
    assert keys_main(["show", out[0]]) == 0
    assert capsys.readouterr().out.strip() == load_public_key(out[1]).decode()
    assert keys_main(["show", str(tmp_path / "missing.key")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert keys_main(["init", str(tmp_path / "local")]) == 0
    assert "curve: true" in capsys.readouterr().out


# ----- the job secret (PLAIN) -----------------------------------------------------------------
def test_a_role_file_grants_that_role_only(secrets):
    from ps_common.security.credentials import CredentialError, load_secret

    worker = load_secret(secrets["worker"])
    assert worker.roles == ("worker",)
    with pytest.raises(CredentialError, match="holds the worker secret only"):
        worker.secret_for("operator")
    with pytest.raises(CredentialError, match="servers need the job's master"):
        SecurityConfig(secret_file=secrets["worker"]).require_server()
    SecurityConfig(secret_file=secrets["worker"]).require_client("worker")


def test_secret_files_cli_and_errors(tmp_path, capsys):
    from ps_common.security.credentials import CredentialError, load_secret

    assert keys_main(["secret", str(tmp_path / "m.secret")]) == 0
    assert stat.S_IMODE((tmp_path / "m.secret").stat().st_mode) == 0o600
    assert keys_main(["secret", str(tmp_path / "w.secret"), "--role", "worker",
                      "--from", str(tmp_path / "m.secret")]) == 0
    worker = load_secret(tmp_path / "w.secret").secret_for("worker")
    assert worker == load_secret(tmp_path / "m.secret").secret_for("worker")
    capsys.readouterr()
    assert keys_main(["secret", str(tmp_path / "m.secret")]) == 2
    assert "refusing to overwrite" in capsys.readouterr().err
    assert keys_main(["secret", str(tmp_path / "x.secret"), "--role", "worker"]) == 2
    (tmp_path / "junk").write_text("hello")
    with pytest.raises(CredentialError, match="not an lbbsp secret file"):
        load_secret(tmp_path / "junk")
    with pytest.raises(CredentialError, match="no such file"):
        load_secret(tmp_path / "missing")
