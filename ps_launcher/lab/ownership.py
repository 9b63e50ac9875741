"""Who owns a lab object, so leftovers of killed runs can be found and removed.

Every run gets a run id ``<pid>-<4 hex>``; all names it creates start with ``lbps-<runid>-``.
A small JSON record under ``/run/lbps-lab/<runid>.json`` stores the owner's pid and its start time
(pid reuse would otherwise make a dead owner look alive). Without a record the pid is read back
from the name. ``/run`` is a tmpfs, so records vanish at reboot together with what they describe.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import threading
from pathlib import Path

log = logging.getLogger(__name__)

PREFIX = "lbps-"
STATE_DIR = Path(os.environ.get("LBPS_LAB_STATE_DIR", "/run/lbps-lab"))
_RUNID_RE = re.compile(r"^(\d+)-([0-9a-f]{4})$")
_lock = threading.Lock()


def new_run_id() -> str:
    """A fresh run id that encodes this process's pid (``<pid>-<4 hex>``)."""
    return f"{os.getpid()}-{secrets.token_hex(2)}"


_default: tuple[int, str] | None = None


def default_run_id() -> str:
    """One run id per process (a forked child gets its own), shared by its groups and labs."""
    global _default
    if _default is None or _default[0] != os.getpid():
        _default = (os.getpid(), new_run_id())
    return _default[1]


def check_name(name: str, what: str = "name") -> str:
    """Names end up in paths and interface/namespace names: allow only [A-Za-z0-9_.-]."""
    if not name or not re.fullmatch(r"[A-Za-z0-9_.][A-Za-z0-9_.-]*", name):
        raise ValueError(f"{what} {name!r}: use letters, digits, '_', '.', '-' only")
    return name


def proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot (/proc/pid/stat field 22); None if gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may contain spaces and parentheses: split after the last ')'
    fields = raw[raw.rfind(")") + 2 :].split()
    try:
        return int(fields[19])
    except (IndexError, ValueError):
        return None


def register(run_id: str, kind: str, name: str) -> None:
    """Record that this process owns ``name`` (a cgroup path or namespace) under ``run_id``."""
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with _lock:
        _update(STATE_DIR / f"{run_id}.json", run_id, kind, name, add=True)


def unregister(run_id: str, kind: str, name: str) -> None:
    """Forget ``name``; the record file goes when it lists nothing more."""
    with _lock:
        _update(STATE_DIR / f"{run_id}.json", run_id, kind, name, add=False)


def _update(path: Path, run_id: str, kind: str, name: str, add: bool) -> None:
    rec = _read(path)
    if rec is None:
        if not add:
            return
        rec = {
            "run_id": run_id,
            "pid": os.getpid(),
            "start_ticks": proc_start_ticks(os.getpid()),
            "objects": [],
        }
    if add and [kind, name] not in rec["objects"]:
        rec["objects"].append([kind, name])
    if not add:
        rec["objects"] = [o for o in rec["objects"] if o != [kind, name]]
        if not rec["objects"]:
            path.unlink(missing_ok=True)
            return
    tmp = path.with_suffix(f".tmp{os.getpid()}-{threading.get_ident()}")
    tmp.write_text(json.dumps(rec))
    os.replace(tmp, path)


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def run_id_of(name: str, prefix: str = PREFIX) -> str | None:
    """The run id inside ``<prefix><runid>-<rest>``, or None if the name has no parsable id."""
    if not name.startswith(prefix):
        return None
    parts = name[len(prefix) :].split("-")
    if len(parts) < 2:
        return None
    rid = f"{parts[0]}-{parts[1]}"
    if _RUNID_RE.match(rid):
        return rid
    # custom run ids: trust only a record file that names this object
    for path in STATE_DIR.glob("*.json") if STATE_DIR.is_dir() else []:
        rec = _read(path)
        if rec and name.startswith(f"{prefix}{rec.get('run_id')}-"):
            return str(rec["run_id"])
    return None


def owner_alive(run_id: str) -> bool | None:
    """True/False if the owner of ``run_id`` is known to be alive/dead; None if unknown.

    Unknown (a custom run id without a record) is treated as alive by the cleaners: never remove
    what we cannot prove is abandoned.
    """
    rec = _read(STATE_DIR / f"{run_id}.json")
    if rec is not None:
        pid = int(rec["pid"])
        ticks = proc_start_ticks(pid)
        if ticks is None:
            return False
        want = rec.get("start_ticks")
        return want is None or ticks == want
    m = _RUNID_RE.match(run_id)
    if not m:
        return None
    return proc_start_ticks(int(m.group(1))) is not None


def forget_run(run_id: str) -> None:
    """Delete the record of a run (after its leftovers were removed)."""
    (STATE_DIR / f"{run_id}.json").unlink(missing_ok=True)


def _exists(kind: str, name: str) -> bool:
    if kind == "cgroup":
        return Path(name).exists()
    if kind == "netns":
        return Path("/run/netns", name).exists()
    return True


def prune_records() -> None:
    """Delete the records of dead owners that list nothing still existing (an owner killed
    between recording an object and making it)."""
    if not STATE_DIR.is_dir():
        return
    for path in STATE_DIR.glob("*.json"):
        rec = _read(path)
        if rec is None or owner_alive(str(rec.get("run_id"))) is not False:
            continue
        if not any(_exists(k, n) for k, n in rec.get("objects", [])):
            path.unlink(missing_ok=True)
