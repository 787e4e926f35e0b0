//! The Apply stream: every item kind means what its unary call means,
//! redelivery counts nothing, bad items are answered and the stream goes
//! on, garbage ends one stream alone, back-pressure, the stream limit, the
//! per-batch deadline, and shutdown.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use readstates::config::Config;
use readstates::proto::apply_item::Change;
use readstates::proto::apply_result::Outcome;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::*;
use readstates::store::Store;
use readstates::store::faulty::{Effect, Fault, FaultyStore, Operation};
use readstates::store::memory::MemoryStore;
use readstates::test_support::{ack, delete, message};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

use crate::helpers::{
    TestApp, garbage_stream, small_window_channel, spawn_app, spawn_app_on, spawn_app_with,
    test_config,
};

/// One open Apply stream (the fleet tests use it too).
pub struct Applier {
    pub batches: mpsc::Sender<ApplyRequest>,
    pub results: Streaming<ApplyResponse>,
}

impl Applier {
    pub async fn open(app: &TestApp) -> Applier {
        Applier::try_open(app.channel().await, 16)
            .await
            .expect("Apply")
    }

    /// A stream whose client queues at most `queued` batches unsent.
    pub async fn try_open(channel: Channel, queued: usize) -> Result<Applier, tonic::Status> {
        let (batches, receiver) = mpsc::channel(queued);
        let results = ReadStatesClient::new(channel)
            .apply(ReceiverStream::new(receiver))
            .await?
            .into_inner();
        Ok(Applier { batches, results })
    }

    pub async fn send(&self, batch: ApplyRequest) {
        self.batches.send(batch).await.expect("stream open");
    }

    /// The next response's results, within 5 s.
    pub async fn next(&mut self) -> Result<Vec<ApplyResult>, tonic::Status> {
        let message = tokio::time::timeout(Duration::from_secs(5), self.results.message())
            .await
            .expect("a response within 5 s")?;
        Ok(message.expect("not ended").results)
    }

    /// Sends `changes` as one batch (ids 0, 1, ...) and waits for every
    /// answer: the outcomes in item order, each answered exactly once.
    pub async fn apply(&mut self, changes: Vec<Change>) -> Vec<Outcome> {
        let count = changes.len();
        self.send(batch(changes)).await;
        let mut answers = HashMap::new();
        while answers.len() < count {
            for result in self.next().await.expect("results") {
                let outcome = result.outcome.expect("an outcome");
                assert!(
                    answers.insert(result.id, outcome).is_none(),
                    "item {} answered twice",
                    result.id
                );
            }
        }
        (0..count as u64)
            .map(|id| answers.remove(&id).expect("every item answered"))
            .collect()
    }
}

/// `changes` as a batch, with ids 0, 1, ...
pub fn batch(changes: Vec<Change>) -> ApplyRequest {
    ApplyRequest {
        items: changes
            .into_iter()
            .enumerate()
            .map(|(id, change)| ApplyItem {
                id: id as u64,
                change: Some(change),
                ..ApplyItem::default()
            })
            .collect(),
        timeout_ms: 0,
    }
}

/// An app whose store takes `delay` to load `user`.
async fn app_with_slow_loads_of(user: u64, delay: Duration) -> TestApp {
    let store = Arc::new(FaultyStore::new(Arc::new(MemoryStore::new()), 0));
    store.inject(Fault::new(Operation::Load, Effect::Delay(delay)).user(user));
    spawn_app_on(test_config(), store).await
}

/// The error an item was answered with.
fn error(outcome: &Outcome) -> (Code, &str) {
    match outcome {
        Outcome::Error(e) => (Code::from_i32(e.code), e.message.as_str()),
        other => panic!("expected an error, got {other:?}"),
    }
}

/// A user's read states without their versions (which come from the
/// clock), and its totals.
async fn states(app: &mut TestApp, user_id: u64) -> (Vec<ReadState>, u64, u32) {
    let response = app.all_read_states(user_id).await;
    let states = response
        .read_states
        .into_iter()
        .map(|state| ReadState {
            version: 0,
            ..state
        })
        .collect();
    (
        states,
        response.total_mention_count,
        response.unread_channel_count,
    )
}

