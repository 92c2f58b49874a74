#!/usr/bin/env bash
# An emulated cluster network on one machine: N "hosts" as Linux network namespaces, each with
# one veth link into a bridge, every link shaped to RATE in both directions (tc tbf), so that MPI
# ranks placed one per namespace talk over TCP at a cluster's link speed instead of through
# shared memory. Used to measure the quantised all-reduce where bytes on the wire cost what they
# cost between hosts (benchmarks/allreduce_netns.sh).
set -Eeuo pipefail

usage() {
  cat <<'EOF'
Usage: scripts/netns_cluster.sh up N RATE   N namespaces cpdns0..cpdns{N-1} (10.77.0.1..N/24),
                                            links shaped to RATE (tc syntax: 1gbit, 10gbit, ...;
                                            none: unshaped veth, limited by the CPUs only)
       scripts/netns_cluster.sh down        remove them (idempotent)
       scripts/netns_cluster.sh mpirun NP PROGRAM [ARGS...]
                                            NP ranks of PROGRAM, rank r in namespace cpdns{r}:
                                            TCP BTL on 10.77.0.0/24 (no shared memory), PMIx
                                            over the bridge
       scripts/netns_cluster.sh --help
Needs root (ip netns, tc) and iproute2. The bridge cpdbr0 holds 10.77.0.254, where Open MPI's
PMIx server listens so that ranks in the namespaces can reach it.
EOF
}

PROG=netns_cluster
die() { echo "$PROG: $*" >&2; exit 1; }
MAX_HOSTS=16

down() {
  for i in $(seq 0 $((MAX_HOSTS - 1))); do
    ip netns del "cpdns$i" 2>/dev/null || true
    ip link del "cpdv$i" 2>/dev/null || true
  done
  ip link del cpdbr0 2>/dev/null || true
}

up() {
  local n=$1 rate=$2
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 2 ] && [ "$n" -le "$MAX_HOSTS" ] ||
    die "N must be in 2..$MAX_HOSTS, got '$n'"
  [[ "$rate" =~ ^[0-9]+(k|m|g)?bit$ || "$rate" == none ]] ||
    die "RATE must look like 1gbit or 10gbit (or none: unshaped veth), got '$rate'"
  command -v ip >/dev/null && command -v tc >/dev/null || die "needs iproute2 (ip, tc)"
  [ "$(id -u)" -eq 0 ] || die "needs root (ip netns, tc)"
  down
  ip link add cpdbr0 type bridge
  ip addr add 10.77.0.254/24 dev cpdbr0
  ip link set cpdbr0 up
  for i in $(seq 0 $((n - 1))); do
    local ns=cpdns$i
    ip netns add "$ns"
    ip link add "cpdv$i" type veth peer name eth0 netns "$ns"
    ip link set "cpdv$i" master cpdbr0 up
    ip -n "$ns" addr add "10.77.0.$((i + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
    # Shape both directions: the host's transmit (in its namespace) and its receive (the
    # bridge port's transmit). A burst of 1 Mbit keeps the shaping close to the rate.
    if [ "$rate" != none ]; then
      ip netns exec "$ns" tc qdisc add dev eth0 root tbf rate "$rate" burst 1mbit latency 50ms
      tc qdisc add dev "cpdv$i" root tbf rate "$rate" burst 1mbit latency 50ms
    fi
  done
  echo "$PROG: $n hosts cpdns0..cpdns$((n - 1)) on 10.77.0.0/24, links at $rate"
}

run_mpirun() {
  [ $# -ge 2 ] || { usage >&2; exit 2; }
  local np=$1
  shift
  ip link show cpdbr0 >/dev/null 2>&1 || die "no emulated cluster: run '$0 up N RATE' first"
  ip netns pids "cpdns$((np - 1))" >/dev/null 2>&1 || die "NP $np exceeds the hosts brought up"
  local self
  self=$(readlink -f "$0")
  local root=()
  [ "$(id -u)" -ne 0 ] || root=(--allow-run-as-root)
  # PMIx (the launcher's channel to each rank) listens on the bridge, reachable from every
  # namespace; the MPI traffic itself takes the TCP BTL over the shaped links.
  PMIX_MCA_ptl_tcp_if_include=cpdbr0 PMIX_MCA_ptl_tcp_remote_connections=1 \
    exec mpirun "${root[@]}" --oversubscribe --bind-to none --mca btl self,tcp \
    --mca btl_tcp_if_include 10.77.0.0/24 --mca oob_tcp_if_include lo \
    -np "$np" "$self" enter "$@"
}

# Internal: the per-rank wrapper mpirun starts (enters the rank's namespace, then execs).
enter() {
  local rank=${OMPI_COMM_WORLD_RANK:?not started by mpirun}
  exec ip netns exec "cpdns$rank" "$@"
}

case "${1:-}" in
  up) [ $# -eq 3 ] || { usage >&2; exit 2; }; up "$2" "$3" ;;
  down) down; echo "$PROG: removed" ;;
  mpirun) shift; run_mpirun "$@" ;;
  enter) shift; enter "$@" ;;
  -h|--help) usage ;;
  *) usage >&2; exit 2 ;;
esac
