//! Changes sent over `Apply` streams in batches, as a message pipeline's
//! consumer would ([`Applier`]: the stream's sender takes what is queued,
//! up to the batch size, as one batch, without waiting for more, so
//! batches fill under load and stay small when it is light). A change's
//! latency runs from its queueing to its result.

use std::sync::atomic::{AtomicUsize, Ordering};

use readstates::proto::apply_item::Change;
use readstates_routing::apply::Applier;
use tonic::metadata::MetadataMap;
use tonic::transport::Channel;

/// How the changes of a run are sent: `batch` items per batch at most,
/// over `streams` streams.
#[derive(Clone, Copy, Debug)]
pub struct StreamConfig {
    pub batch: usize,
    pub streams: usize,
}

#[derive(Debug)]
pub struct Streams {
    streams: Vec<Applier>,
    next: AtomicUsize,
}

impl Streams {
    /// Opens `config.streams` streams, over `channels` in turn.
    pub fn open(channels: &[Channel], config: StreamConfig) -> Streams {
        let streams = (0..config.streams.max(1))
            .map(|i| {
                let channel = channels[i % channels.len()].clone();
                Applier::open(channel, MetadataMap::new(), config.batch)
            })
            .collect();
        Streams {
            streams,
            next: AtomicUsize::new(0),
        }
    }

    /// Sends `change` on the next stream; its result's code name if not OK.
    pub async fn execute(&self, change: Change) -> Result<(), String> {
        let index = self.next.fetch_add(1, Ordering::Relaxed) % self.streams.len();
        self.streams[index]
            .apply(change, None)
            .await
            .map(|_| ())
            .map_err(|status| format!("{:?}", status.code()))
    }
}
