//! The Watch stream: subscribe, the delta first, then every change in
//! version order; bounded buffers with resync; refusals that leave the
//! stream up; garbage; shutdown.

use std::sync::Arc;
use std::time::Duration;

use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::*;
use readstates::store::faulty::{Effect, Fault, FaultyStore, Operation};
use readstates::test_support::{ack, message};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;
use tonic::{Code, Streaming};

use crate::helpers::{
    TestApp, garbage_stream, small_window_channel, spawn_app, spawn_app_on, spawn_app_with,
    spawn_process, terminate, test_config,
};
use crate::raw_h2;

/// One open Watch stream (the fleet tests use it too).
pub struct Watcher {
    requests: mpsc::Sender<WatchRequest>,
    events: Streaming<WatchEvent>,
}

impl Watcher {
    pub async fn open(app: &TestApp) -> Watcher {
        Watcher::open_on(app.channel().await).await
    }

    /// A stream whose client takes at most 64 KiB ahead of what it reads
    /// (hyper's default is 2 MiB), so that a reader that stops reading
    /// quickly fills the server's buffer. The connection window stays at
    /// hyper's 5 MiB: h2 allows half of it in buffered small DATA frames
    /// (one event each here) before it gives up on the connection.
    pub async fn open_small_window(app: &TestApp) -> Watcher {
        let channel = small_window_channel(app).await;
        Watcher::open_on(channel).await
    }

    pub async fn open_on(channel: Channel) -> Watcher {
        let (requests, receiver) = mpsc::channel(1024);
        let mut client = ReadStatesClient::new(channel);
        let events = client
            .watch(ReceiverStream::new(receiver))
            .await
            .expect("Watch")
            .into_inner();
        Watcher { requests, events }
    }

    pub async fn subscribe(&self, user_id: u64, since_version: u64) {
        let subscribe = watch_request::Action::Subscribe(WatchSubscribe {
            user_id,
            since_version,
        });
        self.send(Some(subscribe)).await;
    }

    pub async fn unsubscribe(&self, user_id: u64) {
        let unsubscribe = watch_request::Action::Unsubscribe(WatchUnsubscribe { user_id });
        self.send(Some(unsubscribe)).await;
    }

    pub async fn send(&self, action: Option<watch_request::Action>) {
        self.requests
            .send(WatchRequest { action })
            .await
            .expect("stream open");
    }

    pub async fn next(&mut self) -> WatchEvent {
        tokio::time::timeout(Duration::from_secs(5), self.events.message())
            .await
            .expect("an event within 5 s")
            .expect("no error")
            .expect("not ended")
    }

    /// The status the stream ends with, within 5 s (the request grace of a
    /// shutdown is 10 s, so it ends well before the grace runs out).
    pub async fn ending(&mut self) -> tonic::Status {
        tokio::time::timeout(Duration::from_secs(5), self.events.message())
            .await
            .expect("the stream ends at once")
            .expect_err("an error status")
    }

    pub async fn changed(&mut self) -> (u64, ReadStatesChanged) {
        let event = self.next().await;
        match event.event {
            Some(watch_event::Event::Changed(changed)) => (event.user_id, changed),
            other => panic!("expected a change, got {other:?}"),
        }
    }

