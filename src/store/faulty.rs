//! A [`Store`] decorator that fails, delays or hangs calls on command, for
//! unit, property and end-to-end tests of what the cache and write-behind do
//! when the store misbehaves. It also counts calls and logs the writes that
//! reached the store. Nothing of the service knows it is there.
//!
//! A [`Fault`] names the operation it hits, optionally one user, what it
//! does, and for how many calls or how long it lasts; faults are tried in the
//! order they were injected and the first that matches a call decides it.
//! [`Effect::Hang`] holds calls until the fault is cleared.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::watch;
use tokio::time::Instant;

use super::memory::MemoryStore;
use super::{Store, StoreError, StoredUser, UserWrite};
use crate::channel_state::ChannelState;

/// Which calls a fault hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Operation {
    Load,
    Write,
}

/// What a fault does to a call it hits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Effect {
    /// The call fails without reaching the store.
    Fail,
    /// The call waits this long, then goes through.
    Delay(Duration),
    /// The call waits until the fault is cleared, then is decided again.
    Hang,
}

#[derive(Clone, Debug)]
pub struct Fault {
    operation: Operation,
    user_id: Option<u64>,
    effect: Effect,
    /// Calls it still hits; `None`: no limit.
    remaining: Option<usize>,
    /// It stops hitting at this instant; `None`: never.
    until: Option<Instant>,
    /// A Fail hits a call with this chance (the store's seeded generator).
    chance: f64,
}

impl Fault {
    pub fn new(operation: Operation, effect: Effect) -> Fault {
        Fault {
            operation,
            user_id: None,
            effect,
            remaining: None,
            until: None,
            chance: 1.0,
        }
    }

    /// Only calls for this user.
    pub fn user(mut self, user_id: u64) -> Fault {
        self.user_id = Some(user_id);
        self
    }

    /// Only the next `calls` matching calls.
    pub fn times(mut self, calls: usize) -> Fault {
        self.remaining = Some(calls);
        self
    }

    /// Only for `duration` from now.
    pub fn lasting(mut self, duration: Duration) -> Fault {
        self.until = Some(Instant::now() + duration);
        self
    }

    /// Each matching call is hit with this chance (0 to 1).
    pub fn chance(mut self, chance: f64) -> Fault {
        self.chance = chance;
        self
    }

    fn matches(&self, operation: Operation, user_id: u64, now: Instant) -> bool {
        self.operation == operation
            && self.user_id.is_none_or(|u| u == user_id)
            && self.remaining != Some(0)
            && self.until.is_none_or(|until| now < until)
    }
}

#[derive(Debug)]
struct Faults {
    faults: Vec<Fault>,
    random: fastrand::Rng,
}

#[derive(Debug)]
pub struct FaultyStore {
    inner: Arc<dyn Store>,
    faults: Mutex<Faults>,
    /// Bumped whenever faults are cleared, so hung calls look again.
    cleared: watch::Sender<u64>,
    loads: AtomicUsize,
    failed_writes: AtomicUsize,
    writes_under_way: AtomicUsize,
    most_writes_under_way: AtomicUsize,
    /// Writes the inner store took, in order.
    written: Mutex<Vec<UserWrite>>,
    /// Channel states the inner store took, in order.
    written_channels: Mutex<Vec<ChannelState>>,
}

impl FaultyStore {
    /// Wraps `inner`; `seed` drives the chance of [`Fault::chance`].
    pub fn new(inner: Arc<dyn Store>, seed: u64) -> FaultyStore {
        FaultyStore {
            inner,
            faults: Mutex::new(Faults {
                faults: Vec::new(),
                random: fastrand::Rng::with_seed(seed),
            }),
            cleared: watch::Sender::new(0),
            loads: AtomicUsize::new(0),
            failed_writes: AtomicUsize::new(0),
            writes_under_way: AtomicUsize::new(0),
            most_writes_under_way: AtomicUsize::new(0),
            written: Mutex::new(Vec::new()),
            written_channels: Mutex::new(Vec::new()),
        }
    }

    /// A fault-free [`MemoryStore`] behind it.
    pub fn memory() -> FaultyStore {
        FaultyStore::new(Arc::new(MemoryStore::new()), 0)
    }

    pub fn inject(&self, fault: Fault) {
        self.lock().faults.push(fault);
    }

    /// Every fault gone; hung calls are decided again.
    pub fn clear(&self) {
        self.lock().faults.clear();
        self.cleared.send_modify(|generation| *generation += 1);
    }

    /// Every load and write fails until [`FaultyStore::clear`].
    pub fn fail_all(&self) {
        self.inject(Fault::new(Operation::Load, Effect::Fail));
        self.inject(Fault::new(Operation::Write, Effect::Fail));
    }

    /// Loads called so far (failed ones too).
    pub fn loads(&self) -> usize {
        self.loads.load(Ordering::SeqCst)
    }

    pub fn failed_writes(&self) -> usize {
        self.failed_writes.load(Ordering::SeqCst)
    }

    /// The most writes that were under way at once.
    pub fn most_writes_under_way(&self) -> usize {
        self.most_writes_under_way.load(Ordering::SeqCst)
    }

