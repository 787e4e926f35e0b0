# readstates: multi-stage build. The first stage compiles (no system protoc
# needed: the build uses protox), with dependencies in their own cached layer;
# the runtime image is slim and runs as a non-root user.

FROM rust:1.90-bookworm AS build
WORKDIR /src
# Dependencies first: this layer is rebuilt only when the manifests change.
# Every workspace member's manifest comes with stub sources (and the routing
# crate with a stub build script), so that cargo can read the workspace.
COPY Cargo.toml Cargo.lock ./
COPY routing/Cargo.toml routing/
COPY loadtest/Cargo.toml loadtest/
RUN mkdir -p src benches routing/src loadtest/src \
    && echo 'fn main() {}' > src/main.rs && touch src/lib.rs \
    && echo 'fn main() {}' > benches/cache.rs \
    && echo 'fn main() {}' > routing/build.rs && touch routing/src/lib.rs \
    && echo 'fn main() {}' > loadtest/src/main.rs && touch loadtest/src/lib.rs \
    && cargo build --release --locked -p readstates \
    && rm -rf src benches routing/src routing/build.rs
COPY proto proto
COPY routing routing
COPY schema schema
COPY src src
COPY benches benches
COPY examples examples
# Make cargo see the real sources as newer than the placeholder build.
RUN touch src/main.rs src/lib.rs routing/build.rs routing/src/lib.rs \
    && cargo build --release --locked --bin readstates

# grpc_health_probe: the health check speaks grpc.health.v1.
FROM golang:1.23-bookworm AS probe
RUN go install github.com/grpc-ecosystem/grpc-health-probe@v0.4.35

FROM debian:bookworm-slim
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/readstates --create-home readstates
COPY --from=build /src/target/release/readstates /usr/local/bin/readstates
COPY --from=probe /go/bin/grpc-health-probe /usr/local/bin/grpc-health-probe
COPY config/readstates.toml /etc/readstates/readstates.toml
USER readstates
WORKDIR /var/lib/readstates
ENV READSTATES_CONFIG=/etc/readstates/readstates.toml \
    READSTATES_LISTEN=0.0.0.0:50051 \
    READSTATES_METRICS_LISTEN=0.0.0.0:9090 \
    READSTATES_DATA_DIR=/var/lib/readstates/data \
    READSTATES_LOG_FORMAT=json
EXPOSE 50051 9090
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
    CMD ["grpc-health-probe", "-addr=127.0.0.1:50051", "-service=readstates.v1.ReadStates"]
# SIGTERM (docker stop) drains and writes every unwritten change; give it time.
STOPSIGNAL SIGTERM
ENTRYPOINT ["readstates"]
CMD ["serve"]
