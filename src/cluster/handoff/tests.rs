use super::*;
use crate::journal::record;
use crate::read_state::Key;

fn user(user_id: u64, version: u64) -> HandedUser {
    let row = |kind, channel_id| ReadState {
        last_acked_id: 3,
        last_message_id: 4,
        version,
        mention_count: 1,
        unread_count: 2,
        ..ReadState::new(Key { kind, channel_id })
    };
    let rows = vec![(row(Kind::Channel, 5), 0), (row(Kind::Thread, 6), 5)];
    let header = Header {
        version,
        written_version: 0,
        delta_floor: 0,
        clear_pending: false,
    };
    HandedUser {
        user_id,
        states: UserReadStates::from_parts(header, Owned::from_rows(rows)),
        unwritten_for: Some(Duration::from_millis(250)),
    }
}

fn chunk_in(format: u32, users: Vec<HandedUser>) -> proto::HandOverRequest {
    to_request(Part::Chunk(Chunk::Users(users)), None, format)
}

#[test]
fn users_read_back_as_sent_in_either_format() {
    let users = vec![user(1, 10), user(2, 20)];
    for format in [PROTOBUF, PACKED] {
        let parts = from_request(chunk_in(format, users.clone())).unwrap();
        assert_eq!(
            parts,
            [Part::Chunk(Chunk::Users(users.clone()))],
            "format {format}"
        );
    }
}

#[test]
fn packed_users_cut_short_or_of_an_unknown_kind_are_refused() {
    let packed = chunk_in(PACKED, vec![user(1, 10), user(2, 20)]).packed_users;
    // Cut anywhere but between the two users, a message does not read.
    let between = packed::len(&user(1, 10));
    for len in (1..packed.len()).filter(|&len| len != between) {
        let request = proto::HandOverRequest {
            packed_users: packed[..len].to_vec(),
            ..Default::default()
        };
        assert!(from_request(request).is_err(), "cut to {len} bytes");
    }
    let mut unknown = packed.clone();
    unknown[packed::len(&user(1, 10)) - record::ROW] = 200; // the first user's last row's kind
    let request = proto::HandOverRequest {
        packed_users: unknown,
        ..Default::default()
    };
    assert!(from_request(request).is_err(), "kind 200");
}

#[test]
fn a_packed_user_from_after_this_nodes_clock_is_refused() {
    let ahead = clock::now_micros() + clock::MAX_AHEAD.as_micros() as u64 + 60_000_000;
    let refused = from_request(chunk_in(PACKED, vec![user(1, ahead)])).unwrap_err();
    assert!(
        refused.contains("from after this node's clock"),
        "{refused}"
    );
}
