//! `DeleteReadStates`: a user left a channel, a channel was deleted, or the
//! user is gone.

use std::sync::Arc;

use super::validate;
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{DeleteReadStatesRequest, DeleteReadStatesResponse};

pub async fn handle(
    cache: Arc<Cache>,
    request: DeleteReadStatesRequest,
) -> Result<DeleteReadStatesResponse, Error> {
    let user_id = validate::id("user_id", request.user_id)?;
    if request.all && !request.keys.is_empty() {
        return Err(Error::invalid("keys", "must be empty when `all` is set"));
    }
    if !request.all && request.keys.is_empty() {
        return Err(Error::invalid(
            "keys",
            "empty: name the read states to delete, or set `all` to delete every one",
        ));
    }
    validate::at_most("keys", request.keys.len(), validate::MAX_DELETE_KEYS)?;
    let keys = request
        .keys
        .iter()
        .enumerate()
        .map(|(i, key)| validate::key(format_args!("keys[{i}]"), key.channel_id, key.kind))
        .collect::<Result<Vec<_>, Error>>()?;
    cache
        .update(user_id, |user, now_us| {
            let deleted = if request.all {
                user.delete_all(now_us)
            } else {
                user.delete(&keys, now_us)
            };
            DeleteReadStatesResponse {
                version: user.version(),
                deleted,
            }
        })
        .await
}
