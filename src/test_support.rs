//! Request builders shared by every test binary (end-to-end, Cassandra,
//! simulation) and the load generator's tests: one home, so no test file
//! imports another's. Compiled only with the `test-support` feature.

use crate::proto::{AckRequest, DeleteReadStatesRequest, MessageCreatedRequest, ReadStateKey};

/// A normal ack of a channel read state.
pub fn ack(user_id: u64, channel_id: u64, message_id: u64) -> AckRequest {
    AckRequest {
        user_id,
        channel_id,
        message_id,
        ..AckRequest::default()
    }
}

/// A new message in a channel: `author_id` 0 for none.
pub fn message(
    channel_id: u64,
    message_id: u64,
    author_id: u64,
    mentioned: &[u64],
    unread: &[u64],
) -> MessageCreatedRequest {
    MessageCreatedRequest {
        channel_id,
        message_id,
        author_id,
        mentioned_user_ids: mentioned.to_vec(),
        unread_user_ids: unread.to_vec(),
        ..MessageCreatedRequest::default()
    }
}

/// Deletes channel read states of a user, or all of them with `all`.
pub fn delete(user_id: u64, channel_ids: &[u64], all: bool) -> DeleteReadStatesRequest {
    DeleteReadStatesRequest {
        user_id,
        keys: channel_ids
            .iter()
            .map(|&channel_id| ReadStateKey {
                channel_id,
                kind: 0,
            })
            .collect(),
        all,
    }
}
