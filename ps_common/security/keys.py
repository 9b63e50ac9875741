"""CURVE key files: read, check and write zmq certificates, and the role a file name grants.

Keys are zmq "certificate" files as written by :func:`zmq.auth.create_certificates`:
``NAME.key`` holds the public key, ``NAME.key_secret`` the public and the secret key (mode 0600).
Errors name the setting the file came from (``what``) and what is wrong with the file.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from ps_common.security.credentials import ROLES, CredentialError

log = logging.getLogger(__name__)

KEY_Z85_LEN = 40
"""Length of a z85-encoded CURVE key."""


class SecurityError(CredentialError):
    """A security setting or key file is wrong or missing; the message names the key.

    Both a ``ValueError`` and a ``RuntimeError`` (as :class:`CredentialError`), so handlers that
    catch either one report it cleanly.
    """


def expand(p: str | os.PathLike) -> Path:
    """A configured path with ``~`` expanded."""
    return Path(os.path.expanduser(str(p)))


def require_curve_support() -> None:
    if not zmq.has("curve"):
        raise SecurityError(
            "security.curve is true but this libzmq has no CURVE support (built without "
            "libsodium/tweetnacl): install a pyzmq wheel, which bundles it")


def _check_z85(key: bytes | None, what: str, path: Path) -> bytes:
    if not key or len(key) != KEY_Z85_LEN:
        raise SecurityError(f"{what}: {path} holds a malformed key")
    try:
        z85.decode(key)
    except Exception:
        raise SecurityError(f"{what}: {path} holds a malformed key") from None
    return key


def _read_cert(path: str | os.PathLike, what: str) -> tuple[bytes | None, bytes | None]:
    p = expand(path)
    if not p.is_file():
        raise SecurityError(f"{what}: {p}: no such file")
    try:
        return zmq.auth.load_certificate(p)
    except (OSError, ValueError) as exc:
        raise SecurityError(f"{what}: cannot read key file {p}: {exc}") from None


def load_keypair(path: str | os.PathLike, what: str | None = None) -> tuple[bytes, bytes]:
    """(public, secret) z85 keys from a ``.key_secret`` certificate file; errors name ``what``
    (default: the path)."""
    what = str(path) if what is None else what
    pub, sec = _read_cert(path, what)
    p = expand(path)
    if sec is None:
        raise SecurityError(
            f"{what}: {p} holds no secret key (give the .key_secret file, not the public .key)")
    mode = p.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s: secret key file %s is accessible by others (mode %o); chmod 600 it",
                    what, p, stat.S_IMODE(mode))
    return _check_z85(pub, what, p), _check_z85(sec, what, p)


def load_public_key(path: str | os.PathLike, what: str | None = None) -> bytes:
    """The public z85 key of a certificate file (public ``.key`` or ``.key_secret``)."""
    what = str(path) if what is None else what
    pub, _ = _read_cert(path, what)
    return _check_z85(pub, what, expand(path))


def generate_keypair(directory: str | os.PathLike, name: str, *,
                     overwrite: bool = False) -> tuple[Path, Path]:
    """Write ``DIR/NAME.key`` (public) and ``DIR/NAME.key_secret`` (mode 0600); return both paths.

    The files are made in a private (0700) temporary directory and moved into place, so the
    secret key is never readable by others, not even briefly. Existing files are kept (an
    error) unless ``overwrite``.
    """
    if not name or "/" in name or os.sep in name or name.startswith("."):
        raise SecurityError(f"bad key name {name!r}: a plain file name is needed")
    d = expand(directory)
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


def role_of_key_file(name: str) -> str | None:
    """The role an allowed key file grants, from its name: ``worker-hostA.key`` -> worker."""
    stem = name[:-len(".key")] if name.endswith(".key") else name
    for role in ROLES:
        if stem == role or stem.startswith((f"{role}-", f"{role}_", f"{role}.")):
            return role
    return None
