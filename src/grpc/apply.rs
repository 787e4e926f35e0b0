//! `Apply`: changes in batches on one long-lived stream. Each item is the
//! unary call of its kind, run by the same handler through the same
//! routing, so it means exactly what the call means; the stream saves the
//! per-call transport, which is most of what a small change costs.
//!
//! A task per stream reads batches a few ahead ([`READ_AHEAD`]) and starts
//! their items in order ([`Items`]). An item done at once (a cached user)
//! is answered in the response of its batch; one that has to wait (a load,
//! an owner elsewhere) waits without holding up the stream, and is
//! answered in a later response when it is done. An item touching a user
//! (or a channel's messages) of an item under way is held until that one
//! is done, so each user's changes, and each channel's messages, apply in
//! the order sent. Items begin only while those under way touch fewer than
//! [`MAX_USERS`] users and fewer than [`MAX_ANSWERED_BYTES`] of answers wait
//! to be sent (the rest of a batch of heavy items waits, held); at most
//! [`MAX_ITEMS`] items are read and not sent per stream, and once all
//! streams together hold [`memory::NODE_BYTES`] (batches read ahead, at
//! what they take decoded, and answers until the transport takes them) no
//! stream reads more: the client is slowed by flow control. A batch is at
//! most [`MAX_BATCH_BYTES`] encoded, and one of more than 1,000 items (or
//! not well formed) is refused whole before it is decoded, ending the
//! stream (`readstates_routing::codec`). So the node's Apply streams hold
//! about [`memory::NODE_BYTES`], and past it at most one batch each being
//! decoded. Shutdown answers the items
//! begun once they are done, refuses the rest with UNAVAILABLE, and ends
//! the stream with UNAVAILABLE marked [`ALL_ANSWERED`]: an item read and
//! not answered was not applied.

use std::collections::{HashMap, VecDeque};
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

use futures::stream::FuturesUnordered;
use futures::{Stream, StreamExt, TryFutureExt, future};
use prost::Message;
use tokio::sync::{OwnedSemaphorePermit, mpsc};
use tokio::time::{Duration, Instant};
use tokio_stream::wrappers::ReceiverStream;
use tonic::metadata::MetadataValue;
use tonic::{Status, Streaming};

use super::route::{ALL_ANSWERED, EPOCH, Hop, OWNER, SAFE_TO_RETRY};
use super::validate::{self, MAX_APPLY_ITEMS};
use super::{
    Origin, ReadStatesService, ack, ack_all, bulk_ack, delete_read_states, get_badge_counts,
    message_created, message_deleted, set_muted,
};
use crate::cache::Cache;
use crate::error::Error;
use crate::metrics::MethodMetrics;
use crate::proto::apply_item::Change;
use crate::proto::apply_result::Outcome;
use crate::proto::{ApplyError, ApplyItem, ApplyRequest, ApplyResponse, ApplyResult};

pub type ApplyStream = Pin<Box<dyn Stream<Item = Result<ApplyResponse, Status>> + Send>>;

mod memory;

pub use memory::Memory;

/// Batches read ahead of the items being started: the client's next
/// batches are on hand when the items before are under way.
const READ_AHEAD: usize = 4;

/// The largest message the gRPC port decodes, an Apply batch included
/// (tonic's default, set here on purpose): a unary MessageCreated of
/// 10,000 users is about 90 KB.
pub const MAX_BATCH_BYTES: usize = 4 << 20;

/// Users (one for an item that names none) the items under way or unsent
/// of one stream may touch: an item's answer grows with its users (a
/// GetBadgeCounts of 1,000 users answers about 20 KB).
const MAX_USERS: usize = 100_000;

/// Answers, encoded, one stream holds unsent before it stops reading.
const MAX_ANSWERED_BYTES: usize = 4 << 20;

/// Responses the client has not read yet before the stream stops sending.
const UNREAD_RESPONSES: usize = 4;

/// Items under way, held or answered and not sent, per stream, past which
/// it reads no further batch.
const MAX_ITEMS: usize = 4 * MAX_APPLY_ITEMS;

