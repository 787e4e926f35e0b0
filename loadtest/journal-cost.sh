#!/usr/bin/env bash
# The journal's cost at a fixed rate: two embedded-store servers side by
# side, `--journal sync` (with JOURNAL_ARGS) and `--journal off`, each with
# `--write-delay 1h` so that the store's write-behind (most of the CPU at a
# fixed rate) does not blur it, driven in turn by open-loop unary acks.
# Prints per pair each server's CPU per ack (from /proc/<pid>/stat), their
# ratio and p99s, then the sync server's syncs per second.
#
#   loadtest/journal-cost.sh                                  10,000 acks/s, 4 pairs
#   RATE=5000 JOURNAL_ARGS="--journal-sync-gap 0s" loadtest/journal-cost.sh
set -euo pipefail
cd "$(dirname "$0")/.."

RATE="${RATE:-10000}"
PAIRS="${PAIRS:-4}"
DURATION="${DURATION:-10s}"
JOURNAL_ARGS="${JOURNAL_ARGS:-}"
WORKLOAD=loadtest/workloads/acks.toml
OUT=target/loadtest-journal-cost

cargo build --release -p readstates -p loadtest
RS=target/release/readstates
LT=target/release/loadtest
rm -rf "$OUT"
mkdir -p "$OUT"
source loadtest/lib.sh

# shellcheck disable=SC2086 # the arguments are words
"$RS" serve --store embedded --data-dir "$OUT/sync" --write-delay 1h $JOURNAL_ARGS \
    --listen 127.0.0.1:50181 --metrics-listen 127.0.0.1:9181 --log-level warn 2>>"$OUT/sync.log" &
sync_pid=$!
"$RS" serve --store embedded --data-dir "$OUT/off" --write-delay 1h --journal off \
    --listen 127.0.0.1:50182 --metrics-listen 127.0.0.1:9182 --log-level warn 2>>"$OUT/off.log" &
off_pid=$!
trap 'kill $sync_pid $off_pid 2>/dev/null || true' EXIT
sleep 1

# measure NAME PID PORT [ARGS...]: prints "ok/s cpu-us-per-ack p99-ms".
measure() {
    local name=$1 pid=$2 port=$3 before after
    shift 3
    before=$(cpu_ticks "$pid")
    "$LT" run --workload "$WORKLOAD" --target "$name=grpc://127.0.0.1:$port" --rate "$RATE" \
        --duration "$DURATION" --report "$OUT/$name.json" "$@" >/dev/null 2>>"$OUT/loadtest.log"
    after=$(cpu_ticks "$pid")
    per_request "$OUT/$name.json" "$WORKLOAD" "$before" "$after"
}
syncs() { curl -s http://127.0.0.1:9181/metrics | awk '/^readstates_journal_syncs_total / { print $2 }'; }

measure sync "$sync_pid" 50181 >/dev/null
measure off "$off_pid" 50182 >/dev/null
echo "load average before the pairs: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| pair | acks/s | sync CPU us/ack | off CPU us/ack | sync / off | sync p99 ms | off p99 ms |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
syncs_before=$(syncs)
sync_seconds=0
for pair in $(seq 1 "$PAIRS"); do
    started=$(date +%s.%N)
    read -r s_rate s_cpu s_p99 < <(measure sync "$sync_pid" 50181 --skip-preload)
    sync_seconds=$(python3 -c "print($sync_seconds + $(date +%s.%N) - $started)")
    read -r _ o_cpu o_p99 < <(measure off "$off_pid" 50182 --skip-preload)
    echo "| $pair | $s_rate | $s_cpu | $o_cpu | $(python3 -c "print(f'{$s_cpu / $o_cpu:.2f}')") | $s_p99 | $o_p99 |"
done
echo "load average after the pairs: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 -c "
syncs = $(syncs) - $syncs_before
print(f'sync server: {syncs / $sync_seconds:.0f} syncs/s, {$RATE / (syncs / $sync_seconds):.1f} acks per sync (warm-ups included)')"
