//! `Watch`: a live change stream. The client subscribes and unsubscribes
//! users on the request stream; each subscription first gets what changed
//! since the client's version, then every change, from the cache shard that
//! holds the user (see [`crate::watch`]).
//!
//! On a node of a fleet, a user served by another node is subscribed there
//! and its events relayed (see [`relay`]); a user whose slot moves away gets
//! a `moved` event, and the client subscribes again from its last version.
//!
//! A refused subscribe or unsubscribe is answered with a `rejected` event
//! for that user and the stream goes on: one bad request must not cost a
//! gateway the thousands of other subscriptions on its stream. A request
//! stream that cannot be decoded ends the stream with its status; shutdown
//! ends it with `UNAVAILABLE`, after the events already queued.

use std::pin::Pin;
use std::sync::Arc;

use futures::{Stream, StreamExt};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::{Status, Streaming};

mod relay;

use super::route::Router;
use super::validate;
use crate::cache::Cache;
use crate::error::Error;
use crate::ownership::SlotState;
use crate::proto::{
    ReadStatesChanged, WatchEvent, WatchMoved, WatchRejected, WatchRequest, WatchResync,
    watch_event, watch_request,
};
use crate::watch::{Event, Feed};

pub type WatchStream = Pin<Box<dyn Stream<Item = Result<WatchEvent, Status>> + Send>>;

/// Starts serving one stream: a task reads its requests, and the returned
/// stream sends its feed.
/// With `router` (a fleet node, on a stream not itself relayed from another
/// node), users served elsewhere are relayed.
pub fn handle(
    cache: Arc<Cache>,
    requests: Streaming<WatchRequest>,
    buffer: usize,
    stopping: CancellationToken,
    router: Option<Router>,
) -> WatchStream {
    let feed = Feed::new(buffer);
    let relays = router.map(|router| relay::Relays::new(router, feed.clone()));
    tokio::spawn(serve_requests(
        cache,
        requests,
        feed.clone(),
        stopping,
        relays,
    ));
    let events = futures::stream::unfold(Sender(feed), |sender| async move {
        match sender.0.next().await {
            Ok(event) => Some((Ok(to_proto(event)), sender)),
            // The feed is drained and closed: the next poll ends the stream.
            Err(Some(error)) => Some((Err(Status::from(error)), sender)),
            Err(None) => None,
        }
    });
    Box::pin(events)
}

/// The sending half; the client going away drops it, which closes the feed.
struct Sender(Arc<Feed>);

impl Drop for Sender {
    fn drop(&mut self) {
        self.0.close(None);
    }
}

/// Requests read ahead of the one being applied. HTTP/2 keeps only a few
/// thousand small DATA frames that the application has not read before it
/// closes the whole connection (h2's flood budget), so requests are read as
/// they arrive and wait here instead: enough for a gateway that subscribes
/// as many users as a stream takes, all at once. A client further ahead
/// than this is not read until the stream catches up.
const READ_AHEAD: usize = validate::MAX_WATCHED_USERS_PER_STREAM + 1_024;

/// Subscribed users loaded at once, ahead of their subscribes.
const LOADS_AHEAD: usize = 64;

/// Applies the stream's requests until the stream ends, then unsubscribes
/// everything it subscribed. A task reads them as they arrive (see
/// [`READ_AHEAD`]); the users of the next subscribes are loaded
/// concurrently ([`LOADS_AHEAD`]), and each request is applied in order once
/// its events have room.
async fn serve_requests(
    cache: Arc<Cache>,
    requests: Streaming<WatchRequest>,
    feed: Arc<Feed>,
    stopping: CancellationToken,
    mut relays: Option<relay::Relays>,
) {
    let (read, pending) = mpsc::channel(READ_AHEAD);
    tokio::spawn(read_requests(requests, read));
    let mut pending = ReceiverStream::new(pending)
        .map(|request| load_ahead(&cache, request))
        .buffered(LOADS_AHEAD);
    let mut reading = true;
    loop {
        // One request: wait for room (a client that does not read its
        // events gets no more requests applied), then apply the next;
        // raced against shutdown and the stream's end, so neither waits
        // for it.
        let step = async {
            feed.room().await;
            match pending.next().await {
                Some(Ok(request)) => {
                    apply(&cache, &feed, relays.as_mut(), request).await;
                    Ok(true)
                }
                None => Ok(false),
                Some(Err(status)) => Err(*status),
            }
        };
        tokio::select! {
            biased;
            () = stopping.cancelled() => {
                feed.close(Some(Error::ShuttingDown));
                break;
            }
            () = feed.closed() => break,
            step = step, if reading => match step {
                Ok(true) => {}
                // Half-closed: keep sending until the client goes away.
                Ok(false) => reading = false,
                Err(status) => {
                    feed.close(Some(Error::BadStream(status.message().to_owned())));
                    break;
                }
            },
        }
    }
    // Dropping `pending` ends the reader.
    for user_id in feed.users() {
        cache.unsubscribe(user_id, &feed);
    }
}

/// A request read ahead, or why the request stream cannot be read (boxed:
/// a `Status` is several times a request's size, and the queue holds many).
type Read = Result<WatchRequest, Box<Status>>;

