#!/usr/bin/env bash
# The test command: starts a local Cassandra (scripts/cassandra.sh: fetched
# from Maven Central on first use, then cached), runs every test, and stops it.
# Extra arguments go to `cargo test`.
set -euo pipefail
cd "$(dirname "$0")/.."

scripts/cassandra.sh start
trap 'scripts/cassandra.sh stop' EXIT
READSTATES_TEST_CASSANDRA="127.0.0.1:${CASSANDRA_PORT:-9042}" cargo test --workspace "$@"