    pub async fn rejected(&mut self) -> (u64, WatchRejected) {
        let event = self.next().await;
        match event.event {
            Some(watch_event::Event::Rejected(rejected)) => (event.user_id, rejected),
            other => panic!("expected a rejection, got {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_subscription_gets_the_delta_then_every_change_in_order() {
    let mut app = spawn_app().await;
    app.client.ack(ack(1, 10, 100)).await.unwrap();
    app.client.ack(ack(1, 11, 100)).await.unwrap();
    let held = app.all_read_states(1).await.version;
    app.client.ack(ack(1, 11, 101)).await.unwrap();

    let mut watcher = Watcher::open(&app).await;
    watcher.subscribe(1, held).await;
    let (user_id, first) = watcher.changed().await;
    assert_eq!(user_id, 1);
    assert!(first.partial, "a delta from the version held");
    assert_eq!(first.read_states.len(), 1);
    assert_eq!(first.read_states[0].channel_id, 11);

    // Every later change, in version order, with the totals.
    let mut version = first.version;
    app.client
        .message_created(message(10, 200, 0, &[1], &[]))
        .await
        .unwrap();
    let (_, mention) = watcher.changed().await;
    assert!(mention.version > version);
    assert_eq!(
        (mention.total_mention_count, mention.unread_channel_count),
        (1, 1)
    );
    assert_eq!(mention.read_states[0].last_message_id, 200);
    version = mention.version;
    app.client.ack(ack(1, 10, 200)).await.unwrap();
    let (_, read) = watcher.changed().await;
    assert!(read.version > version);
    assert_eq!(
        (read.total_mention_count, read.unread_channel_count),
        (0, 0),
        "a badge can go down"
    );
    app.client
        .delete_read_states(readstates::test_support::delete(1, &[11], false))
        .await
        .unwrap();
    let (_, deleted) = watcher.changed().await;
    assert_eq!(deleted.deleted.len(), 1);
    assert_eq!(deleted.deleted[0].channel_id, 11);
    app.client
        .delete_read_states(readstates::test_support::delete(1, &[], true))
        .await
        .unwrap();
    let (_, wiped) = watcher.changed().await;
    assert!(!wiped.partial && wiped.read_states.is_empty(), "{wiped:?}");

    // A full set on subscribe from 0; another user's changes on the same
    // stream; nothing after unsubscribing.
    watcher.subscribe(2, 0).await;
    let (user_id, full) = watcher.changed().await;
    assert_eq!((user_id, full.partial), (2, false));
    watcher.unsubscribe(1).await;
    // Requests are applied in order: once this one's refusal is back, the
    // unsubscribe is done (it travels on another connection than the acks).
    watcher.unsubscribe(7).await;
    assert_eq!(watcher.rejected().await.0, 7);
    app.client.ack(ack(1, 12, 1)).await.unwrap();
    app.client.ack(ack(2, 12, 1)).await.unwrap();
    let (user_id, _) = watcher.changed().await;
    assert_eq!(user_id, 2, "user 1 was unsubscribed");
}

#[tokio::test]
async fn many_changes_from_many_writers_arrive_once_each_in_version_order() {
    let mut app = spawn_app().await;
    let mut watcher = Watcher::open(&app).await;
    for user_id in 1..=20 {
        watcher.subscribe(user_id, 0).await;
        watcher.changed().await;
    }
    let mut writers = Vec::new();
    for writer in 0..4u64 {
        let mut client = app.client.clone();
        writers.push(tokio::spawn(async move {
            for i in 0..50u64 {
                let unread: Vec<u64> = (1..=20).filter(|u| (u + i + writer) % 3 == 0).collect();
                let m = message(writer + 1, 1_000 + i, 0, &[], &unread);
                client.message_created(m).await.unwrap();
            }
        }));
    }
    for writer in writers {
        writer.await.unwrap();
    }
    let mut expected = std::collections::HashMap::new();
    for user_id in 1..=20 {
        expected.insert(user_id, app.all_read_states(user_id).await);
    }
    let mut last = std::collections::HashMap::<u64, ReadStatesChanged>::new();
    let mut done = 0;
    while done < 20 {
        let (user_id, changed) = watcher.changed().await;
        if let Some(previous) = last.get(&user_id) {
            assert!(changed.version > previous.version, "user {user_id}: order");
        }
        let finished = changed.version == expected[&user_id].version;
        last.insert(user_id, changed);
        done += usize::from(finished);
    }
    for (user_id, changed) in last {
        let wanted = &expected[&user_id];
        assert_eq!(changed.total_mention_count, wanted.total_mention_count);
        assert_eq!(changed.unread_channel_count, wanted.unread_channel_count);
    }
}

#[tokio::test]
async fn a_slow_reader_gets_a_resync_and_never_slows_writers() {
    let mut config = test_config();
    config.watch_buffer = 4;
    let mut app = spawn_app_with(config).await;
    let mut watcher = Watcher::open_small_window(&app).await;
    watcher.subscribe(1, 0).await;
    watcher.subscribe(2, 0).await;
    // Nobody reads: the HTTP/2 windows (64 KiB, about 1,000 events) and then
    // the buffer (4 events) fill, and writers go on regardless (were they
    // held up, this would never finish).
    const CHANGES: u64 = 2_000;
    for i in 1..=CHANGES {
        app.client.ack(ack(1, 10, i)).await.unwrap();
        app.client.ack(ack(2, 10, i)).await.unwrap();
    }

    let mut resyncs = std::collections::HashMap::new();
    let mut delivered = std::collections::HashMap::<u64, u64>::new();
    while resyncs.len() < 2 {
        let event = watcher.next().await;
        match event.event.unwrap() {
            watch_event::Event::Changed(c) => {
                assert!(
                    !resyncs.contains_key(&event.user_id),
                    "nothing after a resync"
                );
                delivered.insert(event.user_id, c.version);
            }
            watch_event::Event::Resync(r) => {
                assert_eq!(
                    Some(&r.version),
                    delivered.get(&event.user_id),
                    "last delivered"
                );
                resyncs.insert(event.user_id, r.version);
            }
            other => panic!("{other:?}"),
        }
    }
    // Subscribing again from there gives exactly what was missed.
    watcher.subscribe(1, resyncs[&1]).await;
    let (_, missed) = watcher.changed().await;
    assert!(missed.partial);
    let now = app.all_read_states(1).await;
    assert_eq!(missed.version, now.version);
    assert_eq!(missed.read_states[0].last_acked_id, CHANGES);
}

fn subscribe(user_id: u64) -> WatchRequest {
    WatchRequest {
        action: Some(watch_request::Action::Subscribe(WatchSubscribe {
            user_id,
            since_version: 0,
        })),
    }
}

/// Issue 24, item 1: a gateway re-subscribing its users after a restart or a
/// move writes them all at once, each subscribe its own small DATA frame. The
/// server read one and waited on its load before the next, the frames piled
/// up in HTTP/2 (whose budget for small unread frames is about 4,000 here),
/// and the connection was closed with ENHANCE_YOUR_CALM, every stream on it
/// lost. Item 4: at the per-stream limit a re-subscribe of a watched user,
/// which adds nothing, was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_burst_of_subscribes_up_to_the_limit_is_answered_on_a_connection_that_stays_up() {
    const LIMIT: u64 = 100_000; // validate::MAX_WATCHED_USERS_PER_STREAM
    let mut app = spawn_app().await;
    app.client.ack(ack(LIMIT, 10, 5)).await.unwrap();
    let connection = raw_h2::connect(app.addr, 1 << 20).await;
    let mut watch = raw_h2::open(&connection, "/readstates.v1.ReadStates/Watch").await;
    for user_id in 1..=LIMIT {
        watch
            .send(&subscribe(user_id))
            .unwrap_or_else(|e| panic!("subscribe {user_id}: the stream is gone: {e}"));
    }
    eprintln!("sent");
    let mut answered = std::collections::HashSet::new();
    while answered.len() < LIMIT as usize {
        let event: WatchEvent = tokio::time::timeout(Duration::from_secs(60), watch.next())
            .await
            .expect("answers keep coming")
            .unwrap_or_else(|ended| panic!("ended after {} answers: {ended:?}", answered.len()));
        match event.event {
            Some(watch_event::Event::Changed(_)) => {
                assert!(answered.insert(event.user_id));
                if answered.len() % 10000 == 0 {
                    eprintln!("{}", answered.len());
                }
            }
            other => panic!("user {}: {other:?}", event.user_id),
        }
    }

    // Item 4: watched already, so nothing is added.
    watch.send(&subscribe(LIMIT)).unwrap();
    let event: WatchEvent = watch.next().await.unwrap();
    assert_eq!(event.user_id, LIMIT);
    match event.event {
        Some(watch_event::Event::Changed(changed)) => {
            assert_eq!(changed.read_states[0].last_acked_id, 5)
        }
        other => panic!("a re-subscribe at the limit: {other:?}"),
    }
    watch.send(&subscribe(LIMIT + 1)).unwrap();
    let event: WatchEvent = watch.next().await.unwrap();
    match event.event {
        Some(watch_event::Event::Rejected(rejected)) => {
            assert_eq!(
                (event.user_id, rejected.code),
                (LIMIT + 1, Code::ResourceExhausted as i32)
            )
        }
        other => panic!("one more user than the limit: {other:?}"),
    }

    // The connection is up: another call on it, and events on the stream.
    let mut get = raw_h2::open(&connection, "/readstates.v1.ReadStates/GetReadStates").await;
    get.send(&GetReadStatesRequest {
        user_id: LIMIT,
        ..GetReadStatesRequest::default()
    })
    .unwrap();
    get.finish();
    let response: GetReadStatesResponse = get.next().await.unwrap();
    assert_eq!(response.read_states[0].last_acked_id, 5);
    app.client.ack(ack(7, 10, 1)).await.unwrap();
    let event: WatchEvent = watch.next().await.unwrap();
    assert_eq!(event.user_id, 7);
}

#[tokio::test]
async fn bad_requests_are_rejected_and_the_stream_goes_on() {
    let mut app = spawn_app().await;
    let mut watcher = Watcher::open(&app).await;
    watcher.subscribe(0, 0).await;
    let (_, rejected) = watcher.rejected().await;
    assert_eq!(rejected.code, Code::InvalidArgument as i32);
    assert!(rejected.message.contains("user_id"), "{rejected:?}");
    watcher.unsubscribe(7).await;
    let (user_id, rejected) = watcher.rejected().await;
    assert_eq!((user_id, rejected.code), (7, Code::NotFound as i32));
    watcher.send(None).await;
    let (_, rejected) = watcher.rejected().await;
    assert_eq!(rejected.code, Code::InvalidArgument as i32);
    assert!(rejected.message.contains("action"), "{rejected:?}");

    watcher.subscribe(1, 0).await;
    watcher.changed().await;
    app.client.ack(ack(1, 10, 1)).await.unwrap();
    let (user_id, _) = watcher.changed().await;
    assert_eq!(user_id, 1, "still serving this stream");
    app.all_read_states(1).await;
}

#[tokio::test]
async fn a_stream_of_garbage_ends_alone() {
    let app = spawn_app().await;
    let mut good = Watcher::open(&app).await;
    good.subscribe(1, 0).await;
    good.changed().await;

    let status = garbage_stream(&app, "/readstates.v1.ReadStates/Watch").await;
    assert_ne!(status.code(), Code::Ok, "{status:?}");

    let mut client = app.client.clone();
    client.ack(ack(1, 10, 1)).await.unwrap();
    let (user_id, _) = good.changed().await;
    assert_eq!(user_id, 1, "the other stream is undisturbed");
}

#[tokio::test]
async fn a_watched_user_evicted_and_loaded_again_is_still_watched() {
    let mut config = test_config();
    config.cache_capacity = 2;
    config.shards = 1;
    let app = spawn_app_with(config).await;
    let mut client = app.client.clone();
    client.ack(ack(1, 10, 1)).await.unwrap();
    let mut watcher = Watcher::open(&app).await;
    watcher.subscribe(1, 0).await;
    let (_, first) = watcher.changed().await;
    for user_id in 2..=10 {
        client.ack(ack(user_id, 10, 1)).await.unwrap();
    }
    client.ack(ack(1, 10, 2)).await.unwrap();
    let (user_id, next) = watcher.changed().await;
    assert_eq!(user_id, 1);
    assert!(next.version > first.version);
    assert_eq!(next.read_states[0].last_acked_id, 2);
}

#[tokio::test]
async fn shutdown_ends_streams_with_unavailable() {
    let app = spawn_app().await;
    let mut watcher = Watcher::open(&app).await;
    watcher.subscribe(1, 0).await;
    watcher.changed().await;
    let stopping = tokio::spawn(app.stop());
    let status = watcher.ending().await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    let report = tokio::time::timeout(Duration::from_secs(20), stopping)
        .await
        .expect("shutdown is not held up by the stream")
        .unwrap();
    assert_eq!(report.unwritten, 0);
}

/// Issue 24, item 2: a reader that had fallen behind when SIGTERM came got
/// about two thirds of its queued events, then the connection closed with
/// no status. It must get every queued event, then UNAVAILABLE, as long as
/// it reads within the request grace (10 s). The real binary: the process
/// exits once shutdown is done, which in-process servers never show.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_behind_at_shutdown_gets_every_queued_event_then_unavailable() {
    reader_behind_at_shutdown(Behind::Window).await;
}

/// The same, with the reader behind in TCP: it stopped reading its socket.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_stalled_at_shutdown_gets_every_queued_event_then_unavailable() {
    reader_behind_at_shutdown(Behind::Socket).await;
}

