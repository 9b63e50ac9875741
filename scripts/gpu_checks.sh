#!/usr/bin/env bash
# What a session with a GPU runs (issue 12): the CUDA tests, the saturation curves and the
# memory-limited comparison of benchmarks/bench_gpu_memory.py. Logs go to OUTDIR. Needs torch
# with CUDA and the project's dependencies importable from here:
#   PYTHONPATH=$PWD bash scripts/gpu_checks.sh OUTDIR [tests] [saturation] [policies]
# (no step named: all three; each step takes a few minutes)
set -uo pipefail
out=${1:-gpu-checks}
shift || true
steps=${*:-tests saturation policies}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
step() { echo; echo "### $*"; date -u +%T; }
wants() { [[ " $steps " == *" $1 "* ]]; }

{
  step environment
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
  $py -c 'import torch, zmq; print("torch", torch.__version__, "cuda", torch.version.cuda,
torch.cuda.get_device_name(0), "pyzmq", zmq.__version__)'
  nproc
} 2>&1 | tee "$out/env.txt"

if wants tests; then
  step "CUDA tests" | tee "$out/tests.txt"
  timeout 300 $py -m pytest -q -s -p no:cacheprovider tests/integration/test_in_process_workers.py \
    tests/system/test_system_memory.py -k "cuda" 2>&1 | tee -a "$out/tests.txt"
fi

if wants saturation; then
  step "saturation curves" | tee "$out/saturation.txt"
  for model in lenet cnn1m; do
    timeout 120 $py benchmarks/bench_gpu_memory.py --device cuda --model "$model" --tables a \
      --sizes 16,64,256,1024,2048,4096,8192,16384,32768,65536 2>&1 | tee -a "$out/saturation.txt"
  done
fi

if wants policies; then
  # cnn1m reserves about 1.1 MB per sample on CUDA (the saturation table): at X = 4096 an even
  # share (1024) does not fit in 600 or 700 MB. (b1) two slow-memory workers, one slow worker;
  # (b2) the one worker with little memory is a fast one, and the speeds differ 4x.
  step "memory-limited workers" | tee "$out/policies.txt"
  timeout 270 $py benchmarks/bench_gpu_memory.py --device cuda --model cnn1m --tables b --global-batch 4096 \
    --limits-mb 2000,2000,600,600 --slowdowns 1,1,1,2 --iterations 40 --skip 10 2>&1 | tee -a "$out/policies.txt"
  timeout 270 $py benchmarks/bench_gpu_memory.py --device cuda --model cnn1m --tables b --global-batch 4096 \
    --limits-mb 700,4000,4000,4000 --slowdowns 1,1,2,4 --iterations 40 --skip 10 2>&1 | tee -a "$out/policies.txt"
fi
