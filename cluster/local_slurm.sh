#!/usr/bin/env bash
# A real SLURM cluster on this one machine, to try (and test) the cluster path without a cluster.
#
#   cluster/local_slurm.sh start [--nodes 1|2] [--dir DIR]   install if missing, configure, start (idempotent)
#   cluster/local_slurm.sh status [--dir DIR]                the daemons and the nodes
#   cluster/local_slurm.sh stop [--dir DIR]                  cancel its jobs, stop the daemons it started
#
# Needs root and apt (Debian/Ubuntu): installs slurmctld, slurmd, slurm-client and munge without recommends.
# Runs munged, slurmctld and one slurmd per node directly (no systemd), every file of theirs (config, munge key,
# state, logs, pid files) in DIR (default /var/lib/meshtrain-slurm). With --nodes 2 the same host plays two
# nodes, n1 and n2: two slurmd processes on distinct ports. JAX's SLURM detection uses the first node's name as the
# coordinator host, so n1/n2 must resolve: start adds them to /etc/hosts as 127.0.0.1 (one marked line) unless
# they resolve already, and stop removes that line. Client commands read DIR/slurm.conf through $SLURM_CONF, or
# through /etc/slurm/slurm.conf, which start links there when no other configuration is installed.
# stop ends only processes whose pids are in DIR's pid files (and checks each pid is still that daemon).
set -euo pipefail

usage() {
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//'
  exit "${1:-2}"
}

COMMAND=${1:-}
[[ -n $COMMAND ]] || usage
shift
NODES=1
DIR=${MESHTRAIN_SLURM_DIR:-/var/lib/meshtrain-slurm}
while (($#)); do
  case $1 in
    --nodes) NODES=${2:?--nodes needs 1 or 2}; shift 2 ;;
    --nodes=*) NODES=${1#*=}; shift ;;
    --dir) DIR=${2:?--dir needs a directory}; shift 2 ;;
    --dir=*) DIR=${1#*=}; shift ;;
    -h|--help) usage 0 ;;
    *) echo "local_slurm.sh: unknown argument '$1'" >&2; usage ;;
  esac
