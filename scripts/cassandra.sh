#!/usr/bin/env bash
# A single-node Apache Cassandra for tests and local runs, from Maven Central's
# artifacts (no Docker, no tarball): Java 17 and Maven are all it needs.
#
#   scripts/cassandra.sh start    resolve the jars (cached), start, wait for CQL
#   scripts/cassandra.sh stop     stop and wait for the process to exit
#   scripts/cassandra.sh status   "running" (exit 0) or "stopped" (exit 1)
#   scripts/cassandra.sh wipe     stop and delete its data
#
# Environment:
#   CASSANDRA_VERSION  cassandra-all version (default 5.0.9)
#   CASSANDRA_HOME     where the jars are cached (default ~/.cache/readstates/cassandra-VERSION)
#   CASSANDRA_DIR      data, logs and pid file (default target/cassandra in the repository)
#   CASSANDRA_PORT     CQL port (default 9042); the storage port is CASSANDRA_PORT - 2042
set -euo pipefail

VERSION="${CASSANDRA_VERSION:-5.0.9}"
HOME_DIR="${CASSANDRA_HOME:-${HOME}/.cache/readstates/cassandra-${VERSION}}"
REPO="$(cd "$(dirname "$0")/.." && pwd)"
DIR="${CASSANDRA_DIR:-${REPO}/target/cassandra}"
PORT="${CASSANDRA_PORT:-9042}"
STORAGE_PORT=$((PORT - 2042))
PID_FILE="${DIR}/cassandra.pid"
START_TIMEOUT=180
STOP_TIMEOUT=90

log() { echo "cassandra.sh: $*" >&2; }

