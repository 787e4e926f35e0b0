//! `SetChannelCounting`: switches a channel to counting by channel, once
//! (see `docs/counting.md`). Every member keeps their counts: what was
//! counted per member stays in their read states, and messages past
//! `counted_from` are counted by the channel.

use std::sync::Arc;

use super::{by_channel, validate};
use crate::cache::Cache;
use crate::error::Error;
use crate::proto::{SetChannelCountingRequest, SetChannelCountingResponse};

pub async fn handle(
    cache: Arc<Cache>,
    request: SetChannelCountingRequest,
) -> Result<SetChannelCountingResponse, Error> {
    let channel_id = validate::id("channel_id", request.channel_id)?;
    let switched = cache.change_channels(|channels, now_us| {
        channels.switch(channel_id, request.counted_from, now_us)
    })?;
    match switched {
        Ok(applied) => {
            if applied {
                by_channel::write_through(cache.channels(), channel_id).await?;
            }
            Ok(SetChannelCountingResponse { applied })
        }
        Err(already) => Err(Error::SwitchedAlready {
            channel_id,
            counted_from: already.counted_from,
        }),
    }
}
