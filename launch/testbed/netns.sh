#!/bin/bash
# A multi-host test bed on one machine: one network namespace per simulated host, joined by a
# bridge, each host with its own address, hostname and /etc/hosts. Needs root and iproute2.
#
#   launch/testbed/netns.sh up [HOSTS]     # create (idempotent); HOSTS defaults to 3
#   launch/testbed/netns.sh down           # end every process inside, delete it all (idempotent)
#   launch/testbed/netns.sh exec HOST -- CMD [ARGS...]   # run CMD on HOST (exec, same PID)
#   launch/testbed/netns.sh kill HOST      # host crash: SIGKILL every process on HOST
#   launch/testbed/netns.sh cut HOST       # link cut: HOST's cable unplugged (veth down)
#   launch/testbed/netns.sh mend HOST      # plug it back in
#   launch/testbed/netns.sh pids HOST      # the processes running on HOST
#   launch/testbed/netns.sh status         # hosts, addresses, link states
#
# Layout (RJ_TESTBED=rjtb, RJ_TESTBED_SUBNET=10.77.0): the bridge `rjtbbr` in the root namespace
# holds 10.77.0.1, the head host `rjtbhead` (where a supervisor or slurmctld runs); host i is the
# namespace `rjtbn<i>` at 10.77.0.<10+i> with hostname `rjtbn<i>`. The root namespace's own
# /etc/hosts is never touched: `exec` gives each process a private mount and UTS namespace in which
# /etc/hosts lists every test-bed host (so JAX's gloo, which resolves the hostname to find its own
# address, and slurmd, which must be its NodeName, both work). HOST may be `head` or a host name.
# Two test beds with different RJ_TESTBED and RJ_TESTBED_SUBNET coexist.
set -euo pipefail

P=${RJ_TESTBED:-rjtb}
SUBNET=${RJ_TESTBED_SUBNET:-10.77.0}
STATE=/run/$P-testbed
BRIDGE=${P}br
HEAD=${P}head

die() {
  echo "netns.sh: $*" >&2
  exit 1
}

((${#P} <= 8)) || die "RJ_TESTBED='$P' is longer than 8 characters (interface names are <= 15)"
[[ $P =~ ^[a-z][a-z0-9]*$ ]] || die "RJ_TESTBED='$P': lower-case letters and digits only"

need_tools() {
  [[ $(id -u) == 0 ]] || die "needs root (network namespaces, bridges, mounts)"
  local tool
  for tool in ip nsenter unshare mount hostname; do
    command -v "$tool" >/dev/null || die "missing '$tool' (iproute2 / util-linux)"
  done
}

host_names() { cat "$STATE/hosts.list" 2>/dev/null || true; }

host_ns() { # HOST -> namespace name (the host name itself)
  local host=$1
  [[ $host == head ]] && host=$HEAD
  echo "$host"
}

check_host() {
  local host=$1
  [[ $host == "$HEAD" ]] && return
  grep -qx "$host" "$STATE/hosts.list" 2>/dev/null || die "no test-bed host '$host' (up first?)"
}

cmd_up() {
  need_tools
  local count=${1:-3} i host addr
  [[ $count =~ ^[1-9][0-9]?$ ]] && ((count <= 40)) || die "HOSTS='$count': 1..40 hosts"
  mkdir -p "$STATE"
  # The bridge: the head host's address, and the switch every host is cabled to.
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
  fi
  ip addr replace "$SUBNET.1/24" dev "$BRIDGE"
  ip link set "$BRIDGE" up
  {
    echo "127.0.0.1 localhost"
    echo "$SUBNET.1 $HEAD"
    for ((i = 1; i <= count; i++)); do echo "$SUBNET.$((10 + i)) ${P}n$i"; done
  } >"$STATE/hosts"
  : >"$STATE/hosts.list"
  for ((i = 1; i <= count; i++)); do
    host=${P}n$i
    addr=$SUBNET.$((10 + i))
    echo "$host" >>"$STATE/hosts.list"
    [[ -e /run/netns/$host ]] || ip netns add "$host"
    if ! ip link show "${host}v" >/dev/null 2>&1; then
      ip link add "${host}v" type veth peer name "${host}p"
      ip link set "${host}p" netns "$host"
      ip -n "$host" link set "${host}p" name eth0
    fi
    ip link set "${host}v" master "$BRIDGE"
    ip link set "${host}v" up
    ip -n "$host" addr replace "$addr/24" dev eth0
    ip -n "$host" link set eth0 up
    ip -n "$host" link set lo up
  done
}

cmd_down() {
  need_tools
  local ns pid
  # Every namespace of this test bed, including hosts of an earlier, larger `up`.
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^${P}n[0-9]+$" || true); do
    for pid in $(ip netns pids "$ns" 2>/dev/null); do
      kill -9 "$pid" 2>/dev/null || true
    done
    ip link del "${ns}v" 2>/dev/null || true
    ip netns del "$ns" 2>/dev/null || true
  done
  ip link del "$BRIDGE" 2>/dev/null || true
  rm -rf "$STATE"
}

cmd_exec() {
  local host
  host=$(host_ns "${1:?exec HOST -- CMD}")
  shift
  [[ ${1:-} == -- ]] && shift
  (($# > 0)) || die "exec $host: no command"
  check_host "$host"
  local net=()
  [[ $host == "$HEAD" ]] || net=(nsenter "--net=/run/netns/$host")
  # A private mount namespace (its own /etc/hosts) and UTS namespace (its own hostname); the
  # command keeps this script's PID, so killing that PID ends the command.
  exec "${net[@]}" unshare --uts --mount --propagation private -- \
    sh -c 'mount --bind "$1" /etc/hosts && hostname "$2" && shift 2 && exec "$@"' \
    sh "$STATE/hosts" "$host" "$@"
}

cmd_pids() {
  local host
  host=$(host_ns "${1:?pids HOST}")
  check_host "$host"
  [[ $host == "$HEAD" ]] && die "the head host shares the root namespace: its processes are yours"
  ip netns pids "$host"
}

cmd_kill() {
  local pid
  for pid in $(cmd_pids "$@"); do kill -9 "$pid" 2>/dev/null || true; done
}

cmd_link() { # HOST up|down
  local host
  host=$(host_ns "$1")
  check_host "$host"
  [[ $host == "$HEAD" ]] && die "the head host has no link to cut"
  ip link set "${host}v" "$2"
}

cmd_status() {
  [[ -d $STATE ]] || {
    echo "test bed $P: down"
    return
  }
  echo "test bed $P: bridge $BRIDGE $SUBNET.1 ($HEAD)"
  local host
  for host in $(host_names); do
    printf '%s %s link=%s processes=%s\n' "$host" \
      "$(ip -n "$host" -4 -o addr show dev eth0 2>/dev/null | awk '{print $4}')" \
      "$(ip -o link show "${host}v" 2>/dev/null | grep -q 'state UP\|,UP' && echo up || echo down)" \
      "$(ip netns pids "$host" 2>/dev/null | wc -l)"
  done
}

case ${1:-} in
  up) cmd_up "${2:-3}" ;;
  down) cmd_down ;;
  exec)
    shift
    cmd_exec "$@"
    ;;
  pids) cmd_pids "${2:-}" ;;
  kill) cmd_kill "${2:-}" ;;
  cut) cmd_link "${2:?cut HOST}" down ;;
  mend) cmd_link "${2:?mend HOST}" up ;;
  status) cmd_status ;;
  *)
    sed -n '2,13p' "$0" >&2
    exit 2
    ;;
esac