/// The same changes, to users `base + 1..=base + 3`, one of each kind.
fn every_kind(base: u64) -> Vec<Change> {
    let (a, b, c) = (base + 1, base + 2, base + 3);
    vec![
        Change::Ack(ack(a, 10, 100)),
        Change::BulkAck(BulkAckRequest {
            user_id: a,
            entries: [11, 12, 13]
                .map(|channel_id| AckEntry {
                    channel_id,
                    kind: 0,
                    message_id: 100,
                })
                .to_vec(),
        }),
        Change::MessageCreated(message(10, 200, b, &[a], &[c])),
        Change::MessageCreated(message(11, 201, b, &[], &[a, c])),
        Change::MessageCreated(message(12, 202, b, &[a, c], &[])),
        Change::MessageDeleted(MessageDeletedRequest {
            channel_id: 12,
            message_id: 202,
            mentioned_user_ids: vec![c],
            ..MessageDeletedRequest::default()
        }),
        Change::SetMuted(SetMutedRequest {
            user_id: a,
            channel_id: 11,
            kind: 0,
            muted: true,
        }),
        Change::AckAll(AckAllRequest {
            user_id: c,
            kinds: vec![],
            parent_id: 0,
        }),
        Change::MessageCreated(message(13, 203, b, &[c], &[a])),
        Change::DeleteReadStates(delete(a, &[13], false)),
        Change::Ack(AckRequest {
            manual: true,
            mention_count: 3,
            unread_count: 4,
            ..ack(c, 10, 150)
        }),
        Change::GetBadgeCounts(GetBadgeCountsRequest {
            user_ids: vec![a, b, c],
        }),
    ]
}

/// Runs one change as its unary call: the outcome an item would get.
async fn unary(client: &mut ReadStatesClient<Channel>, change: Change) -> Outcome {
    let outcome = match change {
        Change::Ack(r) => client.ack(r).await.map(|r| Outcome::Ack(r.into_inner())),
        Change::BulkAck(r) => client
            .bulk_ack(r)
            .await
            .map(|r| Outcome::BulkAck(r.into_inner())),
        Change::MessageCreated(r) => client
            .message_created(r)
            .await
            .map(|r| Outcome::MessageCreated(r.into_inner())),
        Change::MessageDeleted(r) => client
            .message_deleted(r)
            .await
            .map(|r| Outcome::MessageDeleted(r.into_inner())),
        Change::AckAll(r) => client
            .ack_all(r)
            .await
            .map(|r| Outcome::AckAll(r.into_inner())),
        Change::SetMuted(r) => client
            .set_muted(r)
            .await
            .map(|r| Outcome::SetMuted(r.into_inner())),
        Change::DeleteReadStates(r) => client
            .delete_read_states(r)
            .await
            .map(|r| Outcome::DeleteReadStates(r.into_inner())),
        Change::GetBadgeCounts(r) => client
            .get_badge_counts(r)
            .await
            .map(|r| Outcome::GetBadgeCounts(r.into_inner())),
    };
    outcome.unwrap_or_else(|status| {
        Outcome::Error(ApplyError {
            code: status.code() as i32,
            message: status.message().to_owned(),
            ..ApplyError::default()
        })
    })
}

/// An outcome with its versions (from the clock) zeroed.
fn unversioned(outcome: Outcome) -> Outcome {
    let state = |s: Option<ReadState>| s.map(|s| ReadState { version: 0, ..s });
    match outcome {
        Outcome::Ack(r) => Outcome::Ack(AckResponse {
            version: 0,
            read_state: state(r.read_state),
            ..r
        }),
        Outcome::BulkAck(r) => Outcome::BulkAck(BulkAckResponse {
            version: 0,
            read_states: r
                .read_states
                .into_iter()
                .map(|s| ReadState { version: 0, ..s })
                .collect(),
        }),
        Outcome::SetMuted(r) => Outcome::SetMuted(SetMutedResponse {
            version: 0,
            read_state: state(r.read_state),
            ..r
        }),
        Outcome::AckAll(r) => Outcome::AckAll(AckAllResponse { version: 0, ..r }),
        Outcome::DeleteReadStates(r) => {
            Outcome::DeleteReadStates(DeleteReadStatesResponse { version: 0, ..r })
        }
        Outcome::GetBadgeCounts(mut r) => {
            // The users differ by the base; their counts must not.
            r.counts.iter_mut().for_each(|c| c.user_id %= 1_000);
            Outcome::GetBadgeCounts(r)
        }
        other => other,
    }
}

#[tokio::test]
async fn every_item_kind_answers_and_changes_what_its_unary_call_does() {
    let mut app = spawn_app().await;
    let mut stream = Applier::open(&app).await;
    let streamed = stream.apply(every_kind(0)).await;
    let mut client = app.client.clone();
    let mut called = Vec::new();
    for change in every_kind(1_000) {
        called.push(unary(&mut client, change).await);
    }
    assert_eq!(streamed.len(), 12);
    for (i, (s, c)) in streamed.into_iter().zip(called).enumerate() {
        assert!(!matches!(s, Outcome::Error(_)), "item {i}: {s:?}");
        assert_eq!(unversioned(s), unversioned(c), "item {i}");
    }
    for user in 1..=3 {
        let streamed = states(&mut app, user).await;
        assert!(!streamed.0.is_empty(), "user {user} has read states");
        assert_eq!(
            streamed,
            states(&mut app, 1_000 + user).await,
            "user {user}"
        );
    }
}

