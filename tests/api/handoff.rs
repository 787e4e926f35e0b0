//! The warm handoff's failure paths, found in review: a handoff that does
//! not complete (cut, past a deadline, or dropped by its sender) leaves
//! nothing of its copy ahead on the new owner, which then serves what the
//! store holds; and the MessageDeleted memory of users no longer cached
//! moves with their slot. The old owner is played by a stand-in `Fleet`
//! server where the test needs to control the stream.

use std::sync::Arc;
use std::time::Duration;

use readstates::cluster::admin::{self, RingChange};
use readstates::cluster::ring_store::RingStore;
use readstates::cluster::ring_store::memory::MemoryRingStore;
use readstates::proto::fleet_client::FleetClient as RawFleet;
use readstates::proto::fleet_server::{Fleet, FleetServer};
use readstates::proto::{
    ChangeChannelRequest, ChangeChannelResponse, CopyChannelsRequest, CopyChannelsResponse,
    HandOverFormatRequest, HandOverFormatResponse, HandOverRequest, HandOverResponse,
    HandedReadState, HandedUser, MessageCreatedRequest, MessageDeletedRequest, MirrorRequest,
    MirrorResponse, ReleaseSlotsRequest, ReleaseSlotsResponse,
};
use readstates::read_state::{Kind, ReadState};
use readstates::store::memory::MemoryStore;
use readstates::store::{Store, UserWrite};
use readstates_routing::{Node, slot_of};
use tokio::sync::watch;
use tonic::{Request, Response, Status, Streaming};

use crate::fleet::{adopted, first_read_state, reweigh};
use crate::helpers::{TestApp, as_node, spawn_member, test_config};

/// A stand-in for an old owner "x": answers ReleaseSlots once told to, and
/// makes the channel changes it is asked for (it still serves them),
/// counting those passed on to it.
#[derive(Clone)]
struct FakeX {
    release: watch::Receiver<bool>,
    passed_on: Arc<std::sync::atomic::AtomicUsize>,
}

#[tonic::async_trait]
impl Fleet for FakeX {
    type MirrorStream = futures::stream::Empty<Result<MirrorResponse, Status>>;

