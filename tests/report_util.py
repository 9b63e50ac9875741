"""Reports for tests: what a worker may send, drawn from the edges of what the wire accepts."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import numpy as np

from batchsize_manager import WorkerReport
from ps_common.protocol import Push, decode, encode
from ps_common.report import Telemetry


def edge_report(rng: random.Random, w: int, it: int, x: int) -> WorkerReport:
    """A report a worker may send (every value within its field's range, so the decoder takes
    it) drawn from the edges: 0, the smallest float, tiny and huge values, None where optional.
    No out-of-memory reports: enough of them leave no split of X, which the manager refuses."""
    tel: dict[str, Any] = {}
    for f in dataclasses.fields(Telemetry):
        lo, hi = f.metadata.get("range", (0, 1))
        if f.name == "oom":
            continue
        if isinstance(f.default, int):
            tel[f.name] = rng.choice([0, 1, int(hi)])
        else:
            pool = [0.0, 5e-324, 1e-300, 1e-6, 0.5, float(hi)] + ([None] if f.default is None else [])
            tel[f.name] = rng.choice(pool)
    push = Push(worker_id=w, token="t", iteration=it, batch_size=x, telemetry=Telemetry(**tel),
                arrays=[np.zeros(1, dtype=np.float32)])
    got = decode(encode(push)).telemetry
    assert got is not None
    return WorkerReport.received(w, it, x, got)
