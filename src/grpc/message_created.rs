//! `MessageCreated`: a new message raises the counts of the users it reaches
//! and marks the channel read for its author. A redelivery counts nothing:
//! each read state counts only messages past its watermark. In a channel
//! counted by channel, the channel takes the message once (its members'
//! unread counts are counted from it when read) and only the mentioned
//! users and the author are changed.

use std::collections::HashSet;
use std::sync::Arc;

use super::by_channel::{self, Counted};
use super::recipients::{Effect, recipients};
use super::scatter::{Scatter, keep};
use super::{reply, validate};
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{
    ChangeChannelRequest, ChannelTaken, MessageCreatedRequest, MessageCreatedResponse,
    ReadStateKind,
};
use crate::read_state::Channels;
use crate::read_state::{Key, Kind};

pub async fn handle(
    cache: Arc<Cache>,
    request: MessageCreatedRequest,
) -> Result<MessageCreatedResponse, Error> {
    let key = Key {
        channel_id: validate::id("channel_id", request.channel_id)?,
        kind: validate::kind("kind", request.kind)?,
    };
    let message_id = validate::id("message_id", request.message_id)?;
    let effects = recipients(
        request.author_id,
        &request.mentioned_user_ids,
        &request.unread_user_ids,
    )?;
    match key.kind {
        Kind::Thread => {
            return reply::handle(cache, &request, key.channel_id, message_id, &effects).await;
        }
        _ if request.parent_id != 0 => {
            return Err(Error::invalid(
                "parent_id",
                "only a reply (kind THREAD) names a parent channel",
            ));
        }
        _ => {}
    }
    let user_ids: Vec<u64> = effects.iter().map(|&(id, _)| id).collect();
    let channels = cache.channels().clone();
    let counted = Counted::new(
        &cache,
        key,
        message_id,
        &request.unread_user_ids,
        request.channel_taken,
    )?;
    let (took, changed) = cache
        .update_many_after(
            &user_ids,
            |now_us| {
                Ok(counted.decide()?
                    && channels
                        .update(key.channel_id, |c| c.message_created(message_id, now_us))
                        .unwrap_or(false))
            },
            |index, user, now_us| {
                channels.read(|channels| match (effects[index].1, channels.get_key(key)) {
                    (Effect::Author, _) => user.ack(key, message_id, now_us).is_some(),
                    (Effect::Mention, channel) if counted.by_channel() => {
                        user.mentioned(key, message_id, now_us, counted.holds(channel))
                    }
                    (effect, _) => {
                        let mentioned = effect == Effect::Mention;
                        user.message_created(key, message_id, mentioned, now_us, channels)
                    }
                })
            },
        )
        .await?;
    if counted.by_channel() {
        by_channel::write_through(&channels, key.channel_id).await?;
    }
    let users = changed.into_iter().filter(|&c| c).count() as u32;
    Ok(MessageCreatedResponse {
        updated: users + u32::from(took),
    })
}

impl Scatter for MessageCreatedRequest {
    fn users(&self) -> Result<Vec<u64>, Error> {
        let effects = recipients(
            self.author_id,
            &self.mentioned_user_ids,
            &self.unread_user_ids,
        )?;
        Ok(effects.into_iter().map(|(id, _)| id).collect())
    }

    fn part(&self, users: &HashSet<u64>) -> Self {
        MessageCreatedRequest {
            author_id: if users.contains(&self.author_id) {
                self.author_id
            } else {
                0
            },
            mentioned_user_ids: keep(&self.mentioned_user_ids, users),
            unread_user_ids: keep(&self.unread_user_ids, users),
            ..self.clone()
        }
    }

    fn merge(&self, parts: Vec<MessageCreatedResponse>) -> MessageCreatedResponse {
        MessageCreatedResponse {
            updated: parts.iter().map(|p| p.updated).sum(),
        }
    }

    fn channel_change(&self) -> Option<ChangeChannelRequest> {
        let by_channel = self.kind == ReadStateKind::Channel as i32
            && self.channel_taken.is_none()
            && self.unread_user_ids.is_empty();
        by_channel.then_some(ChangeChannelRequest {
            channel_id: self.channel_id,
            message_id: self.message_id,
            deleted: false,
        })
    }

    fn channel_taken(&self) -> Option<ChannelTaken> {
        self.channel_taken
    }

    fn taken(self, taken: ChannelTaken) -> Self {
        MessageCreatedRequest {
            channel_taken: Some(taken),
            ..self
        }
    }

    fn with_channel_change(merged: MessageCreatedResponse) -> MessageCreatedResponse {
        MessageCreatedResponse {
            updated: merged.updated + 1,
        }
    }
}
