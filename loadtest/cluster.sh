#!/usr/bin/env bash
# A fleet of three readstates nodes on the real Cassandra (scripts/cassandra.sh),
# measured side by side: every request entering at one node (grpc://, which
# forwards and splits) against routing straight to owners (cluster://, by the
# routing table), in alternating closed-loop runs; then open-loop runs at
# MOVING_LOAD (default: half) of the routed rate while the ring moves slots
# twice (routed to owners, then entering at one node; each after 10 s at the
# same rate with nothing moving, for what the moves add), for errors, latency,
# how long moving slots were served nowhere, store loads, the cache hit
# ratio and how long each ring change took to be served. The nodes keep the default 30 s write
# delay: moved users carry the last 30 s of changes unwritten. Each moving
# run says where the host's cores went (nodes, Cassandra, the rest). Then a
# rolling restart of the three nodes under open-loop acks at the moving
# rate (each drained, stopped, started again and given its weight back),
# the acknowledged acks read back from Cassandra. Last, a node
# killed (kill -9) and then one frozen for 20 s under open-loop acks at
# FAULT_RATE (default: the moving rate), each summed up in one line with
# the acknowledged acks lost, read back from Cassandra.
#
#   loadtest/cluster.sh                    3 pairs of 10 s runs
#   PAIRS=5 DURATION=10s WORKLOAD=loadtest/workloads/mixed.toml MOVING_LOAD=0.25 loadtest/cluster.sh
#   MOVING_RATE=5000 loadtest/cluster.sh   the moves at a fixed rate (comparable
#                                          across runs; the pairs' median moves
#                                          with the host's load)
#   SERVE_ARGS="--journal off" loadtest/cluster.sh
#                                          every node started with these too
#   ONLY=faults FAULT_RATE=3000 loadtest/cluster.sh
#                                          the kill and the freeze alone
set -euo pipefail
cd "$(dirname "$0")/.."

PAIRS="${PAIRS:-3}"
DURATION="${DURATION:-10s}"
WORKLOAD="${WORKLOAD:-loadtest/workloads/mixed.toml}"
MOVING_LOAD="${MOVING_LOAD:-0.5}"
OUT=target/loadtest-cluster

source loadtest/lib.sh
# shellcheck disable=SC2086 # the arguments are words
start_fleet "$OUT" 3 5020 ${SERVE_ARGS:-}
for n in 1 2 3; do
    "$RS" ring "${common[@]}" add "n$n" "127.0.0.1:5020$n" --weight 100 --wait 60s >/dev/null
done

# measure NAME URL DURATION [ARGS...]: prints "ok/s p99.9-ms cpu-us-per-request errors".
measure() {
    local name=$1 url=$2 duration=$3 before after
    shift 3
    before=$(cpu_ticks "${pids[@]}")
    "$LT" run --workload "$WORKLOAD" --target "$name=$url" --duration "$duration" \
        --report "$OUT/$name.json" "$@" >/dev/null 2>>"$OUT/loadtest.log"
    after=$(cpu_ticks "${pids[@]}")
    python3 - "$OUT/$name.json" "$before" "$after" "$(getconf CLK_TCK)" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
before, after, hz = map(int, sys.argv[2:5])
cpu = (after - before) / hz * 1e6 / max(report["requests"], 1)
print(f"{report['throughput']:.0f} {report['latency']['p999_us'] / 1000:.1f} {cpu:.0f} {report['errors']}")
PY
}

# cores: CPU ticks so far of the nodes, of Cassandra and of the whole host,
# and the time (seconds).
cores() {
    local cassandra
    cassandra=$(cat "${CASSANDRA_DIR:-target/cassandra}/cassandra.pid")
    echo "$(cpu_ticks "${pids[@]}") $(cpu_ticks "$cassandra")" \
        "$(awk '/^cpu / { print $2 + $3 + $4 + $7 + $8 }' /proc/stat) $(date +%s.%N)"
}