/// The most a response carries (encoded), well within what a gRPC client
/// decodes by default (4 MiB): answers of 1,000 badge counts of 1,000
/// users each would be ten times that.
const MAX_RESPONSE_BYTES: usize = 1 << 20;

/// Each item kind's metrics (method `Apply.<Kind>`), apart from the unary
/// calls'.
#[derive(Debug)]
pub struct ItemMetrics {
    ack: MethodMetrics,
    bulk_ack: MethodMetrics,
    message_created: MethodMetrics,
    message_deleted: MethodMetrics,
    ack_all: MethodMetrics,
    set_muted: MethodMetrics,
    delete_read_states: MethodMetrics,
    get_badge_counts: MethodMetrics,
}

impl ItemMetrics {
    pub fn new(node: &str) -> ItemMetrics {
        ItemMetrics {
            ack: MethodMetrics::new("Apply.Ack", node),
            bulk_ack: MethodMetrics::new("Apply.BulkAck", node),
            message_created: MethodMetrics::new("Apply.MessageCreated", node),
            message_deleted: MethodMetrics::new("Apply.MessageDeleted", node),
            ack_all: MethodMetrics::new("Apply.AckAll", node),
            set_muted: MethodMetrics::new("Apply.SetMuted", node),
            delete_read_states: MethodMetrics::new("Apply.DeleteReadStates", node),
            get_badge_counts: MethodMetrics::new("Apply.GetBadgeCounts", node),
        }
    }
}

/// Starts serving one stream, which came `hop`; `permit` is its place
/// among the node's Apply streams (none for another node's), held until
/// it ends.
pub fn handle(
    service: ReadStatesService,
    requests: Streaming<ApplyRequest>,
    hop: Hop,
    permit: Option<OwnedSemaphorePermit>,
) -> ApplyStream {
    let (responses, sent) = mpsc::channel(UNREAD_RESPONSES);
    // The stream's changes are confirmed per response, not per item.
    tokio::spawn(Cache::confirming_later(async move {
        serve(service, requests, hop, responses).await;
        drop(permit);
    }));
    // Counted in the node's memory until the transport takes them.
    let sent = ReceiverStream::new(sent).map(|response| response.map(memory::Charged::into_inner));
    Box::pin(sent)
}

type Responses = mpsc::Sender<Result<memory::Charged<ApplyResponse>, Status>>;

