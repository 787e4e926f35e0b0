//! Requests a node sends on to other nodes go as items of one Apply stream
//! per peer, not a unary call each: single-user changes, and the parts of
//! split messages, deletions and badge counts. A peer that has no Apply
//! (an older build, during an upgrade) is sent unary calls instead. The
//! routing client sends changes straight to their owners' streams.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::{BufMut, Bytes, BytesMut};
use prost::Message;
use readstates::cluster::ring_store::RingStore;
use readstates::metrics::scrape;
use readstates::proto::{
    AckRequest, AckResponse, GetBadgeCountsRequest, MessageCreatedRequest, MessageDeletedRequest,
};
use readstates_routing::Node;

use readstates::proto::apply_item::Change;
use readstates::proto::apply_result::Outcome;
use readstates::store::faulty::{Effect, Fault, FaultyStore, Operation};
use readstates_routing::client::FleetClient;
use std::time::Duration;

use crate::apply::Applier;
use crate::fleet::{
    add, beside_a_stand_in, first_read_state, member, set_weight, shared, two_nodes,
};
use crate::helpers::{spawn_app, spawn_member, test_config};

fn ack(user_id: u64, message_id: u64) -> AckRequest {
    AckRequest {
        user_id,
        channel_id: 1,
        message_id,
        ..AckRequest::default()
    }
}

/// The requests answered OK of `method` at `node`, as `text` counts them.
fn count(text: &str, method: &str, node: &str) -> f64 {
    let series =
        format!("readstates_requests_total{{method=\"{method}\",code=\"OK\",node=\"{node}\"}}");
    scrape::value(text, &series)
}

