#!/usr/bin/env bash
# A fleet of three readstates nodes on the real Cassandra (scripts/cassandra.sh),
# measured side by side: every request entering at one node (grpc://, which
# forwards and splits) against routing straight to owners (cluster://, by the
# routing table), in alternating closed-loop runs; then an open-loop run at
# half the routed rate while the ring moves slots twice, for the longest
# pause a moving slot saw and how long each ring change took to be served.
# The nodes keep the default 30 s write delay, so a move first writes what
# the last 30 s changed in the moving slots.
#
#   loadtest/cluster.sh                    3 pairs of 10 s runs
#   PAIRS=5 DURATION=10s WORKLOAD=loadtest/workloads/mixed.toml loadtest/cluster.sh
set -euo pipefail
cd "$(dirname "$0")/.."

PAIRS="${PAIRS:-3}"
DURATION="${DURATION:-10s}"
WORKLOAD="${WORKLOAD:-loadtest/workloads/mixed.toml}"
OUT=target/loadtest-cluster
KEYSPACE="readstates_bench_$(date +%s)"
CASSANDRA="127.0.0.1:${CASSANDRA_PORT:-9042}"

cargo build --release -p readstates -p loadtest
RS=target/release/readstates
LT=target/release/loadtest
mkdir -p "$OUT"
rm -f "$OUT"/*.log

scripts/cassandra.sh start
common=(--store cassandra --cassandra-nodes "$CASSANDRA" --keyspace "$KEYSPACE")
"$RS" migrate "${common[@]}" --log-level warn

pids=()
cleanup() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}
trap cleanup EXIT
for n in 1 2 3; do
    "$RS" serve "${common[@]}" --node-id "n$n" --advertise "127.0.0.1:5020$n" \
        --listen "127.0.0.1:5020$n" --metrics-listen "127.0.0.1:920$n" \
        --log-format json 2>>"$OUT/n$n.log" &
    pids+=($!)
done
sleep 2
for n in 1 2 3; do
    "$RS" ring "${common[@]}" add "n$n" "127.0.0.1:5020$n" --weight 100 --wait 60s >/dev/null
done

# CPU time of the three nodes, in clock ticks.
cpu_ticks() { for pid in "${pids[@]}"; do cat "/proc/$pid/stat"; done | awk '{ s += $14 + $15 } END { print s }'; }

# measure NAME URL DURATION [ARGS...]: prints "ok/s p99.9-ms cpu-us-per-request errors".
measure() {
    local name=$1 url=$2 duration=$3 before after
    shift 3
    before=$(cpu_ticks)
    "$LT" run --workload "$WORKLOAD" --target "$name=$url" --duration "$duration" \
        --report "$OUT/$name.json" "$@" >/dev/null 2>>"$OUT/loadtest.log"
    after=$(cpu_ticks)
    python3 - "$OUT/$name.json" "$before" "$after" "$(getconf CLK_TCK)" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
before, after, hz = map(int, sys.argv[2:5])
cpu = (after - before) / hz * 1e6 / max(report["requests"], 1)
print(f"{report['throughput']:.0f} {report['latency']['p999_us'] / 1000:.1f} {cpu:.0f} {report['errors']}")
PY
}

# unwritten: read states the three nodes have not written yet.
unwritten() {
    for n in 1 2 3; do
        curl -s "127.0.0.1:920$n/metrics" | awk '/^readstates_unwritten_read_states / { print $2 }'
    done | awk '{ s += $1 } END { print s + 0 }'
}

# drain: waits (at most 5 min) until the nodes have written everything, so a
# run does not measure the write-behind of the one before.
drain() {
    for _ in $(seq 1 300); do
        [ "$(unwritten)" = 0 ] && return
        sleep 1
    done
}

# Preload once, through the routing client; its writes land before the runs.
measure preload "cluster://127.0.0.1:50201" 2s --rate 0 >/dev/null
drain

echo "| pair | entry node ok/s | owners ok/s | owners/entry | entry p99.9 ms | owners p99.9 ms | entry CPU us/req | owners CPU us/req |"
echo "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
rates=()
for pair in $(seq 1 "$PAIRS"); do
    read -r e_rate e_p999 e_cpu _ < <(measure entry "grpc://127.0.0.1:50201" "$DURATION" --rate 0 --skip-preload)
    read -r o_rate o_p999 o_cpu _ < <(measure owners "cluster://127.0.0.1:50201" "$DURATION" --rate 0 --skip-preload)
    ratio=$(python3 -c "print(f'{$o_rate / $e_rate:.2f}x')")
    echo "| $pair | $e_rate | $o_rate | $ratio | $e_p999 | $o_p999 | $e_cpu | $o_cpu |"
    rates+=("$o_rate")
done

# Slots moving under open-loop load at a quarter of the routed rate, after
# the pairs' writes: what a move writes is the last write delay's changes.
drain
rate=$(IFS=,; python3 -c "import statistics; print(int(statistics.median([${rates[*]}]) / 4))")
(
    sleep 4
    "$RS" ring "${common[@]}" set-weight n3 300 --wait 60s
    sleep 4
    "$RS" ring "${common[@]}" set-weight n3 100 --wait 60s
) >"$OUT/ring.out" 2>&1 &
mover=$!
measure moving "cluster://127.0.0.1:50201" 20s --rate "$rate" --skip-preload >/dev/null
wait "$mover"
python3 - "$OUT/moving.json" "$OUT" <<'PY'
import glob, json, sys
report = json.load(open(sys.argv[1]))
waited = []
for path in glob.glob(f"{sys.argv[2]}/n*.log"):
    for line in open(path):
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("message") == "acquired":
            waited.append(int(event["waited_ms"]))
print(f"moving slots at {report['target_rate']}/s for {report['seconds']:.0f} s: {report['throughput']:.0f} ok/s, "
      f"{report['errors']} errors, p99.9 {report['latency']['p999_us'] / 1000:.1f} ms, "
      f"max {report['latency']['max_us'] / 1000:.1f} ms, worst one-second p99.9 "
      f"{report['worst_second_p999_us'] / 1000:.1f} ms")
print(f"longest wait of a new owner for a release: {max(waited, default=0)} ms over {len(waited)} acquisitions")
PY
grep "served by its owner" "$OUT/ring.out" | sed 's/^/ring change: /'
