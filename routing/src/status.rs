//! What a node's answers say beyond their code: the metadata it puts on
//! them (its epoch, the owner it knows, whether every item was answered)
//! and, from that and the transport's errors, whether a request may be sent
//! again. The fleet client and the `Apply` stream both retry by these rules.

use tonic::{Code, Status};

/// Trailing metadata of a refusal: the epoch of the node's table.
pub const EPOCH: &str = "x-readstates-epoch";
/// Trailing metadata of a refusal: the owner, `id@host:port`.
pub const OWNER: &str = "x-readstates-owner";
/// Set by a node on a request it forwards, so it is never forwarded again.
pub const FORWARDED: &str = "x-readstates-forwarded";
/// Trailing metadata of the status that ends an Apply stream once every
/// item the node read is answered (it shuts down, or a frame did not
/// decode): an item with no answer was not applied.
pub const ALL_ANSWERED: &str = "x-readstates-all-answered";

/// Trailing metadata of an error a node says is safe to send again: the
/// change may or may not have been applied (a request it forwarded was
/// cut by the owner's death), and applying it again counts nothing. Any
/// client may retry what carries it.
pub const SAFE_TO_RETRY: &str = "x-readstates-safe-to-retry";

/// Whether `status` says its request may be sent again: UNAVAILABLE from a
/// node (not applied), an error a node marked [`SAFE_TO_RETRY`], a request
/// the transport cut before sending it (see [`is_cut`]) or after (see
/// [`cut_in_flight`]), or one a node refused unprocessed (see
/// [`refused_by_goaway`]).
pub fn not_applied(status: &Status) -> bool {
    status.code() == Code::Unavailable
        || status.metadata().contains_key(SAFE_TO_RETRY)
        || is_cut(status)
        || refused_by_goaway(status)
        || cut_in_flight(status)
}

/// A request whose connection broke before its answer (the node was
/// killed, its machine lost: a reset, or a close mid-stream), made by this
/// client's transport, never a status a node sent (which would carry its
/// headers). It may or may not have been applied; every change applied
/// again counts nothing twice (`docs/api.md`, "Retries and idempotence"),
/// so it is sent again. tonic reports it as UNKNOWN ("transport error") or
/// INTERNAL ("h2 protocol error").
pub fn cut_in_flight(status: &Status) -> bool {
    if !status.metadata().is_empty() {
        return false;
    }
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<tonic::transport::Error>()
            || error.is::<h2::Error>()
            || error.is::<std::io::Error>()
        {
            return true;
        }
        source = error.source();
    }
    false
}

/// `status`, marked [`SAFE_TO_RETRY`].
pub fn safe_to_retry(mut status: Status) -> Status {
    status.metadata_mut().insert(
        SAFE_TO_RETRY,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    status
}

/// A stream a node going away refused with a graceful GOAWAY: above the
/// last stream it took, so never processed (HTTP/2, RFC 9113 6.8). tonic
/// reports it as INTERNAL ("h2 protocol error"); only the transport's own
/// error, never a status a node sent, is taken for one.
pub fn refused_by_goaway(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if let Some(h2) = error.downcast_ref::<h2::Error>() {
            return h2.is_go_away() && h2.is_remote() && h2.reason() == Some(h2::Reason::NO_ERROR);
        }
        source = error.source();
    }
    false
}

/// CANCELLED made by this client's transport, not sent by a node (which
/// would carry its headers): the connection went away before the request
/// was sent (a node shutting down), so nothing was applied; or an Apply
/// stream ended before the item's answer, which is safe to send again. A
/// node's own CANCELLED (its deadline passed) may come after the change
/// was applied, and is not retried unless marked [`SAFE_TO_RETRY`].
pub fn is_cut(status: &Status) -> bool {
    status.code() == Code::Cancelled && status.metadata().is_empty()
}
