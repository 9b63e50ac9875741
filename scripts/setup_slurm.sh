#!/usr/bin/env bash
# A single-host Slurm for tests/system/test_system_slurm.py: Debian's slurm-wlm and munge, this host as
# the only node (with more CPUs declared than it has, so a job's tasks all fit), controller and
# node daemons started in the background. Needs root and the package registry. Idempotent.
#   bash scripts/setup_slurm.sh          # install, configure, start
#   bash scripts/setup_slurm.sh stop     # stop the daemons this script started
set -euo pipefail
if [ "${1:-}" = stop ]; then
  # Each daemon leads its own process group (setsid below): signal the group, so a wrapper
  # (runuser) and the daemon it runs both go, then make sure.
  for p in slurmd slurmctld munged; do
    f="/run/lbbsp-$p.pid"
    [ -f "$f" ] || continue
    pid=$(cat "$f")
    kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 -- "-$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL -- "-$pid" 2>/dev/null || true
    rm -f "$f"
  done
  exit 0
fi
[ "$(id -u)" = 0 ] || { echo "setup_slurm.sh: needs root" >&2; exit 2; }
if ! command -v sbatch >/dev/null || ! command -v slurmd >/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
fi
NODE=$(hostname -s)
mkdir -p /etc/munge /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge
if [ ! -s /etc/munge/munge.key ]; then
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key
cat > /etc/slurm/slurm.conf <<CONF
ClusterName=lbbsp
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# backfill: the default, and the only scheduler that runs heterogeneous jobs
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
MpiDefault=none
JobCompType=jobcomp/none
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=$NODE CPUs=16 State=UNKNOWN
PartitionName=lbbsp Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
start() {  # name, pid file, command...
  local name=$1; shift
  if [ -f "/run/lbbsp-$name.pid" ] && kill -0 "$(cat "/run/lbbsp-$name.pid")" 2>/dev/null; then return; fi
  setsid "$@" >"/var/log/slurm/lbbsp-$name.out" 2>&1 &
  echo $! > "/run/lbbsp-$name.pid"
}
start munged runuser -u munge -- /usr/sbin/munged -F
sleep 1
start slurmctld /usr/sbin/slurmctld -D
start slurmd /usr/sbin/slurmd -D
for _ in $(seq 1 30); do
  if sinfo -h -o %T 2>/dev/null | grep -q idle; then sinfo; exit 0; fi
  sleep 1
done
echo "setup_slurm.sh: the node did not come up; see /var/log/slurm/" >&2
exit 1
