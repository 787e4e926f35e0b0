//! Every metric the service exports, named in one place, and the Prometheus
//! recorder behind them.
//!
//! Hot-path counters (cache hits, misses, evictions) are plain integers in the
//! shards; a sampler (`app::sampler`) copies them and the shard gauges out once a second, so a
//! request never pays for a metrics registry lookup it does not need.

pub mod latency;
#[cfg(any(test, feature = "test-support"))]
pub mod scrape;
pub mod server;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use latency::Latency;
use metrics::{Counter, counter, gauge, histogram};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};

pub const REQUESTS: &str = "readstates_requests_total";
pub const REQUEST_DURATION: &str = "readstates_request_duration_seconds";
pub const CACHE_HITS: &str = "readstates_cache_hits_total";
pub const CACHE_MISSES: &str = "readstates_cache_misses_total";
pub const CACHE_EVICTIONS: &str = "readstates_cache_evictions_total";
pub const CACHE_EVICTIONS_UNWRITTEN: &str = "readstates_cache_evictions_unwritten_total";
pub const CACHED_USERS: &str = "readstates_cached_users";
pub const CACHED_READ_STATES: &str = "readstates_cached_read_states";
pub const UNWRITTEN_READ_STATES: &str = "readstates_unwritten_read_states";
pub const EVICTED_UNWRITTEN: &str = "readstates_evicted_unwritten_read_states";
pub const EVICTED_UNWRITTEN_LIMIT: &str = "readstates_evicted_unwritten_limit";
pub const OLDEST_UNWRITTEN: &str = "readstates_oldest_unwritten_change_seconds";
pub const STORE_OPERATIONS: &str = "readstates_store_operations_total";
pub const STORE_DURATION: &str = "readstates_store_duration_seconds";
pub const STORE_WRITTEN: &str = "readstates_store_written_read_states_total";
pub const BUILD_INFO: &str = "readstates_build_info";
/// Requests slower than `slow_request`, by `method` (each logged with its
/// breakdown, a few a second at most).
pub const SLOW_REQUESTS: &str = "readstates_slow_requests_total";
pub const WATCHED_USERS: &str = "readstates_watched_users";
/// Channels counted by channel this node holds, and those of them with
/// changes the store does not hold yet.
pub const CHANNEL_STATES: &str = "readstates_channel_states";
pub const UNWRITTEN_CHANNEL_STATES: &str = "readstates_unwritten_channel_states";
pub const SLOTS: &str = "readstates_slots";
/// Users of released slots, by how they left: `handed` over warm, or
/// `written` to the store and dropped (a handoff that failed).
pub const MOVED_USERS: &str = "readstates_moved_users_total";
/// Tries of a node's own ring change (joining, draining) that waited for
/// another change to be handed over first.
pub const RING_CHANGE_WAITS: &str = "readstates_ring_change_waits_total";
/// Users installed from handoffs by their previous owners.
pub const HANDED_IN_USERS: &str = "readstates_handed_in_users_total";
/// Calls refused as a node's without the fleet's token, by `reason`.
pub const NODE_CALLS_REFUSED: &str = "readstates_node_calls_refused_total";
/// The journal (`docs/journal.md`): syncs, the records (one per change)
/// and bytes they made durable, how long each took, failed writes or syncs, whether the
/// last one succeeded (0: changes are refused), and its sealed segments.
pub const JOURNAL_SYNCS: &str = "readstates_journal_syncs_total";
pub const JOURNAL_RECORDS: &str = "readstates_journal_records_total";
pub const JOURNAL_BYTES: &str = "readstates_journal_bytes_total";
pub const JOURNAL_SYNC_DURATION: &str = "readstates_journal_sync_duration_seconds";
pub const JOURNAL_FAILURES: &str = "readstates_journal_failures_total";
pub const JOURNAL_HEALTHY: &str = "readstates_journal_healthy";
pub const JOURNAL_SEGMENTS: &str = "readstates_journal_segments";
/// Whether this fleet node holds its lease (1) and may serve its slots.
pub const LEASE_HELD: &str = "readstates_lease_held";
/// Whether the ring this fleet node follows names it (1); 0: it runs out
/// of the ring, owns nothing and only forwards (taken over while alive,
/// or never added: `--join-weight` adds it back once it holds its lease).
pub const IN_RING: &str = "readstates_in_ring";
/// Tries to renew or take this node's lease, by `result`: `applied`,
/// `lost` (revoked or taken by another incarnation), `failed` (no answer).
pub const LEASE_RENEWALS: &str = "readstates_lease_renewals_total";
/// Whether this fleet node's backup holds all its unwritten changes (1),
/// so that changes are answered once two nodes hold them; 0: none (a fleet
/// of one, a backup down or catching up), changes rest on this node alone.
pub const BACKUP_ATTACHED: &str = "readstates_backup_attached";
/// Times this node's backup stream ended or was cut, by `reason`.
pub const BACKUP_DETACHED: &str = "readstates_backup_detached_total";
/// What this node holds as the backup of others: their journal batches not
/// written yet, in bytes, and the streams feeding them.
pub const BACKUP_HELD_BYTES: &str = "readstates_backup_held_bytes";
pub const BACKUP_STREAMS: &str = "readstates_backup_streams";
/// The most this node holds as the backup of others (`backup_budget_mib`).
pub const BACKUP_BUDGET_BYTES: &str = "readstates_backup_budget_bytes";
/// Dead nodes this node took over as their backup, by `result`.
pub const TAKEOVERS: &str = "readstates_takeovers_total";
pub const TLS_HANDSHAKE_FAILURES: &str = "readstates_tls_handshake_failures_total";
pub const TLS_RELOADS: &str = "readstates_tls_reloads_total";

