#!/usr/bin/env bash
# Issue 9's benchmarks in one go, for a host with more cores than the 2-core VM they were built on
# (for example the 16-core machine a session with a device is lent): on that VM every process
# shares two cores and code idle for 50 ms runs 5-20x slower than warm (bench_decision_cold's
# reference rows), so these say which results are the code's and which are the VM's.
# Sized for a lent machine's 15 minutes (start-up included): about 8 minutes in all on the
# 16-core H100 host of 2026-11-27, where a fleet run took 13-14 s at 4 and 100 workers and
# 24-27 s at 1,000, one repeat of the data plane 110 s with one thread count (three thread
# counts did not finish in 240 s), and bench_manager's 1,000- and 10,000-worker rows up to
# ARIMA's 120 s (before the blocks step, whose two runs have 60 s timeouts and have not run there
# yet; here each took about 15 s). Every table prints its rows as they
# are measured, so a step cut by its timeout keeps what it finished. Steps:
#   dataplane  bench_dataplane --phases: push + pull through the shards against raw pyzmq, with
#              1 and 8 threads per shard's update (cluster.shard_threads)
#   passive    the 2-shard data-plane rows with 1, 4 and 8 threads per shard, spinning after
#              each step (libgomp's default, --spinning-threads) and sleeping between updates
#              (OMP_WAIT_POLICY=PASSIVE, as ps-server sets it); not in the default steps: name it
#   parts      the 2-shard data-plane rows with 8 threads per shard, each new version answered
#              whole after the update and in 4 MiB parts streamed during it
#              (--params-part-bytes 0 4194304); not in the default steps: name it
#   blocks     bench_update_blocks: a shard's update in blocks against the whole slice at once,
#              with 1 and 8 threads (5M parameters, one and two gradients)
#   fleet      bench_fleet: the decision's share of the iteration in a real run
#   manager    bench_manager table (a): decision time at 1,000 and 10,000 workers
#   cold       bench_decision_cold: a decision's CPU tight, after a sleep and after a spin
# Each step's arguments can be replaced: DATAPLANE_ARGS, PASSIVE_ARGS, PARTS_ARGS, BLOCKS_ARGS, FLEET_ARGS,
# MANAGER_ARGS, COLD_ARGS; the fleet's and the manager's time limits too: FLEET_TIMEOUT (default
# 150 s) and MANAGER_TIMEOUT (120 s). On the 16-core H200 host of 2026-11-28, with the compiled
# kernels, one fleet run took 13-14 s at 4 and 100 workers and 32-37 s at 1,000, so the four
# predictors at all three sizes need about 250 s (FLEET_TIMEOUT=280); bench_manager's
# --sizes 1000 10000 reached ARIMA's 1,000-worker row in 120 s (its 10,000-worker row needs more).
# Logs go to OUTDIR/<step>.txt. Needs the project's dependencies importable from here:
#   PYTHONPATH=$PWD bash scripts/speed_checks.sh OUTDIR [dataplane] [passive] [parts] [blocks] [fleet] [manager] [cold]
# (no step named: all but passive and parts, in that order). On the lent device machine (Python 3.12, no pydantic
# or orjson in its image) the missing packages travel as wheels, fetched here into an ignored .whl:
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic pydantic-core annotated-types typing-inspection orjson pyzmq typing-extensions
# (the versions this checkout's .venv has: pydantic and pydantic-core must match) and there
# (carrying .whl): python3 -m pip install -q --no-index --no-deps --target /tmp/site
#   .whl/*.whl && PYTHONPATH=/tmp/site:$PWD bash scripts/speed_checks.sh $OUT
# CLIENT_PROCS sets bench_fleet's client processes
# (default: a quarter of the cores, at least 2), so that the simulated workers do not starve
# shard 0 of a core.
set -uo pipefail
out=${1:-speed-checks}
shift || true
steps=${*:-dataplane blocks fleet manager cold}
mkdir -p "$out"
out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
cores=$(nproc)
client_procs=${CLIENT_PROCS:-$(( cores / 4 > 2 ? cores / 4 : 2 ))}
step() { echo; echo "### $*"; date -u +%T; }
wants() { [[ " $steps " == *" $1 "* ]]; }

{
  step environment
  echo "cores: $cores"
  grep -m1 "model name" /proc/cpuinfo
  $py -c 'import sys, numpy, torch, zmq; print("python", sys.version.split()[0], "numpy", numpy.__version__,
"torch", torch.__version__, "pyzmq", zmq.__version__)'
} 2>&1 | tee "$out/env.txt"

if wants dataplane; then
  step "data plane" | tee "$out/dataplane.txt"
  timeout 240 $py benchmarks/bench_dataplane.py ${DATAPLANE_ARGS:---repeats 1 --iters 8 --shard-threads 1 8 --phases} 2>&1 \
    | tee -a "$out/dataplane.txt"
fi

if wants passive; then
  for wait in --spinning-threads ""; do
    step "data plane, two shards, ${wait:-threads sleeping between updates, as in ps-server}" \
      | tee -a "$out/passive.txt"
    timeout 200 $py benchmarks/bench_dataplane.py $wait ${PASSIVE_ARGS:---repeats 1 --iters 8 --shards 2 \
      --shard-threads 1 4 8 --phases} 2>&1 | tee -a "$out/passive.txt"
  done
fi

if wants parts; then
  step "data plane, two shards, answers whole and streamed in parts" | tee "$out/parts.txt"
  timeout 240 $py benchmarks/bench_dataplane.py ${PARTS_ARGS:---repeats 2 --iters 8 --shards 2 --shard-threads 8 \
    --params-part-bytes 0 4194304} 2>&1 | tee -a "$out/parts.txt"
fi

if wants blocks; then
  step "the update in blocks" | tee "$out/blocks.txt"
  for threads in 1 8; do
    timeout 60 env OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE} $py benchmarks/bench_update_blocks.py \
      --threads $threads ${BLOCKS_ARGS:---steps 15} 2>&1 | tee -a "$out/blocks.txt"
  done
fi

if wants fleet; then
  step "real runs, $client_procs client processes" | tee "$out/fleet.txt"
  timeout ${FLEET_TIMEOUT:-150} $py benchmarks/bench_fleet.py --client-procs "$client_procs" \
    ${FLEET_ARGS:---workers 4 1000 --policies last narx --iterations 80 --skip 30} 2>&1 | tee -a "$out/fleet.txt"
fi

if wants manager; then
  step "decision time at 1,000 and 10,000 workers" | tee "$out/manager.txt"
  timeout ${MANAGER_TIMEOUT:-120} $py benchmarks/bench_manager.py --tables a ${MANAGER_ARGS:---sizes 1000 10000} 2>&1 \
    | tee -a "$out/manager.txt"
fi

if wants cold; then
  step "decision CPU after idling" | tee "$out/cold.txt"
  timeout 60 $py benchmarks/bench_decision_cold.py ${COLD_ARGS:---workers 4 100 --decisions 60} 2>&1 \
    | tee -a "$out/cold.txt"
fi
