//! Where a request's time went (issue 56, tail capture): a client that asks
//! gets its request's breakdown back, and a request slower than
//! `slow_request` is counted (and logged) with it.

use std::sync::Arc;
use std::time::Duration;

use readstates::metrics::scrape;
use readstates::proto::{AckRequest, GetReadStatesRequest};
use readstates::store::faulty::{Effect, Fault, FaultyStore, Operation};
use readstates::timing::TIMING;
use tonic::Request;

use crate::helpers::{spawn_app_on, test_config};

/// `name=<n>us` of a `readstates-timing` value, in microseconds.
fn phase(header: &str, name: &str) -> u64 {
    header
        .split(',')
        .find_map(|part| part.strip_prefix(name)?.strip_prefix('='))
        .and_then(|us| us.strip_suffix("us")?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {header}"))
}

#[tokio::test]
async fn a_slow_load_shows_in_the_breakdown_and_is_counted() {
    let store = Arc::new(FaultyStore::memory());
    let mut config = test_config();
    config.slow_request = Duration::from_millis(100);
    let mut app = spawn_app_on(config, store.clone()).await;
    // Process-wide: other tests' slow requests count too.
    let slow = "readstates_slow_requests_total{method=\"GetReadStates\"}";
    let count = async |app: &crate::helpers::TestApp| scrape::value(&app.metrics().await, slow);
    let before = count(&app).await;

    store.inject(Fault::new(
        Operation::Load,
        Effect::Delay(Duration::from_millis(150)),
    ));
    let mut request = Request::new(GetReadStatesRequest {
        user_id: 1,
        ..GetReadStatesRequest::default()
    });
    request.metadata_mut().insert(TIMING, "1".parse().unwrap());
    let response = app.client.get_read_states(request).await.unwrap();
    let header = response
        .metadata()
        .get(TIMING)
        .expect("asked for")
        .to_str()
        .unwrap();
    assert!(phase(header, "load") >= 150_000, "{header}");
    assert!(phase(header, "total") >= phase(header, "load"), "{header}");
    assert_eq!(phase(header, "forward"), 0, "{header}");
    assert!(count(&app).await > before, "not counted");

    // Not asked: no breakdown.
    let ack = AckRequest {
        user_id: 1,
        channel_id: 5,
        message_id: 9,
        ..AckRequest::default()
    };
    let response = app.client.ack(ack).await.unwrap();
    assert!(response.metadata().get(TIMING).is_none());
    app.stop().await;
}
