//! The result of a run: a table for people, JSON for tools and charts.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::op::OpKind;
use crate::stats::{Stats, Window};

#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Percentiles {
    pub p50_us: u64,
    pub p90_us: u64,
    pub p99_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

impl Percentiles {
    pub fn of(histogram: &Histogram<u64>) -> Percentiles {
        Percentiles {
            p50_us: histogram.value_at_quantile(0.5),
            p90_us: histogram.value_at_quantile(0.9),
            p99_us: histogram.value_at_quantile(0.99),
            p999_us: histogram.value_at_quantile(0.999),
            max_us: histogram.max(),
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct OpReport {
    pub ok: u64,
    pub errors: BTreeMap<String, u64>,
    pub latency: Percentiles,
}

/// Store writes during the run, read from the target's `/metrics`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct StoreWrites {
    /// User writes (one batch or transaction each).
    pub writes: f64,
    /// Read states those writes carried.
    pub written_read_states: f64,
    /// Read states the run's requests may have changed.
    pub changes: u64,
    /// `writes / changes`.
    pub writes_per_change: f64,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Report {
    pub name: String,
    pub target: String,
    /// "open" (fixed rate) or "closed" (as fast as `concurrency` allows).
    pub mode: String,
    pub target_rate: Option<u64>,
    pub concurrency: usize,
    pub seconds: f64,
    pub requests: u64,
    pub errors: u64,
    /// Successful requests per second.
    pub throughput: f64,
    pub latency: Percentiles,
    pub ops: BTreeMap<String, OpReport>,
    pub timeline: Vec<Window>,
    /// Worst and median one-second p99.9, and their ratio (spikes).
    pub worst_second_p999_us: u64,
    pub median_second_p999_us: u64,
    pub store: Option<StoreWrites>,
}

impl Report {
    pub fn new(
        name: &str,
        target: &str,
        target_rate: Option<u64>,
        concurrency: usize,
        elapsed: Duration,
        stats: &Stats,
    ) -> Report {
        let overall = stats.overall();
        let ops = OpKind::ALL
            .iter()
            .map(|kind| kind.name())
            .zip(&stats.kinds)
            .filter(|(_, k)| !k.latency.is_empty() || !k.errors.is_empty())
            .map(|(name, k)| {
                let report = OpReport {
                    ok: k.latency.len(),
                    errors: k.errors.clone(),
                    latency: Percentiles::of(&k.latency),
                };
                ((*name).to_owned(), report)
            })
            .collect();
        // Windows with no traffic (e.g. a last partial second) say nothing.
        let mut p999s: Vec<u64> = stats
            .windows
            .iter()
            .filter(|w| w.requests > 0)
            .map(|w| w.p999_us)
            .collect();
        p999s.sort_unstable();
        Report {
            name: name.to_owned(),
            target: target.to_owned(),
            mode: if target_rate.is_some() {
                "open"
            } else {
                "closed"
            }
            .to_owned(),
            target_rate,
            concurrency,
            seconds: elapsed.as_secs_f64(),
            requests: stats.requests(),
            errors: stats.errors(),
            throughput: overall.len() as f64 / elapsed.as_secs_f64().max(1e-9),
            latency: Percentiles::of(&overall),
            ops,
            timeline: stats.windows.clone(),
            worst_second_p999_us: p999s.last().copied().unwrap_or(0),
            median_second_p999_us: p999s.get(p999s.len() / 2).copied().unwrap_or(0),
            store: None,
        }
    }

    /// The human-readable summary.
    pub fn table(&self) -> String {
        let mut out = String::new();
        let rate = self
            .target_rate
            .map_or("closed loop".to_owned(), |r| format!("open loop at {r}/s"));
        let _ = writeln!(
            out,
            "{}: {} ({rate}, concurrency {}), {:.1} s: {:.0} ok/s, {} requests, {} errors",
            self.name,
            self.target,
            self.concurrency,
            self.seconds,
            self.throughput,
            self.requests,
            self.errors
        );
        let _ = writeln!(
            out,
            "{:<16} {:>9} {:>8} {:>9} {:>9} {:>9} {:>9} {:>9}",
            "operation", "ok", "errors", "p50 µs", "p90 µs", "p99 µs", "p99.9 µs", "max µs"
        );
        let rows = self
            .ops
            .iter()
            .map(|(n, o)| (n.as_str(), o.ok, o.errors.values().sum::<u64>(), o.latency));
        let all = std::iter::once((
            "all",
            self.requests - self.errors,
            self.errors,
            self.latency,
        ));
        for (name, ok, errors, p) in rows.chain(all) {
            let _ = writeln!(
                out,
                "{name:<16} {ok:>9} {errors:>8} {:>9} {:>9} {:>9} {:>9} {:>9}",
                p.p50_us, p.p90_us, p.p99_us, p.p999_us, p.max_us
            );
        }
        for (name, op) in &self.ops {
            for (code, n) in &op.errors {
                let _ = writeln!(out, "  {name} {code}: {n}");
            }
        }
        let _ = writeln!(
            out,
            "one-second p99.9: median {} µs, worst {} µs (worst/median {:.2})",
            self.median_second_p999_us,
            self.worst_second_p999_us,
            self.spike_ratio()
        );
        if let Some(store) = &self.store {
            let _ = writeln!(
                out,
                "store: {:.0} writes ({:.0} read states) for {} changes: {:.4} writes per change",
                store.writes, store.written_read_states, store.changes, store.writes_per_change
            );
        }
        out
    }

    /// Worst one-second p99.9 over the median one.
    pub fn spike_ratio(&self) -> f64 {
        self.worst_second_p999_us as f64 / self.median_second_p999_us.max(1) as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_summarises_the_stats_and_round_trips_as_json() {
        let mut stats = Stats::default();
        for second in 1..=5u64 {
            for i in 0..100u64 {
                let us = if second == 3 { 10_000 } else { 100 + i };
                stats.record(
                    OpKind::ALL[(i % 2) as usize],
                    Duration::from_micros(us),
                    &Ok(()),
                    1,
                );
            }
            stats.close_window();
        }
        stats.record(
            OpKind::MessageCreated,
            Duration::from_micros(5),
            &Err("Unavailable".into()),
            3,
        );
        let report = Report::new(
            "t",
            "grpc://x",
            Some(100),
            8,
            Duration::from_secs(5),
            &stats,
        );
        assert_eq!((report.requests, report.errors), (501, 1));
        assert_eq!(report.mode, "open");
        assert!((report.throughput - 100.0).abs() < 1e-9);
        assert_eq!(report.ops.len(), 3, "kinds with no traffic are left out");
        assert_eq!(report.ops["MessageCreated"].errors["Unavailable"], 1);
        assert!(report.worst_second_p999_us >= 9_990);
        assert!(report.median_second_p999_us < 200);
        assert!(report.spike_ratio() > 50.0);

        let table = report.table();
        assert!(
            table.contains("GetReadStates") && table.contains("MessageCreated Unavailable: 1"),
            "{table}"
        );
        let json = serde_json::to_string(&report).unwrap();
        assert_eq!(serde_json::from_str::<Report>(&json).unwrap(), report);
    }
}