running() {
    [[ -f "$PID_FILE" ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null
}

# True once the node answers a CQL OPTIONS request with SUPPORTED.
cql_answers() {
    python3 - "$PORT" <<'PY'
import socket, sys
try:
    with socket.create_connection(("127.0.0.1", int(sys.argv[1])), timeout=2) as s:
        s.sendall(bytes([4, 0, 0, 0, 5, 0, 0, 0, 0]))  # v4 OPTIONS, stream 0
        header = s.recv(9)
        sys.exit(0 if len(header) == 9 and header[0] == 0x84 and header[4] == 6 else 1)
except OSError:
    sys.exit(1)
PY
}

resolve() {
    if [[ -f "${HOME_DIR}/lib/cassandra-all-${VERSION}.jar" ]]; then
        return
    fi
    log "resolving org.apache.cassandra:cassandra-all:${VERSION} into ${HOME_DIR}"
    local work
    work="$(mktemp -d)"
    cat >"${work}/pom.xml" <<POM
<project xmlns="http://maven.apache.org/POM/4.0.0">
  <modelVersion>4.0.0</modelVersion>
  <groupId>readstates</groupId><artifactId>cassandra-runtime</artifactId><version>1</version>
  <packaging>pom</packaging>
  <dependencies>
    <dependency>
      <groupId>org.apache.cassandra</groupId><artifactId>cassandra-all</artifactId><version>${VERSION}</version>
    </dependency>
  </dependencies>
</project>
POM
    mkdir -p "${HOME_DIR}"
    (cd "$work" && mvn -q -B dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="${HOME_DIR}/lib.partial")
    mv "${HOME_DIR}/lib.partial" "${HOME_DIR}/lib"
    rm -rf "$work"
}

write_config() {
    mkdir -p "${DIR}/data" "${DIR}/commitlog" "${DIR}/saved_caches" "${DIR}/hints" "${DIR}/cdc_raw" "${DIR}/logs"
    cat >"${DIR}/cassandra.yaml" <<YAML
cluster_name: readstates-test
num_tokens: 1
initial_token: 0
partitioner: org.apache.cassandra.dht.Murmur3Partitioner
auto_bootstrap: false
endpoint_snitch: SimpleSnitch
seed_provider:
  - class_name: org.apache.cassandra.locator.SimpleSeedProvider
    parameters:
      - seeds: "127.0.0.1:${STORAGE_PORT}"
listen_address: 127.0.0.1
rpc_address: 127.0.0.1
storage_port: ${STORAGE_PORT}
native_transport_port: ${PORT}
start_native_transport: true
data_file_directories: [${DIR}/data]
commitlog_directory: ${DIR}/commitlog
saved_caches_directory: ${DIR}/saved_caches
hints_directory: ${DIR}/hints
cdc_raw_directory: ${DIR}/cdc_raw
commitlog_sync: periodic
commitlog_sync_period: 10000ms
authenticator: AllowAllAuthenticator
authorizer: AllowAllAuthorizer
YAML
    cat >"${DIR}/logback.xml" <<XML
<configuration>
  <appender name="FILE" class="ch.qos.logback.core.FileAppender">
    <file>${DIR}/logs/system.log</file>
    <encoder><pattern>%-5level [%thread] %date{ISO8601} %F:%L - %msg%n</pattern></encoder>
  </appender>
  <root level="INFO"><appender-ref ref="FILE"/></root>
</configuration>
XML
}

start() {
    if running; then
        log "already running (pid $(cat "$PID_FILE"))"
        wait_for_cql
        return
    fi
    command -v java >/dev/null || { log "java not found: Java 17 is needed"; exit 1; }
    command -v mvn >/dev/null || { log "mvn not found: Maven is needed to fetch Cassandra"; exit 1; }
    resolve
    write_config
    local opens=()
    for p in java.base/jdk.internal.misc java.base/jdk.internal.ref java.base/sun.nio.ch \
        java.management.rmi/com.sun.jmx.remote.internal.rmi java.rmi/sun.rmi.registry \
        java.rmi/sun.rmi.server java.sql/java.sql java.base/java.lang.ref jdk.unsupported/sun.misc; do
        opens+=("--add-exports" "${p}=ALL-UNNAMED")
    done
    for p in java.base/java.lang.module java.base/jdk.internal.loader java.base/jdk.internal.ref \
        java.base/jdk.internal.reflect java.base/jdk.internal.math java.base/jdk.internal.module \
        java.base/jdk.internal.util.jar jdk.management/com.sun.management.internal java.base/sun.nio.ch \
        java.base/java.io java.base/java.nio java.base/java.util.concurrent java.base/java.util \
        java.base/java.util.concurrent.atomic java.base/java.lang java.base/java.math \
        java.base/java.lang.reflect java.base/java.net; do
        opens+=("--add-opens" "${p}=ALL-UNNAMED")
    done
    log "starting Cassandra ${VERSION} on 127.0.0.1:${PORT} (data in ${DIR})"
    nohup java -Xms1g -Xmx1g -XX:+UseG1GC -Xss512k \
        -Djdk.attach.allowAttachSelf=true "${opens[@]}" \
        -Dcassandra.config="file://${DIR}/cassandra.yaml" \
        -Dlogback.configurationFile="${DIR}/logback.xml" \
        -Dcassandra.storagedir="${DIR}" \
        -Dcassandra.logdir="${DIR}/logs" \
        -Dcassandra-foreground=yes \
        -Dcassandra.skip_wait_for_gossip_to_settle=0 \
        -Dcassandra.ring_delay_ms=100 \
        -cp "${HOME_DIR}/lib/*" \
        org.apache.cassandra.service.CassandraDaemon >"${DIR}/logs/stdout.log" 2>&1 &
    echo $! >"$PID_FILE"
    wait_for_cql
}

wait_for_cql() {
    local waited=0
    until cql_answers; do
        if ! running; then
            log "Cassandra exited during startup; last log lines:"
            tail -n 30 "${DIR}/logs/system.log" "${DIR}/logs/stdout.log" >&2 2>/dev/null || true
            exit 1
        fi
        if ((waited >= START_TIMEOUT)); then
            log "no CQL answer after ${START_TIMEOUT}s"
            exit 1
        fi
        sleep 1
        waited=$((waited + 1))
    done
    log "CQL answers on 127.0.0.1:${PORT}"
}

stop() {
    if ! running; then
        rm -f "$PID_FILE"
        return
    fi
    local pid waited=0
    pid="$(cat "$PID_FILE")"
    log "stopping (pid ${pid})"
    kill "$pid" 2>/dev/null || true
    # The CQL port closes seconds before the process has drained and exited;
    # a node started meanwhile would fail, so wait for the process itself.
    while kill -0 "$pid" 2>/dev/null; do
        if ((waited >= STOP_TIMEOUT)); then
            log "still running after ${STOP_TIMEOUT}s; killing"
            kill -9 "$pid" 2>/dev/null || true
        fi
        sleep 1
        waited=$((waited + 1))
    done
    rm -f "$PID_FILE"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) if running && cql_answers; then echo running; else echo stopped; exit 1; fi ;;
wipe) stop; rm -rf "${DIR}" ;;
*) echo "usage: $0 start|stop|status|wipe" >&2; exit 2 ;;
esac
