//! `Ack`: a user read a channel up to a message, or marked it unread.

use std::sync::Arc;

use super::{convert, validate};
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{AckRequest, AckResponse};
use crate::read_state::Channels;
use crate::read_state::{Key, saturated_count};

pub async fn handle(cache: Arc<Cache>, request: AckRequest) -> Result<AckResponse, Error> {
    let user_id = validate::id("user_id", request.user_id)?;
    let key = Key {
        channel_id: validate::id("channel_id", request.channel_id)?,
        kind: validate::kind("kind", request.kind)?,
    };
    if !request.manual {
        validate::id("message_id", request.message_id)?;
    }
    let channels = cache.channels().clone();
    cache
        .update(user_id, |user, now_us| {
            channels.read(|channels| {
                let applied = if request.manual {
                    // In a channel counted by channel, the read state keeps
                    // only what the channel does not count.
                    let unread = saturated_count(request.unread_count);
                    let unread = channels.get_key(key).map_or(unread, |channel| {
                        channel.per_member_part(request.message_id, unread)
                    });
                    let mentions = saturated_count(request.mention_count);
                    (user.manual_ack(key, request.message_id, mentions, unread, now_us)).is_some()
                } else {
                    user.ack(key, request.message_id, now_us).is_some()
                };
                AckResponse {
                    applied,
                    version: user.version(),
                    read_state: convert::shown(user.view(), key, channels),
                }
            })
        })
        .await
}
