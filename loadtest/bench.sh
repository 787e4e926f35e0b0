#!/usr/bin/env bash
# The standard comparison, end to end: readstates (memory, embedded and
# Cassandra stores, write-behind and write-through) against the transport
# ceiling (loadtest baseline-server) and Redis, on this machine.
# Reports (JSON), charts (SVG) and summary.md go to target/loadtest/.
#
#   loadtest/bench.sh                     the full comparison (about 20 minutes)
#   DURATION=5s SPIKE=20s loadtest/bench.sh   a quick pass
#
# Environment: DURATION (each closed-loop and half-rate run, default 30s),
# STEP (each sweep rate, default 8s), SPIKE (the over-time run, default 5m),
# WORKLOAD (default loadtest/workloads/mixed.toml).
set -euo pipefail
cd "$(dirname "$0")/.."

DURATION="${DURATION:-30s}"
STEP="${STEP:-8s}"
SPIKE="${SPIKE:-5m}"
WORKLOAD="${WORKLOAD:-loadtest/workloads/mixed.toml}"
OUT=target/loadtest
RS_GRPC=127.0.0.1:50151
RS_METRICS=127.0.0.1:9190
BASELINE=127.0.0.1:50161
REDIS_PORT=6390
KEYSPACE=readstates_bench

log() { echo "bench: $*" >&2; }

# --- prerequisites --------------------------------------------------------
if ! command -v redis-server >/dev/null; then
    log "installing redis-server from Debian's packages"
    apt-get update -qq && apt-get install -y -qq redis-server >/dev/null
fi
cargo build --release -p readstates -p loadtest
RS=target/release/readstates
LT=target/release/loadtest
rm -rf "$OUT" && mkdir -p "$OUT"
scripts/cassandra.sh start
"$RS" migrate --keyspace "$KEYSPACE" 2>/dev/null

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    redis-cli -p "$REDIS_PORT" shutdown nosave >/dev/null 2>&1 || true
    scripts/cassandra.sh stop
}
trap cleanup EXIT

wait_port() {
    local host=${1%:*} port=${1#*:}
    for _ in $(seq 1 100); do
        (exec 3<>"/dev/tcp/$host/$port") 2>/dev/null && return 0
        sleep 0.1
    done
    log "nothing listens on $1"
    return 1
}

# readstates NAME ARGS...: starts readstates, leaving its pid in $RS_PID.
start_readstates() {
    # A fresh journal each time (the environment, which older builds ignore).
    rm -rf "$OUT/journal"
    READSTATES_JOURNAL_DIR="$OUT/journal" "$RS" serve --listen "$RS_GRPC" --metrics-listen "$RS_METRICS" --log-level warn "$@" \
        2>>"$OUT/readstates.log" &
    RS_PID=$!
    pids+=("$RS_PID")
    wait_port "$RS_GRPC"
}

stop_readstates() {
    kill -TERM "$RS_PID"
    wait "$RS_PID" || log "readstates exited with $?"
}

# run NAME TARGET [loadtest run args...]
run() {
    local name=$1 target=$2
    shift 2
    log "run $name"
    "$LT" run --workload "$WORKLOAD" --target "$name=$target" --report "$OUT/$name.json" "$@" \
        | tee "$OUT/$name.txt"
}

readstates_target="grpc://$RS_GRPC,metrics=$RS_METRICS"
cassandra_args=(--store cassandra --keyspace "$KEYSPACE")

# --- the transport ceiling ------------------------------------------------
"$LT" baseline-server --listen "$BASELINE" 2>>"$OUT/baseline.log" &
pids+=($!)
wait_port "$BASELINE"
run 1-baseline-closed "grpc://$BASELINE" --rate 0 --duration "$DURATION"

# --- readstates, closed loop, each store ----------------------------------
start_readstates --store memory
run 2-readstates-memory-closed "$readstates_target" --rate 0 --duration "$DURATION"
stop_readstates

rm -rf "$OUT/embedded-data"
start_readstates --store embedded --data-dir "$OUT/embedded-data"
run 3-readstates-embedded-closed "$readstates_target" --rate 0 --duration "$DURATION"
stop_readstates

start_readstates "${cassandra_args[@]}"
run 4-readstates-cassandra-closed "$readstates_target" --rate 0 --duration "$DURATION"
stop_readstates

start_readstates "${cassandra_args[@]}" --write-delay 0s
run 5-readstates-cassandra-write-through-closed "$readstates_target" --rate 0 --duration "$DURATION"
stop_readstates

# --- Redis -----------------------------------------------------------------
mkdir -p "$OUT/redis"
redis-server --port "$REDIS_PORT" --dir "$PWD/$OUT/redis" --daemonize yes --logfile "$PWD/$OUT/redis.log"
wait_port "127.0.0.1:$REDIS_PORT"
run 6-redis-closed "redis://127.0.0.1:$REDIS_PORT" --rate 0 --duration "$DURATION"

# --- same rate, half of readstates' closed-loop maximum ---------------------
half=$(python3 -c "import json; print(int(json.load(open('$OUT/2-readstates-memory-closed.json'))['throughput'] / 2))")
run 7-baseline-half "grpc://$BASELINE" --rate "$half" --duration "$DURATION"
start_readstates --store memory
run 8-readstates-memory-half "$readstates_target" --rate "$half" --duration "$DURATION"
stop_readstates

# --- sweep: p99.9 against throughput ----------------------------------------
log "sweep"
start_readstates --store memory
"$LT" sweep --workload "$WORKLOAD" --start 2000 --factor 1.4 --step "$STEP" \
    --target "baseline=grpc://$BASELINE" \
    --target "readstates-memory=$readstates_target" \
    --target "redis=redis://127.0.0.1:$REDIS_PORT" \
    --report "$OUT/sweep.json" --chart "$OUT/sweep.svg"
stop_readstates

# --- cold GetReadStates from Cassandra, light load --------------------------
start_readstates "${cassandra_args[@]}" --cache-capacity 20000
WORKLOAD=loadtest/workloads/cold.toml run 9-readstates-cassandra-cold-get "$readstates_target"
stop_readstates

# --- no spikes: a full, evicting cache (half the data fits), write-behind to
# Cassandra. First this configuration's own maximum, then 5 minutes at half
# of it on the same server, data already loaded.
start_readstates "${cassandra_args[@]}" --cache-capacity 1000000
run 10-readstates-cassandra-evicting-closed "$readstates_target" --rate 0 --duration "$DURATION"
evicting_half=$(python3 -c "import json; print(int(json.load(open('$OUT/10-readstates-cassandra-evicting-closed.json'))['throughput'] / 2))")
run 11-readstates-cassandra-evicting-over-time "$readstates_target" --rate "$evicting_half" --duration "$SPIKE" \
    --skip-preload --chart "$OUT/over-time.svg"
stop_readstates

"$LT" summary "$OUT" | tee "$OUT/summary.md"
log "reports, charts and summary.md in $OUT"