const LATENCY_BUCKETS: [f64; 16] = [
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.002_5, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 10.0,
];

/// The process-wide recorder, installed on first use (a process holds one
/// recorder; tests start several applications in one process).
pub fn handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), &LATENCY_BUCKETS)
                .map(PrometheusBuilder::build_recorder)
                .unwrap_or_else(|_| PrometheusBuilder::new().build_recorder());
            let handle = recorder.handle();
            if metrics::set_global_recorder(recorder).is_err() {
                tracing::warn!("a metrics recorder was already installed; /metrics will be empty");
            }
            handle
        })
        .clone()
}

/// `readstates_build_info{version, node}`: which build each node runs, so
/// that a canary and the fleet show side by side.
pub fn build_info(node: &str) {
    gauge!(BUILD_INFO, "version" => env!("CARGO_PKG_VERSION"), "node" => node.to_owned()).set(1.0);
}

/// The request metrics of one gRPC method on one node (the node id, or
/// `standalone`), so a canary's requests compare with the fleet's. The handles are resolved once:
/// looking a labelled metric up builds its key and hashes it, which would
/// cost every request an allocation and a registry lookup.
#[derive(Clone, Debug)]
pub struct MethodMetrics {
    method: &'static str,
    node: String,
    ok: Counter,
    duration: Arc<Latency>,
}

impl MethodMetrics {
    pub fn new(method: &'static str, node: &str) -> MethodMetrics {
        let ok = code_name(tonic::Code::Ok);
        MethodMetrics {
            method,
            node: node.to_owned(),
            ok: counter!(REQUESTS, "method" => method, "code" => ok, "node" => node.to_owned()),
            duration: Latency::registered(method, node),
        }
    }

    /// The method's name, as its metrics label it.
    pub fn method(&self) -> &'static str {
        self.method
    }

    /// One request ended with `code`.
    pub fn record(&self, code: tonic::Code, elapsed: Duration) {
        if code == tonic::Code::Ok {
            self.ok.increment(1);
        } else {
            let node = self.node.clone();
            counter!(REQUESTS, "method" => self.method, "code" => code_name(code), "node" => node)
                .increment(1);
        }
        self.duration.record(elapsed);
    }
}

/// One store operation (`load` or `write`) ended.
pub fn store_operation(store: &'static str, operation: &'static str, elapsed: Duration, ok: bool) {
    let result = if ok { "ok" } else { "error" };
    counter!(STORE_OPERATIONS, "store" => store, "operation" => operation, "result" => result)
        .increment(1);
    histogram!(STORE_DURATION, "store" => store, "operation" => operation)
        .record(elapsed.as_secs_f64());
}