    async fn mirror(
        &self,
        _request: Request<Streaming<MirrorRequest>>,
    ) -> Result<Response<Self::MirrorStream>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn release_slots(
        &self,
        _request: Request<ReleaseSlotsRequest>,
    ) -> Result<Response<ReleaseSlotsResponse>, Status> {
        let mut r = self.release.clone();
        let _ = r.wait_for(|&v| v).await;
        Ok(Response::new(ReleaseSlotsResponse {}))
    }
    async fn hand_over(
        &self,
        _request: Request<Streaming<HandOverRequest>>,
    ) -> Result<Response<HandOverResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn hand_over_format(
        &self,
        _request: Request<HandOverFormatRequest>,
    ) -> Result<Response<HandOverFormatResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
    async fn change_channel(
        &self,
        request: Request<ChangeChannelRequest>,
    ) -> Result<Response<ChangeChannelResponse>, Status> {
        if request.metadata().contains_key("x-readstates-passed-on") {
            (self.passed_on).fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        Ok(Response::new(ChangeChannelResponse {
            counted: true,
            changed: true,
            holds: true,
            state: None,
        }))
    }
    async fn copy_channels(
        &self,
        _request: Request<CopyChannelsRequest>,
    ) -> Result<Response<CopyChannelsResponse>, Status> {
        Err(Status::unimplemented("fake"))
    }
}

fn state(acked: u64, version: u64) -> ReadState {
    ReadState {
        channel_id: 1,
        last_acked_id: acked,
        last_message_id: acked,
        version,
        mention_count: 0,
        unread_count: 0,
        kind: Kind::Channel,
        deleted: false,
        muted: false,
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Ending {
    /// The sender's stream errors / ends without Done: receiver discards.
    Cut,
    /// The HandOver's deadline passes (grpc-timeout): tonic drops the handler.
    Timeout,
    /// The sender drops the call (its adopt cancelled, e.g. SIGTERM after a
    /// drain timeout): RST_STREAM, hyper drops the handler.
    Dropped,
    /// The release is answered (the sender gave up on the handoff, wrote
    /// the users, or an operator forced the release of a dead sender)
    /// before the receiver sees the handoff end: the call is still open
    /// while the slot starts being served.
    ReleasedFirst,
}

/// A fleet of b and a stand-in x, whose slots b is acquiring from x (which
/// answers ReleaseSlots once `release` says so).
struct Acquiring {
    b: TestApp,
    store: Arc<MemoryStore>,
    ring: Arc<MemoryRingStore>,
    release: watch::Sender<bool>,
    epoch: u64,
    /// A user whose slot moves from x to b.
    user: u64,
    /// Channel changes b passed on to x.
    passed_on: Arc<std::sync::atomic::AtomicUsize>,
}

async fn acquiring_from_a_stand_in() -> Acquiring {
    let store = Arc::new(MemoryStore::new());
    let ring = Arc::new(MemoryRingStore::default());
    // The fake old owner x.
    let (release_tx, release_rx) = watch::channel(false);
    let passed_on = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let x_addr = listener.local_addr().unwrap();
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(FleetServer::new(FakeX {
                release: release_rx,
                passed_on: passed_on.clone(),
            }))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let mut config = test_config();
    config.node_id = Some("b".into());
    config.ring_poll = Duration::from_millis(50);
    let mut b = spawn_member(config, store.clone(), ring.clone()).await;

    let x = Node {
        id: "x".into(),
        address: x_addr.to_string(),
        weight: 100,
    };
    admin::change(&*ring, RingChange::Add(x)).await.unwrap();
    ring.report("x", 1).await.unwrap();
    let bn = Node {
        id: "b".into(),
        address: b.addr.to_string(),
        weight: 0,
    };
    admin::change(&*ring, RingChange::Add(bn)).await.unwrap();
    ring.report("x", 2).await.unwrap();
    ring.report("b", 2).await.unwrap();
    let record = reweigh(&ring, "b", 100).await;
    let epoch = record.ring.epoch();
    adopted(&mut b, epoch).await;
    let user = (1..)
        .find(|&u| {
            record.ring.owner_of(u).unwrap().id == "b"
                && record.previous.owner_of(u).unwrap().id == "x"
        })
        .unwrap();
    Acquiring {
        b,
        store,
        ring,
        release: release_tx,
        epoch,
        user,
        passed_on,
    }
}

/// Found at 3,000/s (issue 54): a message of a channel counted by channel
/// whose slot moved was held by the new owner from the start of the move
/// until it had acquired the slot (the whole handoff of the slot's users,
/// a second or more), while the previous owner still served the channel.
/// The new owner passes it on to the previous owner instead. With the old
/// handler the change waits out the hold (2 s) and is refused.
#[tokio::test]
async fn a_channel_change_for_a_slot_being_acquired_is_made_by_its_previous_owner() {
    let fleet = acquiring_from_a_stand_in().await;
    let mut client = RawFleet::connect(format!("http://{}", fleet.b.addr))
        .await
        .unwrap();
    let mut request = Request::new(ChangeChannelRequest {
        channel_id: fleet.user,
        message_id: 1_000,
        deleted: false,
    });
    as_node(&mut request, "x");
    request.set_timeout(Duration::from_secs(5));
    let started = std::time::Instant::now();
    let answer = client
        .change_channel(request)
        .await
        .expect("made")
        .into_inner();
    assert!(answer.counted && answer.changed);
    assert_eq!(
        fleet.passed_on.load(std::sync::atomic::Ordering::SeqCst),
        1,
        "made by x, passed on by b"
    );
    assert!(
        started.elapsed() < Duration::from_secs(1),
        "answered after {:?}: held while b acquires",
        started.elapsed()
    );
    // Still acquiring: x has not released the slot.
    assert!(!*fleet.release.borrow());
}

async fn stale_copy_ahead(ending: Ending) -> (u64, u64, u32) {
    let Acquiring {
        mut b,
        store,
        ring,
        release: release_tx,
        epoch,
        user,
        ..
    } = acquiring_from_a_stand_in().await;
    // What x held of the user at its copy ahead: channel 1 acked to 5,
    // written (version 5).
    store
        .write(&UserWrite {
            user_id: user,
            version: 5,
            delta_floor: 0,
            clear_below: None,
            read_states: vec![state(5, 5)],
            parents: Default::default(),
            lowered: Vec::new(),
        })
        .await
        .unwrap();

    // x's HandOver: the copy ahead of the user, then nothing more for now.
    let (send, requests) = tokio::sync::mpsc::channel::<HandOverRequest>(4);
    send.send(HandOverRequest {
        epoch,
        slots: vec![u32::from(slot_of(user))],
        node_id: "x".into(),
        users: vec![handed(user, 5, 5, 5)],
        ..HandOverRequest::default()
    })
    .await
    .unwrap();
    let mut client = RawFleet::connect(format!("http://{}", b.addr))
        .await
        .unwrap();
    let mut request = Request::new(tokio_stream::wrappers::ReceiverStream::new(requests));
    as_node(&mut request, "x");
    if ending == Ending::Timeout {
        request.set_timeout(Duration::from_millis(800));
    }
    let call = tokio::spawn(async move { client.hand_over(request).await });
    // Let b install the copy ahead.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let open = match ending {
        Ending::Cut => {
            drop(send);
            let _ = call.await.unwrap();
            None
        }
        Ending::Timeout => {
            let _ = call.await.unwrap();
            drop(send);
            None
        }
        Ending::Dropped => {
            call.abort();
            let _ = call.await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            drop(send);
            None
        }
        Ending::ReleasedFirst => Some((send, call)),
    };
    // x, told nothing arrived, does the cold path: the user changed since
    // the copy (acked to 10), x writes it, and answers ReleaseSlots.
    store
        .write(&UserWrite {
            user_id: user,
            version: 7,
            delta_floor: 0,
            clear_below: None,
            read_states: vec![state(10, 7)],
            parents: Default::default(),
            lowered: Vec::new(),
        })
        .await
        .unwrap();
    release_tx.send(true).unwrap();
    // b serves the slot once released.
    ring.report("x", epoch).await.unwrap();
    admin::wait_served(&*ring, epoch, Duration::from_secs(20))
        .await
        .unwrap();
    let acked = first_read_state(&mut b, user)
        .await
        .map_or(0, |s| s.last_acked_id);
    if let Some((send, call)) = open {
        drop(send);
        let _ = call.await.unwrap();
    }
    // A redelivered message 8 (at or below the ack of 10) must count nothing.
    let created = b
        .client
        .message_created(MessageCreatedRequest {
            channel_id: 1,
            message_id: 8,
            unread_user_ids: vec![user],
            ..MessageCreatedRequest::default()
        })
        .await
        .unwrap()
        .into_inner()
        .updated;
    b.stop().await;
    let stored = store.load(user).await.unwrap();
    let stored_ack = stored.read_states.first().map_or(0, |s| s.last_acked_id);
    eprintln!("{ending:?}: served ack {acked}, msg 8 updated {created}, stored ack {stored_ack}");
    (acked, stored_ack, created)
}

/// A handoff cut before it was done: the new owner drops its copy ahead.
#[tokio::test]
async fn a_cut_handoff_leaves_nothing_behind() {
    let (acked, stored, created) = stale_copy_ahead(Ending::Cut).await;
    assert_eq!((acked, stored, created), (10, 10, 0));
}

/// Found in review: past the call's deadline, tonic dropped the handler
/// before it could drop what it had installed, and the new owner then
/// served the stale copy (ack 5, not 10), counted a redelivered message
/// and later wrote ack 5 over 10.
#[tokio::test]
async fn a_handoff_past_its_deadline_leaves_nothing_behind() {
    let (acked, stored, created) = stale_copy_ahead(Ending::Timeout).await;
    assert_eq!((acked, stored, created), (10, 10, 0));
}

/// Found in review: the same when the sender drops the call (RST_STREAM).
#[tokio::test]
async fn a_handoff_its_sender_dropped_leaves_nothing_behind() {
    let (acked, stored, created) = stale_copy_ahead(Ending::Dropped).await;
    assert_eq!((acked, stored, created), (10, 10, 0));
}

/// Found by the kill -9 test: the new owner dropped what a handoff had
/// installed only if the slot was still being acquired when the handoff
/// ended; released first (by the sender's fallback, or by force), it
/// served the stale copy.
#[tokio::test]
async fn a_handoff_still_open_when_the_slot_is_released_leaves_nothing_behind() {
    let (acked, stored, created) = stale_copy_ahead(Ending::ReleasedFirst).await;
    assert_eq!((acked, stored, created), (10, 10, 0));
}

/// Found in review: the memory of users evicted (written) before their
/// slot moved stayed behind, and a retried deletion lowered them again.
#[tokio::test]
async fn the_deletion_memory_of_users_no_longer_cached_moves_with_their_slot() {
    deletion_memory(40).await;
}

#[tokio::test]
async fn the_deletion_memory_of_cached_users_moves_with_their_slot() {
    deletion_memory(1_000_000).await;
}

async fn deletion_memory(capacity: usize) {
    let store = Arc::new(MemoryStore::new());
    let ring = Arc::new(MemoryRingStore::default());
    let member = |id: &str, capacity: usize| {
        let mut config = test_config();
        config.node_id = Some(id.to_owned());
        config.ring_poll = Duration::from_millis(50);
        config.cache_capacity = capacity;
        let (store, ring) = (store.clone(), ring.clone());
        async move { spawn_member(config, store, ring).await }
    };
    let mut a = member("a", capacity).await;
    let mut b = member("b", 10_000).await;
    let add = async |ring: &MemoryRingStore, change: RingChange| {
        let record = admin::change(ring, change).await.unwrap();
        admin::wait_served(ring, record.ring.epoch(), Duration::from_secs(20))
            .await
            .unwrap();
        record
    };
    let node = |id: &str, app: &TestApp, weight| Node {
        id: id.into(),
        address: app.addr.to_string(),
        weight,
    };
    add(&ring, RingChange::Add(node("a", &a, 100))).await;
    add(&ring, RingChange::Add(node("b", &b, 0))).await;
    let users: Vec<u64> = (1000..1040).collect();
    for m in [100, 101] {
        a.client
            .message_created(MessageCreatedRequest {
                channel_id: 1,
                message_id: m,
                unread_user_ids: users.clone(),
                ..MessageCreatedRequest::default()
            })
            .await
            .unwrap();
    }
    let deleted = MessageDeletedRequest {
        channel_id: 1,
        message_id: 101,
        unread_user_ids: users.clone(),
        ..MessageDeletedRequest::default()
    };
    a.client.message_deleted(deleted.clone()).await.unwrap();
    // Other users push these out of a's small cache (written, then dropped).
    for u in 5000..5400u64 {
        a.client
            .ack(readstates::proto::AckRequest {
                user_id: u,
                channel_id: 1,
                message_id: 1,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    let record = add(
        &ring,
        RingChange::SetWeight {
            node: "b".into(),
            weight: 100,
        },
    )
    .await;
    let on_b: Vec<u64> = users
        .iter()
        .copied()
        .filter(|&u| record.ring.owner_of(u).unwrap().id == "b")
        .collect();
    assert!(!on_b.is_empty(), "some users moved to b");
    // The retry: must lower nobody.
    let again = b
        .client
        .message_deleted(deleted)
        .await
        .unwrap()
        .into_inner();
    for &u in &users {
        let unread = first_read_state(&mut b, u)
            .await
            .map_or(0, |s| s.unread_count);
        assert_eq!(unread, 1, "user {u}: message 100 is still unread");
    }
    a.stop().await;
    b.stop().await;
    assert_eq!(
        again.updated, 0,
        "a retried MessageDeleted lowered users again"
    );
}

/// A user x hands over: channel 1 acked to `acked` at `version`, of which
/// the store holds `written`.
fn handed(user_id: u64, acked: u64, version: u64, written: u64) -> HandedUser {
    HandedUser {
        user_id,
        version,
        written_version: written,
        delta_floor: 0,
        clear_pending: false,
        read_states: vec![HandedReadState {
            channel_id: 1,
            kind: 0,
            last_acked_id: acked,
            last_message_id: acked,
            version,
            mention_count: 0,
            unread_count: 0,
            deleted: false,
            muted: false,
            parent_id: 0,
        }],
        unwritten_for_ms: 0,
    }
}

/// A whole handoff of `user` from x to b in `epoch`, sent as a node.
async fn hand_over_whole(
    b: &TestApp,
    epoch: u64,
    user: HandedUser,
) -> Result<HandOverResponse, Status> {
    let mut client = RawFleet::connect(format!("http://{}", b.addr))
        .await
        .unwrap();
    let mut request = Request::new(futures::stream::iter([HandOverRequest {
        epoch,
        slots: vec![u32::from(slot_of(user.user_id))],
        node_id: "x".into(),
        users: vec![user],
        done: true,
        users_sent: 1,
        ..HandOverRequest::default()
    }]));
    as_node(&mut request, "x");
    client.hand_over(request).await.map(Response::into_inner)
}

/// x releases the slots to b, which then serves them.
async fn released(fleet: &Acquiring) {
    fleet.release.send(true).unwrap();
    fleet.ring.report("x", fleet.epoch).await.unwrap();
    admin::wait_served(&*fleet.ring, fleet.epoch, Duration::from_secs(20))
        .await
        .unwrap();
}

/// Issue 35, item 1: a stranger's HandOver naming the same sender and
/// slots, cut midway, made the receiver drop what the real handoff had
/// installed (15,225 moving users' unwritten changes lost). One handoff a
/// slot and epoch: a second is refused, and undoes nothing.
#[tokio::test]
async fn a_second_handoff_of_a_slot_is_refused_and_undoes_nothing_of_the_first() {
    let mut fleet = acquiring_from_a_stand_in().await;
    let (epoch, user) = (fleet.epoch, fleet.user);
    // The real handoff: the user acked to 9, unwritten.
    let answer = hand_over_whole(&fleet.b, epoch, handed(user, 9, 9, 0)).await;
    assert_eq!(answer.unwrap().users_installed, 1);
    // A second one, of an older copy, cut before it is done.
    let (send, requests) = tokio::sync::mpsc::channel(4);
    send.send(HandOverRequest {
        epoch,
        slots: vec![u32::from(slot_of(user))],
        node_id: "x".into(),
        users: vec![handed(user, 3, 3, 0)],
        ..HandOverRequest::default()
    })
    .await
    .unwrap();
    let mut client = RawFleet::connect(format!("http://{}", fleet.b.addr))
        .await
        .unwrap();
    let mut request = Request::new(tokio_stream::wrappers::ReceiverStream::new(requests));
    as_node(&mut request, "x");
    let call = tokio::spawn(async move { client.hand_over(request).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    drop(send);
    let refused = call.await.unwrap().unwrap_err();
    assert_eq!(
        refused.code(),
        tonic::Code::FailedPrecondition,
        "{refused:?}"
    );
    released(&fleet).await;
    let served = first_read_state(&mut fleet.b, user).await;
    assert_eq!(served.map(|s| s.last_acked_id), Some(9));
    let report = fleet.b.stop().await;
    assert_eq!(report.unwritten, 0);
    let stored = fleet.store.load(user).await.unwrap();
    assert_eq!(stored.read_states.first().map(|s| s.last_acked_id), Some(9));
}

/// Issue 35, item 1: a forged user of version 2^62 was installed, served
/// and written, and a forged channel copy of version 2^64-1 could never be
/// replaced. A version from after the receiver's clock (beyond the skew a
/// fleet tolerates) was issued by no node: refused, even from a node.
#[tokio::test]
async fn versions_from_after_the_clock_are_refused_from_a_node() {
    let mut fleet = acquiring_from_a_stand_in().await;
    let (epoch, user) = (fleet.epoch, fleet.user);
    let forged = handed(user, 999, 1 << 62, 0);
    let refused = hand_over_whole(&fleet.b, epoch, forged).await.unwrap_err();
    assert!(
        refused.message().contains("after this node's clock"),
        "{refused:?}"
    );
    let mut copy = Request::new(CopyChannelsRequest {
        channels: vec![readstates::proto::ChannelStateCopy {
            channel_id: 7,
            counted_from: 1,
            version: u64::MAX,
            ..Default::default()
        }],
    });
    as_node(&mut copy, "x");
    let mut client = RawFleet::connect(format!("http://{}", fleet.b.addr))
        .await
        .unwrap();
    let refused = client.copy_channels(copy).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
    released(&fleet).await;
    assert_eq!(first_read_state(&mut fleet.b, user).await, None);
    fleet.b.stop().await;
}
