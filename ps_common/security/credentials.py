"""Role credentials without CURVE: a job secret, and the per-role secrets derived from it.

Four roles take part in a job: ``shard``, ``worker``, ``evaluator`` and ``operator`` (the
launcher, ``ps-compare``, a person with a status client). Every connection to a shard
authenticates as one role in ZeroMQ's handshake (PLAIN: username = role, password = that
role's secret), checked by the server's ZAP handler before a single message of the connection
is delivered; the server then reads the role from each message's ``User-Id`` and refuses the
message types that role may not send (``ps_server.roles``).

A *master* secret file lets its holder act as any role and verify all of them: shards need it.
A *role* secret file (``ps-keys secret --role worker --from MASTER``) lets its holder act as
that role only: hand one to each worker host, and a compromised worker cannot stop the job or
pose as a shard. ``ps-launch`` makes a master for every run and gives each child only its
role's file.

File format, one line: ``lbbsp-secret v1 master <64 hex>`` or
``lbbsp-secret v1 role <role> <64 hex>``; files are written 0600 and a group/world-readable
one is reported.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from ps_common.errors import PsError

log = logging.getLogger(__name__)

ROLES = ("shard", "worker", "evaluator", "operator")
_MAGIC = "lbbsp-secret"
_FORMAT = "v1"


class CredentialError(PsError, ValueError, RuntimeError):
    """A secret file is missing, malformed or does not grant the role asked for."""


def derive_role_secret(master: bytes, role: str) -> str:
    """The PLAIN password of ``role``: HMAC-SHA256(master, role), hex."""
    check_role(role)
    return hmac.new(master, f"lbbsp-role:{role}".encode(), hashlib.sha256).hexdigest()


def check_role(role: str) -> str:
    if role not in ROLES:
        raise CredentialError(f"unknown role {role!r}; known: {', '.join(ROLES)}")
    return role


@dataclass(frozen=True)
class JobSecret:
    """What one process holds: the master (every role) or one role's secret."""

    path: str
    master: bytes | None = None
    role: str | None = None
    role_secret: str | None = None

    @property
    def roles(self) -> tuple[str, ...]:
        return ROLES if self.master is not None else ((self.role,) if self.role else ())

    def secret_for(self, role: str) -> str:
        check_role(role)
        if self.master is not None:
            return derive_role_secret(self.master, role)
        if role == self.role and self.role_secret:
            return self.role_secret
        raise CredentialError(
            f"{self.path} holds the {self.role} secret only; this process needs the {role} "
            "role (give it the master secret file or a role file made with "
            f"`ps-keys secret FILE --role {role} --from MASTER`)")

    def verifier(self) -> dict[str, str]:
        """{role: secret} for a server's ZAP handler; only a master can verify."""
        if self.master is None:
            raise CredentialError(
                f"{self.path} holds the {self.role} secret only; servers need the job's master "
                "secret file to check every role")
        return {r: derive_role_secret(self.master, r) for r in ROLES}


def _write_private(path: Path, text: str, *, overwrite: bool) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    flags = os.O_WRONLY | os.O_CREAT | (os.O_TRUNC if overwrite else os.O_EXCL)
    try:
        fd = os.open(path, flags, 0o600)
    except FileExistsError:
        raise CredentialError(f"{path} exists; refusing to overwrite a secret") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    os.chmod(path, 0o600)


def generate_master(path: str | os.PathLike, *, overwrite: bool = False) -> JobSecret:
    """Write a new random master secret (0600) and return it."""
    p = Path(path)
    master = secrets.token_bytes(32)
    _write_private(p, f"{_MAGIC} {_FORMAT} master {master.hex()}\n", overwrite=overwrite)
    return JobSecret(str(p), master=master)


def write_role_secret(path: str | os.PathLike, master: JobSecret, role: str, *,
                      overwrite: bool = False) -> JobSecret:
    """Write the secret of one ``role`` derived from ``master`` (0600)."""
    secret = master.secret_for(role)
    p = Path(path)
    _write_private(p, f"{_MAGIC} {_FORMAT} role {role} {secret}\n", overwrite=overwrite)
    return JobSecret(str(p), role=role, role_secret=secret)


def load_secret(path: str | os.PathLike) -> JobSecret:
    """Read a secret file; the error names the file and what is wrong with it."""
    p = Path(os.path.expanduser(str(path)))
    try:
        text = p.read_text()
        mode = p.stat().st_mode
    except FileNotFoundError:
        raise CredentialError(
            f"security.secret_file: {p}: no such file (make one with `ps-keys secret {p}`; "
            "ps-launch makes one per run)") from None
    except OSError as exc:
        raise CredentialError(f"security.secret_file: cannot read {p}: {exc}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("secret file %s is accessible by others (mode %o); chmod 600 it", p,
                    stat.S_IMODE(mode))
    parts = text.split()
    try:
        if parts[:3] == [_MAGIC, _FORMAT, "master"] and len(parts) == 4:
            master = bytes.fromhex(parts[3])
            if len(master) < 16:
                raise ValueError("too short")
            return JobSecret(str(p), master=master)
        if parts[:3] == [_MAGIC, _FORMAT, "role"] and len(parts) == 5:
            role = check_role(parts[3])
            bytes.fromhex(parts[4])
            return JobSecret(str(p), role=role, role_secret=parts[4])
    except ValueError:
        pass
    raise CredentialError(f"security.secret_file: {p} is not an lbbsp secret file "
                          f"(expected '{_MAGIC} {_FORMAT} master HEX' or '... role ROLE HEX')")
