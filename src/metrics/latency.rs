//! Request durations, bucketed as they are recorded. The exporter's
//! histogram keeps every sample until its upkeep folds them into buckets:
//! a push per request, and once a second a fold of every request of that
//! second on the worker that runs the upkeep (a few hundred thousand Apply
//! items). Here a request adds to one bucket and to the sum, and `/metrics`
//! renders the series beside the exporter's, in the same format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use super::{LATENCY_BUCKETS, REQUEST_DURATION};

/// One method's durations on one node.
#[derive(Debug, Default)]
pub struct Latency {
    /// Per bucket of [`LATENCY_BUCKETS`] and one past the last (not
    /// cumulative: each request counts in one).
    counts: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

/// The series of the process, by method and node: tests run several
/// applications in one process, and the same labels share one series.
type Registered = BTreeMap<(&'static str, String), Arc<Latency>>;

static REGISTERED: Mutex<Registered> = Mutex::new(BTreeMap::new());

impl Latency {
    /// The series of `method` on `node`, registered on first use.
    pub fn registered(method: &'static str, node: &str) -> Arc<Latency> {
        let mut registered = REGISTERED.lock().unwrap_or_else(PoisonError::into_inner);
        registered
            .entry((method, node.to_owned()))
            .or_default()
            .clone()
    }

    /// One request took `elapsed`.
    pub fn record(&self, elapsed: Duration) {
        let seconds = elapsed.as_secs_f64();
        let bucket = LATENCY_BUCKETS.partition_point(|&bound| bound < seconds);
        self.counts[bucket].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    fn render(&self, labels: &str, text: &mut String) {
        let mut count = 0;
        let bounds = LATENCY_BUCKETS.iter().map(f64::to_string);
        for (bucket, le) in self.counts.iter().zip(bounds.chain(["+Inf".into()])) {
            count += bucket.load(Ordering::Relaxed);
            let _ = writeln!(
                text,
                "{REQUEST_DURATION}_bucket{{{labels},le=\"{le}\"}} {count}"
            );
        }
        let sum = self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        let _ = writeln!(text, "{REQUEST_DURATION}_sum{{{labels}}} {sum}");
        let _ = writeln!(text, "{REQUEST_DURATION}_count{{{labels}}} {count}");
    }
}

/// Every registered series, as Prometheus text.
pub fn render() -> String {
    let registered = REGISTERED.lock().unwrap_or_else(PoisonError::into_inner);
    let mut text = String::new();
    if !registered.is_empty() {
        let _ = writeln!(text, "# TYPE {REQUEST_DURATION} histogram");
    }
    for ((method, node), latency) in registered.iter() {
        let node = escaped(node);
        latency.render(&format!("method=\"{method}\",node=\"{node}\""), &mut text);
    }
    text
}

/// A label value as the exposition format writes it: the node id comes
/// from the configuration, and one quote in it would spoil the whole page.
fn escaped(value: &str) -> String {
    value
        .replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::Latency;
    use crate::metrics::scrape;

    #[test]
    fn a_duration_counts_in_the_first_bucket_it_fits_and_in_every_one_above() {
        let latency = Latency::registered("Test.Buckets", "test");
        latency.record(Duration::from_micros(50));
        latency.record(Duration::from_micros(300));
        latency.record(Duration::from_secs(20));
        let text = super::render();
        let series = |le: &str| {
            let name = "readstates_request_duration_seconds_bucket";
            let labels = format!("method=\"Test.Buckets\",node=\"test\",le=\"{le}\"}}");
            scrape::value(&text, &format!("{name}{{{labels}"))
        };
        assert_eq!(series("0.00005"), 1.0);
        assert_eq!(series("0.00025"), 1.0);
        assert_eq!(series("0.0005"), 2.0);
        assert_eq!(series("10"), 2.0);
        assert_eq!(series("+Inf"), 3.0);
        let count = "readstates_request_duration_seconds_count{method=\"Test.Buckets\"";
        assert_eq!(scrape::value(&text, count), 3.0);
        let sum = "readstates_request_duration_seconds_sum{method=\"Test.Buckets\"";
        assert!((scrape::value(&text, sum) - 20.00035).abs() < 1e-9);
    }

    #[test]
    fn a_node_id_is_escaped_as_a_label_value() {
        let latency = Latency::registered("Test.Escaped", "a\\b\"c\nd");
        latency.record(Duration::from_micros(50));
        let text = super::render();
        let count = "readstates_request_duration_seconds_count";
        let labels = r#"{method="Test.Escaped",node="a\\b\"c\nd"}"#;
        assert!(text.contains(&format!("{count}{labels} 1\n")), "{text}");
    }
}
