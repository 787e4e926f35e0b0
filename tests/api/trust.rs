//! Who may speak as a node of the fleet (issue 35, items 1 and 2): only a
//! call that carries the fleet's token may use the `Fleet` service or be
//! taken as forwarded or passed on by a node; a client's gets
//! PERMISSION_DENIED, changes nothing, and is counted.

use futures::stream;
use readstates::cluster::credential::FleetCredential;
use readstates::grpc::route::{FORWARDED, PASSED_ON};
use readstates::proto::fleet_client::FleetClient;
use readstates::proto::*;
use readstates::test_support::message;
use tonic::{Code, Request};

use crate::apply::Applier;
use crate::fleet::two_nodes;
use crate::helpers::{as_node, spawn_app_with, test_config};

const REFUSED: &str = "readstates_node_calls_refused_total";

/// The number `metrics` gives the series that starts with `series`.
fn value_of(metrics: &str, series: &str) -> f64 {
    (metrics.lines())
        .find(|line| line.starts_with(series))
        .and_then(|line| line.rsplit(' ').next()?.parse().ok())
        .unwrap_or(0.0)
}

/// `message` with a token of another fleet that shares the secret (issue
/// 53, item 5: such fleets took each other's calls).
fn forged<T>(message: T) -> Request<T> {
    let mut request = Request::new(message);
    let another = FleetCredential::new(crate::helpers::FLEET_SECRET, "another fleet", "b");
    another.stamp(request.metadata_mut());
    request
}

/// Before the fix, each of these was served to anyone: a stranger's
/// `HandOver` cut midway dropped what the real handoff had installed, a
/// forged one was served and written, a forged `CopyChannels` pinned
/// wrong counts, and `ReleaseSlots` was answered.
#[tokio::test]
async fn a_client_without_the_fleet_token_cannot_call_the_fleet_service() {
    let (_ring, a, b) = two_nodes("a", "b").await;
    let mut fleet = FleetClient::new(a.channel().await);
    let release = || ReleaseSlotsRequest {
        epoch: 2,
        slots: vec![],
        node_id: "b".into(),
    };
    let refusals = [
        fleet.release_slots(release()).await.map(|_| ()),
        (fleet.copy_channels(CopyChannelsRequest {
            channels: vec![ChannelStateCopy {
                channel_id: 7,
                counted_from: 1,
                version: u64::MAX,
                ..ChannelStateCopy::default()
            }],
        }))
        .await
        .map(|_| ()),
        (fleet.change_channel(ChangeChannelRequest {
            channel_id: 7,
            message_id: 2,
            deleted: false,
        }))
        .await
        .map(|_| ()),
        (fleet.hand_over(stream::iter([HandOverRequest {
            epoch: 2,
            slots: vec![0],
            node_id: "b".into(),
            done: true,
            ..HandOverRequest::default()
        }])))
        .await
        .map(|_| ()),
    ];
    for refused in refusals {
        let refused = refused.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
        assert!(refused.message().contains("fleet"), "{refused:?}");
    }
    // Another fleet's token is no better.
    let refused = fleet.release_slots(forged(release())).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    // The fleet's own nodes are answered.
    let mut request = Request::new(release());
    as_node(&mut request, "b");
    fleet.release_slots(request).await.unwrap();
    let metrics = a.metrics().await;
    let missing = format!("{REFUSED}{{reason=\"missing\"}}");
    assert!(value_of(&metrics, &missing) >= 4.0, "{metrics}");
    a.stop().await;
    b.stop().await;
}

/// Before the fix, a client's stream marked as forwarded was not counted
/// against `--max-apply-streams`, and a message marked so could claim its
/// channel had taken it, skipping the check that a client's may not.
#[tokio::test]
async fn a_client_cannot_mark_its_calls_as_a_node_s() {
    let mut config = test_config();
    config.max_apply_streams = 1;
    let mut app = spawn_app_with(config).await;
    let _only = Applier::open(&app).await;
    for marker in [FORWARDED, PASSED_ON] {
        let mut stream = Request::new(stream::empty::<ApplyRequest>());
        stream.metadata_mut().insert(marker, "n1".parse().unwrap());
        let refused = app.client.apply(stream).await.unwrap_err();
        assert_eq!(
            refused.code(),
            Code::PermissionDenied,
            "{marker}: {refused:?}"
        );

        let mut created = Request::new(MessageCreatedRequest {
            channel_taken: Some(ChannelTaken { holds: true }),
            ..message(9, 100, 0, &[1], &[2])
        });
        created.metadata_mut().insert(marker, "n1".parse().unwrap());
        let refused = app.client.message_created(created).await.unwrap_err();
        assert_eq!(
            refused.code(),
            Code::PermissionDenied,
            "{marker}: {refused:?}"
        );
    }
    // Nothing counted.
    for user in [1, 2] {
        assert!(app.all_read_states(user).await.read_states.is_empty());
    }
    // An unmarked stream is still refused at the limit.
    let refused = Applier::try_open(app.channel().await, 1).await.err();
    assert_eq!(refused.map(|s| s.code()), Some(Code::ResourceExhausted));
    app.stop().await;
}