#[tokio::test]
async fn a_redelivered_batch_counts_nothing() {
    let mut app = spawn_app().await;
    let mut stream = Applier::open(&app).await;
    let changes = || {
        (1..=50)
            .map(|m| Change::MessageCreated(message(7, 1_000 + m, 1, &[2], &[3, 4])))
            .collect::<Vec<_>>()
    };
    let first = stream.apply(changes()).await;
    assert!(
        first
            .iter()
            .all(|o| matches!(o, Outcome::MessageCreated(r) if r.updated == 4)),
        "{first:?}"
    );
    let again = stream.apply(changes()).await;
    assert!(
        again
            .iter()
            .all(|o| matches!(o, Outcome::MessageCreated(r) if r.updated == 0)),
        "{again:?}"
    );
    let (states, mentions, _) = states(&mut app, 2).await;
    assert_eq!(
        (states[0].mention_count, states[0].unread_count, mentions),
        (50, 50, 50)
    );
}

#[tokio::test]
async fn bad_items_get_the_unary_errors_and_the_stream_goes_on() {
    let app = spawn_app().await;
    let mut stream = Applier::open(&app).await;
    let mut client = app.client.clone();
    let too_many: Vec<u64> = (1..=10_001).collect();
    let bad = vec![
        Change::Ack(ack(0, 10, 100)),
        Change::Ack(ack(1, 10, 0)),
        Change::BulkAck(BulkAckRequest {
            user_id: 1,
            entries: vec![AckEntry::default(); 101],
        }),
        Change::MessageCreated(message(10, 5, 0, &too_many, &[])),
        Change::MessageDeleted(MessageDeletedRequest {
            channel_id: 10,
            message_id: 5,
            unread_user_ids: vec![1, 0],
            ..MessageDeletedRequest::default()
        }),
        Change::SetMuted(SetMutedRequest {
            user_id: 1,
            channel_id: 10,
            kind: 99,
            muted: true,
        }),
        Change::DeleteReadStates(delete(1, &[10], true)),
        Change::GetBadgeCounts(GetBadgeCountsRequest {
            user_ids: (1..=1_001).collect(),
        }),
    ];
    let mut items = bad.clone();
    items.push(Change::Ack(ack(1, 10, 100)));
    let outcomes = stream.apply(items).await;
    for (i, change) in bad.into_iter().enumerate() {
        let (code, message) = error(&outcomes[i]);
        let expected = unary(&mut client, change).await;
        assert_eq!((code, message), error(&expected), "item {i}");
        assert_eq!(code, Code::InvalidArgument, "item {i}: {message}");
    }
    assert!(
        matches!(&outcomes[8], Outcome::Ack(r) if r.applied),
        "the good item among them is applied: {:?}",
        outcomes[8]
    );

    // An item with no change, and a batch over the limit: every item
    // answered, none applied.
    stream
        .send(ApplyRequest {
            items: vec![ApplyItem {
                id: 7,
                change: None,
                ..ApplyItem::default()
            }],
            timeout_ms: 0,
        })
        .await;
    let results = stream.next().await.unwrap();
    assert_eq!(results[0].id, 7);
    let (code, message) = error(results[0].outcome.as_ref().unwrap());
    assert_eq!(
        (code, message),
        (Code::InvalidArgument, "change: must be set")
    );
    // Issue 35, item 3: a batch over the limit is refused whole, before it
    // is decoded (it was decoded, then refused item by item, each refusal
    // held until read: 2,000,000 empty items took 2 GiB): one error, which
    // ends the stream, after what was read before it is answered.
    let over: Vec<Change> = (1..=1_001).map(|m| Change::Ack(ack(2, 10, m))).collect();
    stream.send(batch(over)).await;
    let refused = stream.next().await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(
        refused
            .message()
            .contains("at most 1000 items; this one holds 1001"),
        "{refused:?}"
    );
    assert!(refused.metadata().contains_key("x-readstates-all-answered"));
    assert!(
        client
            .get_read_states(GetReadStatesRequest {
                user_id: 2,
                ..GetReadStatesRequest::default()
            })
            .await
            .unwrap()
            .into_inner()
            .read_states
            .is_empty(),
        "nothing of the refused batch applied"
    );
    let mut again = Applier::open(&app).await;
    let outcomes = again.apply(vec![Change::Ack(ack(2, 10, 1))]).await;
    assert!(
        matches!(&outcomes[0], Outcome::Ack(r) if r.applied),
        "another stream is served"
    );
}

