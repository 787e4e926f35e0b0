//! The errors a request can end in, and the one place they become gRPC
//! statuses.

use tonic::{Code, Status};

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// The request is wrong; retrying it will not help.
    #[error("{field}: {reason}")]
    InvalidArgument { field: String, reason: String },
    /// The user could not be loaded from the store.
    #[error("read states of user {user_id} could not be loaded: {reason}")]
    LoadFailed { user_id: u64, reason: String },
    /// Write-through mode: the change could not be written before the
    /// answer. It is applied in memory and write-behind retries it, so the
    /// caller must treat it as a timed-out write: it may still land.
    #[error(
        "the change to user {user_id} could not be written, it is retried in the background: {reason}"
    )]
    WriteFailed { user_id: u64, reason: String },
    /// Write-through mode: a change to a channel counted by channel could
    /// not be written before the answer; as [`Error::WriteFailed`].
    #[error(
        "the change to channel {channel_id} could not be written, it is retried in the background: {reason}"
    )]
    ChannelWriteFailed { channel_id: u64, reason: String },
    /// The store is not keeping up (or is down): too many evicted read
    /// states wait for it, and memory must not grow further.
    #[error("{evicted} evicted read states are waiting for the store (limit {limit}); retry later")]
    TooManyUnwritten { evicted: usize, limit: usize },
    /// Shutdown has begun: the change was not applied; retry it (on another
    /// node, or once this one is back).
    #[error("the server is shutting down; the change was not applied, retry it")]
    ShuttingDown,
    /// The change could not be made durable in this node's journal (a
    /// full or failing disk; see `docs/journal.md`): it was not
    /// acknowledged. Refused before it was applied while the journal is
    /// failing; otherwise applied in memory and written behind, and a
    /// retry counts nothing twice. Retry it.
    #[error("the change was not journaled, retry it: {reason}")]
    JournalFailed { reason: String },
    /// Unsubscribing a user the Watch stream does not watch (never
    /// subscribed, unsubscribed already, or dropped with a resync).
    #[error("user {user_id} is not subscribed on this stream")]
    NotSubscribed { user_id: u64 },
    /// A Watch stream already watches as many users as one may.
    #[error("this stream watches {limit} users, the most one may; open another stream")]
    TooManySubscriptions { limit: usize },
    /// A Watch request stream that could not be read.
    #[error("the request stream could not be read: {0}")]
    BadStream(String),
    /// The client's deadline passed first. A change cut before its apply
    /// changed nothing; in write-through mode one cut during its write stays
    /// applied and is written later, as after `WriteFailed`.
    #[error("the deadline passed before the request was done")]
    DeadlineExceeded,
    /// This node of a fleet does not serve the user's slot (now, or at
    /// all): the request was not applied here. The service forwards it to
    /// the owner, or holds it while the slot is being acquired.
    #[error("user {user_id} is not served by this node (its slot is {})", .state.name())]
    NotServed {
        user_id: u64,
        state: crate::ownership::SlotState,
    },
    /// This node's lease on its slots lapsed between a change's check and
    /// its answer (a freeze, or the ring store out of reach): another node
    /// may take its users, so the change is not answered OK. Retrying it
    /// counts nothing twice.
    #[error("this node's lease on its slots lapsed before the change was answered; retry")]
    LeaseLapsed,
    /// A Watch subscription of a user served by another node could not be
    /// sent there (the node is down or left the ring).
    #[error("user {user_id}'s owner {owner} could not be reached; subscribe again")]
    Unrelayed { user_id: u64, owner: String },
    /// `ReleaseSlots` for a slot this node owns in its newer epoch: the
    /// asking node is behind, and learns so.
    #[error("slot {slot} is {} on this node in epoch {epoch}: not released", .state.name())]
    NotReleased {
        slot: u16,
        epoch: u64,
        state: crate::ownership::SlotState,
    },
    /// `HandOver` that this node does not take now (another epoch, or a
    /// slot it is not acquiring from the sender): the sender writes the
    /// users itself.
    #[error("handoff refused in epoch {epoch}: {reason}")]
    HandoffRefused { epoch: u64, reason: String },
    /// A `HandOver` that broke off or did not add up: nothing of it is kept.
    #[error("handoff broken: {0}")]
    HandoffBroken(String),
    /// A channel switched to counting by channel from another message: a
    /// switch is made once.
    #[error(
        "channel {channel_id} is counted by channel from message {counted_from} already; a channel is switched once"
    )]
    SwitchedAlready { channel_id: u64, counted_from: u64 },
    /// A message of a channel counted by channel (as this node's copy of
    /// it says) reached a node of a fleet that does not own the channel as
    /// a part counted per member: the node that split it had not heard of
    /// the switch yet. Nothing was applied.
    #[error(
        "channel {channel_id} is counted by channel, by another node of the fleet; not applied, retry"
    )]
    ChannelNotOwned { channel_id: u64 },
    /// A switch to counting by channel was made and written by the
    /// channel's owner, but not every node of the fleet has it yet (until
    /// they have, a message without members could be taken for one counted
    /// per member). A retry answers once they have.
    #[error(
        "channel {channel_id} is switched, but not every node of the fleet has it yet ({reason}); retry"
    )]
    SwitchNotCopied { channel_id: u64, reason: String },
    /// Thread read states are off on this node (`--threads`).
    #[error(
        "thread read states are off on this node: turn on --threads once every node of the fleet runs a build that reads them"
    )]
    ThreadsOff,
    /// A user follows as many threads as one may.
    #[error("the user follows {limit} threads, the most one may; unfollow some first")]
    TooManyThreads { limit: usize },
    /// More requests are in progress than the server takes at once.
    #[error("more than {limit} requests in progress; retry later")]
    Overloaded { limit: usize },
}

impl Error {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            field: field.into(),
            reason: reason.into(),
        }
    }

    pub fn code(&self) -> Code {
        match self {
            Error::InvalidArgument { .. } | Error::BadStream(_) => Code::InvalidArgument,
            Error::NotSubscribed { .. } => Code::NotFound,
            Error::TooManySubscriptions { .. } | Error::TooManyThreads { .. } => {
                Code::ResourceExhausted
            }
            Error::LoadFailed { .. }
            | Error::WriteFailed { .. }
            | Error::ChannelWriteFailed { .. }
            | Error::TooManyUnwritten { .. }
            | Error::ShuttingDown
            | Error::JournalFailed { .. }
            | Error::NotServed { .. }
            | Error::LeaseLapsed
            | Error::Unrelayed { .. }
            | Error::ChannelNotOwned { .. }
            | Error::SwitchNotCopied { .. } => Code::Unavailable,
            Error::Overloaded { .. } => Code::ResourceExhausted,
            Error::DeadlineExceeded => Code::DeadlineExceeded,
            Error::NotReleased { .. }
            | Error::HandoffRefused { .. }
            | Error::SwitchedAlready { .. }
            | Error::ThreadsOff => Code::FailedPrecondition,
            Error::HandoffBroken(_) => Code::Aborted,
        }
    }
}

impl From<Error> for Status {
    fn from(error: Error) -> Status {
        Status::new(error.code(), error.to_string())
    }
}
