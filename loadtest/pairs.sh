#!/usr/bin/env bash
# Repeated side-by-side closed-loop runs of the transport ceiling (loadtest
# baseline-server) and readstates --store memory, alternating, for the
# throughput ratio on a noisy machine. Each line also gives each server's own
# CPU time per request (from /proc/<pid>/stat), which the load generator
# sharing the cores does not blur.
#
#   loadtest/pairs.sh                   5 pairs of 10 s runs
#   PAIRS=9 DURATION=10s WORKLOAD=loadtest/workloads/mixed.toml loadtest/pairs.sh
#   WATCH_USERS=10000 loadtest/pairs.sh  also readstates with that many users
#                                        watched over WATCH_STREAMS (4) streams
#   COMPARE=/tmp/old/readstates loadtest/pairs.sh
#                                        also that build of readstates, in the
#                                        same pairs (before/after a change)
#   RS_ARGS="--store embedded --data-dir target/p/a" \
#   COMPARE=target/release/readstates \
#   COMPARE_ARGS="--store embedded --data-dir target/p/b --journal off" \
#   loadtest/pairs.sh                    the same build with other settings
#                                        (RS_ARGS, COMPARE_ARGS: "--store
#                                        memory" by default); with
#                                        STREAM_BATCH, the stream on both
#   RATE=8000 loadtest/pairs.sh          open loop at that many changes a second
#                                        instead of closed (the CPU per change at
#                                        a load short of saturation), with each
#                                        run's p99 in ms at the end of the line
#   STREAM_BATCH=100 WORKLOAD=loadtest/workloads/acks.toml loadtest/pairs.sh
#                                        also readstates with the changes sent
#                                        over STREAMS (4) Apply streams in
#                                        batches of up to 100, closed loop at
#                                        STREAM_CONCURRENCY (2 x batch x
#                                        streams); "CPU x" is unary's CPU per
#                                        request over the stream's
set -euo pipefail
cd "$(dirname "$0")/.."

PAIRS="${PAIRS:-5}"
WATCH_USERS="${WATCH_USERS:-0}"
WATCH_STREAMS="${WATCH_STREAMS:-4}"
COMPARE="${COMPARE:-}"
STREAM_BATCH="${STREAM_BATCH:-0}"
STREAMS="${STREAMS:-4}"
STREAM_CONCURRENCY="${STREAM_CONCURRENCY:-$((2 * STREAM_BATCH * STREAMS))}"
DURATION="${DURATION:-10s}"
RATE="${RATE:-0}"
WORKLOAD="${WORKLOAD:-loadtest/workloads/mixed.toml}"
RS_ARGS="${RS_ARGS:---store memory}"
COMPARE_ARGS="${COMPARE_ARGS:---store memory}"
RS_GRPC=127.0.0.1:50151
RS_METRICS=127.0.0.1:9190
BASELINE=127.0.0.1:50161
CMP_GRPC=127.0.0.1:50152
CMP_METRICS=127.0.0.1:9192
OUT=target/loadtest-pairs

cargo build --release -p readstates -p loadtest
RS=target/release/readstates
LT=target/release/loadtest
mkdir -p "$OUT"

"$LT" baseline-server --listen "$BASELINE" 2>>"$OUT/baseline.log" &
baseline_pid=$!
# shellcheck disable=SC2086 # the arguments are words
"$RS" serve $RS_ARGS --listen "$RS_GRPC" --metrics-listen "$RS_METRICS" --log-level warn \
    2>>"$OUT/readstates.log" &
readstates_pid=$!
compare_pid=
if [ -n "$COMPARE" ]; then
    # shellcheck disable=SC2086
    "$COMPARE" serve $COMPARE_ARGS --listen "$CMP_GRPC" --metrics-listen "$CMP_METRICS" \
        --log-level warn 2>>"$OUT/compare.log" &
    compare_pid=$!
fi
trap 'kill $baseline_pid $readstates_pid $compare_pid 2>/dev/null || true' EXIT
sleep 1

source loadtest/lib.sh

# measure NAME PID URL [ARGS...]: one run (closed loop, or open at RATE);
# prints "ok/s cpu-us-per-request p99-ms".
measure() {
    local name=$1 pid=$2 url=$3 before after
    shift 3
    before=$(cpu_ticks "$pid")
    "$LT" run --workload "$WORKLOAD" --target "$name=$url" --rate "$RATE" --duration "$DURATION" \
        --report "$OUT/$name.json" "$@" >/dev/null 2>>"$OUT/loadtest.log"
    after=$(cpu_ticks "$pid")
    per_request "$OUT/$name.json" "$WORKLOAD" "$before" "$after"
}

