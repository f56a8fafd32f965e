#!/usr/bin/env bash
# A local Slurm cluster for the slurm tests: one controller and two emulated nodes (node1, node2;
# one slurmd -N each) on this machine, CPU only, configured under DIR.
#   bash cluster.sh install      # Debian's slurm-wlm and munge, as root, if sbatch is missing
#   bash cluster.sh start DIR    # writes DIR/slurm.conf, starts munged, slurmctld, two slurmd
#   bash cluster.sh stop DIR     # stops what start started
# Commands then need SLURM_CONF=DIR/slurm.conf.
set -euo pipefail
action=${1:?install, start DIR or stop DIR}
dir=${2:-}

install() {
  command -v sbatch >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null && return
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "slurm is not installed and cannot be: installing needs root and apt-get" >&2; exit 2
  fi
  DEBIAN_FRONTEND=noninteractive apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm munge >/dev/null
}

write_conf() {
  mkdir -p "$dir/state" "$dir/spool"
  cpus=$(nproc)
  cat > "$dir/slurm.conf" <<CONF
ClusterName=megatron-rl-bi-test
SlurmctldHost=localhost
SlurmUser=root
SlurmctldPort=16817
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
NodeName=node[1-2] NodeHostname=localhost NodeAddr=127.0.0.1 Port=[17001-17002] CPUs=$cpus RealMemory=2000 State=UNKNOWN
PartitionName=test Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP
CONF
}

start_munge() {
  munge -n >/dev/null 2>&1 && return  # already running
  [ -s /etc/munge/munge.key ] || { mkdir -p /etc/munge; dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null; }
  chown munge:munge /etc/munge/munge.key 2>/dev/null || true
  chmod 400 /etc/munge/munge.key
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  munged --force 2>/dev/null
  touch "$dir/munged.started"
}

start() {
  write_conf
  start_munge
  export SLURM_CONF=$dir/slurm.conf
  slurmctld
  for node in node1 node2; do slurmd -N "$node"; done
  for _ in $(seq 1 60); do  # both nodes idle
    [ "$(sinfo -h -o '%T %D' 2>/dev/null | awk '$1 == "idle" {n += $2} END {print n + 0}')" = 2 ] && return
    sleep 0.5
  done
  echo "the cluster did not come up: $(sinfo 2>&1)" >&2; exit 1
}

stop() {
  pids=$(cat "$dir"/slurmd-*.pid "$dir/slurmctld.pid" 2>/dev/null || true)
  [ -n "$pids" ] && kill $pids 2>/dev/null || true
  for _ in $(seq 1 40); do  # gone, ports free for the next start
    alive=$(for pid in $pids; do kill -0 "$pid" 2>/dev/null && echo "$pid"; done)
    [ -z "$alive" ] && break
    sleep 0.25
  done
  if [ -f "$dir/munged.started" ]; then pkill -x munged || true; rm -f "$dir/munged.started"; fi
}

case $action in
  install) install ;;
  start) : "${dir:?start needs DIR}"; start ;;
  stop) : "${dir:?stop needs DIR}"; stop ;;
  *) echo "unknown action $action" >&2; exit 2 ;;
esac