/// Reads requests as they arrive, until the stream ends (an undecodable one
/// is passed on, and ends it) or nobody takes them any more.
async fn read_requests(mut requests: Streaming<WatchRequest>, read: mpsc::Sender<Read>) {
    loop {
        let message = tokio::select! {
            () = read.closed() => return,
            message = requests.message() => message,
        };
        let request = match message {
            Ok(Some(request)) => Ok(request),
            Ok(None) => return,
            Err(status) => Err(Box::new(status)),
        };
        let ends = request.is_err();
        if read.send(request).await.is_err() || ends {
            return;
        }
    }
}

/// A request, once the user it subscribes is in the cache (or could not be
/// loaded, which its subscribe will say; user 0 is refused there).
async fn load_ahead(cache: &Arc<Cache>, request: Read) -> Read {
    if let Ok(WatchRequest {
        action: Some(watch_request::Action::Subscribe(subscribe)),
    }) = &request
        && subscribe.user_id != 0
    {
        let _ = cache.load(subscribe.user_id).await;
    }
    request
}

async fn apply(
    cache: &Arc<Cache>,
    feed: &Arc<Feed>,
    relays: Option<&mut relay::Relays>,
    request: WatchRequest,
) {
    let (user_id, result) = match request.action {
        Some(watch_request::Action::Subscribe(subscribe)) => {
            let user_id = subscribe.user_id;
            let since = subscribe.since_version;
            (
                user_id,
                subscribe_user(cache, feed, relays, user_id, since).await,
            )
        }
        Some(watch_request::Action::Unsubscribe(unsubscribe)) => {
            let user_id = unsubscribe.user_id;
            let relayed = match relays {
                Some(relays) => relays.unsubscribe(user_id).await,
                None => false,
            };
            // The shard first: once it lets go, no resync for the user can
            // be queued after the unsubscribe.
            let result = validate::id("unsubscribe.user_id", user_id).and_then(|user_id| {
                let subscribed = cache.unsubscribe(user_id, feed);
                feed.forget(user_id);
                if subscribed || relayed {
                    Ok(())
                } else {
                    Err(Error::NotSubscribed { user_id })
                }
            });
            (user_id, result)
        }
        None => (
            0,
            Err(Error::invalid("action", "must be subscribe or unsubscribe")),
        ),
    };
    if let Err(error) = result {
        feed.reject(user_id, error);
    }
}

async fn subscribe_user(
    cache: &Arc<Cache>,
    feed: &Arc<Feed>,
    relays: Option<&mut relay::Relays>,
    user_id: u64,
    since: u64,
) -> Result<(), Error> {
    let user_id = validate::id("subscribe.user_id", user_id)?;
    // Only a user the stream does not watch yet adds to it.
    let watched = feed.watches(user_id) || relays.as_ref().is_some_and(|r| r.relays(user_id));
    let relayed = relays.as_ref().map_or(0, |r| r.count());
    if !watched && feed.subscribed() + relayed >= validate::MAX_WATCHED_USERS_PER_STREAM {
        return Err(Error::TooManySubscriptions {
            limit: validate::MAX_WATCHED_USERS_PER_STREAM,
        });
    }
    let Some(relays) = relays else {
        return cache.subscribe(user_id, feed, since).await;
    };
    // Subscribing again starts over, wherever the user is now.
    relays.unsubscribe(user_id).await;
    let router = relays.router().clone();
    match cache.subscribe(user_id, feed, since).await {
        // Served elsewhere (by the previous owner, while this node acquires
        // the slot): relayed from there.
        Err(Error::NotServed { user_id, state }) => match router.destination(user_id) {
            Some(node) => relays.subscribe(user_id, &node, since).await,
            None if state == SlotState::Acquiring && router.hold(user_id, None).await => {
                cache.subscribe(user_id, feed, since).await
            }
            None => Err(Error::NotServed { user_id, state }),
        },
        result => result,
    }
}

fn to_proto(event: Event) -> WatchEvent {
    match event {
        Event::Changed(change) => {
            let changed = ReadStatesChanged {
                version: change.version,
                partial: change.partial,
                read_states: change.read_states.iter().map(Into::into).collect(),
                deleted: change.deleted.iter().map(|&k| k.into()).collect(),
                total_mention_count: change.counts.total_mention_count,
                unread_channel_count: change.counts.unread_channel_count,
                unread_thread_count: change.counts.unread_thread_count,
                mentioned_thread_count: change.counts.mentioned_thread_count,
            };
            WatchEvent {
                user_id: change.user_id,
                event: Some(match change.recounted {
                    true => watch_event::Event::Recounted(changed),
                    false => watch_event::Event::Changed(changed),
                }),
            }
        }
        Event::Resync { user_id, version } => WatchEvent {
            user_id,
            event: Some(watch_event::Event::Resync(WatchResync { version })),
        },
        Event::Moved { user_id, version } => WatchEvent {
            user_id,
            event: Some(watch_event::Event::Moved(WatchMoved { version })),
        },
        Event::Relayed(event) => *event,
        Event::Rejected { user_id, error } => WatchEvent {
            user_id,
            event: Some(watch_event::Event::Rejected(WatchRejected {
                code: error.code() as i32,
                message: error.to_string(),
            })),
        },
    }
}
