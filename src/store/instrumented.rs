//! A [`Store`] decorator that measures every call: count and latency by
//! operation and result, and the read states each successful write carried.
//! The cache and write-behind call the store without knowing it is measured.

use std::sync::Arc;

use async_trait::async_trait;
use tokio::time::Instant;

use super::{Store, StoreError, StoredUser, UserWrite};
use crate::channel_state::ChannelState;
use crate::metrics;

#[derive(Debug)]
pub struct Instrumented {
    inner: Arc<dyn Store>,
}

impl Instrumented {
    pub fn new(inner: Arc<dyn Store>) -> Instrumented {
        Instrumented { inner }
    }
}

#[async_trait]
impl Store for Instrumented {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn load(&self, user_id: u64) -> Result<StoredUser, StoreError> {
        let started = Instant::now();
        let result = self.inner.load(user_id).await;
        metrics::store_operation(self.name(), "load", started.elapsed(), result.is_ok());
        result
    }

    async fn write(&self, write: &UserWrite) -> Result<(), StoreError> {
        let started = Instant::now();
        let result = self.inner.write(write).await;
        metrics::store_operation(self.name(), "write", started.elapsed(), result.is_ok());
        if result.is_ok() {
            metrics::store_written(write.read_states.len());
        }
        result
    }

    async fn load_channels(&self) -> Result<Vec<ChannelState>, StoreError> {
        let started = Instant::now();
        let result = self.inner.load_channels().await;
        let ok = result.is_ok();
        metrics::store_operation(self.name(), "load_channels", started.elapsed(), ok);
        result
    }

    async fn write_channel(&self, channel: &ChannelState) -> Result<(), StoreError> {
        let started = Instant::now();
        let result = self.inner.write_channel(channel).await;
        let ok = result.is_ok();
        metrics::store_operation(self.name(), "write_channel", started.elapsed(), ok);
        result
    }
}
