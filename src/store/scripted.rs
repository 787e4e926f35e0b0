//! A memory store that tests can script: count calls, fail loads or writes,
//! and hold writes at a gate, to drive the cache and write-behind through
//! their failure paths.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use async_trait::async_trait;
use tokio::sync::Semaphore;

use super::memory::MemoryStore;
use super::{Store, StoreError, StoredUser, UserWrite};

#[derive(Debug, Default)]
pub(crate) struct ScriptedStore {
    inner: MemoryStore,
    pub(crate) loads: AtomicUsize,
    pub(crate) fail_loads: AtomicBool,
    pub(crate) fail_writes: AtomicBool,
    /// Successful writes, in order.
    pub(crate) writes: Mutex<Vec<UserWrite>>,
    pub(crate) failed_writes: AtomicUsize,
    /// When set, each write waits for a permit (tests add them).
    pub(crate) gate: Option<Semaphore>,
}

impl ScriptedStore {
    pub(crate) fn gated() -> ScriptedStore {
        ScriptedStore {
            gate: Some(Semaphore::new(0)),
            ..ScriptedStore::default()
        }
    }

    pub(crate) fn writes(&self) -> Vec<UserWrite> {
        self.writes.lock().unwrap().clone()
    }

    pub(crate) fn set(flag: &AtomicBool, value: bool) {
        flag.store(value, Ordering::SeqCst);
    }
}

#[async_trait]
impl Store for ScriptedStore {
    fn name(&self) -> &'static str {
        "scripted"
    }

    async fn load(&self, user_id: u64) -> Result<StoredUser, StoreError> {
        self.loads.fetch_add(1, Ordering::SeqCst);
        // Let concurrent requests pile up behind the load.
        tokio::task::yield_now().await;
        if self.fail_loads.load(Ordering::SeqCst) {
            return Err(StoreError::new("scripted", "load refused"));
        }
        self.inner.load(user_id).await
    }

    async fn write(&self, write: &UserWrite) -> Result<(), StoreError> {
        if let Some(gate) = &self.gate {
            gate.acquire()
                .await
                .map_err(|e| StoreError::new("scripted", e))?
                .forget();
        }
        if self.fail_writes.load(Ordering::SeqCst) {
            self.failed_writes.fetch_add(1, Ordering::SeqCst);
            return Err(StoreError::new("scripted", "write refused"));
        }
        self.inner.write(write).await?;
        self.writes.lock().unwrap().push(write.clone());
        Ok(())
    }
}
