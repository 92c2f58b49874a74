#!/usr/bin/env bash
# Brings up a real one-node Slurm on this machine so that `srun --mpi=pmix` can launch MPI ranks:
# installs slurm-wlm + munge from Debian apt if missing, creates the munge key, starts munged,
# writes /etc/slurm/slurm.conf for this node (no cgroups: proctrack/linuxproc, task/none), starts
# slurmctld and slurmd, and waits until the node is idle. Idempotent: a second run only checks.
# Slurm stays optional for CPD; scripts/install_deps.sh does not install it.
set -Eeuo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/slurm_local.sh [--stop | --help]

  (no argument)  install slurm-wlm + munge if missing (Debian apt), create the munge key,
                 start munged, write /etc/slurm/slurm.conf (only when missing or different),
                 start slurmctld + slurmd, wait (<= 30 s) until the node is idle, print a status.
  --stop         stop slurmd, slurmctld and munged.
  --help         this text.

Then, e.g.:
  srun --mpi=pmix --overcommit -n 4 build/bin/comm_mpi_test
Needs root (daemons run as root, SlurmUser=root). No systemd: the daemons are started directly.
Logs: /var/log/slurm/slurmctld.log, /var/log/slurm/slurmd.log, /var/log/munge/munged.log.
EOF
}

PROG="slurm_local"
die() { echo "$PROG: $*" >&2; exit 1; }
on_err() { local rc=$?; echo "$PROG: failed (exit $rc) at line $1: $2" >&2; exit "$rc"; }
trap 'on_err "$LINENO" "$BASH_COMMAND"' ERR

MODE=start
case "${1:-}" in
  "") ;;
  --stop) MODE=stop ;;
  -h|--help) usage; exit 0 ;;
  *) echo "$PROG: unknown argument '$1' (try --help)" >&2; exit 2 ;;
