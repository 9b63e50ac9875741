"""One NARX refit job of 20 workers: what framing, indexing and parsing it cost (tight loop, µs)."""
import sys, time, statistics, pickle
sys.path.insert(0, '.')  # run from the repository's root
import numpy as np
from predictors import refit as R
from predictors.narx import BatchNARX, refit_job
p = BatchNARX(refit='sync')
p.resize(128) if hasattr(p, 'resize') else None
d = np.arange(20)
cfg = p.cfg
payload = {"cfg": cfg, "logv": p._logv[d], "x": p._x[d], "pos": p._pos[d], "count": p._cnt[d], "has_w": p._has_w[d],
           "w1": p._w1[d], "b1": p._b1[d], "w2": p._w2[d], "b2": p._b2[d], "hook": None}
def t(f, k=2000):
    ts = []
    for _ in range(k):
        a = time.perf_counter(); f(); ts.append(time.perf_counter() - a)
    return statistics.median(ts) * 1e6
print('shapes', {k: v.shape for k, v in payload.items() if hasattr(v, 'shape')})
print('frame us', t(lambda: R._frame(1, (refit_job, payload))))
print('pickle cfg us', t(lambda: pickle.dumps(cfg, protocol=5)))
print('fancy-index payload us', t(lambda: {"logv": p._logv[d], "x": p._x[d], "pos": p._pos[d], "count": p._cnt[d], "has_w": p._has_w[d], "w1": p._w1[d], "b1": p._b1[d], "w2": p._w2[d], "b2": p._b2[d]}))
res = {"w1": np.zeros((20, 10, 8)), "b1": np.zeros((20, 10)), "w2": np.zeros((20, 10)), "b2": np.zeros(20), "mx": np.zeros((20, 8)), "sx": np.ones((20, 8)), "my": np.zeros(20), "sy": np.ones(20), "ok": np.ones(20, bool)}
chunks = R._frame(1, (res, None))
buf = bytearray(b"".join(bytes(c) for c in chunks))
print('result bytes', len(buf), 'parse us', t(lambda: R._parse_frame(buf, 0)))
print('frame result us', t(lambda: R._frame(1, (res, None))))
