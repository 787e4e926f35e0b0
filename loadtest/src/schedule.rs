//! Open-loop scheduling: when each request is due, at a fixed rate, whether or
//! not earlier ones have returned. Latency is measured from the due time, so
//! a request delayed by queueing (in the target or in this tool) counts its
//! wait: coordinated omission is not hidden.

use std::time::{Duration, Instant};

/// The due times `start + i / rate`, exactly (no drift from rounding).
#[derive(Clone, Debug)]
pub struct Schedule {
    start: Instant,
    rate: u64,
    sent: u64,
}

impl Schedule {
    pub fn new(start: Instant, rate: u64) -> Schedule {
        Schedule {
            start,
            rate: rate.max(1),
            sent: 0,
        }
    }

    /// The due time of the next request.
    pub fn peek(&self) -> Instant {
        let nanos = u128::from(self.sent) * 1_000_000_000 / u128::from(self.rate);
        self.start + Duration::from_nanos(nanos as u64)
    }

    /// Takes the next request's due time.
    pub fn take(&mut self) -> Instant {
        let due = self.peek();
        self.sent += 1;
        due
    }

    /// Every request due at or before `now`.
    pub fn due(&mut self, now: Instant) -> Vec<Instant> {
        let mut due = Vec::new();
        while self.peek() <= now {
            due.push(self.take());
        }
        due
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_times_are_evenly_spaced_without_drift() {
        let start = Instant::now();
        let mut schedule = Schedule::new(start, 3);
        let times: Vec<Duration> = (0..7).map(|_| schedule.take() - start).collect();
        let ms: Vec<u128> = times.iter().map(Duration::as_millis).collect();
        assert_eq!(ms, vec![0, 333, 666, 1000, 1333, 1666, 2000]);
    }

    #[test]
    fn due_catches_up_after_a_stall() {
        let start = Instant::now();
        let mut schedule = Schedule::new(start, 1_000);
        assert_eq!(schedule.due(start).len(), 1, "the first is due at once");
        // The sender stalled 10 ms: the ten requests due meanwhile are all due now.
        let late = schedule.due(start + Duration::from_millis(10));
        assert_eq!(late.len(), 10);
        assert_eq!(late[0] - start, Duration::from_millis(1));
        assert_eq!(schedule.peek() - start, Duration::from_millis(11));
    }

    #[test]
    fn rate_over_a_second_is_exact() {
        let start = Instant::now();
        let mut schedule = Schedule::new(start, 7_919);
        let in_one_second = schedule.due(start + Duration::from_secs(1) - Duration::from_nanos(1));
        assert_eq!(in_one_second.len(), 7_919);
    }
}