/// Applies the stream's items until it ends, the client goes away, or
/// shutdown begins.
async fn serve(
    service: ReadStatesService,
    requests: Streaming<ApplyRequest>,
    hop: Hop,
    responses: Responses,
) {
    let (read, mut pending) = mpsc::channel(READ_AHEAD);
    tokio::spawn(read_requests(requests, read, service.apply_memory.clone()));
    let stopping = service.stopping.clone();
    // Made once, not on every turn of the loop: each registers a waiter
    // under a lock.
    let cancelled = stopping.cancelled();
    let closed = responses.closed();
    tokio::pin!(cancelled, closed);
    let mut items = Items::new(&service, hop);
    let memory = service.apply_memory.clone();
    // Why nothing more is read: the client half-closed (`Some(None)`), or
    // the stream ends with this status once every item read is answered.
    let mut ended: Option<Option<Status>> = None;
    // One journal wait (and lease check) for all the answers made while
    // the one before ran, not one per item; the stream goes on meanwhile.
    let confirming = future::Either::Left(future::pending());
    tokio::pin!(confirming);
    let mut confirmed_all = true;
    loop {
        if ended.is_some() && items.is_empty() {
            break;
        }
        if confirmed_all && items.answered.len() > items.confirmed {
            let (cache, count) = (
                service.cache.clone(),
                items.answered.len() - items.confirmed,
            );
            confirming.set(future::Either::Right(Box::pin(async move {
                (count, cache.confirm().await)
            })));
            confirmed_all = false;
        }
        tokio::select! {
            biased;
            () = &mut cancelled, if ended.is_none() => {
                // Items begun are done and answered; the others are
                // answered unapplied.
                items.stop();
                pending.close();
                while let Ok(Ok((_, batch))) = pending.try_recv() {
                    items.refuse(&batch.into_inner(), &Error::ShuttingDown);
                }
                ended = Some(Some(Error::ShuttingDown.into()));
            }
            () = &mut closed => return,
            (count, confirmed) = &mut confirming, if !confirmed_all => {
                items.confirm(count, confirmed.err().as_ref());
                confirmed_all = true;
            }
            permit = responses.reserve(), if items.confirmed > 0 => {
                let Ok(permit) = permit else { return };
                // The client may have held the send up past the lease.
                if let Err(lapsed) = service.cache.still_leased() {
                    items.unconfirm(0..items.confirmed, &lapsed);
                }
                permit.send(Ok(items.take_answered()));
                if items.may_resume() {
                    items.resume();
                }
            }
            Some(done) = items.waiting.next(), if !items.waiting.is_empty() => items.done(done),
            // Nothing else may wake a stream that stopped reading while the
            // node's Apply streams held all they may: it looks again.
            () = tokio::time::sleep(MEMORY_POLL), if ended.is_none() && !memory.has_room() => {}
            next = pending.recv(), if ended.is_none() && items.has_room() => match next {
                Some(Ok((arrived, batch))) => {
                    if let Err(refused) = items.read(arrived, batch.into_inner()) {
                        ended = Some(Some(refused));
                    }
                }
                None => ended = Some(None),
                // A batch over the limit, refused before it was decoded
                // (see `readstates_routing::codec`), says so itself.
                Some(Err(status)) if status.code() == tonic::Code::InvalidArgument => {
                    ended = Some(Some(*status));
                }
                Some(Err(status)) => {
                    let error = Error::BadStream(status.message().to_owned());
                    ended = Some(Some(error.into()));
                }
            },
        }
    }
    if let Some(Some(status)) = ended {
        let _ = responses.send(Err(all_answered(status))).await;
    }
}

/// `status`, ending a stream whose every item read was answered, says so:
/// an item with no answer was not applied.
fn all_answered(mut status: Status) -> Status {
    status
        .metadata_mut()
        .insert(ALL_ANSWERED, MetadataValue::from_static("1"));
    status
}

/// A batch read ahead (counted in the node's [`Memory`] until begun), with
/// when it arrived, or why the request stream cannot be read (boxed: a
/// `Status` is several times a batch's size).
type Read = Result<(Instant, memory::Charged<ApplyRequest>), Box<Status>>;

/// How often a stream that stopped reading for the node's memory looks
/// again.
const MEMORY_POLL: Duration = Duration::from_millis(5);

/// Reads batches until the stream ends (an undecodable one is passed on,
/// and ends it) or nobody takes them any more; none while the node's
/// Apply streams hold all they may.
async fn read_requests(
    mut requests: Streaming<ApplyRequest>,
    read: mpsc::Sender<Read>,
    memory: Memory,
) {
    loop {
        while !memory.has_room() {
            tokio::select! {
                () = read.closed() => return,
                () = tokio::time::sleep(MEMORY_POLL) => {}
            }
        }
        let message = tokio::select! {
            () = read.closed() => return,
            message = requests.message() => message,
        };
        let batch = match message {
            Ok(Some(batch)) => {
                let bytes = decoded_bytes(&batch);
                Ok((Instant::now(), memory.charge(batch, bytes)))
            }
            Ok(None) => return,
            Err(status) => Err(Box::new(status)),
        };
        let ends = batch.is_err();
        if read.send(batch).await.is_err() || ends {
            return;
        }
    }
}

/// What an item is kept in order with: the items before it that touch
/// the same user, or carry a message of the same channel (a channel
/// counted by channel takes its messages in id order, and such a message
/// may name no user).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Ordered {
    User(u64),
    Channel(u64),
}

/// An item read and not begun.
struct Item {
    id: u64,
    change: Option<Change>,
    /// What it is kept in order with.
    users: Vec<Ordered>,
    started: Instant,
    until: Option<Instant>,
}

/// An item that was waiting, done: its id, what it is ordered with, and
/// its outcome.
type Done = (u64, Vec<Ordered>, Outcome);