# cores_line WHAT BEFORE AFTER: where the host's cores went between two
# `cores` readings: this 2-core host runs the nodes, Cassandra and the load
# generator at once, so a rate the nodes could take alone may not fit.
cores_line() {
    python3 - "$@" "$(getconf CLK_TCK)" "$(nproc)" <<'PY'
import sys
what, before, after, hz, ncpu = sys.argv[1:6]
b, a = map(float, before.split()), map(float, after.split())
nodes, cassandra, host, seconds = (y - x for x, y in zip(b, a))
per = lambda ticks: ticks / int(hz) / seconds
print(f"cores busy {what}: {per(host):.2f} of {ncpu} (nodes {per(nodes):.2f}, Cassandra "
      f"{per(cassandra):.2f}, the rest, the load generator most of it, "
      f"{per(host - nodes - cassandra):.2f})")
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

if [ "${ONLY:-}" != faults ]; then # the pairs, the moves and the rolling restart

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

# counters: the three nodes' store loads, cache hits and misses, summed.
counters() {
    for n in 1 2 3; do
        curl -s "127.0.0.1:920$n/metrics"
    done | awk '
        /^readstates_store_operations_total\{.*operation="load"/ { loads += $NF }
        /^readstates_cache_hits_total/ { hits += $NF }
        /^readstates_cache_misses_total/ { misses += $NF }
        END { print loads + 0, hits + 0, misses + 0 }'
}

# Slots moving under open-loop load at MOVING_LOAD of the routed rate, after
# the pairs' writes: moved twice (n3 to 300, back to 100) while the load is
# routed to owners by the routing client (cluster://), then twice again
# while it all enters at n1 (grpc://, forwarded and split there).
rate=$(IFS=,; python3 -c "import statistics; print(int(statistics.median([${rates[*]}]) * $MOVING_LOAD))")
rate="${MOVING_RATE:-$rate}"
for route in cluster grpc; do
    drain
    # The same load with nothing moving, for what the moves add.
    before=$(cores)
    measure "steady-$route" "$route://127.0.0.1:50201" 10s --rate "$rate" --skip-preload >/dev/null
    steady_cores=$(cores_line "with nothing moving" "$before" "$(cores)")
    python3 - "$OUT/steady-$route.json" "$route" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
entry = "routed to owners" if sys.argv[2] == "cluster" else "entering at one node"
print(f"nothing moving at {report['target_rate']}/s for {report['seconds']:.0f} s: "
      f"{report['throughput']:.0f} ok/s, {report['errors']} errors, "
      f"p99.9 {report['latency']['p999_us'] / 1000:.1f} ms, "
      f"worst one-second p99.9 {report['worst_second_p999_us'] / 1000:.1f} ms ({entry})")
PY
    : >"$OUT/ring.out"
    marks=$(for n in 1 2 3; do wc -l <"$OUT/n$n.log"; done | paste -sd,)
    read -r loads0 hits0 misses0 < <(counters)
    (
        sleep 4
        "$RS" ring "${common[@]}" set-weight n3 300 --wait 60s
        sleep 4
        "$RS" ring "${common[@]}" set-weight n3 100 --wait 60s
    ) >"$OUT/ring.out" 2>&1 &
    mover=$!
    before=$(cores)
    measure "moving-$route" "$route://127.0.0.1:50201" 20s --rate "$rate" --skip-preload >/dev/null
    moving_cores=$(cores_line "while moving" "$before" "$(cores)")
    wait "$mover"
    read -r loads1 hits1 misses1 < <(counters)
    python3 - "$OUT/moving-$route.json" "$OUT" "$route" "$marks" \
        "$loads0 $hits0 $misses0 $loads1 $hits1 $misses1" <<'PY'
import json, sys
report = json.load(open(sys.argv[1]))
out, route = sys.argv[2], sys.argv[3]
marks = [int(m) for m in sys.argv[4].split(",")]
loads0, hits0, misses0, loads1, hits1, misses1 = map(float, sys.argv[5].split())
waited, unserved, users, sent, written = [], [], 0, 0, 0
for n, mark in zip((1, 2, 3), marks):
    for line in open(f"{out}/n{n}.log").readlines()[mark:]:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if event.get("message") == "acquired":
            waited.append(int(event["waited_ms"]))
        if event.get("message") == "handed over":
            unserved.append(int(event["unserved_ms"]))
            users += int(event["users"])
            sent += int(event["sent"])
        if event.get("message") == "handoff failed; writing the users instead":
            written += 1
entry = "routed to owners" if route == "cluster" else "entering at one node"
print(f"moving slots at {report['target_rate']}/s for {report['seconds']:.0f} s: "
      f"{report['throughput']:.0f} ok/s, {report['errors']} errors, "
      f"p99.9 {report['latency']['p999_us'] / 1000:.1f} ms, "
      f"max {report['latency']['max_us'] / 1000:.1f} ms, worst one-second p99.9 "
      f"{report['worst_second_p999_us'] / 1000:.1f} ms ({entry})")
print(f"longest wait of a new owner for a release: {max(waited, default=0)} ms over {len(waited)} acquisitions")
print(f"handed over warm: {users} users ({sent} sent, counting those sent again after the copy "
      f"ahead), {written} handoffs failed; slots served nowhere for at most "
      f"{max(unserved, default=0)} ms")
ratio = lambda h, m: 100 * h / max(h + m, 1)
print(f"store loads during the run: {loads1 - loads0:.0f}; cache hit ratio "
      f"{ratio(hits0, misses0):.1f}% before it, {ratio(hits1 - hits0, misses1 - misses0):.1f}% during it")
PY
    grep "served by its owner" "$OUT/ring.out" | sed 's/^/ring change: /'
    echo "$steady_cores; $moving_cores"
done

# A rolling restart under open-loop acks at the moving rate, as a deploy
# makes it: each node in turn drained (weight 0, its users handed to the
# others warm), stopped (SIGTERM), started again on its journal and given
# its weight back. Every acknowledged ack is read back from Cassandra.
drain
"$LT" failover --entry 127.0.0.1:50201 --rate "$rate" --duration 60s --settle 40s \
    --cassandra-nodes "${common[3]}" --keyspace "${common[5]}" --what "a rolling restart" \
    >"$OUT/rolling.txt" &
load=$!
sleep 5
for n in 1 2 3; do
    "$RS" ring "${common[@]}" set-weight "n$n" 0 --wait 60s
    kill -TERM "${pids[n - 1]}"
    while kill -0 "${pids[n - 1]}" 2>/dev/null; do sleep 0.1; done
    start_node "$n"
    "$RS" ring "${common[@]}" set-weight "n$n" 100 --wait 60s
done >"$OUT/rolling.out" 2>&1
wait "$load"
cat "$OUT/rolling.txt"
grep "served by its owner" "$OUT/rolling.out" | sed 's/^/rolling restart, ring change: /'

fi # the pairs, the moves and the rolling restart

# A node lost for good, then one frozen for 20 s, each under open-loop acks
# through the fleet client at FAULT_RATE a second (by default the moving
# slots' rate: half the routed median). Every acknowledged ack is read back
# from Cassandra once the write delay (30 s) has passed (`loadtest failover`).
fault_rate="${FAULT_RATE:-${rate:-3000}}"
store_args=(--cassandra-nodes "${common[3]}" --keyspace "${common[5]}")
drain
(sleep 5 && kill -9 "${pids[2]}" && echo "killed n3 at $(date -u +%T.%3N)") &
fault=$!
"$LT" failover --entry 127.0.0.1:50201 --rate "$fault_rate" --duration 20s --settle 40s \
    "${store_args[@]}" --what "killing a node"
wait "$fault"
# n3 is gone for good (its backup took it over); n2 freezes, and n1, its
# backup, takes it over: then a fleet of one.
(sleep 5 && kill -STOP "${pids[1]}" && echo "froze n2 at $(date -u +%T.%3N)" && sleep 20 &&
    kill -CONT "${pids[1]}") &
fault=$!
"$LT" failover --entry 127.0.0.1:50201 --rate "$fault_rate" --duration 40s --settle 40s \
    "${store_args[@]}" --what "freezing a node for 20 s"
wait "$fault"
