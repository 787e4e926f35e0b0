# Shared by the load scripts (sourced, not run): a fleet of release nodes on
# the real Cassandra, and the standard workload resized for a preload.

# preload_workload USERS PER_USER: the standard workload's keyspace with
# USERS users of PER_USER read states, every request kind off, so that a
# run only preloads (BulkAck of every channel of every user).
preload_workload() {
    sed -e "0,/^users = .*/s//users = $1/" \
        -e "s/^channels_per_user = .*/channels_per_user = $2/" \
        -e "s/^get_read_states = .*/get_read_states = 0/" \
        -e "s/^ack = .*/ack = 0/" -e "s/^bulk_ack = .*/bulk_ack = 0/" \
        -e "s/^message_created = .*/message_created = 0/" \
        -e "s/^warmup = .*/warmup = \"0s\"/" \
        -e "s/^concurrency = .*/concurrency = 32/" \
        loadtest/workloads/mixed.toml
}

# start_fleet OUT NODES PORTS [SERVE ARGS...]: builds the release binaries
# ($RS, $LT; $BUILD instead of the readstates just built, for one build
# against another), starts Cassandra, migrates a fresh keyspace and starts NODES
# nodes n1..nN (PORTS 5020: gRPC on 127.0.0.1:5020N, metrics on
# 127.0.0.1:920N; JSON logs in OUT/nN.log), killed on exit. Sets $common (the store settings every `readstates` command takes)
# and $pids.
start_fleet() {
    local out=$1 nodes=$2 prefix=$3
    shift 3
    cargo build --release -p readstates -p loadtest
    RS="${BUILD:-target/release/readstates}"
    LT=target/release/loadtest
    mkdir -p "$out"
    rm -f "$out"/*.log
    # Each node journals in its own directory (a fresh one per run).
    rm -rf "$out"/journal-n*
    scripts/cassandra.sh start
    common=(--store cassandra --cassandra-nodes "127.0.0.1:${CASSANDRA_PORT:-9042}"
        --keyspace "readstates_bench_$(date +%s)")
    "$RS" migrate "${common[@]}" --log-level warn
    # The nodes' shared secret (what they prove to each other with), one per run.
    export READSTATES_FLEET_SECRET="${READSTATES_FLEET_SECRET:-$(od -An -tx1 -N24 /dev/urandom | tr -d ' \n')}"
    pids=()
    fleet_out=$out fleet_prefix=$prefix fleet_args=("$@")
    trap stop_fleet EXIT
    for n in $(seq 1 "$nodes"); do
        start_node "$n"
    done
    sleep 2
}

# start_node N: starts node nN as start_fleet did (again, after it stopped:
# same journal directory, same arguments), its pid in ${pids[N-1]}.
start_node() {
    local n=$1
    READSTATES_JOURNAL_DIR="$fleet_out/journal-n$n" "$RS" serve "${common[@]}" --node-id "n$n" \
        --advertise "127.0.0.1:$fleet_prefix$n" --listen "127.0.0.1:$fleet_prefix$n" \
        --metrics-listen "127.0.0.1:9${fleet_prefix#50}$n" \
        --log-format json "${fleet_args[@]}" 2>>"$fleet_out/n$n.log" &
    pids[n - 1]=$!
}

stop_fleet() {
    for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
    wait 2>/dev/null || true
}

# cpu_ticks PID...: user + system time of processes, in clock ticks.
cpu_ticks() { for pid in "$@"; do cat "/proc/$pid/stat"; done | awk '{ s += $14 + $15 } END { print s }'; }

# per_request REPORT WORKLOAD BEFORE AFTER: from a loadtest report and the
# servers' CPU ticks around its run, prints "ok/s cpu-us-per-request
# p99-ms". The servers also worked through the warm-up, at about the same
# rate, so the requests are scaled up to cover it.
per_request() {
    python3 - "$1" "$2" "$3" "$4" "$(getconf CLK_TCK)" <<'EOF'
import json, re, sys, tomllib
report = json.load(open(sys.argv[1]))
warmup = tomllib.load(open(sys.argv[2], "rb")).get("load", {}).get("warmup", "0s")
warmup = float(re.fullmatch(r"([\d.]+)s", warmup).group(1))
before, after, hz = map(int, sys.argv[3:6])
requests = report["requests"] * (report["seconds"] + warmup) / report["seconds"]
cpu = (after - before) / hz * 1e6 / max(requests, 1)
print(f"{report['throughput']:.0f} {cpu:.1f} {report['latency']['p99_us'] / 1000:.2f}")
EOF
}
