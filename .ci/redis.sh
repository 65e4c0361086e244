# Sourced by .ci/run (bash, set -euo pipefail): real Redis servers for the tests.
#
# `redis_up` installs Debian's redis-server when it is not on PATH, starts one standalone
# server and a 3-master Redis Cluster on free loopback ports, each in its own directory
# under one temporary directory with persistence off, waits until they answer (PING;
# cluster_state:ok), and exports
#   KVTIER_TEST_REDIS_URL=redis://127.0.0.1:PORT/0
#   KVTIER_TEST_REDIS_CLUSTER_URL=redis+cluster://127.0.0.1:P1,127.0.0.1:P2,127.0.0.1:P3
# for the tests' fixtures (tests/conftest.py). It sets an EXIT trap (`redis_down`) that
# stops every server it started by PID and removes the directory.

KVTIER_REDIS_PIDS=()
KVTIER_REDIS_DIR=""

redis_install() {
  if command -v redis-server >/dev/null && command -v redis-cli >/dev/null; then
    return 0
  fi
  local sudo=()
  if [ "$(id -u)" != 0 ]; then
    if ! command -v sudo >/dev/null; then
      echo "redis-server is not installed, and neither root nor sudo is available to install it" >&2
      return 1
    fi
    sudo=(sudo)
  fi
  echo "+ apt-get install -y redis-server"
  "${sudo[@]}" apt-get update -qq
  "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
}

# Free loopback ports, as many as asked, all distinct (bound together, then released).
redis_free_ports() {
  python3 - "$1" <<'EOF'
import socket, sys
socks = [socket.socket() for _ in range(int(sys.argv[1]))]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(" ".join(str(s.getsockname()[1]) for s in socks))
EOF
}

# redis_start DIR PORT [ARGS...]: one server in the background, its PID recorded.
redis_start() {
  local dir=$1 port=$2
  shift 2
  mkdir -p "$dir"
  redis-server --bind 127.0.0.1 --port "$port" --dir "$dir" --save '' --appendonly no \
    --daemonize no --protected-mode no "$@" >"$dir/server.log" 2>&1 &
  KVTIER_REDIS_PIDS+=("$!")
}

# redis_wait PORT TEXT ARGS...: until `redis-cli -p PORT ARGS...` prints TEXT (15 s at most).
redis_wait() {
  local port=$1 text=$2
  shift 2
  for _ in $(seq 300); do
    if redis-cli -h 127.0.0.1 -p "$port" "$@" 2>/dev/null | grep -q "$text"; then
      return 0
    fi
    sleep 0.05
  done
  echo "redis on port $port: no '$text' from '$*' after 15 s; its log:" >&2
  cat "$KVTIER_REDIS_DIR"/*/server.log >&2 || true
  return 1
}

redis_down() {
  local pid
  for pid in "${KVTIER_REDIS_PIDS[@]}"; do
    kill "$pid" 2>/dev/null || true
  done
  for pid in "${KVTIER_REDIS_PIDS[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  KVTIER_REDIS_PIDS=()
  if [ -n "$KVTIER_REDIS_DIR" ]; then
    rm -rf "$KVTIER_REDIS_DIR"
  fi
}

redis_up() {
  redis_install
  KVTIER_REDIS_DIR=$(mktemp -d "${TMPDIR:-/tmp}/kvtier-redis.XXXXXX")
  trap redis_down EXIT
  local ports
  read -r -a ports <<<"$(redis_free_ports 7)"
  local standalone=${ports[0]} nodes=() i port
  redis_start "$KVTIER_REDIS_DIR/standalone" "$standalone"
  for i in 1 2 3; do
    # A cluster bus port of its own: PORT+10000 may be out of range or taken.
    redis_start "$KVTIER_REDIS_DIR/node$i" "${ports[$i]}" --cluster-enabled yes \
      --cluster-port "${ports[$((i + 3))]}" --cluster-config-file "$KVTIER_REDIS_DIR/node$i/nodes.conf"
    nodes+=("127.0.0.1:${ports[$i]}")
  done
  for port in "$standalone" "${ports[@]:1:3}"; do
    redis_wait "$port" PONG ping
  done
  redis-cli -h 127.0.0.1 -p "${ports[1]}" --cluster create "${nodes[@]}" --cluster-replicas 0 \
    --cluster-yes >"$KVTIER_REDIS_DIR/cluster-create.log"
  for port in "${ports[@]:1:3}"; do
    redis_wait "$port" cluster_state:ok cluster info
  done
  export KVTIER_TEST_REDIS_URL="redis://127.0.0.1:$standalone/0"
  export KVTIER_TEST_REDIS_CLUSTER_URL="redis+cluster://$(IFS=,; echo "${nodes[*]}")"
  echo "+ redis: $KVTIER_TEST_REDIS_URL and $KVTIER_TEST_REDIS_CLUSTER_URL (pids ${KVTIER_REDIS_PIDS[*]})"
}