type Waiting<'a> = FuturesUnordered<Pin<Box<dyn Future<Output = Done> + Send + 'a>>>;

/// The items of one stream from when they are read until their answers
/// are sent.
struct Items<'a> {
    service: &'a ReadStatesService,
    hop: Hop,
    /// Begun, waiting for a load or another node.
    waiting: Waiting<'a>,
    /// Per user (or channel), how many items in `waiting` touch it.
    busy: HashMap<Ordered, usize>,
    /// Not begun: each touches a user of an item waiting or held before
    /// it, in the order read.
    held: VecDeque<Item>,
    /// Per user (or channel), how many items in `held` touch it.
    held_users: HashMap<Ordered, usize>,
    /// Answered, not sent yet.
    answered: Vec<ApplyResult>,
    /// How many of `answered`, from the first, are confirmed (see
    /// `Cache::confirm`) and may be sent.
    confirmed: usize,
    /// `answered`, encoded (counted in the node's memory too).
    answered_bytes: usize,
    /// The users of the items read and not answered (one for an item that
    /// names none): what their answers may grow to.
    users: usize,
    /// The users of the items begun and not done.
    begun: usize,
    /// Some of `held` wait for room (see [`Items::room`]), not for an item
    /// before them.
    held_for_room: bool,
}

/// At most what `batch` takes in memory, decoded: its items, and its
/// encoded bytes eight times over (an id of one byte on the wire takes
/// eight).
fn decoded_bytes(batch: &ApplyRequest) -> usize {
    batch.items.len() * std::mem::size_of::<ApplyItem>() + batch.encoded_len() * 8
}

/// What an item counts against [`MAX_USERS`].
fn weight(users: &[Ordered]) -> usize {
    users.len().max(1)
}

