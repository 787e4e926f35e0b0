#!/usr/bin/env bash
# Resident memory per read state of a running node, filled over gRPC as
# gateways fill it: every channel of every user acked with BulkAck (the
# workload's preload) into `readstates serve --store memory --write-delay 1h`,
# so nothing is written or evicted. Prints one line per (build, read states
# per user): the growth of the server's RSS over the read states it holds.
#
#   loadtest/footprint.sh                        10 and 100 per user, 10 M read states
#   PER_USER="5 10" READ_STATES=2000000 loadtest/footprint.sh
#   BUILDS="/tmp/before/readstates target/release/readstates" loadtest/footprint.sh
#                                                two builds side by side
set -euo pipefail
cd "$(dirname "$0")/.."

READ_STATES="${READ_STATES:-10000000}"
PER_USER="${PER_USER:-10 100}"
BUILDS="${BUILDS:-target/release/readstates}"
LT="${LT:-target/release/loadtest}"
GRPC=127.0.0.1:50171
METRICS=127.0.0.1:9191
OUT=target/loadtest-footprint
mkdir -p "$OUT"
source loadtest/lib.sh

rss_kib() { awk '/^VmRSS:/ { print $2 }' "/proc/$1/status"; }

for per_user in $PER_USER; do
    users=$((READ_STATES / per_user))
    # The standard workload's keyspace, resized; the measured second only
    # reads badge counts, so it adds nothing.
    preload_workload "$users" "$per_user" >"$OUT/workload.toml"
    for build in $BUILDS; do
        "$build" serve --store memory --write-delay 1h --cache-capacity $((READ_STATES * 2)) \
            --listen "$GRPC" --metrics-listen "$METRICS" --log-level warn 2>>"$OUT/readstates.log" &
        pid=$!
        trap 'kill $pid 2>/dev/null || true' EXIT
        sleep 1
        before=$(rss_kib "$pid")
        "$LT" run --workload "$OUT/workload.toml" --target "readstates=grpc://$GRPC" \
            --rate 0 --duration 1s --report "$OUT/run.json" >/dev/null 2>>"$OUT/loadtest.log"
        after=$(rss_kib "$pid")
        held=$(curl -s "http://$METRICS/metrics" | awk '/^readstates_cached_read_states / { print $2 }')
        kill "$pid"
        wait "$pid" 2>/dev/null || true
        python3 -c "
b, a, held = $before, $after, float('$held')
print(f'$build: $users users x $per_user = {held:.0f} read states, RSS +{(a - b) / 1024:.0f} MiB, {(a - b) * 1024 / held:.1f} bytes per read state')"
    done
done
