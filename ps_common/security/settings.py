"""The ``security:`` config section: which credentials a process uses, checked per role."""

from __future__ import annotations

import os
import shutil
from typing import Optional

from pydantic import BaseModel, ConfigDict

from ps_common.security.credentials import load_secret
from ps_common.security.keys import (
    SecurityError,
    expand,
    generate_keypair,
    load_keypair,
    load_public_key,
    require_curve_support,
)


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
        require_curve_support()
        self._required("server_secret_key")
        self._required("allowed_clients_dir")
        self.server_keypair()
        d = expand(self.allowed_clients_dir)  # type: ignore[arg-type]
        if not d.is_dir():
            raise SecurityError(f"security.allowed_clients_dir: {d} is not a directory")

    def require_client(self, role: str = "worker") -> None:
        """Check what a client of ``role`` needs: its CURVE key pair, or its job secret."""
        if not self.curve:
            if self.secret_file:
                load_secret(self.secret_file).secret_for(role)
            return
        require_curve_support()
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
        return load_keypair(self._required("server_secret_key"), "security.server_secret_key")

    def server_public(self) -> bytes:
        """The servers' public z85 key, from server_public_key or else server_secret_key."""
        if self.server_public_key:
            return load_public_key(self.server_public_key, "security.server_public_key")
        if self.server_secret_key:
            return load_public_key(self.server_secret_key, "security.server_secret_key")
        raise SecurityError("security.server_public_key is required when security.curve is true")

    def client_keypair(self, role: str = "worker") -> tuple[bytes, bytes]:
        """(public, secret) z85 keys a process of ``role`` dials with.

        ``client_secret_key`` if set, else ``client_keys_dir/ROLE.key_secret``, else (shards,
        and single-host setups) the server pair. The servers map the key to a role; a key
        whose role is not ``role`` gets this process's messages refused.
        """
        if role == "shard" and self.server_secret_key:
            return load_keypair(self.server_secret_key, "security.server_secret_key")
        if self.client_secret_key:
            return load_keypair(self.client_secret_key, "security.client_secret_key")
        if self.client_keys_dir:
            return load_keypair(expand(self.client_keys_dir) / f"{role}.key_secret",
                                "security.client_keys_dir")
        if self.server_secret_key:
            return load_keypair(self.server_secret_key, "security.server_secret_key")
        raise SecurityError(
            "security.client_secret_key (or client_keys_dir) is required when security.curve "
            "is true (this client's .key_secret file, made by `ps-keys generate DIR NAME`)")


def init_local_keys(directory: str | os.PathLike) -> SecurityConfig:
    """A complete single-host key set under ``directory`` and the config that uses it.

    ``server.key[_secret]``; one pair per client role (``worker``, ``evaluator``,
    ``operator``) in ``directory`` with their public keys in ``allowed/``, so the servers know
    each key's role; every local process shares the one config (``client_keys_dir``).
    """
    d = expand(directory).resolve()
    _, server_secret = generate_keypair(d, "server")
    allowed = d / "allowed"
    allowed.mkdir(exist_ok=True)
    for role in ("worker", "evaluator", "operator"):
        public, _ = generate_keypair(d, role)
        shutil.copyfile(public, allowed / f"{role}.key")
    return SecurityConfig(curve=True, server_secret_key=str(server_secret),
                          server_public_key=str(d / "server.key"), client_keys_dir=str(d),
                          allowed_clients_dir=str(allowed))