impl<'a> Items<'a> {
    fn new(service: &'a ReadStatesService, hop: Hop) -> Items<'a> {
        Items {
            service,
            hop,
            waiting: FuturesUnordered::new(),
            busy: HashMap::new(),
            held: VecDeque::new(),
            held_users: HashMap::new(),
            answered: Vec::new(),
            confirmed: 0,
            answered_bytes: 0,
            users: 0,
            begun: 0,
            held_for_room: false,
        }
    }

    /// Whether another item may begin: the stream's items under way touch
    /// fewer than [`MAX_USERS`] users and its unsent answers take less
    /// than [`MAX_ANSWERED_BYTES`]. The items of one batch begin together
    /// only while there is room: heavy ones wait their turn, held.
    fn room(&self) -> bool {
        self.begun < MAX_USERS && self.answered_bytes < MAX_ANSWERED_BYTES
    }

    /// Whether the stream may read another batch: it holds less than its
    /// bounds, and the node's Apply streams less than theirs.
    fn has_room(&self) -> bool {
        self.len() < MAX_ITEMS
            && self.users < MAX_USERS
            && self.answered_bytes < MAX_ANSWERED_BYTES
            && self.service.apply_memory.has_room()
    }

    /// `result`, to be sent.
    fn answer(&mut self, result: ApplyResult) {
        let bytes = result.encoded_len();
        self.answered_bytes += bytes;
        self.service.apply_memory.take(bytes);
        self.answered.push(result);
    }

    /// The next `count` answers not confirmed yet are (see
    /// `Cache::confirm`), and may be sent; or, with an `error`, could not
    /// be: each of them that says it was done says `error` instead. Those
    /// changes stay applied here; a retry counts nothing twice.
    fn confirm(&mut self, count: usize, error: Option<&Error>) {
        let (first, upto) = (self.confirmed, self.confirmed + count);
        self.confirmed = upto;
        if let Some(error) = error {
            self.unconfirm(first..upto, error);
        }
    }

    /// The answers in `range` that say done say `error` instead.
    fn unconfirm(&mut self, range: std::ops::Range<usize>, error: &Error) {
        for result in &mut self.answered[range] {
            if matches!(result.outcome, Some(Outcome::Error(_))) {
                continue;
            }
            let before = result.encoded_len();
            *result = refused(result.id, error);
            self.answered_bytes = self.answered_bytes + result.encoded_len() - before;
            self.service.apply_memory.take(result.encoded_len());
            self.service.apply_memory.give_back(before);
        }
    }

    /// Items under way, held, or answered and not sent.
    fn len(&self) -> usize {
        self.waiting.len() + self.held.len() + self.answered.len()
    }

    fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The answers not sent yet, as many as fit in one response (see
    /// [`MAX_RESPONSE_BYTES`]; at least one), counted in the node's memory
    /// until the transport takes them.
    fn take_answered(&mut self) -> memory::Charged<ApplyResponse> {
        let mut size = 0;
        let mut taken = 0;
        let fit = self.answered[..self.confirmed]
            .iter()
            .take_while(|result| {
                let bytes = result.encoded_len();
                size += bytes;
                let fits = size <= MAX_RESPONSE_BYTES || taken == 0;
                taken += if fits { bytes } else { 0 };
                fits
            })
            .count();
        let rest = self.answered.split_off(fit);
        self.confirmed -= fit;
        self.answered_bytes -= taken;
        let response = ApplyResponse {
            results: std::mem::replace(&mut self.answered, rest),
        };
        self.service.apply_memory.counted(response, taken)
    }

    /// Starts, or holds, the items of `batch`, which `arrived` then, in
    /// order. A batch over the limit is refused whole (ending the stream: see
    /// `readstates_routing::codec`), none of it applied.
    fn read(&mut self, arrived: Instant, batch: ApplyRequest) -> Result<(), Status> {
        validate::at_most("items", batch.items.len(), MAX_APPLY_ITEMS)?;
        let batch_until = limit(arrived, batch.timeout_ms);
        let items: Vec<Item> = (batch.items.into_iter())
            .map(|item| Item {
                users: touched(&item),
                id: item.id,
                change: item.change,
                started: arrived,
                until: match (batch_until, limit(arrived, item.timeout_ms)) {
                    (Some(a), Some(b)) => Some(a.min(b)),
                    (a, b) => a.or(b),
                },
            })
            .collect();
        // The batch's users are known before the first is changed: their
        // cache misses are taken together, not one item after another.
        let mut users: Vec<u64> = (items.iter().flat_map(|item| &item.users))
            .filter_map(|&ordered| match ordered {
                Ordered::User(user_id) => Some(user_id),
                Ordered::Channel(_) => None,
            })
            .collect();
        self.service.cache.prefetch(&mut users);
        let stopping = self.service.stopping.is_cancelled();
        self.users += items.iter().map(|item| weight(&item.users)).sum::<usize>();
        for item in items {
            self.start(item, stopping);
        }
        Ok(())
    }

    /// Begins `item`, or holds it behind an item before it of one of its
    /// users, or until there is room.
    fn start(&mut self, item: Item, stopping: bool) {
        if self.blocked(&item) {
            self.hold(item);
        } else if !self.room() {
            self.held_for_room = true;
            self.hold(item);
        } else {
            self.begin(item, stopping);
        }
    }

    /// Begins what is held and can be now, in order.
    fn resume(&mut self) {
        let held = std::mem::take(&mut self.held);
        self.held_users.clear();
        self.held_for_room = false;
        let stopping = self.service.stopping.is_cancelled();
        for item in held {
            self.start(item, stopping);
        }
    }

    /// Whether items held for room can begin now.
    fn may_resume(&self) -> bool {
        self.held_for_room && self.room()
    }

    /// Answers every item of `batch` with `error`, unapplied.
    fn refuse(&mut self, batch: &ApplyRequest, error: &Error) {
        for item in &batch.items {
            self.answer(refused(item.id, error));
        }
    }

    /// Whether `item` must wait for an item before it of one of its users.
    fn blocked(&self, item: &Item) -> bool {
        item.users
            .iter()
            .any(|user| self.busy.contains_key(user) || self.held_users.contains_key(user))
    }

    fn hold(&mut self, item: Item) {
        for &user in &item.users {
            *self.held_users.entry(user).or_default() += 1;
        }
        self.held.push_back(item);
    }

    /// Runs `item`: answered at once if it is done at once, else waiting;
    /// refused if shutdown is `stopping` (asked once per batch: the token
    /// takes a lock).
    fn begin(&mut self, item: Item, stopping: bool) {
        let Item {
            id,
            change,
            users,
            started,
            until,
        } = item;
        let outcome = if stopping {
            self.users -= weight(&users);
            Outcome::Error(apply_error(&Error::ShuttingDown.into()))
        } else if until.is_some_and(|until| Instant::now() >= until) {
            self.users -= weight(&users);
            Outcome::Error(apply_error(&Error::DeadlineExceeded.into()))
        } else {
            // A node's stream says no epoch per item: a refusal by an owner
            // behind it is sent again as a call that does (`Router::send`).
            let origin = Origin {
                started,
                until,
                hop: self.hop.clone(),
                epoch: 0,
            };
            let mut applying = self.service.apply_item(change, origin);
            // Polled once here: most items (cached users) are done at
            // once; `waiting` polls the others again with its own waker.
            match applying
                .as_mut()
                .poll(&mut Context::from_waker(Waker::noop()))
            {
                Poll::Ready(result) => {
                    self.users -= weight(&users);
                    outcome(result)
                }
                Poll::Pending => {
                    self.begun += weight(&users);
                    for &user in &users {
                        *self.busy.entry(user).or_default() += 1;
                    }
                    self.waiting.push(Box::pin(
                        async move { (id, users, outcome(applying.await)) },
                    ));
                    return;
                }
            }
        };
        self.answer(ApplyResult {
            id,
            outcome: Some(outcome),
        });
    }

    /// A waiting item is done: answered, and the items held behind it
    /// that no other item holds up begun.
    fn done(&mut self, (id, users, outcome): Done) {
        self.users -= weight(&users);
        self.begun -= weight(&users);
        self.answer(ApplyResult {
            id,
            outcome: Some(outcome),
        });
        let mut freed = false;
        for user in users {
            freed |= release(&mut self.busy, user) && self.held_users.contains_key(&user);
        }
        if freed || self.may_resume() {
            self.resume();
        }
    }

    /// Shutdown: the items held are answered unapplied (those begun are
    /// answered as they are done).
    fn stop(&mut self) {
        let held = std::mem::take(&mut self.held);
        self.held_users.clear();
        for item in held {
            self.users -= weight(&item.users);
            self.answer(refused(item.id, &Error::ShuttingDown));
        }
    }
}

impl Drop for Items<'_> {
    /// Answers never sent (the client went away) no longer count.
    fn drop(&mut self) {
        self.service.apply_memory.give_back(self.answered_bytes);
    }
}

/// One count of `user` in `counts` less; whether that was its last.
fn release(counts: &mut HashMap<Ordered, usize>, user: Ordered) -> bool {
    let Some(count) = counts.get_mut(&user) else {
        return false;
    };
    *count -= 1;
    if *count > 0 {
        return false;
    }
    counts.remove(&user);
    true
}

/// The instant `timeout_ms` after `started`; none for 0.
fn limit(started: Instant, timeout_ms: u32) -> Option<Instant> {
    (timeout_ms > 0).then(|| started + Duration::from_millis(timeout_ms.into()))
}

/// An item's run, boxed as its own kind's call (not as one future sized
/// for the largest kind, which every item would move and allocate).
type Applying<'a> = Pin<Box<dyn Future<Output = Result<Outcome, Status>> + Send + 'a>>;

impl ReadStatesService {
    /// One item, as its unary call would run it.
    fn apply_item(&self, change: Option<Change>, origin: Origin) -> Applying<'_> {
        let metrics = &self.item_metrics;
        let Some(change) = change else {
            let error = Error::invalid("change", "must be set");
            return Box::pin(future::ready(Err(error.into())));
        };
        match change {
            Change::Ack(r) => Box::pin(
                self.run_routed(&metrics.ack, origin, r, ack::handle, true)
                    .map_ok(Outcome::Ack),
            ),
            Change::BulkAck(r) => Box::pin(
                self.run_routed(&metrics.bulk_ack, origin, r, bulk_ack::handle, true)
                    .map_ok(Outcome::BulkAck),
            ),
            Change::AckAll(r) => Box::pin(
                self.run_routed(&metrics.ack_all, origin, r, ack_all::handle, true)
                    .map_ok(Outcome::AckAll),
            ),
            Change::SetMuted(r) => Box::pin(
                self.run_routed(&metrics.set_muted, origin, r, set_muted::handle, true)
                    .map_ok(Outcome::SetMuted),
            ),
            Change::DeleteReadStates(r) => Box::pin(
                self.run_routed(
                    &metrics.delete_read_states,
                    origin,
                    r,
                    delete_read_states::handle,
                    true,
                )
                .map_ok(Outcome::DeleteReadStates),
            ),
            Change::MessageCreated(r) => match self.takes_threads(r.kind) {
                Ok(()) => Box::pin(
                    self.run_scattered(
                        &metrics.message_created,
                        origin,
                        r,
                        message_created::handle,
                    )
                    .map_ok(Outcome::MessageCreated),
                ),
                Err(refused) => Box::pin(future::ready(Err(refused.into()))),
            },
            Change::MessageDeleted(r) => Box::pin(
                self.run_scattered(&metrics.message_deleted, origin, r, message_deleted::handle)
                    .map_ok(Outcome::MessageDeleted),
            ),
            Change::GetBadgeCounts(r) => Box::pin(
                self.run_scattered(
                    &metrics.get_badge_counts,
                    origin,
                    r,
                    get_badge_counts::handle,
                )
                .map_ok(Outcome::GetBadgeCounts),
            ),
        }
    }
}

