#!/usr/bin/env bash
# Apply's per-item latency as the server measures it (the `Apply.Ack`
# histogram: from a batch's arrival to each item's answer), over one open-loop
# run of acks over 4 Apply streams, with how long the server's threads waited
# for a core meanwhile (/proc/<pid>/task/*/schedstat): on a host where the
# generator shares the cores, that wait is the tail.
#
#   loadtest/apply-latency.sh               200,000 acks/s for 30 s
#   RATE=100000 DURATION=60s loadtest/apply-latency.sh
#
# Prints the share of items within each histogram bucket, the generator's own
# throughput and p99.9, and the server threads' CPU and wait.
set -euo pipefail
cd "$(dirname "$0")/.."

RATE="${RATE:-200000}"
DURATION="${DURATION:-30s}"
WORKLOAD=loadtest/workloads/acks.toml
GRPC=127.0.0.1:50171
METRICS=127.0.0.1:9171
OUT=target/loadtest-apply-latency

cargo build --release -p readstates -p loadtest
RS=target/release/readstates
LT=target/release/loadtest
mkdir -p "$OUT"

"$RS" serve --store memory --listen "$GRPC" --metrics-listen "$METRICS" --log-level warn \
    2>>"$OUT/readstates.log" &
pid=$!
trap 'kill $pid 2>/dev/null || true' EXIT
sleep 1

# histogram: the Apply.Ack buckets, cumulative, as "le count" lines.
histogram() {
    curl -s "http://$METRICS/metrics" |
        sed -n 's/^readstates_request_duration_seconds_bucket{.*method="Apply.Ack".*le="\([^"]*\)".* \([0-9]*\)$/\1 \2/p'
}
# scheduled: the server threads' "on-CPU-ns waiting-ns timeslices", summed.
scheduled() { cat /proc/"$pid"/task/*/schedstat | awk '{ c += $1; w += $2; n += $3 } END { printf "%.0f %.0f %.0f\n", c, w, n }'; }

"$LT" run --workload "$WORKLOAD" --target "readstates=grpc://$GRPC" --duration 5s --rate 0 \
    >/dev/null 2>>"$OUT/loadtest.log"
histogram >"$OUT/before.txt"
read -r cpu0 wait0 slices0 < <(scheduled)
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$LT" run --workload "$WORKLOAD" --target "readstates=grpc://$GRPC" --skip-preload \
    --duration "$DURATION" --rate "$RATE" --stream-batch 100 --streams 4 \
    --report "$OUT/report.json" >/dev/null 2>>"$OUT/loadtest.log"
read -r cpu1 wait1 slices1 < <(scheduled)
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
histogram >"$OUT/after.txt"

python3 - "$OUT" "$((cpu1 - cpu0))" "$((wait1 - wait0))" "$((slices1 - slices0))" <<'EOF'
import json, sys
out, cpu, wait, slices = sys.argv[1], *map(int, sys.argv[2:5])
def read(path):
    counts = {}
    for line in open(path):
        le, count = line.split()
        counts[le] = counts.get(le, 0) + int(count)
    return counts
before, after = read(f"{out}/before.txt"), read(f"{out}/after.txt")
total = after["+Inf"] - before.get("+Inf", 0)
print(f"Apply.Ack items answered: {total}")
for le in sorted((le for le in after if le != "+Inf"), key=float):
    within = after[le] - before.get(le, 0)
    print(f"  within {float(le) * 1000:g} ms: {within / total * 100:.3f}%")
report = json.load(open(f"{out}/report.json"))
print(f"generator: {report['throughput']:.0f} acks/s, p99.9 {report['latency']['p999_us'] / 1000:.1f} ms, "
      f"{report['errors']} errors")
print(f"server threads: {cpu / 1e9:.1f} s on a core, {wait / 1e9:.1f} s runnable waiting for one, "
      f"{wait / max(slices, 1) / 1e6:.3f} ms a timeslice")
EOF
