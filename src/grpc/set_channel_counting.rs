//! `SetChannelCounting`: switches a channel to counting by channel, once
//! (see `docs/counting.md`). Every member keeps their counts: what was
//! counted per member stays in their read states, and messages past
//! `counted_from` are counted by the channel.
//!
//! A switch is answered only once the store holds it, whatever the write
//! delay: from then on the backend sends messages without members, which a
//! node that lost the switch (killed before writing it) would count for
//! nobody. On a fleet the channel's owner switches it (a request reaching
//! another node goes there, as one for a user does), and answers only once
//! every node of the ring also has a copy of it. A retry writes and sends
//! it again.

use std::sync::Arc;

use super::validate;
use crate::cache::Cache;
use crate::cluster::copier::Copier;
use crate::error::Error;
use crate::proto::{SetChannelCountingRequest, SetChannelCountingResponse};

pub async fn handle(
    cache: Arc<Cache>,
    copier: Option<Arc<Copier>>,
    request: SetChannelCountingRequest,
) -> Result<SetChannelCountingResponse, Error> {
    let channel_id = validate::id("channel_id", request.channel_id)?;
    let switched = cache.change_channel(channel_id, |channels, now_us| {
        channels.switch(channel_id, request.counted_from, now_us)
    })?;
    let applied = switched.map_err(|already| Error::SwitchedAlready {
        channel_id,
        counted_from: already.counted_from,
    })?;
    let channels = cache.channels();
    (channels.write_now(channel_id).await).map_err(|e| Error::ChannelWriteFailed {
        channel_id,
        reason: e.to_string(),
    })?;
    if let Some(copier) = copier {
        let copy: Vec<_> = channels.get(channel_id).into_iter().collect();
        (copier.send_to_all(&copy).await)
            .map_err(|reason| Error::SwitchNotCopied { channel_id, reason })?;
    }
    Ok(SetChannelCountingResponse { applied })
}
