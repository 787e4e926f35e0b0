//! What a run measured: an HDR histogram of latency per operation kind,
//! errors by status, and one window per second of wall time (for the
//! progress line and the over-time chart).

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

use crate::op::OpKind;

/// Latencies are recorded in microseconds, from 1 µs to 100 s, at 3
/// significant digits.
fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 100_000_000, 3).expect("valid histogram bounds")
}

#[derive(Clone, Debug)]
pub struct KindStats {
    pub latency: Histogram<u64>,
    pub errors: BTreeMap<String, u64>,
}

impl Default for KindStats {
    fn default() -> Self {
        KindStats {
            latency: histogram(),
            errors: BTreeMap::new(),
        }
    }
}

/// One second of the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Window {
    /// Seconds since measuring began (1 = the first second).
    pub second: u64,
    pub requests: u64,
    pub errors: u64,
    pub p50_us: u64,
    pub p999_us: u64,
    pub max_us: u64,
}

#[derive(Clone, Debug)]
pub struct Stats {
    pub kinds: Vec<KindStats>,
    pub windows: Vec<Window>,
    window: Histogram<u64>,
    window_errors: u64,
    /// Read states the measured requests may have changed.
    pub changes: u64,
}

impl Default for Stats {
    fn default() -> Self {
        Stats {
            kinds: OpKind::ALL.iter().map(|_| KindStats::default()).collect(),
            windows: Vec::new(),
            window: histogram(),
            window_errors: 0,
            changes: 0,
        }
    }
}

impl Stats {
    /// One request of `kind` ended after `latency` (from its due time).
    pub fn record(
        &mut self,
        kind: OpKind,
        latency: Duration,
        result: &Result<(), String>,
        changes: u64,
    ) {
        match result {
            Ok(()) => {
                let us = (latency.as_micros() as u64).max(1);
                self.kinds[kind.index()].latency.saturating_record(us);
                self.window.saturating_record(us);
                self.changes += changes;
            }
            Err(code) => {
                *self.kinds[kind.index()]
                    .errors
                    .entry(code.clone())
                    .or_insert(0) += 1;
                self.window_errors += 1;
            }
        }
    }

    /// Closes the current one-second window and starts the next.
    pub fn close_window(&mut self) -> Window {
        let window = Window {
            second: self.windows.len() as u64 + 1,
            requests: self.window.len() + self.window_errors,
            errors: self.window_errors,
            p50_us: self.window.value_at_quantile(0.5),
            p999_us: self.window.value_at_quantile(0.999),
            max_us: self.window.max(),
        };
        self.window.reset();
        self.window_errors = 0;
        self.windows.push(window.clone());
        window
    }

    /// Adds `other`'s measurements (e.g. from another worker) to these.
    pub fn merge(&mut self, other: &Stats) {
        for (mine, theirs) in self.kinds.iter_mut().zip(&other.kinds) {
            mine.latency.add(&theirs.latency).expect("same bounds");
            for (code, n) in &theirs.errors {
                *mine.errors.entry(code.clone()).or_insert(0) += n;
            }
        }
        self.changes += other.changes;
    }

    /// Every kind's latencies together.
    pub fn overall(&self) -> Histogram<u64> {
        let mut all = histogram();
        for kind in &self.kinds {
            all.add(&kind.latency).expect("same bounds");
        }
        all
    }

    pub fn requests(&self) -> u64 {
        self.kinds
            .iter()
            .map(|k| k.latency.len() + k.errors.values().sum::<u64>())
            .sum()
    }

    pub fn errors(&self) -> u64 {
        self.kinds
            .iter()
            .map(|k| k.errors.values().sum::<u64>())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn merging_adds_counts_latencies_and_errors() {
        let mut a = Stats::default();
        let mut b = Stats::default();
        for i in 1..=100 {
            a.record(OpKind::GetReadStates, ms(i), &Ok(()), 0);
            b.record(OpKind::GetReadStates, ms(100 + i), &Ok(()), 1);
        }
        b.record(OpKind::Ack, ms(1), &Err("Unavailable".into()), 1);
        a.record(OpKind::Ack, ms(1), &Err("Unavailable".into()), 1);
        a.merge(&b);
        assert_eq!(a.requests(), 202);
        assert_eq!(a.errors(), 2);
        assert_eq!(a.kinds[1].errors["Unavailable"], 2);
        assert_eq!(a.changes, 100, "errors change nothing");
        let overall = a.overall();
        assert_eq!(overall.len(), 200);
        let median_ms = overall.value_at_quantile(0.5) as f64 / 1_000.0;
        assert!((median_ms - 100.0).abs() < 1.0, "{median_ms}");
        assert!(overall.max() >= 199_000);
    }

    #[test]
    fn windows_are_per_second_and_start_afresh() {
        let mut stats = Stats::default();
        for _ in 0..999 {
            stats.record(
                OpKind::GetReadStates,
                Duration::from_micros(100),
                &Ok(()),
                0,
            );
        }
        stats.record(OpKind::GetReadStates, ms(50), &Ok(()), 0);
        stats.record(OpKind::GetReadStates, ms(1), &Err("Internal".into()), 0);
        let first = stats.close_window();
        assert_eq!((first.second, first.requests, first.errors), (1, 1_001, 1));
        assert!(first.p50_us >= 99 && first.p50_us <= 101);
        assert!(first.max_us >= 49_000);
        let second = stats.close_window();
        assert_eq!((second.second, second.requests, second.p999_us), (2, 0, 0));
        assert_eq!(
            stats.overall().len(),
            1_000,
            "windows do not drain the totals"
        );
    }
}