/// A successful write carried this many read states.
/// The journal's writer made a batch durable.
pub fn journal_synced(bytes: usize, records: u64, took: Duration) {
    counter!(JOURNAL_SYNCS).increment(1);
    counter!(JOURNAL_RECORDS).increment(records);
    counter!(JOURNAL_BYTES).increment(bytes as u64);
    histogram!(JOURNAL_SYNC_DURATION).record(took.as_secs_f64());
    gauge!(JOURNAL_HEALTHY).set(1.0);
}

/// The journal's writer failed to write or sync a batch.
pub fn journal_failed() {
    counter!(JOURNAL_FAILURES).increment(1);
    gauge!(JOURNAL_HEALTHY).set(0.0);
}

pub fn journal_healthy(healthy: bool) {
    gauge!(JOURNAL_HEALTHY).set(if healthy { 1.0 } else { 0.0 });
}

pub fn journal_segments(segments: usize) {
    gauge!(JOURNAL_SEGMENTS).set(segments as f64);
}

pub fn store_written(read_states: usize) {
    counter!(STORE_WRITTEN).increment(read_states as u64);
}

fn code_name(code: tonic::Code) -> &'static str {
    use tonic::Code::*;
    match code {
        Ok => "OK",
        Cancelled => "CANCELLED",
        Unknown => "UNKNOWN",
        InvalidArgument => "INVALID_ARGUMENT",
        DeadlineExceeded => "DEADLINE_EXCEEDED",
        NotFound => "NOT_FOUND",
        AlreadyExists => "ALREADY_EXISTS",
        PermissionDenied => "PERMISSION_DENIED",
        ResourceExhausted => "RESOURCE_EXHAUSTED",
        FailedPrecondition => "FAILED_PRECONDITION",
        Aborted => "ABORTED",
        OutOfRange => "OUT_OF_RANGE",
        Unimplemented => "UNIMPLEMENTED",
        Internal => "INTERNAL",
        Unavailable => "UNAVAILABLE",
        DataLoss => "DATA_LOSS",
        Unauthenticated => "UNAUTHENTICATED",
    }
}

#[cfg(test)]
mod tests {
    /// Every metric declared above, read from the declarations themselves,
    /// so a metric added there is checked without being listed again.
    fn declared() -> Vec<&'static str> {
        include_str!("metrics.rs")
            .lines()
            .filter(|line| line.starts_with("pub const ") && line.contains(": &str = \""))
            .filter_map(|line| line.split('"').nth(1))
            .collect()
    }

    #[test]
    fn metric_names_are_unique_and_prefixed() {
        let names = declared();
        assert!(names.len() >= 14, "{names:?}");
        let mut unique = names.clone();
        unique.sort_unstable();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "{names:?}");
        assert!(
            names.iter().all(|n| n.starts_with("readstates_")),
            "{names:?}"
        );
        assert!(names.contains(&super::UNWRITTEN_READ_STATES));
    }

    /// The dashboard and the alerts name only metrics the service exports:
    /// renaming one cannot silently blind them. (Histograms are named with
    /// Prometheus's `_bucket`, `_sum` and `_count` suffixes.)
    #[test]
    fn the_dashboard_and_the_alerts_name_only_exported_metrics() {
        let exported = declared();
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy");
        for file in [
            "grafana/readstates.json",
            "prometheus/alerts.yml",
            "prometheus/alerts.test.yml",
        ] {
            let text = std::fs::read_to_string(root.join(file)).unwrap();
            let named: Vec<&str> = text
                .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .filter(|word| word.starts_with("readstates_"))
                .collect();
            assert!(named.len() >= 5, "{file} names only {named:?}");
            for name in named {
                let histogram = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|suffix| name.strip_suffix(suffix))
                    .filter(|base| base.ends_with("_seconds"));
                assert!(
                    exported.contains(&histogram.unwrap_or(name)),
                    "{file} names {name}, which the service does not export"
                );
            }
        }
    }
}
