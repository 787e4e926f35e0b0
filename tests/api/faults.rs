//! The real server on a store that fails, delays or hangs on command
//! (`readstates::store::faulty`).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::{AckRequest, GetReadStatesRequest, MessageCreatedRequest};
use readstates::store::Store;
use readstates::store::faulty::{Effect, Fault, FaultyStore, Operation};
use readstates::store::memory::MemoryStore;
use tonic::body::Body;
use tonic::{Code, Request};

use crate::helpers::{spawn_app_on, test_config};

/// A client that sends the deadline and leaves it to the server: tonic's
/// own channel would cancel the call itself at the same deadline.
fn deadline_blind_client(addr: SocketAddr) -> ReadStatesClient<Client<HttpConnector, Body>> {
    let http2 = Client::builder(TokioExecutor::new())
        .http2_only(true)
        .build_http::<Body>();
    let origin = format!("http://{addr}").parse().unwrap();
    ReadStatesClient::with_origin(http2, origin)
}

/// Case 9 of "Lossless at every transition": a server-side deadline came
/// back CANCELLED.
#[tokio::test]
async fn a_passed_deadline_is_deadline_exceeded() {
    let store = Arc::new(FaultyStore::memory());
    let delay = Effect::Delay(Duration::from_millis(500));
    store.inject(Fault::new(Operation::Load, delay));
    let app = spawn_app_on(test_config(), store.clone()).await;
    let mut request = Request::new(GetReadStatesRequest {
        user_id: 1,
        ..GetReadStatesRequest::default()
    });
    request
        .metadata_mut()
        .insert("grpc-timeout", "100m".parse().unwrap());
    let mut client = deadline_blind_client(app.addr);
    let status = client.get_read_states(request).await.unwrap_err();
    assert_eq!(status.code(), Code::DeadlineExceeded, "{status:?}");
}

/// Case 4: a MessageCreated cut by the client's deadline changes nobody, so
/// the retry counts each user once.
#[tokio::test]
async fn a_message_cut_by_its_deadline_and_retried_counts_once() {
    let store = Arc::new(FaultyStore::memory());
    let delay = Effect::Delay(Duration::from_millis(2));
    store.inject(Fault::new(Operation::Load, delay));
    let mut config = test_config();
    config.cache_capacity = 200;
    config.shards = 1;
    let mut app = spawn_app_on(config, store.clone()).await;
    let users: Vec<u64> = (1..=1_000).collect();
    let message = MessageCreatedRequest {
        channel_id: 10,
        message_id: 100,
        unread_user_ids: users.clone(),
        ..MessageCreatedRequest::default()
    };
    let mut cut = Request::new(message.clone());
    cut.set_timeout(Duration::from_millis(20));
    let status = app.client.message_created(cut).await.unwrap_err();
    assert!(
        matches!(status.code(), Code::DeadlineExceeded | Code::Cancelled),
        "{status:?}"
    );

    store.clear();
    let updated = app.client.message_created(message).await.unwrap();
    assert_eq!(updated.into_inner().updated, 1_000);
    for user_id in users {
        let read_states = app.all_read_states(user_id).await.read_states;
        assert_eq!(
            read_states[0].unread_count, 1,
            "user {user_id} counted once"
        );
    }
}

/// Case 6 of "Lossless at every transition": a request still running after
/// the shutdown grace (its load hung) kept its connection task, applied its
/// change after the final drain, and answered OK: acknowledged, never
/// written. Now it is refused, unapplied.
#[tokio::test]
async fn a_request_outliving_the_shutdown_grace_is_refused_unapplied() {
    let durable = Arc::new(MemoryStore::new());
    let store = Arc::new(FaultyStore::new(durable.clone(), 0));
    store.inject(Fault::new(Operation::Load, Effect::Hang).user(7));
    let app = spawn_app_on(test_config(), store.clone()).await;
    let mut client = app.client.clone();
    let request = tokio::spawn(async move {
        let ack = AckRequest {
            user_id: 7,
            channel_id: 10,
            message_id: 100,
            ..AckRequest::default()
        };
        client.ack(ack).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await; // its load hangs
    let report = app.stop().await; // waits out the request grace, then drains
    assert_eq!(report.unwritten, 0);
    store.clear(); // the load returns after the drain
    let answer = request.await.unwrap();
    let stored = durable.load(7).await.unwrap();
    let status = answer.expect_err("a change after the final drain must be refused");
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    assert!(stored.read_states.is_empty(), "refused, yet applied");
}
