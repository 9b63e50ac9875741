"""Append-only JSON-lines metric records, one file per process."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any, Iterator


def _clean(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


class MetricsWriter:
    """Writes one JSON object per line and flushes, so a killed process loses at most a line."""

    def __init__(self, path: str | Path | None) -> None:
        self.path = Path(path) if path else None
        self._fh = None
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fh = open(self.path, "a", buffering=1)

    def write(self, **record: Any) -> None:
        if self._fh is None:
            return
        record.setdefault("wall_time", time.time())
        self._fh.write(json.dumps(_clean(record), separators=(",", ":")) + "\n")

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
