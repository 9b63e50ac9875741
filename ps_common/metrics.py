"""Append-only JSON-lines metric records, one file per process.

Records are written with orjson (a few microseconds per record instead of tens: the shards and
workers write one per iteration), which writes NaN and infinities as null, numpy scalars as
numbers, and non-string keys as strings.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Iterator, Literal

import orjson

from ps_common.errors import PsError

_OPTIONS = orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE


#: What a writer does with a file that already holds records: ``append`` (the same run goes
#: on: a shard resumed from its checkpoint), ``refuse`` (an earlier run's: two runs' records
#: in one file would be summed as one run's), ``replace`` (the user asked to overwrite).
Existing = Literal["append", "refuse", "replace"]


class MetricsInUse(PsError, RuntimeError):
    """A metrics file already holds an earlier run's records."""


def existing_for(*, resume: bool = False, overwrite: bool = False) -> Existing:
    """A role's choice from its flags: ``--resume`` continues the run, ``--overwrite`` replaces it."""
    return "append" if resume else "replace" if overwrite else "refuse"


class MetricsWriter:
    """Writes one JSON object per line and flushes, so a killed process loses at most a line."""

    def __init__(self, path: str | Path | None, existing: Existing = "append") -> None:
        self.path = Path(path) if path else None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            if existing == "refuse" and self.path.exists() and self.path.stat().st_size > 0:
                raise MetricsInUse(
                    f"{self.path} already holds records of an earlier run: choose another --run-dir, "
                    "or pass --overwrite to replace that run (a shard continuing it: --resume)")
            self._fh = open(self.path, "wb" if existing == "replace" else "ab", buffering=0)

    def write(self, **record: Any) -> None:
        if self._fh is None:
            return
        record.setdefault("wall_time", time.time())
        self._fh.write(orjson.dumps(record, option=_OPTIONS))

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Records of a JSONL file; a torn last line (killed writer) is skipped."""
    with open(path) as fh:
        for line in fh:
            line = line.strip()
            if not line:
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
