#!/usr/bin/env bash
# The memory and CPU a warm handoff costs: two release nodes on the real Cassandra
# (scripts/cassandra.sh), the first filled with READ_STATES read states over
# gRPC (the workload's BulkAck preload, PER_USER to a user), all unwritten
# (a 1 h write delay: the handoff carries every change); then the second,
# in the ring at weight 1, takes a weight 10,000 times the first's, and the
# first hands it nearly every user (all but about 2 of 16,384 slots) in one
# transfer.
# Prints the CPU each end spent over the transfer, per read state moved,
# and each node's resident memory before, at its peak during the
# transfer (VmHWM, reset first) and after, and the extra memory the
# transfer took at each end: the sender's peak over what it held before,
# the receiver's peak over what it holds after; and what the sender holds
# afterwards as the receiver's backup.
#
#   loadtest/handoff.sh                          1 M read states, 10 per user
#   READ_STATES=2000000 PER_USER=20 loadtest/handoff.sh
#   BUILD=/tmp/before/readstates loadtest/handoff.sh   another build
#   PROFILE=1 loadtest/handoff.sh                also records each end with perf
#                                                (OUT/n1.perf.data, OUT/n2.perf.data)
set -euo pipefail
cd "$(dirname "$0")/.."

READ_STATES="${READ_STATES:-1000000}"
PER_USER="${PER_USER:-10}"
OUT=target/loadtest-handoff

source loadtest/lib.sh
start_fleet "$OUT" 2 5030 --write-delay 1h --cache-capacity $((READ_STATES * 2))
"$RS" ring "${common[@]}" add n1 127.0.0.1:50301 --weight 100 --wait 60s >/dev/null
# n2 at weight 1, not 0: it owns a few slots, so it is n1's backup (and
# n1 its) before the preload, as between the nodes of a running fleet; at
# weight 0 it would become n1's backup at the move, and the CPU measured
# would include n1 journaling all it holds again for it.
"$RS" ring "${common[@]}" add n2 127.0.0.1:50302 --weight 1 --wait 60s >/dev/null

# The standard workload's keyspace, resized, preloaded only.
preload_workload $((READ_STATES / PER_USER)) "$PER_USER" >"$OUT/workload.toml"
"$LT" run --workload "$OUT/workload.toml" --target "n1=cluster://127.0.0.1:50301" \
    --rate 0 --duration 1s --report "$OUT/preload.json" >/dev/null 2>>"$OUT/loadtest.log"

field() { awk "/^$2:/ { print \$2 }" "/proc/$1/status"; }
metric() { curl -s "127.0.0.1:930$1/metrics" | awk "/^$2 / { print \$2 }"; }
held=$(metric 1 readstates_cached_read_states)
unwritten=$(metric 1 readstates_unwritten_read_states)
before=()
for pid in "${pids[@]}"; do
    before+=("$(field "$pid" VmRSS)")
    echo 5 >"/proc/$pid/clear_refs" # resets VmHWM to the current RSS
done

perfs=()
if [ -n "${PROFILE:-}" ]; then
    for i in 0 1; do
        perf record -q --call-graph dwarf,16384 -F 999 -o "$OUT/n$((i + 1)).perf.data" \
            -p "${pids[$i]}" 2>>"$OUT/perf.log" &
        perfs+=($!)
    done
    sleep 1
fi
cpu_before=("$(cpu_ticks "${pids[0]}")" "$(cpu_ticks "${pids[1]}")")
started=$(date +%s.%N)
"$RS" ring "${common[@]}" set-weight n2 1000000 --wait 300s >/dev/null
took=$(python3 -c "print(f'{$(date +%s.%N) - $started:.1f}')")
# The CPU of each end over the transfer (the ring command returns once n2
# serves; the sender's log line follows shortly).
sleep 1
cpu=($(($(cpu_ticks "${pids[0]}") - cpu_before[0])) $(($(cpu_ticks "${pids[1]}") - cpu_before[1])))
# n1 is n2's backup: it holds n2's journal of what n2 took, unwritten.
backup_held=$(metric 1 readstates_backup_held_bytes)
for perf in "${perfs[@]}"; do kill -INT "$perf"; wait "$perf" || true; done

python3 - "$OUT" "$held" "$unwritten" "$took" "${before[@]}" \
    "$(field "${pids[0]}" VmHWM)" "$(field "${pids[0]}" VmRSS)" \
    "$(field "${pids[1]}" VmHWM)" "$(field "${pids[1]}" VmRSS)" \
    "${cpu[0]}" "${cpu[1]}" "$(getconf CLK_TCK)" "${backup_held:-0}" <<'PY'
import json, sys
out = sys.argv[1]
held, unwritten, took = float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
b1, b2, p1, a1, p2, a2 = (int(x) / 1024 for x in sys.argv[5:11])
cpu1, cpu2, hz = (int(x) for x in sys.argv[11:14])
backup_held = float(sys.argv[14]) / 1048576
handed = [json.loads(l) for l in open(f"{out}/n1.log") if '"handed over"' in l]
done = [e for e in handed if e.get("users")]
mib = lambda x: f"{x:.0f} MiB"
print(f"n1 held {held:.0f} read states ({unwritten:.0f} unwritten); handed to n2: "
      f"served by n2 {took} s after the ring command; "
      + "; ".join(f"{e['users']} users in {e['took_ms']} ms, served nowhere for {e['unserved_ms']} ms"
                  for e in done))
us = lambda ticks: f"{ticks / hz:.2f} s, {ticks / hz * 1e6 / max(held, 1):.2f} us per read state"
print(f"handoff CPU: sender n1 {us(cpu1)}; receiver n2 {us(cpu2)}; "
      f"both {us(cpu1 + cpu2)}")
print(f"sender n1: RSS {mib(b1)} before, peak {mib(p1)}, {mib(a1)} after: "
      f"extra at its peak {mib(p1 - b1)} ({(p1 - b1) * 1048576 / max(held, 1):.1f} B per read state moved); "
      f"afterwards it holds {mib(backup_held)} as n2's backup (n2's journal of what it took, unwritten)")
print(f"receiver n2: RSS {mib(b2)} before, peak {mib(p2)}, {mib(a2)} after holding them: "
      f"extra at its peak {mib(p2 - a2)} ({(p2 - a2) * 1048576 / max(held, 1):.1f} B per read state moved)")
PY