    /// Channel writes the inner store took, in order.
    pub fn channel_writes(&self) -> Vec<ChannelState> {
        let written = self.written_channels.lock();
        written.unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Writes the inner store took, in order.
    pub fn writes(&self) -> Vec<UserWrite> {
        self.written
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn lock(&self) -> MutexGuard<'_, Faults> {
        self.faults.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Applies the faults to one call: `Err` if it must fail.
    async fn decide(&self, operation: Operation, user_id: u64) -> Result<(), StoreError> {
        loop {
            let mut cleared = self.cleared.subscribe();
            let effect = {
                let mut state = self.lock();
                let Faults { faults, random } = &mut *state;
                let now = Instant::now();
                let hit = faults.iter_mut().find(|f| {
                    f.matches(operation, user_id, now)
                        && (f.chance >= 1.0 || random.f64() < f.chance)
                });
                hit.map(|fault| {
                    if let Some(remaining) = &mut fault.remaining {
                        *remaining -= 1;
                    }
                    fault.effect
                })
            };
            match effect {
                None => return Ok(()),
                Some(Effect::Fail) => {
                    return Err(StoreError::new("faulty", format!("{operation:?} refused")));
                }
                Some(Effect::Delay(delay)) => {
                    tokio::time::sleep(delay).await;
                    return Ok(());
                }
                Some(Effect::Hang) => {
                    // An error means the store is gone; the caller is too.
                    let _ = cleared.changed().await;
                }
            }
        }
    }
}

#[async_trait]
impl Store for FaultyStore {
    fn name(&self) -> &'static str {
        self.inner.name()
    }

    async fn load(&self, user_id: u64) -> Result<StoredUser, StoreError> {
        self.loads.fetch_add(1, Ordering::SeqCst);
        // Let concurrent requests pile up behind the load.
        tokio::task::yield_now().await;
        self.decide(Operation::Load, user_id).await?;
        self.inner.load(user_id).await
    }

    async fn write(&self, write: &UserWrite) -> Result<(), StoreError> {
        let under_way = self.writes_under_way.fetch_add(1, Ordering::SeqCst) + 1;
        self.most_writes_under_way
            .fetch_max(under_way, Ordering::SeqCst);
        let result = async {
            self.decide(Operation::Write, write.user_id).await?;
            self.inner.write(write).await
        }
        .await;
        self.writes_under_way.fetch_sub(1, Ordering::SeqCst);
        match &result {
            Ok(()) => self
                .written
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(write.clone()),
            Err(_) => {
                self.failed_writes.fetch_add(1, Ordering::SeqCst);
            }
        }
        result
    }

    /// Channels share the plan of users, keyed by channel id.
    async fn load_channels(&self) -> Result<Vec<ChannelState>, StoreError> {
        self.decide(Operation::Load, 0).await?;
        self.inner.load_channels().await
    }

    async fn write_channel(&self, channel: &ChannelState) -> Result<(), StoreError> {
        let result = async {
            self.decide(Operation::Write, channel.channel_id()).await?;
            self.inner.write_channel(channel).await
        }
        .await;
        match &result {
            Ok(()) => {
                let written = self.written_channels.lock();
                written
                    .unwrap_or_else(|p| p.into_inner())
                    .push(channel.clone());
            }
            Err(_) => {
                self.failed_writes.fetch_add(1, Ordering::SeqCst);
            }
        }
        result
    }
}

/// A store whose first load of `user` reads, then waits to be let go: what
/// it returns is what the store held when the load began (a load racing a
/// write that lands meanwhile).
#[derive(Debug)]
pub struct SlowFirstLoad {
    inner: Arc<dyn Store>,
    user: u64,
    first: tokio::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
}

impl SlowFirstLoad {
    /// The store over `inner`, and what lets its first load of `user` go.
    pub fn of(
        inner: Arc<dyn Store>,
        user: u64,
    ) -> (Arc<SlowFirstLoad>, tokio::sync::oneshot::Sender<()>) {
        let (go, wait) = tokio::sync::oneshot::channel();
        let store = SlowFirstLoad {
            inner,
            user,
            first: tokio::sync::Mutex::new(Some(wait)),
        };
        (Arc::new(store), go)
    }
}

#[async_trait]
impl Store for SlowFirstLoad {
    fn name(&self) -> &'static str {
        "slow first load"
    }

    async fn load(&self, user_id: u64) -> Result<StoredUser, StoreError> {
        let read = self.inner.load(user_id).await;
        if user_id != self.user {
            return read;
        }
        let wait = self.first.lock().await.take();
        if let Some(wait) = wait {
            let _ = wait.await;
        }
        read
    }

    async fn write(&self, write: &UserWrite) -> Result<(), StoreError> {
        self.inner.write(write).await
    }

    async fn load_channels(&self) -> Result<Vec<ChannelState>, StoreError> {
        self.inner.load_channels().await
    }

    async fn write_channel(&self, channel: &ChannelState) -> Result<(), StoreError> {
        self.inner.write_channel(channel).await
    }
}
