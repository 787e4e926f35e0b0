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
    /// Too many changes wait for the store; memory must not grow further.
    #[error("{dirty} read states are waiting to be written (limit {limit}); retry later")]
    TooManyUnwritten { dirty: usize, limit: usize },
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
            Error::InvalidArgument { .. } => Code::InvalidArgument,
            Error::LoadFailed { .. } | Error::TooManyUnwritten { .. } => Code::Unavailable,
            Error::Overloaded { .. } => Code::ResourceExhausted,
        }
    }
}

impl From<Error> for Status {
    fn from(error: Error) -> Status {
        Status::new(error.code(), error.to_string())
    }
}
