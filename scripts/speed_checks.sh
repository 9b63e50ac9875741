#!/usr/bin/env bash
# Issue 9's benchmarks in one go, for a host with more cores than the 2-core VM they were built on
# (for example the 16-core machine a session with a device is lent): on that VM every process
# shares two cores and code idle for 50 ms runs 5-20x slower than warm (bench_decision_cold's
# reference rows), so these say which results are the code's and which are the VM's.
# Steps, each one to three minutes on 16 cores:
#   cold       bench_decision_cold: a decision's CPU tight, after a sleep and after a spin
#   fleet      bench_fleet: the decision's share of the iteration in a real run, 4/100/1,000 workers
#   dataplane  bench_dataplane: push + pull through the shards against raw pyzmq
#   manager    bench_manager table (a): decision time up to 10,000 workers
# Logs go to OUTDIR/<step>.txt. Needs the project's dependencies importable from here:
#   PYTHONPATH=$PWD bash scripts/speed_checks.sh OUTDIR [cold] [fleet] [dataplane] [manager]
# (no step named: all four, in that order). On the lent device machine (Python 3.12, no pydantic
# or orjson in its image) the missing packages travel as wheels, fetched here into an ignored .whl:
#   echo /.whl/ >> .git/info/exclude; python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
#     --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
#     pydantic pydantic-core annotated-types typing-inspection orjson pyzmq
# and there (carrying .whl): python3 -m pip install -q --no-index --no-deps --target /tmp/site
#   .whl/*.whl && PYTHONPATH=/tmp/site:$PWD bash scripts/speed_checks.sh $OUT
# CLIENT_PROCS sets bench_fleet's client processes
# (default: a quarter of the cores, at least 2), so that the simulated workers do not starve
# shard 0 of a core.
set -uo pipefail
out=${1:-speed-checks}
shift || true
steps=${*:-cold fleet dataplane manager}
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

if wants cold; then
  step "decision CPU after idling" | tee "$out/cold.txt"
  timeout 300 $py benchmarks/bench_decision_cold.py 2>&1 | tee -a "$out/cold.txt"
fi

if wants fleet; then
  step "real runs, $client_procs client processes" | tee "$out/fleet.txt"
  timeout 420 $py benchmarks/bench_fleet.py --client-procs "$client_procs" --phases 2>&1 | tee -a "$out/fleet.txt"
fi

if wants dataplane; then
  step "data plane" | tee "$out/dataplane.txt"
  timeout 300 $py benchmarks/bench_dataplane.py 2>&1 | tee -a "$out/dataplane.txt"
fi

if wants manager; then
  step "decision time up to 10,000 workers" | tee "$out/manager.txt"
  timeout 420 $py benchmarks/bench_manager.py --tables a 2>&1 | tee -a "$out/manager.txt"
fi