#[tokio::test]
async fn requests_sent_on_go_over_one_apply_stream_per_peer() {
    // Node ids of their own: the metrics are per node id, and other tests
    // run nodes in this process too.
    let (ring, mut a, b) = two_nodes("streams-a", "streams-b").await;
    let record = ring.load().await.unwrap();
    let on_b: Vec<u64> = (1..)
        .filter(|&u| record.ring.owner_of(u).unwrap().id == "streams-b")
        .take(10)
        .collect();
    let on_a: Vec<u64> = (1..)
        .filter(|&u| record.ring.owner_of(u).unwrap().id == "streams-a")
        .take(10)
        .collect();

    for &user in &on_b {
        a.client.ack(ack(user, 20)).await.unwrap();
    }
    let everyone: Vec<u64> = on_a.iter().chain(&on_b).copied().collect();
    let created = a
        .client
        .message_created(MessageCreatedRequest {
            channel_id: 2,
            message_id: 30,
            unread_user_ids: everyone.clone(),
            ..MessageCreatedRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(created.updated, 20);
    let deleted = a
        .client
        .message_deleted(MessageDeletedRequest {
            channel_id: 2,
            message_id: 30,
            unread_user_ids: everyone.clone(),
            ..MessageDeletedRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(deleted.updated, 20);
    let badges = a
        .client
        .get_badge_counts(GetBadgeCountsRequest {
            user_ids: everyone.clone(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(badges.counts.len(), 20);

    let text = b.metrics().await;
    assert_eq!(
        count(&text, "Apply", "streams-b"),
        1.0,
        "one stream: {text}"
    );
    assert_eq!(count(&text, "Apply.Ack", "streams-b"), 10.0);
    for part in ["MessageCreated", "MessageDeleted", "GetBadgeCounts"] {
        assert_eq!(
            count(&text, &format!("Apply.{part}"), "streams-b"),
            1.0,
            "{part}"
        );
        assert_eq!(count(&text, part, "streams-b"), 0.0, "{part} as a call");
    }
    assert_eq!(count(&text, "Ack", "streams-b"), 0.0, "no unary Ack");
    for &user in &on_b {
        assert_eq!(
            first_read_state(&mut a, user)
                .await
                .map(|s| s.last_acked_id),
            Some(20)
        );
    }
    a.stop().await;
    b.stop().await;
}

/// The routing client sends each change to its owner's stream, and a
/// change that was not applied (its slot moved, a load failed) is sent
/// again until it is: every change answered OK stays applied.
#[tokio::test]
async fn the_routing_client_applies_changes_at_their_owners_while_slots_move() {
    let (ring, mut a, b) = two_nodes("apply-a", "apply-b").await;
    let fleet = FleetClient::connect(&a.addr.to_string()).await.unwrap();
    let apply = |fleet: FleetClient, user: u64, message_id: u64| async move {
        let answer = fleet
            .apply(
                user,
                Change::Ack(ack(user, message_id)),
                Some(Duration::from_secs(10)),
            )
            .await
            .unwrap_or_else(|s| panic!("user {user}: {s:?}"));
        assert!(
            matches!(answer, Outcome::Ack(ref r) if r.applied),
            "{answer:?}"
        );
    };
    for user in 1..=20 {
        apply(fleet.clone(), user, 10).await;
    }
    // Straight to owners: each node took only its own users' items (a
    // forwarded one counts at both).
    let text = a.metrics().await;
    let items = count(&text, "Apply.Ack", "apply-a") + count(&text, "Apply.Ack", "apply-b");
    assert_eq!(items, 20.0, "{text}");

    let mover = {
        let ring = ring.clone();
        tokio::spawn(async move {
            set_weight(&ring, "apply-b", 300).await;
            set_weight(&ring, "apply-b", 100).await;
        })
    };
    let mut message_id = 10;
    while !mover.is_finished() {
        message_id += 1;
        let acks = (1..=20).map(|user| apply(fleet.clone(), user, message_id));
        futures::future::join_all(acks).await;
    }
    mover.await.unwrap();
    assert!(message_id > 11, "no change was applied while slots moved");
    for user in 1..=20 {
        let state = first_read_state(&mut a, user).await.unwrap();
        assert_eq!(state.last_acked_id, message_id, "user {user}");
    }
    a.stop().await;
    b.stop().await;
}

#[tokio::test]
async fn the_routing_client_retries_an_item_that_was_not_applied() {
    let store = Arc::new(FaultyStore::memory());
    let ring = Arc::new(readstates::cluster::ring_store::memory::MemoryRingStore::default());
    let mut config = test_config();
    config.node_id = Some("apply-retry".into());
    config.ring_poll = Duration::from_millis(50);
    let a = spawn_member(config, store.clone(), ring.clone()).await;
    add(&ring, "apply-retry", &a, 100).await;
    let fleet = FleetClient::connect(&a.addr.to_string()).await.unwrap();
    store.inject(Fault::new(Operation::Load, Effect::Fail).lasting(Duration::from_secs(1)));
    let started = std::time::Instant::now();
    let answer = fleet.apply(1, Change::Ack(ack(1, 30)), None).await.unwrap();
    assert!(
        matches!(answer, Outcome::Ack(ref r) if r.applied),
        "{answer:?}"
    );
    assert!(started.elapsed() >= Duration::from_millis(900));

    store.inject(Fault::new(Operation::Load, Effect::Fail).lasting(Duration::from_secs(1)));
    let once = fleet.clone().with_retry_budget(Duration::ZERO);
    let refused = once
        .apply(2, Change::Ack(ack(2, 30)), None)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    a.stop().await;
}

/// A peer of an older build, with no Apply: the node finds out on its
/// first stream and sends that request, and the next ones, as unary calls.
#[tokio::test]
async fn a_peer_without_apply_is_sent_unary_calls() {
    let (store, ring) = shared();
    let old = OldNode::start().await;
    let x = Node {
        id: "x".into(),
        address: old.address.clone(),
        weight: 100,
    };
    let (mut b, record) = beside_a_stand_in(x, &store, &ring).await;
    let on_x: Vec<u64> = (1..)
        .filter(|&u| record.ring.owner_of(u).unwrap().id == "x")
        .take(3)
        .collect();
    for &user in &on_x {
        let answer = b.client.ack(ack(user, 5)).await.unwrap().into_inner();
        assert_eq!(answer.version, OldNode::VERSION, "answered by x");
    }
    let calls = old.calls();
    assert_eq!(calls.get("Apply"), Some(&1), "{calls:?}");
    assert_eq!(calls.get("Ack"), Some(&3), "{calls:?}");
    b.stop().await;
}

/// Found in rereading: a stream to a peer that could not be opened for
/// any reason (here the peer answered UNAVAILABLE) made the node take it
/// for a peer without Apply, send the request as a call, and send it calls
/// for a minute. Only a refusal of the stream itself (UNIMPLEMENTED, or
/// RESOURCE_EXHAUSTED) does; the request is otherwise not applied
/// (UNAVAILABLE), and the next one opens a stream again.
#[tokio::test]
async fn a_peer_busy_when_its_stream_opens_is_not_sent_calls_instead() {
    let (store, ring) = shared();
    let x = OldNode::start_busy_first(true).await;
    let stand_in = Node {
        id: "x".into(),
        address: x.address.clone(),
        weight: 100,
    };
    let (mut b, record) = beside_a_stand_in(stand_in, &store, &ring).await;
    let user = (1..)
        .find(|&u| record.ring.owner_of(u).unwrap().id == "x")
        .unwrap();
    let refused = b.client.ack(ack(user, 5)).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::Unavailable, "{refused:?}");
    let answer = b.client.ack(ack(user, 6)).await.unwrap().into_inner();
    assert_eq!(answer.version, OldNode::VERSION);
    let calls = x.calls();
    assert_eq!(
        calls.get("Apply"),
        Some(&2),
        "a stream tried again: {calls:?}"
    );
    assert_eq!(calls.get("Ack"), Some(&1), "{calls:?}");
    b.stop().await;
}

/// A stand-in for a node of an older build: HTTP/2 that answers `Ack`
/// with a fixed response and every other method UNIMPLEMENTED, and counts
/// the calls by method.
struct OldNode {
    address: String,
    calls: Arc<Mutex<HashMap<String, usize>>>,
}

impl OldNode {
    const VERSION: u64 = 4242;

    async fn start() -> OldNode {
        OldNode::start_busy_first(false).await
    }

    /// With `busy_first`, its first Apply call is answered UNAVAILABLE (as
    /// a node busy or shutting down may), the later ones UNIMPLEMENTED.
    async fn start_busy_first(busy_first: bool) -> OldNode {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let calls = Arc::new(Mutex::new(HashMap::new()));
        let counted = calls.clone();
        tokio::spawn(async move {
            while let Ok((socket, _)) = listener.accept().await {
                let counted = counted.clone();
                tokio::spawn(async move {
                    let Ok(mut connection) = h2::server::handshake(socket).await else {
                        return;
                    };
                    while let Some(Ok((request, respond))) = connection.accept().await {
                        let method = request.uri().path().rsplit('/').next().unwrap_or_default();
                        let seen = {
                            let mut counted = counted.lock().unwrap();
                            let seen = counted.entry(method.to_owned()).or_default();
                            *seen += 1;
                            *seen
                        };
                        let busy = busy_first && method == "Apply" && seen == 1;
                        answer(method, respond, busy);
                    }
                });
            }
        });
        OldNode { address, calls }
    }

    fn calls(&self) -> HashMap<String, usize> {
        self.calls.lock().unwrap().clone()
    }
}

/// Answers `method` as an older build does (`busy`: UNAVAILABLE).
fn answer(method: &str, mut respond: h2::server::SendResponse<Bytes>, busy: bool) {
    let head = |status: Option<&str>| {
        let mut response = http::Response::builder()
            .status(200)
            .header("content-type", "application/grpc");
        if let Some(status) = status {
            response = response.header("grpc-status", status);
        }
        response.body(()).unwrap()
    };
    if busy {
        let _ = respond.send_response(head(Some("14")), true);
        return;
    }
    if method != "Ack" {
        let _ = respond.send_response(head(Some("12")), true);
        return;
    }
    let Ok(mut body) = respond.send_response(head(None), false) else {
        return;
    };
    let message = AckResponse {
        applied: true,
        version: OldNode::VERSION,
        read_state: None,
    }
    .encode_to_vec();
    let mut frame = BytesMut::with_capacity(5 + message.len());
    frame.put_u8(0);
    frame.put_u32(message.len() as u32);
    frame.put_slice(&message);
    let _ = body.send_data(frame.freeze(), false);
    let mut trailers = http::HeaderMap::new();
    trailers.insert("grpc-status", "0".parse().unwrap());
    let _ = body.send_trailers(trailers);
}

fn badge(first: u64) -> Change {
    Change::GetBadgeCounts(GetBadgeCountsRequest {
        user_ids: (first..first + 1000).collect(),
    })
}

/// Found in review: 450 callers of one shared stream (as a node's stream
/// to a peer), each with a GetBadgeCounts part of 1,000 users, and one
/// with an Ack: their answers, in one response too large to decode, broke
/// the stream, and every caller got CANCELLED.
#[tokio::test]
async fn a_shared_stream_answers_every_caller_of_large_parts() {
    let app = spawn_app().await;
    let applier = readstates_routing::apply::Applier::open(
        app.channel().await,
        tonic::metadata::MetadataMap::new(),
        readstates_routing::apply::MAX_BATCH,
    );
    applier.apply(badge(1), None).await.expect("warm");
    let calls = (0..450)
        .map(|i| {
            let applier = applier.clone();
            tokio::spawn(async move {
                // One caller's Ack among the push service's badge reads.
                let change = if i == 200 {
                    Change::Ack(ack(5_000, 5))
                } else {
                    badge(1)
                };
                applier.apply(change, None).await
            })
        })
        .collect::<Vec<_>>();
    let mut answers = Vec::new();
    for call in calls {
        answers.push(call.await.unwrap());
    }
    let mut codes: HashMap<String, usize> = HashMap::new();
    for answer in &answers {
        let code = match answer {
            Ok(_) => "OK".to_owned(),
            Err(s) => format!("{:?}", s.code()),
        };
        *codes.entry(code).or_default() += 1;
    }
    assert_eq!(codes.get("OK"), Some(&450), "{codes:?}");
}

/// Found in review: a node at its limit of Apply streams (clients' message
/// pipelines) refused the stream of another node, so every request sent
/// on to it failed. Streams of other nodes do not count against the limit.
#[tokio::test]
async fn a_peer_at_its_limit_of_streams_still_takes_what_is_sent_on() {
    let (store, ring) = shared();
    let mut a = member("rv-limit-a", &store, &ring).await;
    let mut config = test_config();
    config.node_id = Some("rv-limit-b".to_owned());
    config.ring_poll = Duration::from_millis(50);
    config.max_apply_streams = 1;
    let b = spawn_member(config, store.clone(), ring.clone()).await;
    add(&ring, "rv-limit-a", &a, 100).await;
    add(&ring, "rv-limit-b", &b, 100).await;
    let record = ring.load().await.unwrap();
    let user = (1..)
        .find(|&u| record.ring.owner_of(u).unwrap().id == "rv-limit-b")
        .unwrap();
    // A message pipeline holds B's only Apply stream.
    let _pipeline = Applier::open(&b).await;
    let answer = a.client.ack(ack(user, 5)).await;
    assert!(answer.is_ok(), "{answer:?}");
}
