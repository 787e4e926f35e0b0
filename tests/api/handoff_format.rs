//! Which `HandOver` format a sender uses: it asks the receiver
//! (`HandOverFormat`) and packs the users as bytes (format 2) only for a
//! node that reads them; a build before the question (UNIMPLEMENTED) gets
//! protobuf messages (format 1), so a canary and the fleet hand over warm
//! both ways. The receiver is a stand-in that keeps what it was sent.

use std::sync::{Arc, Mutex};

use futures::StreamExt;
use readstates::cache::handoff::{Chunk, HandedUser};
use readstates::cluster::credential::FleetCredential;
use readstates::cluster::handoff::{self, Handoff, Part};
use readstates::cluster::peers::{GrpcPeers, Peers};
use readstates::proto::fleet_server::{Fleet, FleetServer};
use readstates::proto::{
    ChangeChannelRequest, ChangeChannelResponse, CopyChannelsRequest, CopyChannelsResponse,
    HandOverFormatRequest, HandOverFormatResponse, HandOverRequest, HandOverResponse,
    MirrorRequest, MirrorResponse, ReleaseSlotsRequest, ReleaseSlotsResponse,
};
use readstates::read_state::{Header, Key, Kind, Owned, ReadState, UserReadStates};
use readstates_routing::slot_of;
use tokio::time::Duration;
use tonic::{Request, Response, Status, Streaming};

/// A stand-in receiver: answers `HandOverFormat` with `format` (`None`:
/// UNIMPLEMENTED, as a build before it), and keeps every `HandOver`
/// message.
#[derive(Clone)]
struct Receiver {
    format: Option<u32>,
    got: Arc<Mutex<Vec<HandOverRequest>>>,
}

#[tonic::async_trait]
impl Fleet for Receiver {
    type MirrorStream = futures::stream::Empty<Result<MirrorResponse, Status>>;

    async fn hand_over_format(
        &self,
        _request: Request<HandOverFormatRequest>,
    ) -> Result<Response<HandOverFormatResponse>, Status> {
        match self.format {
            Some(format) => Ok(Response::new(HandOverFormatResponse { format })),
            None => Err(Status::unimplemented("a build before HandOverFormat")),
        }
    }
    async fn hand_over(
        &self,
        request: Request<Streaming<HandOverRequest>>,
    ) -> Result<Response<HandOverResponse>, Status> {
        let mut messages = request.into_inner();
        while let Some(message) = messages.message().await? {
            self.got.lock().unwrap().push(message);
        }
        Ok(Response::new(HandOverResponse { users_installed: 2 }))
    }
    async fn mirror(
        &self,
        _request: Request<Streaming<MirrorRequest>>,
    ) -> Result<Response<Self::MirrorStream>, Status> {
        Err(Status::unimplemented("stand-in"))
    }
    async fn release_slots(
        &self,
        _request: Request<ReleaseSlotsRequest>,
    ) -> Result<Response<ReleaseSlotsResponse>, Status> {
        Err(Status::unimplemented("stand-in"))
    }
    async fn change_channel(
        &self,
        _request: Request<ChangeChannelRequest>,
    ) -> Result<Response<ChangeChannelResponse>, Status> {
        Err(Status::unimplemented("stand-in"))
    }
    async fn copy_channels(
        &self,
        _request: Request<CopyChannelsRequest>,
    ) -> Result<Response<CopyChannelsResponse>, Status> {
        Err(Status::unimplemented("stand-in"))
    }
}

/// Two users: one with a channel, a muted thread and a tombstone, some of
/// it unwritten; one with a "delete all" not written yet.
fn users() -> Vec<HandedUser> {
    let row = |kind, channel_id, version| ReadState {
        last_acked_id: 40 + channel_id,
        last_message_id: 50 + channel_id,
        version,
        mention_count: 3,
        unread_count: 7,
        ..ReadState::new(Key { kind, channel_id })
    };
    let thread = ReadState {
        muted: true,
        ..row(Kind::Thread, 9, 12)
    };
    let tombstone = ReadState {
        deleted: true,
        ..row(Kind::Channel, 2, 11)
    };
    let rows = vec![(row(Kind::Channel, 1, 10), 0), (tombstone, 0), (thread, 1)];
    let header = |version, written_version, delta_floor, clear_pending| Header {
        version,
        written_version,
        delta_floor,
        clear_pending,
    };
    vec![
        HandedUser {
            user_id: 7,
            states: UserReadStates::from_parts(header(12, 10, 0, false), Owned::from_rows(rows)),
            unwritten_for: Some(Duration::from_millis(1_500)),
        },
        HandedUser {
            user_id: 8,
            states: UserReadStates::from_parts(header(31, 30, 31, true), Owned::from_rows(vec![])),
            unwritten_for: Some(Duration::ZERO),
        },
    ]
}

/// What a sender sends a stand-in receiver answering `format`, for
/// [`users`] in one chunk.
async fn handed_to(format: Option<u32>) -> Vec<HandOverRequest> {
    let got = Arc::new(Mutex::new(Vec::new()));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap().to_string();
    let receiver = Receiver {
        format,
        got: got.clone(),
    };
    tokio::spawn(
        tonic::transport::Server::builder()
            .add_service(FleetServer::new(receiver))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );
    let peers = GrpcPeers::new(
        None,
        FleetCredential::new("a secret of sixteen bytes", "readstates", "test"),
    );
    let handoff = Handoff {
        epoch: 3,
        slots: vec![slot_of(7), slot_of(8)],
        from: "a".into(),
    };
    let parts = [Part::Chunk(Chunk::Users(users())), Part::Done { users: 2 }];
    let installed = (peers.hand_over(&address, handoff, futures::stream::iter(parts).boxed()))
        .await
        .expect("handed over");
    assert_eq!(installed, 2);
    got.lock().unwrap().clone()
}

/// The users the messages carry, read as a receiver reads them.
fn users_in(messages: Vec<HandOverRequest>) -> Vec<HandedUser> {
    let parts = messages
        .into_iter()
        .flat_map(|m| handoff::from_request(m).unwrap());
    parts
        .flat_map(|part| match part {
            Part::Chunk(Chunk::Users(users)) => users,
            _ => Vec::new(),
        })
        .collect()
}

#[tokio::test]
async fn a_node_that_reads_packed_users_is_sent_them_and_an_older_one_protobuf_messages() {
    for (answers, packed) in [
        (None, false),
        (Some(1), false),
        (Some(2), true),
        (Some(9), true),
    ] {
        let messages = handed_to(answers).await;
        let carrying = |m: &&HandOverRequest| !m.users.is_empty() || !m.packed_users.is_empty();
        let with_users: Vec<&HandOverRequest> = messages.iter().filter(carrying).collect();
        assert_eq!(with_users.len(), 1, "answering {answers:?}: one chunk");
        assert_eq!(
            (
                with_users[0].packed_users.is_empty(),
                with_users[0].users.is_empty()
            ),
            (!packed, packed),
            "answering {answers:?}: packed users {packed}"
        );
        assert_eq!(users_in(messages), users(), "answering {answers:?}");
    }
}
