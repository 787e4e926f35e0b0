//! `SetMuted`: mutes or unmutes a read state. A call of its own rather than a
//! field on Ack: muting is a setting the user changes, not reading, and a
//! field on every ack would have to say "leave it as it is" most of the time.

use std::sync::Arc;

use super::{convert, validate};
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{SetMutedRequest, SetMutedResponse};
use crate::read_state::Key;

pub async fn handle(
    cache: Arc<Cache>,
    request: SetMutedRequest,
) -> Result<SetMutedResponse, Error> {
    let user_id = validate::id("user_id", request.user_id)?;
    let key = Key {
        channel_id: validate::id("channel_id", request.channel_id)?,
        kind: validate::kind("kind", request.kind)?,
    };
    let channels = cache.channels().clone();
    cache
        .update(user_id, |user, now_us| {
            channels.read(|channels| SetMutedResponse {
                applied: user.set_muted(key, request.muted, now_us, channels),
                version: user.version(),
                read_state: convert::shown(user.view(), key, channels),
            })
        })
        .await
}
