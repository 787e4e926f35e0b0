#!/usr/bin/env bash
# What backups cost (docs/failover.md): two fleets of two nodes on the real
# Cassandra (scripts/cassandra.sh), one with backups (the default) and one
# with --backup false, both journaling (--journal sync), measured side by
# side in alternating closed-loop runs routed to the owners (cluster://).
# Each line gives each fleet's throughput and its nodes' CPU time per
# request (from /proc/<pid>/stat, summed over the fleet's two nodes: the
# backup's work lands on the other node); then one open-loop run each at
# half the fleet without backups' median rate, for the p99, and what the
# backups then hold.
#
#   loadtest/backup.sh                                 5 pairs of 10 s runs
#   PAIRS=7 WORKLOAD=loadtest/workloads/mixed.toml loadtest/backup.sh
#   STREAM_BATCH=100 loadtest/backup.sh                the changes over STREAMS
#                                        (4) Apply streams entering at n1 (it
#                                        forwards n2's items), in batches of
#                                        up to 100, closed loop at
#                                        STREAM_CONCURRENCY (2 x batch x
#                                        streams)
set -euo pipefail
cd "$(dirname "$0")/.."

PAIRS="${PAIRS:-5}"
DURATION="${DURATION:-10s}"
WORKLOAD="${WORKLOAD:-loadtest/workloads/acks.toml}"
STREAM_BATCH="${STREAM_BATCH:-0}"
STREAMS="${STREAMS:-4}"
STREAM_CONCURRENCY="${STREAM_CONCURRENCY:-$((2 * STREAM_BATCH * STREAMS))}"
OUT=target/loadtest-backup

source loadtest/lib.sh
# Fleet "on": n1, n2 on 5030N; fleet "off": n1, n2 on 5040N, each in a
# keyspace of its own (the ring is per keyspace).
start_fleet "$OUT/on" 2 5030
on_common=("${common[@]}")
on_pids=("${pids[@]}")
sleep 1
start_fleet "$OUT/off" 2 5040 --backup false
off_common=("${common[@]}")
off_pids=("${pids[@]}")
pids=("${on_pids[@]}" "${off_pids[@]}")
for n in 1 2; do
    "$RS" ring "${on_common[@]}" add "n$n" "127.0.0.1:5030$n" --weight 100 --wait 60s >/dev/null
    "$RS" ring "${off_common[@]}" add "n$n" "127.0.0.1:5040$n" --weight 100 --wait 60s >/dev/null
done
# The fleet with backups streams to them once both are in the ring.
for _ in $(seq 1 100); do
    attached=$(for n in 1 2; do curl -s "127.0.0.1:930$n/metrics" |
        awk '/^readstates_backup_attached / { print $2 }'; done | awk '{ s += $1 } END { print s + 0 }')
    [ "$attached" = 2 ] && break
    sleep 0.2
done
echo "backups attached in the fleet with backups: $attached of 2"

# measure NAME FLEET_PORT_PREFIX PIDS... -- [ARGS...]: one run; prints
# "ok/s cpu-us-per-request p99-ms".
measure() {
    local name=$1 prefix=$2 before after
    shift 2
    local fleet_pids=()
    while [ "$1" != "--" ]; do fleet_pids+=("$1"); shift; done
    shift
    local target="cluster://127.0.0.1:${prefix}1" stream=()
    if [ "$STREAM_BATCH" -gt 0 ]; then
        target="grpc://127.0.0.1:${prefix}1"
        stream=(--stream-batch "$STREAM_BATCH" --streams "$STREAMS")
        # The closed loop's depth; an open-loop run keeps the workload's.
        [ "$2" = 0 ] && stream+=(--concurrency "$STREAM_CONCURRENCY")
    fi
    before=$(cpu_ticks "${fleet_pids[@]}")
    "$LT" run --workload "$WORKLOAD" --target "$name=$target" "${stream[@]}" \
        --duration "$DURATION" --report "$OUT/$name.json" "$@" >/dev/null 2>>"$OUT/loadtest.log"
    after=$(cpu_ticks "${fleet_pids[@]}")
    per_request "$OUT/$name.json" "$WORKLOAD" "$before" "$after"
}

# Preload once per fleet.
measure on 5030 "${on_pids[@]}" -- --rate 0 >/dev/null
measure off 5040 "${off_pids[@]}" -- --rate 0 >/dev/null

# The preloads' writes done first (at most 3 minutes), so that the pairs do
# not measure them.
unwritten() {
    for port in 9301 9302 9401 9402; do
        curl -s "127.0.0.1:$port/metrics" | awk '/^readstates_unwritten_read_states / { print $2 }'
    done | awk '{ s += $1 } END { print s + 0 }'
}
for _ in $(seq 1 180); do
    [ "$(unwritten)" = 0 ] && break
    sleep 1
done
echo "load average before the pairs: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "| pair | backups ok/s | without ok/s | backups CPU us/req | without CPU us/req | CPU x |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: |"
rates=()
ratios=()
for pair in $(seq 1 "$PAIRS"); do
    read -r on_rate on_cpu _ < <(measure on 5030 "${on_pids[@]}" -- --rate 0 --skip-preload)
    read -r off_rate off_cpu _ < <(measure off 5040 "${off_pids[@]}" -- --rate 0 --skip-preload)
    times=$(python3 -c "print(f'{$on_cpu / $off_cpu:.2f}')")
    rates+=("$off_rate")
    ratios+=("$times")
    echo "| $pair | $on_rate | $off_rate | $on_cpu | $off_cpu | $times |"
done
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print v[int((NR + 1) / 2)] }'; }
half=$(python3 -c "print(int($(median "${rates[@]}") / 2))")
read -r _ _ on_p99 < <(measure on 5030 "${on_pids[@]}" -- --rate "$half" --skip-preload)
read -r _ _ off_p99 < <(measure off 5040 "${off_pids[@]}" -- --rate "$half" --skip-preload)
# What the backups hold against what their senders have unwritten, right
# after the open-loop run (the write delay is 30 s: its changes are all
# unwritten). Held: journal frames as sent, until a trimmed segment drops
# them, so also up to a segment's age (5 s) of changes written already.
metric_sum() {
    local name=$1
    shift
    for port in "$@"; do
        curl -s "127.0.0.1:$port/metrics" | awk -v n="$name" '$1 == n { print $2 }'
    done | awk '{ s += $1 } END { printf "%d", s }'
}
held=$(metric_sum readstates_backup_held_bytes 9301 9302)
unwritten=$(metric_sum readstates_unwritten_read_states 9301 9302)
echo "backup memory: $held bytes held for $unwritten unwritten read states" \
    "($(python3 -c "print(f'{$held / max($unwritten, 1):.0f}')") bytes each)"
echo "CPU per request with backups over without: median $(median "${ratios[@]}")x"
echo "p99 at $half req/s (half the rate without backups): $on_p99 ms with backups, $off_p99 ms without"
echo "load average after the pairs: $(cut -d' ' -f1-3 /proc/loadavg)"
