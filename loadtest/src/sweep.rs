//! Sweep: steps the open-loop rate up until the target saturates (achieves
//! less than 90% of the rate asked, or errs on more than 1% of requests),
//! recording p99.9 at each step.

use std::time::Duration;

use crate::report::Report;
use crate::runner::Session;

/// Rates from `start`, each `factor` times the last, up to `max`.
pub fn rates(start: u64, factor: f64, max: u64) -> Vec<u64> {
    let mut rates = Vec::new();
    let mut rate = start.max(1) as f64;
    while rate as u64 <= max {
        rates.push(rate as u64);
        rate *= factor.max(1.01);
    }
    rates
}

/// Whether a step's result means the target is saturated.
pub fn saturated(report: &Report) -> bool {
    let asked = report.target_rate.unwrap_or(0) as f64;
    report.throughput < 0.9 * asked || report.errors as f64 > 0.01 * report.requests.max(1) as f64
}

/// Runs each rate for `step`, stopping after the first saturated step.
pub async fn run(session: &Session, rates: &[u64], step: Duration) -> anyhow::Result<Vec<Report>> {
    let mut reports = Vec::new();
    for &rate in rates {
        // Latency only: waiting for writes to drain would add a write delay
        // to every step.
        let report = session.measure(Some(rate), step, false).await?;
        eprintln!(
            "  rate {rate}/s: achieved {:.0}/s, p99.9 {} µs, errors {}",
            report.throughput, report.latency.p999_us, report.errors
        );
        let done = saturated(&report);
        reports.push(report);
        if done {
            break;
        }
    }
    Ok(reports)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rates_grow_geometrically_to_the_maximum() {
        assert_eq!(rates(1_000, 2.0, 10_000), vec![1_000, 2_000, 4_000, 8_000]);
        assert_eq!(rates(100, 1.5, 400), vec![100, 150, 225, 337]);
        assert!(rates(10, 1.0, 100).len() < 300, "a factor of 1 still ends");
    }

    #[test]
    fn saturation_is_missed_rate_or_errors() {
        let report = |throughput, requests, errors| Report {
            target_rate: Some(1_000),
            throughput,
            requests,
            errors,
            ..Report::default()
        };
        assert!(!saturated(&report(950.0, 10_000, 0)));
        assert!(saturated(&report(850.0, 10_000, 0)));
        assert!(saturated(&report(1_000.0, 10_000, 200)));
    }
}
