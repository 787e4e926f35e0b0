//! Issue 37, leases: a fleet node serves only while it holds its lease, so
//! one cut off from the ring store stops serving (UNAVAILABLE, naming no
//! owner it is unsure of) before anyone may take its slots.

use std::time::Duration;

use readstates::cluster::ring_store::{LeaseRecord, NO_BACKUP, RingStore};
use readstates::grpc::route::OWNER;
use readstates::proto::{AckRequest, GetReadStatesRequest};
use readstates::test_support;
use tokio::time::Instant;
use tonic::Code;
use tonic_health::pb::health_check_response::ServingStatus;

use crate::fleet::{add, adopted, health_of, shared};
use crate::helpers::{spawn_member, test_config};

const LEASE: Duration = Duration::from_millis(600);

/// An ack of `user_id`'s channel 1.
fn ack(user_id: u64, message_id: u64) -> AckRequest {
    test_support::ack(user_id, 1, message_id)
}

#[tokio::test]
async fn a_node_cut_off_from_the_ring_store_stops_serving_within_its_lease() {
    let (store, ring) = shared();
    let mut config = test_config();
    config.node_id = Some("a".to_owned());
    config.ring_poll = Duration::from_millis(50);
    config.lease = LEASE;
    let mut a = spawn_member(config, store, ring.clone()).await;
    add(&ring, "a", &a, 100).await;
    adopted(&mut a, 1).await;
    a.client.ack(ack(1, 5)).await.unwrap();

    ring.cut_off("a", true);
    let cut = Instant::now();
    let mut message_id = 6;
    let refused = loop {
        match a.client.ack(ack(1, message_id)).await {
            Ok(_) => {
                let served = cut.elapsed();
                assert!(served < LEASE, "a change answered {served:?} after the cut");
                message_id += 1;
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            Err(refused) => break refused,
        }
    };
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        refused.metadata().get(OWNER).is_none(),
        "names an owner it cannot be sure of: {refused:?}"
    );
    // Reads too: what it holds may be stale once another node serves.
    let read = a
        .client
        .get_read_states(GetReadStatesRequest {
            user_id: 1,
            ..GetReadStatesRequest::default()
        })
        .await
        .unwrap_err();
    assert_eq!(read.code(), Code::Unavailable, "{read:?}");
    for _ in 0..10 {
        let refused = a.client.ack(ack(1, 100)).await.unwrap_err();
        assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }

    // Back in reach: it renews, and serves what it held.
    ring.cut_off("a", false);
    let back = Instant::now();
    loop {
        match a.client.ack(ack(1, 200)).await {
            Ok(_) => break,
            Err(refused) => {
                assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
                assert!(back.elapsed() < 5 * LEASE, "still refused: {refused:?}");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
    let states = (a.client)
        .get_read_states(GetReadStatesRequest {
            user_id: 1,
            ..GetReadStatesRequest::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(states.read_states[0].last_acked_id, 200);
    a.stop().await;
}

/// A node restarted after kill -9 finds its lease held by its earlier
/// start, which may still serve: it waits the lease out (lease + margin)
/// and says it is not ready meanwhile, so that Kubernetes sends it nothing
/// it would refuse.
#[tokio::test]
async fn a_restarted_node_is_ready_only_once_it_has_waited_out_its_earlier_lease() {
    let (store, ring) = shared();
    let earlier = LeaseRecord {
        holder: "an earlier start".to_owned(),
        renewals: 7,
        backup: NO_BACKUP.to_owned(),
        lease: Some(LEASE),
    };
    assert!(ring.swap_lease("a", None, &earlier).await.unwrap());
    let mut config = test_config();
    config.node_id = Some("a".to_owned());
    config.ring_poll = Duration::from_millis(50);
    config.lease = LEASE;
    let lapse = LEASE + config.lease_margin;
    let started = Instant::now();
    let mut a = spawn_member(config, store, ring.clone()).await;
    while health_of(&a).await != ServingStatus::Serving {
        assert!(started.elapsed() < 3 * lapse, "never ready");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ready = started.elapsed();
    assert!(
        ready >= lapse,
        "ready {ready:?} after start, the earlier lease unexpired"
    );
    add(&ring, "a", &a, 100).await;
    adopted(&mut a, 1).await;
    a.client.ack(ack(1, 5)).await.unwrap();
    let taken = ring.lease("a").await.unwrap().unwrap();
    assert_ne!(taken.holder, earlier.holder);
    a.stop().await;
}
