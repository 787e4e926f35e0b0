//! Where a request's time went: a fixed record of its phases, kept for the
//! task that runs it (a `tokio` task-local, so nothing is allocated and no
//! signature carries it), filled by the places that wait (a store load, the
//! journal and backup, a forward hop, a hold while a slot moves here). The
//! request's path ([`crate::grpc`]) reads it at the end: a request slower
//! than `slow_request`, or failed, is logged with its breakdown (a few a
//! second at most, all counted), and a client that asks
//! (`readstates-timing` in its metadata) gets it back in the response's.
//!
//! Outside a request's scope (a write-behind write, a handoff) a phase
//! added is dropped: nothing to attribute it to.

use std::cell::Cell;
use std::fmt::Write as _;
use std::future::Future;
use std::time::Duration;

/// The metadata key a client sets to ask for its request's breakdown, and
/// the one the response carries it under.
pub const TIMING: &str = "readstates-timing";

/// The waits a request may go through.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// Held on a node acquiring the user's slot, until it serves it.
    Hold,
    /// Sent on to the user's owner (or a previous owner), or to a
    /// channel's owner for its change, to its answer; summed over the parts
    /// of a request of many users sent to several nodes at once.
    Forward,
    /// A user loaded from the store on a miss.
    Load,
    /// Until the change is durable: the journal's sync and the backup's
    /// copy of it, together.
    Durable,
}

const PHASES: [Phase; 4] = [Phase::Hold, Phase::Forward, Phase::Load, Phase::Durable];

impl Phase {
    fn name(self) -> &'static str {
        match self {
            Phase::Hold => "hold",
            Phase::Forward => "forward",
            Phase::Load => "load",
            Phase::Durable => "durable",
        }
    }
}

/// One request's phases, in microseconds.
#[derive(Debug, Default)]
pub struct Timing {
    micros: [Cell<u64>; PHASES.len()],
}

/// A request's phases as read at its end.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Breakdown {
    pub total: Duration,
    micros: [u64; PHASES.len()],
}

tokio::task_local! {
    static CURRENT: Timing;
}

/// Runs `request` with a fresh record; returns its output and breakdown.
pub async fn scope<F: Future>(request: F) -> (F::Output, Breakdown) {
    let started = tokio::time::Instant::now();
    CURRENT
        .scope(Timing::default(), async move {
            let output = request.await;
            let micros = CURRENT.with(|t| t.micros.each_ref().map(Cell::get));
            let total = started.elapsed();
            (output, Breakdown { total, micros })
        })
        .await
}

/// Adds `elapsed` to `phase` of the request running on this task, if any.
pub fn add(phase: Phase, elapsed: Duration) {
    let _ = CURRENT.try_with(|timing| {
        let cell = &timing.micros[phase as usize];
        cell.set(cell.get().saturating_add(elapsed.as_micros() as u64));
    });
}

/// Runs `wait`, adding how long it waited to `phase`: from its first poll
/// that was pending, so that one ready at once (a cached user, a change
/// durable already) costs no clock read.
pub async fn measure<F: Future>(phase: Phase, wait: F) -> F::Output {
    let mut wait = std::pin::pin!(wait);
    let mut started = None;
    let output = std::future::poll_fn(|cx| {
        let polled = wait.as_mut().poll(cx);
        if polled.is_pending() {
            started.get_or_insert_with(tokio::time::Instant::now);
        }
        polled
    })
    .await;
    if let Some(started) = started {
        add(phase, started.elapsed());
    }
    output
}

impl Breakdown {
    /// How long `phase` took.
    pub fn of(&self, phase: Phase) -> Duration {
        Duration::from_micros(self.micros[phase as usize])
    }

    /// `total=1234us,hold=0us,forward=0us,load=812us,durable=301us`: what
    /// the response's metadata carries.
    pub fn header(&self) -> String {
        let mut header = format!("total={}us", self.total.as_micros());
        for phase in PHASES {
            let _ = write!(
                header,
                ",{}={}us",
                phase.name(),
                self.micros[phase as usize]
            );
        }
        header
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn phases_add_up_within_a_scope_and_are_dropped_outside_one() {
        add(Phase::Load, Duration::from_secs(9));
        let ((), breakdown) = scope(async {
            measure(Phase::Load, tokio::time::sleep(Duration::from_millis(30))).await;
            add(Phase::Load, Duration::from_millis(2));
            measure(Phase::Durable, tokio::time::sleep(Duration::from_millis(5))).await;
            tokio::time::sleep(Duration::from_millis(1)).await;
        })
        .await;
        assert_eq!(breakdown.of(Phase::Load), Duration::from_millis(32));
        assert_eq!(breakdown.of(Phase::Durable), Duration::from_millis(5));
        assert_eq!(breakdown.of(Phase::Forward), Duration::ZERO);
        assert_eq!(breakdown.total, Duration::from_millis(36));
        assert_eq!(
            breakdown.header(),
            "total=36000us,hold=0us,forward=0us,load=32000us,durable=5000us"
        );
    }
}
