#!/usr/bin/env bash
# What a session with a GPU runs (issue 12), in one go: the CUDA tests, the saturation curves,
# memory-limited workers of different real speeds (SM shares under CUDA MPS) and, last, workers
# time-slicing the GPU with emulated speeds; every comparison from benchmarks/bench_gpu_memory.py.
# Logs and one JSON line per benchmark run (results.jsonl) go to OUTDIR. Needs torch with CUDA and
# the project's dependencies importable from here:
#   PYTHONPATH=$PWD bash scripts/gpu_checks.sh OUTDIR [tests] [saturation] [mps] [mps-cap] [timeshared]
# (no step named: all five, in that order; each takes one to three minutes on an H100)
set -uo pipefail
out=${1:-gpu-checks}
shift || true
steps=${*:-tests saturation mps mps-cap timeshared}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
bench="$py benchmarks/bench_gpu_memory.py --device cuda --json $out/results.jsonl"
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
  timeout 240 $py -m pytest -q -s -p no:cacheprovider tests/integration/test_in_process_workers.py \
    tests/system/test_system_memory.py tests/unit/test_gpu_share.py -k "cuda or gpu_share" 2>&1 | tee -a "$out/tests.txt"
fi

if wants saturation; then
  step "saturation curves" | tee "$out/saturation.txt"
  for model in lenet cnn1m; do
    timeout 90 $bench --model "$model" --tables a \
      --sizes 16,64,256,1024,2048,4096,8192,16384,32768,65536 2>&1 | tee -a "$out/saturation.txt"
  done
fi

mps_case() {  # four workers at 40/30/20/10% of the SMs, the fastest limited to $1 MB
  timeout 240 $bench --model cnn1m --tables b --global-batch 16384 --train 65536 \
    --limits-mb "$1",none,none,none --slowdowns 1,1,1,1 --sm-percent 40,30,20,10 \
    --iterations "${2:-120}" --skip 40 ${3:-}
}

if wants mps || wants mps-cap; then
  # Separate GPUs of different speeds on one GPU: an MPS control daemon (in a pipe directory of
  # our own, quit at the end), the saturation curve at three SM shares (step mps), then four
  # workers at 40/30/20/10% of the SMs. cnn1m takes about 1.1 MB a sample and the fastest
  # worker's speed earns it about 6,400 of X = 16384: a 6000 MB limit (step mps) hardly binds,
  # 3000 MB (step mps-cap, also with the start-up probe) is below even the even share of 4096.
  {
    step "CUDA MPS"
    mps=$(command -v nvidia-cuda-mps-control || ls /usr/local/nvidia/bin/nvidia-cuda-mps-control /usr/bin/nvidia-cuda-mps-control 2>/dev/null | head -1)
    if [ -z "$mps" ]; then
      echo "no nvidia-cuda-mps-control on this machine: MPS step skipped"
    else
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/lbbsp-mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/lbbsp-mps-log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      "$mps" -d && sleep 1
      ls "$CUDA_MPS_PIPE_DIRECTORY"
      if timeout 60 $py -c 'import torch; x = torch.ones(1, device="cuda"); torch.cuda.synchronize(); print("MPS client up", x.item())'; then
        if wants mps; then
          for pct in 100 50 25; do
            CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$pct timeout 60 $bench --model cnn1m --tables a \
              --sizes 256,1024,4096,16384
          done
          mps_case 6000
        fi
        if wants mps-cap; then
          mps_case 3000 100
          mps_case 3000 100 "--probe --policies lbbsp-cpu,lbbsp-gpu"
        fi
      else
        echo "no MPS client could start: MPS step skipped"
      fi
      echo quit | timeout 20 "$mps"
      sleep 1
      tail -n 8 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null
      unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
    fi
  } 2>&1 | tee "$out/mps.txt"
fi

if wants timeshared; then
  # Without MPS the workers time-slice the GPU; speeds are emulated (a sleep after each pass).
  # (b1) two memory-short workers, one slow; (b2) the one worker short of memory is a fast one.
  step "memory-limited workers, time-sliced" | tee "$out/policies.txt"
  timeout 120 $bench --model cnn1m --tables b --global-batch 4096 \
    --limits-mb 2000,2000,600,600 --slowdowns 1,1,1,2 --iterations 50 --skip 15 2>&1 | tee -a "$out/policies.txt"
  timeout 120 $bench --model cnn1m --tables b --global-batch 4096 \
    --limits-mb 700,4000,4000,4000 --slowdowns 1,1,2,4 --iterations 50 --skip 15 2>&1 | tee -a "$out/policies.txt"
fi
step done
