//! Watch streams held open during a run, as gateways hold them: `users`
//! users subscribed over `streams` streams, every event read and counted.
//! The users are 1..=users, the most drawn under a Zipf key distribution,
//! so the watched users are the ones changing most.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::Context;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::*;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use crate::target::grpc::connect;

#[derive(Debug)]
pub struct Watchers {
    events: Arc<AtomicU64>,
    resyncs: Arc<AtomicU64>,
    readers: Vec<JoinHandle<()>>,
    /// Dropped to end the streams.
    _requests: Vec<mpsc::Sender<WatchRequest>>,
}

impl Watchers {
    /// Opens `streams` Watch streams to `address` and subscribes `users`
    /// users among them, round robin; returns once every subscription's
    /// first event has arrived.
    pub async fn start(address: &str, users: u64, streams: usize) -> anyhow::Result<Watchers> {
        let events = Arc::new(AtomicU64::new(0));
        let resyncs = Arc::new(AtomicU64::new(0));
        let subscribed = Arc::new(tokio::sync::Semaphore::new(0));
        let (mut senders, mut readers) = (Vec::new(), Vec::new());
        for stream in 0..streams.max(1) as u64 {
            let channel = connect(address).await?;
            let (requests, receiver) = mpsc::channel(1024);
            let mut events_in = ReadStatesClient::new(channel)
                .watch(ReceiverStream::new(receiver))
                .await
                .context("Watch")?
                .into_inner();
            let (events, resyncs, subscribed) =
                (events.clone(), resyncs.clone(), subscribed.clone());
            readers.push(tokio::spawn(async move {
                let mut firsts = std::collections::HashSet::new();
                while let Ok(Some(event)) = events_in.message().await {
                    events.fetch_add(1, Ordering::Relaxed);
                    match event.event {
                        Some(watch_event::Event::Changed(_)) if firsts.insert(event.user_id) => {
                            subscribed.add_permits(1);
                        }
                        Some(watch_event::Event::Resync(_)) => {
                            resyncs.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                }
            }));
            let mine = (1..=users).filter(move |u| u % streams as u64 == stream);
            for user_id in mine {
                let subscribe = watch_request::Action::Subscribe(WatchSubscribe {
                    user_id,
                    since_version: 0,
                });
                requests
                    .send(WatchRequest {
                        action: Some(subscribe),
                    })
                    .await
                    .context("subscribe")?;
            }
            senders.push(requests);
        }
        let all = u32::try_from(users).context("users")?;
        let _ = subscribed
            .acquire_many(all)
            .await
            .context("subscriptions")?;
        events.store(0, Ordering::Relaxed);
        Ok(Watchers {
            events,
            resyncs,
            readers,
            _requests: senders,
        })
    }

    /// Events received since the subscriptions were made.
    pub fn events(&self) -> u64 {
        self.events.load(Ordering::Relaxed)
    }

    pub fn resyncs(&self) -> u64 {
        self.resyncs.load(Ordering::Relaxed)
    }
}

impl Drop for Watchers {
    fn drop(&mut self) {
        for reader in &self.readers {
            reader.abort();
        }
    }
}