/// Issue 53, item 5: the token proved membership, not which member: any
/// node could say it was another. What a call says of its sender must be
/// the node its token names.
#[tokio::test]
async fn a_node_cannot_speak_as_another() {
    let (_ring, a, b) = two_nodes("a", "b").await;
    let mut as_d = Request::new(MessageCreatedRequest {
        channel_taken: Some(ChannelTaken { holds: true }),
        ..message(9, 100, 0, &[1], &[2])
    });
    as_d.metadata_mut().insert(FORWARDED, "c".parse().unwrap());
    as_node(&mut as_d, "d");
    let mut client =
        readstates::proto::read_states_client::ReadStatesClient::new(b.channel().await);
    let refused = client.message_created(as_d).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert!(refused.message().contains("another node"), "{refused:?}");

    let mut hand_over = Request::new(stream::iter([HandOverRequest {
        epoch: 2,
        slots: vec![0],
        node_id: "a".into(),
        done: true,
        ..HandOverRequest::default()
    }]));
    as_node(&mut hand_over, "d");
    let refused = FleetClient::new(b.channel().await)
        .hand_over(hand_over)
        .await
        .unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    a.stop().await;
    b.stop().await;
}

/// A rolling upgrade from a build whose nodes send no token: with
/// `--fleet-auth upgrading` a call without one is taken (and counted), a
/// wrong one still refused.
#[tokio::test]
async fn while_upgrading_a_call_without_a_token_is_taken_and_a_wrong_one_refused() {
    let (store, ring) = crate::fleet::shared();
    let mut config = test_config();
    config.node_id = Some("a".into());
    config.fleet_auth = readstates::config::FleetAuth::Upgrading;
    let a = crate::helpers::spawn_member(config, store, ring.clone()).await;
    crate::fleet::add(&ring, "a", &a, 100).await;
    let mut fleet = FleetClient::new(a.channel().await);
    let release = || ReleaseSlotsRequest {
        epoch: 1,
        slots: vec![],
        node_id: "old".into(),
    };
    fleet.release_slots(release()).await.unwrap();
    let refused = fleet.release_slots(forged(release())).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    // Issue 53, item 2: a backup stream's copy reaches the store, and no
    // build before tokens streams one: never taken without a token.
    let start = MirrorRequest {
        part: Some(mirror_request::Part::Start(MirrorStart {
            node: "old".into(),
            ..MirrorStart::default()
        })),
    };
    let refused = fleet.mirror(stream::iter([start])).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    a.stop().await;
}

/// Issue 53, item 2: a `Mirror` stream's copy is written to the store
/// should it break, and a forged one (a live node named, with a made-up
/// incarnation) was written at once, and displaced the node's real stream.
/// A stream is taken only from the incarnation that holds the node's
/// lease, by the node the ring names its backup; never without a token,
/// even while upgrading.
#[tokio::test]
async fn a_backup_stream_is_taken_only_from_the_process_holding_the_nodes_lease() {
    use readstates::cluster::backup::FORMAT;
    use readstates::cluster::ring_store::RingStore;
    use readstates::proto::mirror_request::Part;

    let (ring, a, b) = two_nodes("a", "b").await;
    let holder = ring
        .lease("a")
        .await
        .unwrap()
        .expect("a holds its lease")
        .holder;
    let mut to_b = FleetClient::new(b.channel().await);
    let start = |node: &str, incarnation: &str| {
        let start = MirrorStart {
            node: node.into(),
            incarnation: incarnation.into(),
            format: FORMAT,
            token: "b/forged/0".into(),
        };
        let mut request = Request::new(stream::iter([MirrorRequest {
            part: Some(Part::Start(start)),
        }]));
        crate::helpers::as_node(&mut request, node);
        request
    };
    let forged = to_b.mirror(start("a", "made up")).await.unwrap_err();
    assert_eq!(forged.code(), Code::Unavailable, "{forged:?}");
    assert!(forged.message().contains("lease"), "{forged:?}");
    // b's backup is a, not b.
    let not_backup = to_b.mirror(start("b", "made up")).await.unwrap_err();
    assert_eq!(not_backup.code(), Code::Unavailable, "{not_backup:?}");
    assert!(not_backup.message().contains("backup"), "{not_backup:?}");
    // The real incarnation's stream is taken.
    to_b.mirror(start("a", &holder))
        .await
        .expect("taken from a's holder");
    a.stop().await;
    b.stop().await;
}