/// Issue 35, item 3: a stream of heavy items whose client reads nothing
/// (GetBadgeCounts of 1,000 users each) held up to 4,000 of their answers,
/// 150 MiB. The items under way are bounded by the users they touch too.
#[tokio::test]
async fn heavy_answers_hold_a_stream_back_sooner() {
    let app = spawn_app().await;
    let channel = small_window_channel(&app).await;
    let stream = Applier::try_open(channel, 1).await.unwrap();
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (batches, counter) = (stream.batches.clone(), sent.clone());
    let sender = tokio::spawn(async move {
        for b in 0..400u64 {
            let counts = GetBadgeCountsRequest {
                user_ids: (1..=1_000).collect(),
            };
            let items = (0..10)
                .map(|i| ApplyItem {
                    id: b * 10 + i,
                    change: Some(Change::GetBadgeCounts(counts.clone())),
                    ..ApplyItem::default()
                })
                .collect();
            let request = ApplyRequest {
                items,
                timeout_ms: 0,
            };
            if batches.send(request).await.is_err() {
                return;
            }
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let taken = sent.load(std::sync::atomic::Ordering::SeqCst);
    // Answers of about 20 KB: 4 MiB answered and 4 unsent responses of
    // 1 MiB are about 45 batches, 100,000 users under way 10 more, and a
    // few are read ahead or in the transport's windows (400 before).
    assert!(taken < 100, "{taken} batches of 10,000 users taken");
    sender.abort();
    drop(stream);
}

#[tokio::test]
async fn a_stream_of_garbage_ends_alone() {
    let app = spawn_app().await;
    let mut good = Applier::open(&app).await;
    good.apply(vec![Change::Ack(ack(1, 10, 1))]).await;

    let status = garbage_stream(&app, "/readstates.v1.ReadStates/Apply").await;
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");

    let outcomes = good.apply(vec![Change::Ack(ack(1, 10, 2))]).await;
    assert!(
        matches!(&outcomes[0], Outcome::Ack(r) if r.applied),
        "the other stream goes on"
    );
}

#[tokio::test]
async fn streams_beyond_the_limit_are_refused_until_one_ends() {
    let config = Config {
        max_apply_streams: 2,
        ..test_config()
    };
    let app = spawn_app_with(config).await;
    let mut first = Applier::open(&app).await;
    let _second = Applier::open(&app).await;
    let refused = Applier::try_open(app.channel().await, 1).await.err();
    let status = refused.expect("a third stream is refused");
    assert_eq!(status.code(), Code::ResourceExhausted, "{status:?}");
    assert!(status.message().contains("2 Apply streams"), "{status:?}");

    first.apply(vec![Change::Ack(ack(1, 10, 1))]).await;
    drop(first);
    crate::helpers::eventually("a place is free again", async || {
        Applier::try_open(app.channel().await, 1).await.is_ok()
    })
    .await;
}

/// A client that sends without reading its results is slowed by flow
/// control: the server applies a bounded number of batches ahead of what
/// the client read, and every item is still answered once it reads.
#[tokio::test]
async fn a_client_that_does_not_read_is_held_back_and_loses_nothing() {
    let mut app = spawn_app().await;
    let channel = small_window_channel(&app).await;
    let mut stream = Applier::try_open(channel, 1).await.unwrap();
    const BATCHES: u64 = 200;
    const ITEMS: u64 = 500;
    let sent = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let (batches, counter) = (stream.batches.clone(), sent.clone());
    let sender = tokio::spawn(async move {
        for b in 0..BATCHES {
            let items = (0..ITEMS)
                .map(|i| {
                    let id = b * ITEMS + i + 1;
                    ApplyItem {
                        id,
                        change: Some(Change::Ack(ack(1, 10, id))),
                        ..ApplyItem::default()
                    }
                })
                .collect();
            let batch = ApplyRequest {
                items,
                timeout_ms: 0,
            };
            if batches.send(batch).await.is_err() {
                return;
            }
            counter.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    tokio::time::sleep(Duration::from_secs(2)).await;
    let applied = app.all_read_states(1).await.read_states[0].last_acked_id;
    let taken = sent.load(std::sync::atomic::Ordering::SeqCst);
    assert!(
        applied < 40 * ITEMS && taken < 60,
        "held back: {} batches applied, {taken} taken",
        applied / ITEMS
    );
    let mut answered = std::collections::HashSet::new();
    while answered.len() < (BATCHES * ITEMS) as usize {
        for result in stream.next().await.unwrap() {
            assert!(matches!(result.outcome, Some(Outcome::Ack(ref r)) if r.applied));
            assert!(answered.insert(result.id), "{} answered twice", result.id);
        }
    }
    sender.await.unwrap();
    let applied = app.all_read_states(1).await.read_states[0].last_acked_id;
    assert_eq!(applied, BATCHES * ITEMS);
}

/// An item cut by its batch's timeout, and one that could not start in
/// time (it waits for the first, of the same user), are answered
/// DEADLINE_EXCEEDED and not applied; other users' items go on.
#[tokio::test]
async fn items_late_for_their_batch_timeout_are_not_applied() {
    let mut app = app_with_slow_loads_of(5, Duration::from_millis(600)).await;
    let mut stream = Applier::open(&app).await;
    let mut request = batch(vec![
        Change::Ack(ack(4, 10, 1)),
        Change::Ack(ack(5, 10, 1)),
        Change::Ack(ack(6, 10, 1)),
        Change::Ack(ack(5, 10, 2)),
    ]);
    request.timeout_ms = 200;
    stream.send(request).await;
    let mut outcomes = HashMap::new();
    while outcomes.len() < 4 {
        for result in stream.next().await.unwrap() {
            outcomes.insert(result.id, result.outcome.unwrap());
        }
    }
    for id in [0, 2] {
        assert!(
            matches!(&outcomes[&id], Outcome::Ack(r) if r.applied),
            "{:?}",
            outcomes[&id]
        );
    }
    for id in [1, 3] {
        assert_eq!(error(&outcomes[&id]).0, Code::DeadlineExceeded, "item {id}");
    }
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(app.all_read_states(5).await.read_states.is_empty());
}

/// Shutdown while a batch waits for a slow store: what was applied is
/// answered and written, the rest answered UNAVAILABLE (not applied), and
/// the stream ends with UNAVAILABLE.
#[tokio::test]
async fn shutdown_answers_what_was_applied_and_refuses_the_rest() {
    let durable = Arc::new(MemoryStore::new());
    let store = Arc::new(FaultyStore::new(durable.clone(), 0));
    store.inject(Fault::new(Operation::Load, Effect::Delay(Duration::from_millis(1_000))).user(9));
    let app = spawn_app_on(test_config(), store.clone()).await;
    let mut stream = Applier::open(&app).await;
    // User 9's first item waits for its load, and its later items (the
    // first batch's last, the second's first) are held behind it; the
    // other users' items go on, the second batch's too.
    let first: Vec<Change> = [1, 2, 9, 3, 9]
        .iter()
        .enumerate()
        .map(|(i, &u)| Change::Ack(ack(u, 10, 100 + i as u64)))
        .collect();
    stream.send(batch(first)).await;
    let mut second = batch(vec![
        Change::Ack(ack(9, 10, 200)),
        Change::Ack(ack(4, 10, 100)),
    ]);
    second.items[0].id = 100;
    second.items[1].id = 101;
    stream.send(second).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let stopping = tokio::spawn(app.stop());

    let mut outcomes = HashMap::new();
    let status = loop {
        match tokio::time::timeout(Duration::from_secs(5), stream.results.message())
            .await
            .expect("the stream ends in time")
        {
            Ok(Some(response)) => {
                for result in response.results {
                    let outcome = result.outcome.unwrap();
                    assert!(
                        outcomes.insert(result.id, outcome).is_none(),
                        "answered twice"
                    );
                }
            }
            Ok(None) => panic!("the stream must end with a status"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(
        status
            .metadata()
            .contains_key(readstates::grpc::route::ALL_ANSWERED),
        "an item with no answer was not applied: {status:?}"
    );
    stopping.await.unwrap();
    let mut applied = Vec::new();
    for (id, outcome) in &outcomes {
        match outcome {
            Outcome::Ack(r) => {
                assert!(r.applied);
                applied.push(*id);
            }
            other => assert_eq!(error(other).0, Code::Unavailable, "item {id}"),
        }
    }
    applied.sort_unstable();
    assert_eq!(
        applied,
        [0, 1, 2, 3, 101],
        "the items begun before the shutdown are applied, the others not: {outcomes:?}"
    );
    assert_eq!(outcomes.len(), 7, "every item read is answered");
    for id in applied {
        let user = if id == 101 {
            4
        } else {
            [1, 2, 9, 3][id as usize]
        };
        let written = durable.load(user).await.unwrap();
        assert_eq!(
            written.read_states.len(),
            1,
            "user {user}'s answered ack is written"
        );
    }
}

/// The users of a batch are loaded concurrently: a batch of 20 cold users
/// on a store that takes 300 ms per load waits for about one load, not 20.
#[tokio::test]
async fn a_batch_of_cold_users_waits_for_about_one_load() {
    let store = Arc::new(FaultyStore::new(Arc::new(MemoryStore::new()), 0));
    store.inject(Fault::new(
        Operation::Load,
        Effect::Delay(Duration::from_millis(300)),
    ));
    let app = spawn_app_on(test_config(), store.clone()).await;
    let mut stream = Applier::open(&app).await;
    let started = std::time::Instant::now();
    let outcomes = stream
        .apply((1..=20).map(|u| Change::Ack(ack(u, 10, 5))).collect())
        .await;
    let took = started.elapsed();
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Ack(r) if r.applied))
    );
    assert_eq!(store.loads(), 20);
    assert!(
        took < Duration::from_secs(3),
        "20 loads one after another: {took:?}"
    );
}

/// Several items waiting at once (a slow user's ack, a message to cold
/// users) are each applied.
#[tokio::test]
async fn items_that_wait_together_are_each_applied() {
    let app = app_with_slow_loads_of(1, Duration::from_millis(300)).await;
    let mut stream = Applier::open(&app).await;
    let outcomes = stream
        .apply(vec![
            Change::Ack(ack(1, 10, 5)),
            Change::Ack(ack(2, 10, 5)),
            Change::MessageCreated(message(10, 6, 0, &[50], &[51, 52])),
        ])
        .await;
    assert!(
        matches!(&outcomes[1], Outcome::Ack(r) if r.applied),
        "{outcomes:?}"
    );
    assert!(
        matches!(&outcomes[2], Outcome::MessageCreated(r) if r.updated == 3),
        "{outcomes:?}"
    );
}

/// Items of a user apply in the order sent, also when the first has to
/// wait for the user's load and items of other users go on meanwhile.
#[tokio::test]
async fn a_users_items_apply_in_order_while_others_go_on() {
    let mut app = app_with_slow_loads_of(1, Duration::from_millis(300)).await;
    let mut stream = Applier::open(&app).await;
    let manual = AckRequest {
        manual: true,
        mention_count: 2,
        unread_count: 3,
        ..ack(1, 10, 50)
    };
    let outcomes = stream
        .apply(vec![
            Change::Ack(ack(1, 10, 100)),
            Change::Ack(ack(2, 10, 100)),
            Change::Ack(manual),
            Change::Ack(ack(2, 10, 120)),
        ])
        .await;
    assert!(
        outcomes
            .iter()
            .all(|o| matches!(o, Outcome::Ack(r) if r.applied)),
        "{outcomes:?}"
    );
    let (states, ..) = states(&mut app, 1).await;
    assert_eq!(
        (
            states[0].last_acked_id,
            states[0].mention_count,
            states[0].unread_count
        ),
        (50, 2, 3),
        "the manual ack, sent last, is what stays"
    );
    assert_eq!(states_of(&mut app, 2).await, 120);
}

async fn states_of(app: &mut TestApp, user_id: u64) -> u64 {
    app.all_read_states(user_id).await.read_states[0].last_acked_id
}

/// A client that has fallen behind in reading when shutdown begins still
/// gets, as it reads on, the answer of every item applied, then
/// UNAVAILABLE; what was answered OK is what was written.
#[tokio::test]
async fn a_client_behind_at_shutdown_gets_every_answer_then_unavailable() {
    let durable = Arc::new(MemoryStore::new());
    let app = spawn_app_on(test_config(), durable.clone()).await;
    let channel = small_window_channel(&app).await;
    let mut stream = Applier::try_open(channel, 64).await.unwrap();
    const ITEMS: u64 = 500;
    for b in 0..40 {
        let items = (1..=ITEMS)
            .map(|i| {
                let id = b * ITEMS + i;
                ApplyItem {
                    id,
                    change: Some(Change::Ack(ack(1, 10, id))),
                    ..ApplyItem::default()
                }
            })
            .collect();
        let _ = stream.batches.try_send(ApplyRequest {
            items,
            timeout_ms: 0,
        });
    }
    // The server stops, blocked on answers the client has not read.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stopping = tokio::spawn(app.stop());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let mut applied = 0;
    let status = loop {
        match stream.results.message().await {
            Ok(Some(response)) => {
                for result in response.results {
                    if let Some(Outcome::Ack(r)) = result.outcome {
                        assert!(r.applied);
                        applied = applied.max(result.id);
                    }
                }
            }
            Ok(None) => panic!("the stream must end with UNAVAILABLE, not OK"),
            Err(status) => break status,
        }
    };
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    stopping.await.unwrap();
    let written = durable.load(1).await.unwrap();
    assert!(applied > 0);
    assert_eq!(
        written.read_states[0].last_acked_id, applied,
        "every applied ack was answered"
    );
}

/// A client that never reads does not hold up shutdown past its grace for
/// requests, and every change is still written.
#[tokio::test]
async fn a_client_that_never_reads_does_not_hold_up_shutdown() {
    let app = spawn_app().await;
    let channel = small_window_channel(&app).await;
    let stream = Applier::try_open(channel, 64).await.unwrap();
    for b in 0..40u64 {
        let changes = (1..=500)
            .map(|i| Change::Ack(ack(1, 10, b * 500 + i)))
            .collect();
        let _ = stream.batches.try_send(batch(changes));
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let report = tokio::time::timeout(Duration::from_secs(20), app.stop())
        .await
        .expect("shutdown ends within its grace");
    assert_eq!(report.unwritten, 0);
    drop(stream);
}

/// An item that waits (a slow load) holds up neither the stream nor the
/// answers of other users' items, in its batch or in later ones: they are
/// answered first, and it is answered once done.
#[tokio::test]
async fn a_waiting_item_holds_up_no_other_answer() {
    let app = app_with_slow_loads_of(1, Duration::from_millis(1_000)).await;
    let mut stream = Applier::open(&app).await;
    stream
        .send(batch(vec![
            Change::Ack(ack(1, 10, 5)),
            Change::Ack(ack(2, 10, 5)),
        ]))
        .await;
    let mut later = batch(vec![Change::Ack(ack(3, 10, 5))]);
    later.items[0].id = 2;
    stream.send(later).await;
    let started = std::time::Instant::now();
    let mut order = Vec::new();
    while order.len() < 3 {
        for result in stream.next().await.unwrap() {
            assert!(matches!(result.outcome, Some(Outcome::Ack(ref r)) if r.applied));
            order.push((result.id, started.elapsed()));
        }
    }
    let ids: Vec<u64> = order.iter().map(|&(id, _)| id).collect();
    assert_eq!(
        ids.last(),
        Some(&0),
        "the slow item is answered last: {order:?}"
    );
    assert!(
        order[..2]
            .iter()
            .all(|&(_, at)| at < Duration::from_millis(500)),
        "the others are not held up by it: {order:?}"
    );
}

/// An item's own `timeout_ms` cuts it, not its batch's other items.
#[tokio::test]
async fn an_items_own_timeout_cuts_that_item_only() {
    let mut app = app_with_slow_loads_of(5, Duration::from_millis(600)).await;
    let mut stream = Applier::open(&app).await;
    let mut request = batch(vec![Change::Ack(ack(5, 10, 1)), Change::Ack(ack(6, 10, 1))]);
    request.items[0].timeout_ms = 200;
    request.timeout_ms = 5_000;
    stream.send(request).await;
    let mut outcomes = HashMap::new();
    while outcomes.len() < 2 {
        for result in stream.next().await.unwrap() {
            outcomes.insert(result.id, result.outcome.unwrap());
        }
    }
    assert_eq!(error(&outcomes[&0]).0, Code::DeadlineExceeded);
    assert!(matches!(&outcomes[&1], Outcome::Ack(r) if r.applied));
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert!(app.all_read_states(5).await.read_states.is_empty());
}

fn badge(first: u64) -> Change {
    Change::GetBadgeCounts(GetBadgeCountsRequest {
        user_ids: (first..first + 1000).collect(),
    })
}

/// Found in review: the answers of 450 GetBadgeCounts items of 1,000
/// users each (a 3.6 MB batch) went out in one response of about 5 MB,
/// more than a client decodes by default, and the stream broke. Answers
/// go out in responses of at most 1 MiB.
#[tokio::test]
async fn answers_too_large_for_one_response_are_split() {
    let app = spawn_app().await;
    let mut stream = Applier::open(&app).await;
    // Warm users 1..=1000 (a badge read loads them).
    let warmed = stream.apply(vec![badge(1)]).await;
    assert!(matches!(warmed[0], Outcome::GetBadgeCounts(_)));
    let changes: Vec<Change> = (0..450).map(|_| badge(1)).collect();
    stream.send(batch(changes)).await;
    let mut answered = 0;
    let started = Instant::now();
    while answered < 450 {
        match tokio::time::timeout(Duration::from_secs(120), stream.results.message())
            .await
            .expect("120 s")
        {
            Ok(Some(response)) => {
                answered += response.results.len();
            }
            Ok(None) => panic!("ended"),
            Err(status) => panic!(
                "stream broken after {answered} answers at {:?}: {status:?}",
                started.elapsed()
            ),
        }
    }
}

/// Found in review: an item's `timeout_ms` ran from when the node took its
/// batch from the read-ahead, not from when the batch arrived: an item of
/// 300 ms behind 4,000 held items was applied 1.6 s after it was sent.
#[tokio::test]
async fn an_items_timeout_runs_from_when_its_batch_arrived() {
    let app = app_with_slow_loads_of(1, Duration::from_millis(1_500)).await;
    let mut stream = Applier::open(&app).await;
    let sent = Instant::now();
    for b in 0..4u64 {
        let mut request = batch(
            (0..1000)
                .map(|m| Change::Ack(ack(1, 10, b * 1000 + m + 1)))
                .collect(),
        );
        for item in &mut request.items {
            item.id += b * 1000;
        }
        stream.send(request).await;
    }
    let mut late = batch(vec![Change::Ack(ack(2, 10, 5))]);
    late.items[0].id = 9_999;
    late.items[0].timeout_ms = 300;
    stream.send(late).await;
    loop {
        for result in stream.next().await.unwrap() {
            if result.id == 9_999 {
                let outcome = result.outcome.unwrap();
                let ok = matches!(outcome, Outcome::Ack(ref r) if r.applied);
                assert!(
                    !(ok && sent.elapsed() > Duration::from_millis(600)),
                    "timeout_ms 300, answered applied after {:?}",
                    sent.elapsed()
                );
                if let Outcome::Error(e) = outcome {
                    assert_eq!(Code::from_i32(e.code), Code::DeadlineExceeded);
                }
                return;
            }
        }
    }
}

/// Found in review: at shutdown, answers already made waited, unsent, for
/// every item still under way (here a load of 8 s): a client behind in
/// reading got none of its 10,500 answers for 7 s, and with a slower item
/// would have been cut off by the grace with them unsent.
#[tokio::test]
async fn at_shutdown_answers_go_out_while_a_slow_item_finishes() {
    let app = app_with_slow_loads_of(9, Duration::from_secs(8)).await;
    let channel = small_window_channel(&app).await;
    let mut stream = Applier::try_open(channel, 64).await.unwrap();
    let _ = stream
        .batches
        .try_send(batch(vec![Change::Ack(ack(9, 10, 1))]));
    for b in 0..40u64 {
        let mut request = batch(
            (1..=500)
                .map(|i| Change::Ack(ack(1, 10, b * 500 + i)))
                .collect(),
        );
        for item in &mut request.items {
            item.id += 1 + b * 500;
        }
        let _ = stream.batches.try_send(request);
    }
    tokio::time::sleep(Duration::from_millis(500)).await;
    let stopping = tokio::spawn(app.stop());
    tokio::time::sleep(Duration::from_millis(300)).await;
    let reading = Instant::now();
    let mut last_quick = Duration::ZERO;
    let mut quick = 0;
    let status = loop {
        match stream.results.message().await {
            Ok(Some(response)) => {
                for result in response.results {
                    if result.id != 0 && matches!(result.outcome, Some(Outcome::Ack(_))) {
                        quick += 1;
                        last_quick = reading.elapsed();
                    }
                }
            }
            Ok(None) => panic!("OK end"),
            Err(status) => break status,
        }
    };
    stopping.await.unwrap();
    eprintln!(
        "{quick} quick acks answered, the last {last_quick:?} after reading began; end {status:?}"
    );
    assert!(
        last_quick < Duration::from_secs(3),
        "{quick} answers held {last_quick:?}"
    );
}

/// A channel counted by channel takes its messages in id order, and such a
/// message may name no user: the stream keeps each channel's messages in
/// the order sent too, or the later one would make the earlier one late.
#[tokio::test]
async fn a_channels_messages_apply_in_order_though_they_name_no_user() {
    let mut app = app_with_slow_loads_of(1, Duration::from_millis(300)).await;
    let switch = SetChannelCountingRequest {
        channel_id: 10,
        counted_from: 100,
    };
    app.client.set_channel_counting(switch).await.unwrap();
    let mut stream = Applier::open(&app).await;
    let outcomes = stream
        .apply(vec![
            // Waits for its author's load.
            Change::MessageCreated(message(10, 101, 1, &[], &[])),
            Change::MessageCreated(message(10, 102, 0, &[], &[])),
        ])
        .await;
    let updated = |o: &Outcome| match o {
        Outcome::MessageCreated(r) => r.updated,
        other => panic!("{other:?}"),
    };
    assert_eq!(outcomes.iter().map(updated).collect::<Vec<_>>(), [2, 1]);
    let join = AckRequest {
        manual: true,
        ..ack(2, 10, 100)
    };
    app.client.ack(join).await.unwrap();
    assert_eq!(app.all_read_states(2).await.read_states[0].unread_count, 2);
}
