#!/usr/bin/env bash
# Latency spikes with a full, evicting cache, two builds side by side: each
# serves the mixed workload from a cache holding half the data (every miss a
# Cassandra read, every eviction a write behind), both under the same
# open-loop rate at the same time, so the machine's noise falls on both.
# Prints each build's p99.9 over the run and its worst and median one-second
# p99.9.
#
#   BUILDS="/tmp/old/readstates target/release/readstates" loadtest/evicting.sh
#   RATE=300 SPIKE=5m ...    (the defaults; at 1,000/s each, two servers, Cassandra and
#                            the load on 2 cores saturated: seconds of queueing)
set -euo pipefail
cd "$(dirname "$0")/.."

BUILDS="${BUILDS:-target/release/readstates}"
RATE="${RATE:-300}"
SPIKE="${SPIKE:-5m}"
WORKLOAD="${WORKLOAD:-loadtest/workloads/mixed.toml}"
LT="${LT:-target/release/loadtest}"
OUT=target/loadtest-evicting
rm -rf "$OUT" && mkdir -p "$OUT"

scripts/cassandra.sh start
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
# Every schema first: a migration under another server's load may time out.
i=0
for build in $BUILDS; do
    i=$((i + 1))
    for attempt in 1 2 3; do
        "$build" migrate --keyspace "readstates_evicting_$i" 2>>"$OUT/readstates-$i.log" && break
        [ "$attempt" -lt 3 ] || exit 1
    done
done
i=0
targets=()
for build in $BUILDS; do
    i=$((i + 1))
    keyspace="readstates_evicting_$i"
    # Half of the workload's 100,000 users x 20 read states.
    rm -rf "$OUT/journal-$i"
    READSTATES_JOURNAL_DIR="$OUT/journal-$i" "$build" serve --store cassandra --keyspace "$keyspace" --cache-capacity 1000000 \
        --listen "127.0.0.1:$((50190 + i))" --metrics-listen "127.0.0.1:$((9200 + i))" \
        --log-level warn 2>>"$OUT/readstates-$i.log" &
    pids+=($!)
    sleep 2
    # Load the data (preload) and fill the cache.
    "$LT" run --workload "$WORKLOAD" --target "build$i=grpc://127.0.0.1:$((50190 + i))" \
        --rate 0 --duration 10s --report "$OUT/fill-$i.json" >/dev/null 2>>"$OUT/loadtest.log"
    targets+=("build$i=grpc://127.0.0.1:$((50190 + i))")
done
runs=()
i=0
for target in "${targets[@]}"; do
    i=$((i + 1))
    "$LT" run --workload "$WORKLOAD" --target "$target" --rate "$RATE" --duration "$SPIKE" \
        --skip-preload --report "$OUT/run-$i.json" >/dev/null 2>>"$OUT/loadtest.log" &
    runs+=($!)
done
wait "${runs[@]}"
i=0
for build in $BUILDS; do
    i=$((i + 1))
    python3 - "$OUT/run-$i.json" "$build" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
l = r["latency"]
print(f"{sys.argv[2]}: {r['requests']} requests, {r['errors']} errors, p50 {l['p50_us'] / 1000:.1f} ms, "
      f"p99.9 {l['p999_us'] / 1000:.1f} ms, worst second p99.9 {r['worst_second_p999_us'] / 1000:.1f} ms, "
      f"median second p99.9 {r['median_second_p999_us'] / 1000:.1f} ms")
PY
done