# Preload once (readstates keeps the data), so that the measured runs'
# CPU time is all requests.
measure baseline "$baseline_pid" "grpc://$BASELINE" >/dev/null
measure readstates "$readstates_pid" "grpc://$RS_GRPC" >/dev/null
if [ -n "$COMPARE" ]; then
    measure compare "$compare_pid" "grpc://$CMP_GRPC" >/dev/null
fi

header="| pair | baseline ok/s | readstates ok/s | ratio | baseline CPU us/req | readstates CPU us/req |"
rule="| ---: | ---: | ---: | ---: | ---: | ---: |"
if [ "$WATCH_USERS" -gt 0 ]; then
    header="$header watched ok/s | watched/unwatched | watched CPU us/req |"
    rule="$rule ---: | ---: | ---: |"
fi
if [ -n "$COMPARE" ]; then
    header="$header compared ok/s | ratio | compared CPU us/req |"
    rule="$rule ---: | ---: | ---: |"
fi
if [ "$STREAM_BATCH" -gt 0 ]; then
    header="$header stream ok/s | stream CPU us/req | CPU x |"
    rule="$rule ---: | ---: | ---: |"
    if [ -n "$COMPARE" ]; then
        header="$header compared stream ok/s | compared stream CPU us/req |"
        rule="$rule ---: | ---: |"
    fi
fi
if [ "$RATE" -gt 0 ]; then
    header="$header readstates p99 ms |"
    rule="$rule ---: |"
    [ -n "$COMPARE" ] && header="$header compared p99 ms |" && rule="$rule ---: |"
    if [ "$STREAM_BATCH" -gt 0 ]; then
        header="$header stream p99 ms |"
        rule="$rule ---: |"
        [ -n "$COMPARE" ] && header="$header compared stream p99 ms |" && rule="$rule ---: |"
    fi
fi
echo "load average before the pairs: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "$header"
echo "$rule"
for pair in $(seq 1 "$PAIRS"); do
    read -r b_rate b_cpu _ < <(measure baseline "$baseline_pid" "grpc://$BASELINE" --skip-preload)
    read -r r_rate r_cpu r_p99 < <(measure readstates "$readstates_pid" "grpc://$RS_GRPC" --skip-preload)
    ratio=$(python3 -c "print(f'{$r_rate / $b_rate * 100:.1f}%')")
    line="| $pair | $b_rate | $r_rate | $ratio | $b_cpu | $r_cpu |"
    if [ "$WATCH_USERS" -gt 0 ]; then
        read -r w_rate w_cpu _ < <(measure readstates-watched "$readstates_pid" "grpc://$RS_GRPC" \
            --skip-preload --watch-users "$WATCH_USERS" --watch-streams "$WATCH_STREAMS")
        watched=$(python3 -c "print(f'{$w_rate / $r_rate * 100:.1f}%')")
        line="$line $w_rate | $watched | $w_cpu |"
    fi
    if [ -n "$COMPARE" ]; then
        read -r c_rate c_cpu c_p99 < <(measure compare "$compare_pid" "grpc://$CMP_GRPC" --skip-preload)
        c_ratio=$(python3 -c "print(f'{$c_rate / $b_rate * 100:.1f}%')")
        line="$line $c_rate | $c_ratio | $c_cpu |"
    fi
    if [ "$STREAM_BATCH" -gt 0 ]; then
        read -r s_rate s_cpu s_p99 < <(measure readstates-stream "$readstates_pid" "grpc://$RS_GRPC" \
            --skip-preload --stream-batch "$STREAM_BATCH" --streams "$STREAMS" \
            --concurrency "$STREAM_CONCURRENCY")
        times=$(python3 -c "print(f'{$r_cpu / $s_cpu:.1f}')")
        line="$line $s_rate | $s_cpu | $times |"
        if [ -n "$COMPARE" ]; then
            read -r cs_rate cs_cpu cs_p99 < <(measure compare-stream "$compare_pid" "grpc://$CMP_GRPC" \
                --skip-preload --stream-batch "$STREAM_BATCH" --streams "$STREAMS" \
                --concurrency "$STREAM_CONCURRENCY")
            line="$line $cs_rate | $cs_cpu |"
        fi
    fi
    if [ "$RATE" -gt 0 ]; then
        line="$line $r_p99 |"
        [ -n "$COMPARE" ] && line="$line $c_p99 |"
        if [ "$STREAM_BATCH" -gt 0 ]; then
            line="$line $s_p99 |"
            [ -n "$COMPARE" ] && line="$line $cs_p99 |"
        fi
    fi
    echo "$line"
done
echo "load average after the pairs: $(cut -d' ' -f1-3 /proc/loadavg)"