/// How the test's reader falls behind.
enum Behind {
    /// Its HTTP/2 window lets the server only 16 KiB ahead.
    Window,
    /// It stops reading its socket.
    Socket,
}

async fn reader_behind_at_shutdown(behind: Behind) {
    const USERS: u64 = 20;
    const MESSAGES: u64 = 150;
    let (mut server, addr) = spawn_process(&[]).await;
    let mut client = ReadStatesClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    // The rest waits on the server, whose stream buffer (1,024 events)
    // fills and resyncs users.
    let (connection, open_windows, gate) = match behind {
        Behind::Window => {
            let (connection, open) = raw_h2::connect_with_windows(addr, 16 * 1024).await;
            (connection, Some(open), None)
        }
        Behind::Socket => {
            let (connection, gate) = raw_h2::connect_gated(addr).await;
            (connection, None, Some(gate))
        }
    };
    let mut watch = raw_h2::open(&connection, "/readstates.v1.ReadStates/Watch").await;
    for user_id in 1..=USERS {
        watch.send(&subscribe(user_id)).unwrap();
    }
    for _ in 1..=USERS {
        let snapshot: WatchEvent = watch.next().await.unwrap();
        assert!(matches!(
            snapshot.event,
            Some(watch_event::Event::Changed(_))
        ));
    }
    if let Some(gate) = &gate {
        gate.close();
    }
    let users: Vec<u64> = (1..=USERS).collect();
    for message_id in 1..=MESSAGES {
        let request = message(10, message_id, 999, &[], &users);
        client.message_created(request).await.unwrap();
    }
    let mut last = std::collections::HashMap::new();
    for user_id in 1..=USERS {
        let request = GetReadStatesRequest {
            user_id,
            ..GetReadStatesRequest::default()
        };
        let response = client.get_read_states(request).await.unwrap();
        last.insert(user_id, response.into_inner().version);
    }

    terminate(&server);
    tokio::time::sleep(Duration::from_millis(500)).await;
    if let Some(open_windows) = open_windows {
        open_windows.send(16 << 20).unwrap();
    }
    if let Some(gate) = &gate {
        gate.open();
    }
    let mut changes = std::collections::HashMap::<u64, Vec<u64>>::new();
    let mut resyncs = std::collections::HashMap::new();
    let ending = loop {
        let next = tokio::time::timeout(Duration::from_secs(5), watch.next::<WatchEvent>());
        match next.await.expect("the stream goes on until it ends") {
            Ok(event) => match event.event {
                Some(watch_event::Event::Changed(c)) => {
                    assert!(!resyncs.contains_key(&event.user_id), "after a resync");
                    changes.entry(event.user_id).or_default().push(c.version)
                }
                Some(watch_event::Event::Resync(r)) => {
                    assert!(resyncs.insert(event.user_id, r.version).is_none());
                }
                other => panic!("user {}: {other:?}", event.user_id),
            },
            Err(ending) => break ending,
        }
    };
    let received: usize = changes.values().map(Vec::len).sum();
    for user_id in 1..=USERS {
        let versions = changes.remove(&user_id).unwrap_or_default();
        assert!(versions.is_sorted(), "user {user_id} in version order");
        // Every event queued for the user came: up to its resync, if it
        // had one, or else up to its last change.
        let until = resyncs.get(&user_id).unwrap_or(&last[&user_id]);
        assert_eq!(
            versions.last(),
            Some(until),
            "user {user_id}: {received} events received in all, {} resyncs, then {ending:?}",
            resyncs.len()
        );
    }
    assert_eq!(
        ending.0,
        (Code::Unavailable as i32).to_string(),
        "{ending:?}"
    );
    let exit = tokio::time::timeout(Duration::from_secs(20), server.wait())
        .await
        .expect("it exits")
        .unwrap();
    assert!(exit.success(), "{exit:?}");
}