esac
[ $# -le 1 ] || { echo "$PROG: too many arguments (try --help)" >&2; exit 2; }

[ "$(id -u)" -eq 0 ] || die "must run as root (daemons run as root, SlurmUser=root)"

CONF_DIR=/etc/slurm
CONF=$CONF_DIR/slurm.conf
CTLD_PID=/run/slurmctld.pid
SLURMD_PID=/run/slurmd.pid
MUNGE_RUN=/run/munge
MUNGE_PID=$MUNGE_RUN/munged.pid
MUNGE_KEY=/etc/munge/munge.key
LOG_DIR=/var/log/slurm
STATE_DIR=/var/spool/slurmctld
SPOOL_DIR=/var/spool/slurmd
WAIT_S=30

# Prints the pid of a running daemon named $2 recorded in pid file $1 (falls back to an exact
# process-name match); returns 1 if it is not running.
daemon_pid() {
  local pidfile=$1 name=$2 pid=""
  if [ -r "$pidfile" ]; then
    pid=$(tr -dc '0-9' <"$pidfile")
    if [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$name" ]; then
      echo "$pid"; return 0
    fi
  fi
  pid=$(pgrep -x "$name" 2>/dev/null | head -n1 || true)
  [ -n "$pid" ] || return 1
  echo "$pid"
}

# Stops daemon $2 (pid file $1): SIGTERM, then up to 10 s, then SIGKILL.
stop_daemon() {
  local pidfile=$1 name=$2 pid
  pid=$(daemon_pid "$pidfile" "$name") || return 0
  kill -TERM "$pid" 2>/dev/null || true
  for _ in $(seq 1 50); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.2
  done
  if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
  rm -f "$pidfile"
  echo "$PROG: stopped $name (pid $pid)"
}

if [ "$MODE" = stop ]; then
  stop_daemon "$SLURMD_PID" slurmd
  stop_daemon "$CTLD_PID" slurmctld
  stop_daemon "$MUNGE_PID" munged
  echo "$PROG: slurm stopped"
  exit 0
fi

# ---- 1. Packages (Debian apt only) ----------------------------------------------------------------
PACKAGES=(slurm-wlm munge)
missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "$PROG: installing ${#missing[@]} package(s): ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt_log=$(mktemp /tmp/slurm_local_apt.XXXXXX.log)
  apt-get update -qq >"$apt_log" 2>&1 || die "apt-get update failed (log: $apt_log)"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >>"$apt_log" 2>&1 \
    || die "apt-get install ${missing[*]} failed (log: $apt_log)"
  rm -f "$apt_log"
fi
for b in munged munge slurmctld slurmd sinfo srun scontrol; do
  command -v "$b" >/dev/null 2>&1 || [ -x "/usr/sbin/$b" ] || die "$b not found after install"
done
[ -e /usr/lib/x86_64-linux-gnu/slurm-wlm/mpi_pmix.so ] || ls /usr/lib/*/slurm-wlm/mpi_pmix.so \
  >/dev/null 2>&1 || die "Slurm's mpi_pmix plugin not found (package slurm-wlm-basic-plugins)"

# ---- 2. munge -------------------------------------------------------------------------------------
install -d -o munge -g munge -m 0700 /etc/munge
install -d -o munge -g munge -m 0711 /var/lib/munge
install -d -o munge -g munge -m 0700 /var/log/munge
install -d -o munge -g munge -m 0755 "$MUNGE_RUN"
if [ ! -s "$MUNGE_KEY" ]; then
  if command -v mungekey >/dev/null 2>&1; then
    mungekey --create --keyfile="$MUNGE_KEY" --force >/dev/null 2>&1 \
      || die "mungekey --create failed"
  else
    dd if=/dev/urandom of="$MUNGE_KEY" bs=1 count=1024 status=none || die "creating $MUNGE_KEY failed"
  fi
  chmod 0400 "$MUNGE_KEY"
  echo "$PROG: created $MUNGE_KEY"
fi
chown munge:munge "$MUNGE_KEY"
chmod go-rwx "$MUNGE_KEY"

if ! daemon_pid "$MUNGE_PID" munged >/dev/null; then
  rm -f "$MUNGE_PID" "$MUNGE_RUN"/munge.socket.2 "$MUNGE_RUN"/munge.socket.2.lock
  runuser -u munge -- /usr/sbin/munged >/dev/null 2>&1 \
    || die "munged failed to start (see /var/log/munge/munged.log)"
fi
ok=0
for _ in $(seq 1 50); do
  if munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then ok=1; break; fi
  sleep 0.2
done
[ "$ok" -eq 1 ] || die "munge round trip (munge -n | unmunge) failed (see /var/log/munge/munged.log)"

# ---- 3. slurm.conf --------------------------------------------------------------------------------
NODE=$(hostname -s)
[ -n "$NODE" ] || die "hostname -s is empty"
CPUS=$(nproc --all)
MEM_TOTAL=$(free -m | awk '/^Mem:/ {print $2}')
if [ -z "$MEM_TOTAL" ] || [ "$MEM_TOTAL" -le 0 ]; then die "cannot read total memory from free -m"; fi
# A bit below the total (5%, at least 256 MiB) so slurmd never reports less than configured.
MEM_RESERVE=$(( MEM_TOTAL / 20 > 256 ? MEM_TOTAL / 20 : 256 ))
REAL_MEM=$(( MEM_TOTAL > MEM_RESERVE * 2 ? MEM_TOTAL - MEM_RESERVE : MEM_TOTAL / 2 ))
# If the short host name does not resolve, talk over loopback.
ADDR=$NODE
getent hosts "$NODE" >/dev/null 2>&1 || ADDR=127.0.0.1

new_conf=$(mktemp /tmp/slurm_local_conf.XXXXXX)
cat >"$new_conf" <<EOF
# Written by scripts/slurm_local.sh (CPD): a one-node Slurm without cgroups. Rerun the script to
# regenerate; it only rewrites this file when the content differs.
ClusterName=cpd
SlurmctldHost=${NODE}(${ADDR})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=pmix
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmctldPort=6817
SlurmdPort=6818
StateSaveLocation=${STATE_DIR}
SlurmdSpoolDir=${SPOOL_DIR}
SlurmctldPidFile=${CTLD_PID}
SlurmdPidFile=${SLURMD_PID}
SlurmctldLogFile=${LOG_DIR}/slurmctld.log
SlurmdLogFile=${LOG_DIR}/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
MinJobAge=300
KillWait=10
Waittime=0
NodeName=${NODE} NodeAddr=${ADDR} CPUs=${CPUS} RealMemory=${REAL_MEM} State=UNKNOWN
PartitionName=debug Nodes=${NODE} Default=YES MaxTime=INFINITE State=UP
EOF

conf_changed=0
if [ ! -f "$CONF" ] || ! cmp -s "$new_conf" "$CONF"; then
  install -d -m 0755 "$CONF_DIR"
  install -m 0644 "$new_conf" "$CONF"
  conf_changed=1
  echo "$PROG: wrote $CONF (node $NODE, CPUs=$CPUS, RealMemory=$REAL_MEM)"
fi
rm -f "$new_conf"

install -d -m 0755 "$STATE_DIR" "$SPOOL_DIR" "$LOG_DIR"

# ---- 4. Daemons -----------------------------------------------------------------------------------
if [ "$conf_changed" -eq 1 ]; then
  # A changed node or plugin line needs a restart, not just `scontrol reconfigure`.
  if daemon_pid "$SLURMD_PID" slurmd >/dev/null || daemon_pid "$CTLD_PID" slurmctld >/dev/null; then
    echo "$PROG: configuration changed; restarting the slurm daemons"
    stop_daemon "$SLURMD_PID" slurmd
    stop_daemon "$CTLD_PID" slurmctld
  fi
fi
if ! daemon_pid "$CTLD_PID" slurmctld >/dev/null; then
  rm -f "$CTLD_PID"
  /usr/sbin/slurmctld || die "slurmctld failed to start (see $LOG_DIR/slurmctld.log)"
fi
if ! daemon_pid "$SLURMD_PID" slurmd >/dev/null; then
  rm -f "$SLURMD_PID"
  /usr/sbin/slurmd || die "slurmd failed to start (see $LOG_DIR/slurmd.log)"
fi

# ---- 5. Wait until the node is up and idle (bounded) ----------------------------------------------
state=""
resumed=0
deadline=$(( SECONDS + WAIT_S ))
while :; do
  state=$(sinfo -h -n "$NODE" -o '%T' 2>/dev/null | head -n1 || true)
  case "$state" in
    idle|mixed|allocated|completing) break ;;
    down*|drain*|fail*)
      if [ "$resumed" -eq 0 ]; then
        scontrol update nodename="$NODE" state=resume >/dev/null 2>&1 || true
        resumed=1
      fi ;;
  esac
  daemon_pid "$CTLD_PID" slurmctld >/dev/null || die "slurmctld exited (see $LOG_DIR/slurmctld.log)"
  daemon_pid "$SLURMD_PID" slurmd >/dev/null || die "slurmd exited (see $LOG_DIR/slurmd.log)"
  if [ "$SECONDS" -ge "$deadline" ]; then
    reason=$(sinfo -h -n "$NODE" -o '%E' 2>/dev/null | head -n1 || true)
    die "node $NODE not idle after ${WAIT_S} s (state '${state:-unknown}', reason '${reason:-none}'; see $LOG_DIR/slurmd.log)"
  fi
  sleep 1
done

pmix=no
srun --mpi=list 2>&1 | grep -qw pmix && pmix=yes
echo "$PROG: slurm up: node $NODE $state, partition debug, CPUs=$CPUS, RealMemory=$REAL_MEM, pmix=$pmix;" \
     "run MPI with: srun --mpi=pmix --overcommit -n 4 <mpi program>"
