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

# start_vllm DIR NAME MODEL CORE: a real vLLM engine (scripts/install-vllm) serving the test model
# as MODEL on free loopback ports, pinned to CPU core CORE, its KV events on ipc://DIR/NAME.kv.pub,
# in its own process group (its leader's pid is the group id). Sets VLLM_PID, VLLM_URL,
# VLLM_ZMQ, VLLM_REPLAY; returns at once (the engine answers /health after about a minute).
start_vllm() {
  local dir="$1" name="$2" model="$3" core="$4" port replay
  [ -n "${VLLM_SEMS_BEFORE+x}" ] || VLLM_SEMS_BEFORE=$(ls /dev/shm 2>/dev/null | grep '^sem\.mp-' || true)
  port=$(free_port); replay=$(free_port)
  VLLM_URL="http://127.0.0.1:$port"; VLLM_ZMQ="ipc://$dir/$name.kv.pub"
  VLLM_REPLAY="tcp://127.0.0.1:$replay"
  VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_NUM_OF_RESERVED_CPU=0 VLLM_CPU_OMP_THREADS_BIND="$core" \
    VLLM_SERVER_DEV_MODE=1 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    setsid "$KVROUTE_ROOT/.tools/vllm/venv/bin/python" -m vllm.entrypoints.openai.api_server \
    --model "$KVROUTE_ROOT/.tools/vllm/model" --served-model-name "$model" \
    --host 127.0.0.1 --port "$port" --dtype bfloat16 --enforce-eager --block-size 32 \
    --max-model-len 512 --enable-prefix-caching --enable-prompt-tokens-details \
    --num-gpu-blocks-override 64 \
    --kv-events-config "{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"$VLLM_ZMQ\",\"replay_endpoint\":\"$VLLM_REPLAY\"}" \
    >"$dir/$name.log" 2>&1 &
  VLLM_PID=$!
}

# stop_vllm PGID...: stops the engines' process groups (TERM, then KILL after 10 s) and removes
# the /dev/shm files a killed vLLM leaves (Python's psm_* it mapped, and sem.mp-* semaphores that
# appeared since start_vllm first ran and that no process maps).
stop_vllm() {
  local pgid pid shm=() sem
  for pgid in "$@"; do
    for pid in $(ps -o pid= -g "$pgid" 2>/dev/null || true); do
      shm+=($(grep -o '/dev/shm/psm_[^ ]*' "/proc/$pid/maps" 2>/dev/null | sort -u || true))
    done
    kill -TERM -- "-$pgid" 2>/dev/null || true
  done
  for _ in $(seq 100); do
    local alive=0
    for pgid in "$@"; do kill -0 -- "-$pgid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for pgid in "$@"; do kill -KILL -- "-$pgid" 2>/dev/null || true; done
  [ "${#shm[@]}" -gt 0 ] && rm -f "${shm[@]}"
  # Semaphores that appeared since the first engine started and that no process maps.
  for sem in /dev/shm/sem.mp-*; do
    [ -e "$sem" ] || continue
    grep -qx "${sem#/dev/shm/}" <<<"${VLLM_SEMS_BEFORE:-}" && continue
    grep -qs "$sem" /proc/[0-9]*/maps && continue
    rm -f "$sem"
  done
  return 0
}

# start_bridged_fleet NAME COUNT FIRST_ID MOCKER_ARG...: a kvroute-mocker of COUNT workers
# impersonating $engine_api on free ports (each prints the bridge flags that reach it) and one
# kvroute-bridge serving them as workers FIRST_ID...; returns once the bridge has registered
# them all, with BRIDGE_URL set. Uses the caller's $bin (the binaries' directory), $work (logs:
# $work/NAME.{out,log} and $work/NAME-bridge.log), $engine_api, the array common (the bridge's
# namespace, NATS and etcd flags), and appends both processes to the array pids.
start_bridged_fleet() {
  local name="$1" count="$2" first="$3" port; shift 3
  "$bin/kvroute-mocker" "$@" --workers "$count" --engine-api "$engine_api" --engine-http-port 0 \
    --engine-zmq-port 0 --engine-replay-port 0 >"$work/$name.out" 2>"$work/$name.log" &
  pids+=("$!")
  for _ in $(seq 300); do
    [ "$(grep -c -- '--zmq-endpoint' "$work/$name.out" 2>/dev/null)" = "$count" ] && break
    sleep 0.1
  done
  {
    echo "engines:"
    grep -- '--zmq-endpoint' "$work/$name.out" | while read -r line; do
      flag() { sed -n "s/.*--$1 \([^ ]*\).*/\1/p" <<<"$line"; }
      index=$(sed -n 's/^kvroute-mocker: worker \([0-9]*\).*/\1/p' <<<"$line")
      role=$(flag role)
      echo "  - {engine: $engine_api, engine_url: $(flag engine-url), zmq_endpoint: $(flag zmq-endpoint), zmq_replay_endpoint: $(flag zmq-replay-endpoint), worker_id: $((first + index))${role:+, role: $role}}"
    done
  } >"$work/$name-engines.yaml"
  port=$(free_port)
  "$bin/kvroute-bridge" "${common[@]}" --engines-file "$work/$name-engines.yaml" \
    --http-addr "127.0.0.1:$port" >"$work/$name-bridge.log" 2>&1 &
  pids+=("$!")
  wait_http "http://127.0.0.1:$port/readyz" 60 || { tail -20 "$work/$name-bridge.log"; exit 1; }
  BRIDGE_URL="http://127.0.0.1:$port"
}
