//! The end of a unary request's timing ([`crate::timing`]): one slower than
//! `slow_request` is logged at WARN with its breakdown, one that failed at
//! INFO (both a few a second at most, every slow one counted), and a client
//! that sent `readstates-timing` gets the breakdown back in the response's
//! metadata (or its error's), as TiKV returns a request's timeline.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics::counter;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};
use tonic::{Response, Status};

use crate::metrics::SLOW_REQUESTS;
use crate::timing::{Breakdown, Phase, TIMING};

/// The least time between two logged requests.
const LOG_GAP: Duration = Duration::from_millis(200);

/// What a request's end is told: its method, the slow threshold (zero: no
/// request is slow), and whether its client asked for the breakdown.
pub(super) struct Timed {
    pub method: &'static str,
    pub slow: Duration,
    pub asked: bool,
}

impl Timed {
    /// Whether `metadata` asks for the breakdown.
    pub fn asked(metadata: &MetadataMap) -> bool {
        metadata.contains_key(TIMING)
    }

    /// Logs and counts `result` if it was slow or failed, and gives the
    /// breakdown back if asked.
    pub fn end<T>(
        &self,
        result: Result<Response<T>, Status>,
        breakdown: Breakdown,
    ) -> Result<Response<T>, Status> {
        let slow = !self.slow.is_zero() && breakdown.total >= self.slow;
        if slow {
            counter!(SLOW_REQUESTS, "method" => self.method).increment(1);
        }
        if (slow || result.is_err()) && may_log() {
            let code = result
                .as_ref()
                .map_or_else(Status::code, |_| tonic::Code::Ok);
            let ms = |d: Duration| d.as_secs_f64() * 1e3;
            macro_rules! log {
                ($level:ident, $message:literal) => {
                    tracing::$level!(
                        method = self.method,
                        code = ?code,
                        total_ms = ms(breakdown.total),
                        hold_ms = ms(breakdown.of(Phase::Hold)),
                        forward_ms = ms(breakdown.of(Phase::Forward)),
                        load_ms = ms(breakdown.of(Phase::Load)),
                        durable_ms = ms(breakdown.of(Phase::Durable)),
                        $message
                    )
                };
            }
            match slow {
                true => log!(warn, "slow request"),
                false => log!(info, "failed request"),
            }
        }
        if !self.asked {
            return result;
        }
        let header: AsciiMetadataValue = match breakdown.header().parse() {
            Ok(header) => header,
            Err(_) => return result,
        };
        match result {
            Ok(mut response) => {
                response.metadata_mut().insert(TIMING, header);
                Ok(response)
            }
            Err(mut status) => {
                status.metadata_mut().insert(TIMING, header);
                Err(status)
            }
        }
    }
}

/// At most one logged request per [`LOG_GAP`], node-wide: when every
/// request is slow (an overloaded node), the log must not become the load.
fn may_log() -> bool {
    static LAST: AtomicU64 = AtomicU64::new(0);
    static EPOCH: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    let now = EPOCH
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
        + 1;
    let last = LAST.load(Ordering::Relaxed);
    (last == 0 || now >= last + LOG_GAP.as_millis() as u64)
        && LAST
            .compare_exchange(last, now, Ordering::Relaxed, Ordering::Relaxed)
            .is_ok()
}