/// An item's outcome: its response, or its error.
fn outcome(result: Result<Outcome, Status>) -> Outcome {
    result.unwrap_or_else(|status| Outcome::Error(apply_error(&status)))
}

/// The users an item touches, as its request names them (the ids of an
/// invalid one too: it fails anyway), and the channel of a message.
fn touched(item: &ApplyItem) -> Vec<Ordered> {
    match &item.change {
        Some(Change::Ack(r)) => vec![Ordered::User(r.user_id)],
        Some(Change::BulkAck(r)) => vec![Ordered::User(r.user_id)],
        Some(Change::AckAll(r)) => vec![Ordered::User(r.user_id)],
        Some(Change::SetMuted(r)) => vec![Ordered::User(r.user_id)],
        Some(Change::DeleteReadStates(r)) => vec![Ordered::User(r.user_id)],
        Some(Change::MessageCreated(r)) => [r.author_id]
            .iter()
            .chain(&r.mentioned_user_ids)
            .chain(&r.unread_user_ids)
            .map(|&id| Ordered::User(id))
            .chain([Ordered::Channel(r.channel_id)])
            .collect(),
        Some(Change::MessageDeleted(r)) => (r.mentioned_user_ids.iter())
            .chain(&r.unread_user_ids)
            .map(|&id| Ordered::User(id))
            .chain([Ordered::Channel(r.channel_id)])
            .collect(),
        Some(Change::GetBadgeCounts(r)) => r.user_ids.iter().map(|&id| Ordered::User(id)).collect(),
        None => vec![],
    }
}

/// An item answered with `error` and not applied.
fn refused(id: u64, error: &Error) -> ApplyResult {
    ApplyResult {
        id,
        outcome: Some(Outcome::Error(apply_error(&error.clone().into()))),
    }
}

/// `status` as an item's error, with the owner and epoch of a refusal
/// (which a unary call has in its trailers).
fn apply_error(status: &Status) -> ApplyError {
    let metadata = status.metadata();
    let text = |key| {
        metadata
            .get(key)
            .and_then(|value| value.to_str().ok())
            .unwrap_or_default()
    };
    ApplyError {
        code: status.code() as i32,
        message: status.message().to_owned(),
        owner: text(OWNER).to_owned(),
        epoch: text(EPOCH).parse().unwrap_or(0),
        safe_to_retry: metadata.contains_key(SAFE_TO_RETRY),
    }
}

#[cfg(test)]
mod tests;