/// Issue 24, item 2, its other half: a reader that has stopped reading
/// (its socket full) holds shutdown up only for the 10 s grace for
/// requests; then the process cuts it off, writes everything and exits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reader_that_never_reads_is_cut_off_when_the_grace_runs_out() {
    let (mut server, addr) = spawn_process(&[]).await;
    let mut client = ReadStatesClient::connect(format!("http://{addr}"))
        .await
        .unwrap();
    let (connection, gate) = raw_h2::connect_gated(addr).await;
    let mut watch = raw_h2::open(&connection, "/readstates.v1.ReadStates/Watch").await;
    watch.send(&subscribe(1)).unwrap();
    let _snapshot: WatchEvent = watch.next().await.unwrap();
    gate.close();
    for message_id in 1..=2_000 {
        let request = message(10, message_id, 999, &[], &[1]);
        client.message_created(request).await.unwrap();
    }
    let started = std::time::Instant::now();
    terminate(&server);
    let exit = tokio::time::timeout(Duration::from_secs(30), server.wait())
        .await
        .expect("it exits")
        .unwrap();
    let took = started.elapsed();
    assert!(exit.success(), "{exit:?}");
    assert!(
        (Duration::from_secs(10)..Duration::from_secs(15)).contains(&took),
        "cut off at the grace: {took:?}"
    );
}

/// Found in review: a stream whose request task waited (here on a user's
/// load that hangs) never saw shutdown begin, so it did not end with
/// UNAVAILABLE but was cut off when the request grace ran out.
#[tokio::test]
async fn shutdown_ends_a_stream_waiting_on_a_subscribe() {
    let store = Arc::new(FaultyStore::memory());
    store.inject(Fault::new(Operation::Load, Effect::Hang).user(9));
    let app = spawn_app_on(test_config(), store.clone()).await;
    let mut watcher = Watcher::open(&app).await;
    watcher.subscribe(1, 0).await;
    watcher.changed().await;
    watcher.subscribe(9, 0).await; // its load hangs
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopping = tokio::spawn(app.stop());
    // Well inside the 10 s request grace.
    let status = watcher.ending().await;
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    store.clear();
    stopping.await.unwrap();
}