done
[[ $NODES == 1 || $NODES == 2 ]] || { echo "local_slurm.sh: --nodes must be 1 or 2, not '$NODES'" >&2; exit 2; }
[[ $DIR == /* ]] || DIR=$PWD/$DIR  # absolute: it goes into slurm.conf and the daemons' command lines
CONF=$DIR/slurm.conf
HOSTS_MARK="# meshtrain local_slurm.sh $DIR"
CTLD_PORT=16817
SLURMD_PORT=17001  # node i listens on SLURMD_PORT + i - 1

log() { echo "local_slurm: $*" >&2; }
die() { echo "local_slurm: error: $*" >&2; exit 1; }

need_root() { [[ $(id -u) == 0 ]] || die "needs root (it installs packages and runs the SLURM daemons as root)"; }

# The pid in a pid file if that process is alive and still runs the expected program (pids are reused).
live_pid() {
  local file=$1 program=$2 pid
  [[ -s $file ]] || return 1
  pid=$(tr -dc '0-9' < "$file")
  [[ -n $pid && -r /proc/$pid/cmdline ]] || return 1
  tr '\0' ' ' < "/proc/$pid/cmdline" | grep -q -- "$program" || return 1
  echo "$pid"
}

node_names() {  # the node names of the configured shape
  if [[ $1 == 1 ]]; then hostname -s; else echo n1 n2; fi
}

running_shape() {  # the shape whose daemons are all alive, or nothing
  [[ -s $DIR/shape ]] || return 0
  local shape node
  shape=$(cat "$DIR/shape")
  live_pid "$DIR/run/munged.pid" munged > /dev/null || return 0
  live_pid "$DIR/run/slurmctld.pid" slurmctld > /dev/null || return 0
  for node in $(node_names "$shape"); do
    live_pid "$DIR/run/slurmd-$node.pid" slurmd > /dev/null || return 0
  done
  echo "$shape"
}

install_packages() {
  if command -v slurmctld > /dev/null && command -v slurmd > /dev/null && command -v sbatch > /dev/null \
      && command -v munged > /dev/null; then
    return
  fi
  command -v apt-get > /dev/null || die "SLURM is not installed and there is no apt-get to install it"
  log "installing slurmctld slurmd slurm-client munge (apt, no recommends)"
  local packages=(slurmctld slurmd slurm-client munge)
  # A fresh machine's package lists may be missing or stale: update once if the first attempt fails.
  if ! DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" > "$DIR/apt.log" 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get update -q >> "$DIR/apt.log" 2>&1 || true
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${packages[@]}" >> "$DIR/apt.log" 2>&1 \
      || { tail -20 "$DIR/apt.log" >&2; die "apt-get install failed (log: $DIR/apt.log)"; }
  fi
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...: poll until COMMAND succeeds
  local seconds=$1 what=$2
  shift 2
  local deadline=$((SECONDS + seconds))
  until "$@" > /dev/null 2>&1; do
    ((SECONDS < deadline)) || { log "gave up waiting for $what after $seconds s"; return 1; }
    sleep 0.2
  done
}

resolve_nodes() {
  local node missing=()
  for node in "$@"; do
    getent hosts "$node" > /dev/null || missing+=("$node")
  done
  if ((${#missing[@]})); then
    log "adding '127.0.0.1 ${missing[*]}' to /etc/hosts (the node names must resolve; stop removes it)"
    echo "127.0.0.1 ${missing[*]} $HOSTS_MARK" >> /etc/hosts
  fi
}

unresolve_nodes() {
  grep -qF -- "$HOSTS_MARK" /etc/hosts 2> /dev/null || return 0
  # /etc/hosts may be a bind mount (containers): rewrite it in place rather than replacing the file.
  local kept
  kept=$(grep -vF -- "$HOSTS_MARK" /etc/hosts || true)
  printf '%s\n' "$kept" > /etc/hosts
}

write_config() {
  local shape=$1 hw node i=0
  # The node's real CPUs, boards, sockets, cores and memory, as slurmd itself detects them.
  hw=$(slurmd -C | head -1 | sed 's/^NodeName=[^ ]* //')
  {
    echo "# Written by cluster/local_slurm.sh (--nodes $shape); rewritten on every start."
    echo "ClusterName=meshtrain"
    echo "SlurmctldHost=$(hostname -s)(127.0.0.1)"
    echo "SlurmctldPort=$CTLD_PORT"
    echo "SlurmUser=root"
    echo "SlurmdUser=root"
    echo "AuthType=auth/munge"
    echo "CredType=cred/munge"
    # cred_expire also delays a requeued job's restart (default 120 s); 20 s is still ample to launch a step here.
    echo "AuthInfo=socket=$DIR/run/munge.socket,cred_expire=20"
    echo "StateSaveLocation=$DIR/state"
    echo "SlurmdSpoolDir=$DIR/spool/%n"
    echo "SlurmctldPidFile=$DIR/run/slurmctld.pid"
    echo "SlurmdPidFile=$DIR/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$DIR/log/slurmctld.log"
    echo "SlurmdLogFile=$DIR/log/slurmd-%n.log"
    # No cgroups in containers: track processes by parentage, bind nothing.
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "MpiDefault=none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"  # memory is not a consumable resource: the emulated nodes share one host
    echo "SchedulerType=sched/backfill"
    echo "AccountingStorageType=accounting_storage/none"
    echo "JobCompType=jobcomp/none"
    echo "ReturnToService=2"
    echo "MinJobAge=600"  # finished jobs stay visible to scontrol for 10 min
    echo "KillWait=30"
    echo "InactiveLimit=0"
    echo "SlurmdTimeout=300"
    for node in $(node_names "$shape"); do
      if [[ $shape == 1 ]]; then
        echo "NodeName=$node NodeAddr=127.0.0.1 Port=$SLURMD_PORT $hw State=UNKNOWN"
      else
        echo "NodeName=$node NodeHostname=$(hostname -s) NodeAddr=127.0.0.1 Port=$((SLURMD_PORT + i)) $hw State=UNKNOWN"
      fi
      i=$((i + 1))
    done
    # OverSubscribe: the emulated nodes share the host's cores, and tests run several small jobs at once.
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
  } > "$CONF.tmp"
  mv "$CONF.tmp" "$CONF"
}

start() {
  need_root
  local current
  current=$(running_shape)
  if [[ $current == "$NODES" ]]; then
    log "already running with $NODES node(s) in $DIR"
    show_usage
    return
  fi
  if [[ -n $current || -e $DIR/shape ]]; then
    stop
  fi
  mkdir -p "$DIR"/{run,state,spool,log} || die "cannot create the state directory $DIR"
  install_packages
  # munged refuses a key or socket directory that others can write, and a key readable by others.
  install -d -o munge -g munge -m 0700 "$DIR/munge"
  chown munge:munge "$DIR/run" && chmod 0755 "$DIR/run"
  if [[ ! -s $DIR/munge/munge.key ]]; then
    dd if=/dev/urandom of="$DIR/munge/munge.key" bs=1024 count=1 status=none
    chown munge:munge "$DIR/munge/munge.key"
    chmod 0400 "$DIR/munge/munge.key"
  fi
  runuser -u munge -- munged --socket="$DIR/run/munge.socket" --key-file="$DIR/munge/munge.key" \
    --pid-file="$DIR/run/munged.pid" --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
  wait_for 20 munged test -S "$DIR/run/munge.socket" || die "munged did not start (log: $DIR/munge/munged.log)"

  local names
  read -ra names <<< "$(node_names "$NODES")"
  resolve_nodes "${names[@]}"
  write_config "$NODES"
  export SLURM_CONF=$CONF
  # -c: a fresh controller state on every start (no jobs or node states from an earlier shape).
  slurmctld -c -f "$CONF"
  wait_for 30 slurmctld live_pid "$DIR/run/slurmctld.pid" slurmctld \
    || die "slurmctld did not start (log: $DIR/log/slurmctld.log)"
  local node
  for node in $(node_names "$NODES"); do
    mkdir -p "$DIR/spool/$node"
    slurmd -f "$CONF" -N "$node"
  done
  echo "$NODES" > "$DIR/shape"
  # Plain sbatch/squeue find the configuration when no other SLURM is configured on this machine.
  if [[ ! -e /etc/slurm/slurm.conf || -L /etc/slurm/slurm.conf ]]; then
    mkdir -p /etc/slurm && ln -sfn "$CONF" /etc/slurm/slurm.conf
  fi
  if ! wait_for 60 "idle nodes" all_idle; then
    sinfo -N >&2 || true
    die "the nodes did not become idle within 60 s (logs: $DIR/log/)"
  fi
  log "started: $NODES node(s) ($(node_names "$NODES")), state in $DIR"
  show_usage
}

all_idle() {
  local states
  states=$(SLURM_CONF=$CONF sinfo -h -N -o '%T' 2> /dev/null) || return 1
  [[ -n $states ]] && ! grep -qv -e '^idle' -e '^mixed' -e '^allocated' <<< "$states"
}

show_usage() {
  cat <<EOF
Use it (client commands read SLURM_CONF):
  export SLURM_CONF=$CONF
  sinfo -N
  sbatch --nodes=$NODES --gpus-per-node=0 --cpus-per-task=1 cluster/slurm.sbatch configs/tiny.py \$PWD/runs/slurm --config.cpu_devices=$((8 / NODES))
  squeue; scancel JOBID
  cluster/local_slurm.sh stop
EOF
}

stop() {
  need_root
  export SLURM_CONF=$CONF
  # Jobs first: their slurmstepd processes outlive slurmd and would keep training.
  if live_pid "$DIR/run/slurmctld.pid" slurmctld > /dev/null; then
    local jobs
    jobs=$(squeue -h -o '%i' 2> /dev/null || true)
    if [[ -n $jobs ]]; then
      log "cancelling jobs: $(echo $jobs)"
      scancel $jobs 2> /dev/null || true
      wait_for 60 "jobs to end" no_running_jobs || log "jobs still listed after 60 s: $(squeue -h -o '%i %T' | tr '\n' ' ')"
    fi
  fi
  local file program pid
  for file in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid" "$DIR/run/munged.pid"; do
    [[ -e $file ]] || continue
    case $(basename "$file") in slurmd-*) program=slurmd ;; slurmctld.pid) program=slurmctld ;; *) program=munged ;; esac
    if pid=$(live_pid "$file" "$program"); then
      kill -TERM "$pid" 2> /dev/null || true
      if ! wait_for 20 "$program to stop" dead "$pid"; then
        log "$program (pid $pid) did not stop on SIGTERM within 20 s: SIGKILL"
        kill -KILL "$pid" 2> /dev/null || true
      fi
      log "stopped $program (pid $pid)"
    fi
    rm -f "$file"
  done
  rm -f "$DIR/shape"
  unresolve_nodes
  if [[ -L /etc/slurm/slurm.conf && $(readlink /etc/slurm/slurm.conf) == "$CONF" ]]; then
    rm -f /etc/slurm/slurm.conf
  fi
}

no_running_jobs() { [[ -z $(squeue -h -o '%i' 2> /dev/null) ]]; }
dead() { ! kill -0 "$1" 2> /dev/null; }

status() {
  local shape file program pid rc=0
  shape=$(cat "$DIR/shape" 2> /dev/null || true)
  if [[ -z $shape ]]; then
    echo "not running (no cluster started from $DIR)"
    return 3
  fi
  echo "configured: $shape node(s), $DIR"
  for file in "$DIR/run/munged.pid" "$DIR/run/slurmctld.pid" $(for n in $(node_names "$shape"); do echo "$DIR/run/slurmd-$n.pid"; done); do
    case $(basename "$file") in slurmd-*) program=slurmd ;; slurmctld.pid) program=slurmctld ;; *) program=munged ;; esac
    if pid=$(live_pid "$file" "$program"); then
      echo "  $(basename "$file" .pid): running, pid $pid"
    else
      echo "  $(basename "$file" .pid): NOT running"
      rc=3
    fi
  done
  if ((rc == 0)); then
    SLURM_CONF=$CONF sinfo -N || rc=3
  fi
  return $rc
}

case $COMMAND in
  start) start ;;
  stop) stop ;;
  status) status ;;
  -h|--help|help) usage 0 ;;
  *) echo "local_slurm.sh: unknown command '$COMMAND'" >&2; usage ;;
esac
