#!/usr/bin/env bash
# Set up, then run the main job: a local cluster training LeNet on MNIST under BSP.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/ps-launch configs/mnist_bsp.yaml "$@"
