# Shared helpers for kvroute's scripts: free ports, waiting for HTTP health, and starting
# nats-server / etcd on loopback with data under a given directory. Source it; don't run it.

free_port() {
  python3 - <<'PY'
import socket
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close()
    if p not in (4222, 2379, 2380, 8222):
        print(p); break
PY
}

# free_port_range N: N consecutive free ports, as FIRST-LAST (a compose port range).
free_port_range() {
  python3 - "$1" <<'PY'
import socket, sys
n = int(sys.argv[1])
while True:
    s = socket.socket(); s.bind(("127.0.0.1", 0)); first = s.getsockname()[1]; s.close()
    if first + n > 65535:
        continue
    try:
        for p in range(first, first + n):
            t = socket.socket(); t.bind(("127.0.0.1", p)); t.close()
    except OSError:
        continue
    print("%d-%d" % (first, first + n - 1)); break
PY
}

# wait_http URL [SECONDS]: until URL answers 200.
wait_http() {
  local url="$1" limit="${2:-30}" i=0
  until curl -fsS -o /dev/null "$url" 2>/dev/null; do
    i=$((i + 1))
    if [ "$i" -gt $((limit * 10)) ]; then echo "timed out waiting for $url" >&2; return 1; fi
    sleep 0.1
  done
}

# start_nats DIR: sets NATS_PORT, NATS_MONITOR, NATS_URL, NATS_PID.
start_nats() {
  local dir="$1"
  NATS_PORT=$(free_port); NATS_MONITOR=$(free_port)
  mkdir -p "$dir/nats"
  "$KVROUTE_ROOT/.tools/bin/nats-server" --addr 127.0.0.1 --port "$NATS_PORT" \
    --http_port "$NATS_MONITOR" --jetstream --store_dir "$dir/nats" --server_name demo \
    >"$dir/nats.log" 2>&1 &
  NATS_PID=$!
  NATS_URL="nats://127.0.0.1:$NATS_PORT"
  wait_http "http://127.0.0.1:$NATS_MONITOR/healthz?js-enabled-only=true"
}

# start_etcd DIR: sets ETCD_PORT, ETCD_URL, ETCD_PID.
start_etcd() {
  local dir="$1" peer
  ETCD_PORT=$(free_port); peer=$(free_port)
  etcd --name demo --data-dir "$dir/etcd" \
    --listen-client-urls "http://127.0.0.1:$ETCD_PORT" --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
    --listen-peer-urls "http://127.0.0.1:$peer" --initial-advertise-peer-urls "http://127.0.0.1:$peer" \
    --initial-cluster "demo=http://127.0.0.1:$peer" --log-level warn >"$dir/etcd.log" 2>&1 &
  ETCD_PID=$!
  ETCD_URL="http://127.0.0.1:$ETCD_PORT"
  wait_http "$ETCD_URL/health"
}
