"""One NARX refit job of 20 workers: what framing, indexing and parsing it cost (tight loop, µs).

Run from the repository's root: python docs/results/ddp_vs_ps/narx_refit_traffic_2026-11-28/frame_costs.py
"""

import pickle
import statistics
import sys
import time

sys.path.insert(0, ".")

import numpy as np  # noqa: E402

from predictors import refit as R  # noqa: E402
from predictors.narx import BatchNARX, refit_job  # noqa: E402

STATE = ("logv", "x", "pos", "cnt", "has_w", "w1", "b1", "w2", "b2")
K = 20


def median_us(f, k: int = 2000) -> float:
    ts = []
    for _ in range(k):
        a = time.perf_counter()
        f()
        ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e6


p = BatchNARX(refit="sync")
p.resize(128)   # state rows for 128 worker slots
d = np.arange(K)


def state() -> dict:
    """What BatchNARX._submit copies out of the slots' state for one job."""
    return {name: getattr(p, "_" + name)[d] for name in STATE}


payload = {"cfg": p.cfg, **state(), "hook": None}
print("shapes", {k: v.shape for k, v in payload.items() if hasattr(v, "shape")})
print("frame us", median_us(lambda: R._frame(1, (refit_job, payload))))
print("pickle cfg us", median_us(lambda: pickle.dumps(p.cfg, protocol=5)))
print("fancy-index payload us", median_us(state))
H, n_in = p._w1.shape[1:]
res = {"w1": np.zeros((K, H, n_in)), "b1": np.zeros((K, H)), "w2": np.zeros((K, H)), "b2": np.zeros(K),
       "mx": np.zeros((K, n_in)), "sx": np.ones((K, n_in)), "my": np.zeros(K), "sy": np.ones(K),
       "ok": np.ones(K, bool)}
buf = bytearray(b"".join(bytes(c) for c in R._frame(1, (res, None))))
print("result bytes", len(buf), "parse us", median_us(lambda: R._parse_frame(buf, 0)))
print("frame result us", median_us(lambda: R._frame(1, (res, None))))
