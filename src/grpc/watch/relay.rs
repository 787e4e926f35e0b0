//! Watch subscriptions of users that other nodes of the fleet serve: each
//! goes up one Watch stream per owner (opened on first use, marked
//! forwarded), and the owner's events come back down this stream as they
//! were sent. When an upstream stream ends (its node stopped, or moved the
//! user), its users get a `moved` event, and the client subscribes again
//! from its last version, through this node, to the owner of the moment.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;

use crate::error::Error;
use crate::grpc::route::{FORWARDED, Router};
use crate::proto::read_states_client::ReadStatesClient;
use crate::proto::{WatchRequest, WatchSubscribe, WatchUnsubscribe, watch_event, watch_request};
use crate::watch::{Feed, Offer};

/// Requests queued for one upstream stream before subscribes wait.
const UPSTREAM_QUEUE: usize = 1_024;

/// One downstream stream's relayed subscriptions.
#[derive(Debug)]
pub struct Relays {
    router: Router,
    feed: Arc<Feed>,
    /// By owner id.
    upstreams: HashMap<String, Upstream>,
    /// Each relayed user: its owner and the last version sent down. Shared
    /// with the upstream readers, which drop a user whose subscription ends.
    users: Arc<Mutex<HashMap<u64, Relayed>>>,
}

#[derive(Debug)]
struct Relayed {
    owner: String,
    version: u64,
}

#[derive(Debug)]
struct Upstream {
    requests: mpsc::Sender<WatchRequest>,
    reader: JoinHandle<()>,
}

impl Relays {
    pub fn new(router: Router, feed: Arc<Feed>) -> Relays {
        Relays {
            router,
            feed,
            upstreams: HashMap::new(),
            users: Arc::default(),
        }
    }

    pub fn router(&self) -> &Router {
        &self.router
    }

    /// Users relayed on this stream.
    pub fn count(&self) -> usize {
        self.lock().len()
    }

    /// Whether `user_id` is relayed on this stream.
    pub fn relays(&self, user_id: u64) -> bool {
        self.lock().contains_key(&user_id)
    }

    /// Subscribes `user_id` at its owner, `owner`.
    pub async fn subscribe(&mut self, user_id: u64, owner: &str, since: u64) -> Result<(), Error> {
        let request = WatchRequest {
            action: Some(watch_request::Action::Subscribe(WatchSubscribe {
                user_id,
                since_version: since,
            })),
        };
        self.lock().insert(
            user_id,
            Relayed {
                owner: owner.to_owned(),
                version: since,
            },
        );
        // A closed upstream (its stream ended) is opened again, once.
        for _ in 0..2 {
            let requests = self.upstream(owner).await?;
            if requests.send(request).await.is_ok() {
                return Ok(());
            }
            self.upstreams.remove(owner);
        }
        self.lock().remove(&user_id);
        Err(Error::Unrelayed {
            user_id,
            owner: owner.to_owned(),
        })
    }

    /// Unsubscribes a relayed user; false if it is not relayed here.
    pub async fn unsubscribe(&mut self, user_id: u64) -> bool {
        let Some(relayed) = self.lock().remove(&user_id) else {
            return false;
        };
        if let Some(upstream) = self.upstreams.get(&relayed.owner) {
            let request = WatchRequest {
                action: Some(watch_request::Action::Unsubscribe(WatchUnsubscribe {
                    user_id,
                })),
            };
            // A closed upstream holds no subscription to end.
            let _ = upstream.requests.send(request).await;
        }
        true
    }

    /// The stream to `owner`, opened if needed.
    async fn upstream(&mut self, owner: &str) -> Result<mpsc::Sender<WatchRequest>, Error> {
        if let Some(upstream) = self.upstreams.get(owner)
            && !upstream.requests.is_closed()
        {
            return Ok(upstream.requests.clone());
        }
        let unrelayed = || Error::Unrelayed {
            user_id: 0,
            owner: owner.to_owned(),
        };
        let record = self.router.member.ring();
        let node = record
            .ring
            .node(owner)
            .or_else(|| record.previous.node(owner));
        let node = node.ok_or_else(unrelayed)?;
        let channel = self
            .router
            .peers
            .channel(&node.address)
            .map_err(|_| unrelayed())?;
        let (requests, receiver) = mpsc::channel(UPSTREAM_QUEUE);
        let mut request = self.router.peers.request(ReceiverStream::new(receiver));
        if let Ok(value) = MetadataValue::try_from(self.router.member.id()) {
            request.metadata_mut().insert(FORWARDED, value);
        }
        let events = ReadStatesClient::new(channel)
            .watch(request)
            .await
            .map_err(|_| unrelayed())?
            .into_inner();
        let reader = tokio::spawn(read_upstream(
            owner.to_owned(),
            events,
            requests.clone(),
            self.feed.clone(),
            self.users.clone(),
        ));
        if let Some(old) = self.upstreams.insert(
            owner.to_owned(),
            Upstream {
                requests: requests.clone(),
                reader,
            },
        ) {
            old.reader.abort();
        }
        Ok(requests)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Relayed>> {
        self.users.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Drop for Relays {
    /// The client went away: the upstream streams go too.
    fn drop(&mut self) {
        for upstream in self.upstreams.values() {
            upstream.reader.abort();
        }
    }
}

/// Sends one upstream stream's events down `feed` until it ends; then its
/// users move (see the module doc).
async fn read_upstream(
    owner: String,
    mut events: tonic::Streaming<crate::proto::WatchEvent>,
    requests: mpsc::Sender<WatchRequest>,
    feed: Arc<Feed>,
    users: Arc<Mutex<HashMap<u64, Relayed>>>,
) {
    let lock = || users.lock().unwrap_or_else(|e| e.into_inner());
    while let Ok(Some(event)) = events.message().await {
        let user_id = event.user_id;
        // Unsubscribed meanwhile: nothing more to send.
        let Some(previous) = lock().get(&user_id).map(|r| r.version) else {
            continue;
        };
        let (Some(watch_event::Event::Changed(changed))
        | Some(watch_event::Event::Recounted(changed))) = &event.event
        else {
            // Moved, resync or rejected: the subscription ended there, and
            // ends here too.
            lock().remove(&user_id);
            feed.relay(event);
            continue;
        };
        let version = changed.version;
        if feed.relay(event) == Offer::Full {
            lock().remove(&user_id);
            let unsubscribe = WatchRequest {
                action: Some(watch_request::Action::Unsubscribe(WatchUnsubscribe {
                    user_id,
                })),
            };
            let _ = requests.send(unsubscribe).await;
            feed.resync(user_id, previous);
        } else if let Some(relayed) = lock().get_mut(&user_id) {
            relayed.version = version;
        }
    }
    let moved: Vec<(u64, u64)> = lock()
        .iter()
        .filter(|(_, r)| r.owner == owner)
        .map(|(&id, r)| (id, r.version))
        .collect();
    for (user_id, version) in moved {
        lock().remove(&user_id);
        feed.moved(user_id, version);
    }
}
