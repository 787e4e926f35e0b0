//! Channels counted by channel on a fleet: the channel's owner (the node
//! serving the slot of its id) alone changes it, every node holds a copy,
//! and the channel moves with its slot. A message or switch sent to any
//! node counts exactly once for every member, on every node, across moves.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use readstates::proto::*;
use readstates::test_support::{ack, deleted, message, switch};
use readstates_routing::slot_of;
use tonic::Code;

use readstates::cluster::ring_store::RingStore;
use readstates::store::Store;

use crate::fleet::{add, member, set_weight, shared};
use crate::helpers::TestApp;

/// How long a copy may take to reach every node (sent every 100 ms).
const COPIED_WITHIN: Duration = Duration::from_secs(5);
const SWITCHED_AT: u64 = 100;

/// A member joins: a manual ack at the channel's last message.
async fn join(app: &mut TestApp, user_id: u64, channel_id: u64) {
    let joined = AckRequest {
        manual: true,
        ..ack(user_id, channel_id, SWITCHED_AT)
    };
    app.client.ack(joined).await.unwrap();
}

/// (mention count, unread count) of `user_id` in `channel_id`, read through
/// `app` (which forwards to the user's owner).
async fn counts(app: &mut TestApp, user_id: u64, channel_id: u64) -> (u32, u32) {
    let request = GetReadStatesRequest {
        user_id,
        channel_ids: vec![channel_id],
        ..GetReadStatesRequest::default()
    };
    let answer = app.client.get_read_states(request).await.unwrap();
    let state = answer.into_inner().read_states.into_iter().next();
    state.map_or((0, 0), |s| (s.mention_count, s.unread_count))
}

/// Waits until every node shows `expected` for `user_id`; a count above it
/// (a message counted twice) fails at once, one below is a copy that lags.
async fn settles(apps: &mut [&mut TestApp], user_id: u64, channel_id: u64, expected: (u32, u32)) {
    let deadline = Instant::now() + COPIED_WITHIN;
    for app in apps.iter_mut() {
        loop {
            let seen = counts(app, user_id, channel_id).await;
            assert!(
                seen.0 <= expected.0 && seen.1 <= expected.1,
                "user {user_id} counted {seen:?}, above {expected:?}"
            );
            if seen == expected {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "user {user_id}: {seen:?}, not {expected:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

#[tokio::test]
async fn a_fleet_counts_a_channel_by_channel_once_whichever_node_takes_its_messages() {
    let (store, ring) = shared();
    let mut a = member("a", &store, &ring).await;
    let mut b = member("b", &store, &ring).await;
    let mut c = member("c", &store, &ring).await;
    for (id, app) in [("a", &a), ("b", &b), ("c", &c)] {
        add(&ring, id, app, 100).await;
    }
    const CHANNEL: u64 = 77;
    let members: Vec<u64> = (1..=12).collect();
    let record = ring.load().await.unwrap();
    let owners: BTreeSet<&str> = (members.iter())
        .map(|&u| record.ring.owner_of(u).unwrap().id.as_str())
        .collect();
    assert!(owners.len() == 3, "members on {owners:?} only");

    // Switched through a node that may not own it: answered once every
    // node has it. A retry answers false; another message is refused.
    let switched = b
        .client
        .set_channel_counting(switch(CHANNEL, SWITCHED_AT))
        .await;
    assert!(switched.unwrap().into_inner().applied);
    let again = c
        .client
        .set_channel_counting(switch(CHANNEL, SWITCHED_AT))
        .await;
    assert!(!again.unwrap().into_inner().applied);
    let other = SetChannelCountingRequest {
        counted_from: 99,
        ..switch(CHANNEL, SWITCHED_AT)
    };
    let refused = a.client.set_channel_counting(other).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    for &user in &members {
        join(&mut a, user, CHANNEL).await;
    }

    // Three messages, each through another node, one mentioning user 5;
    // then each sent again through yet another node, and a member list
    // refused wherever it goes.
    let (a, b, c) = (&mut a, &mut b, &mut c);
    a.client
        .message_created(message(CHANNEL, 101, 1, &[5], &[]))
        .await
        .unwrap();
    b.client
        .message_created(message(CHANNEL, 102, 0, &[], &[]))
        .await
        .unwrap();
    c.client
        .message_created(message(CHANNEL, 103, 2, &[], &[]))
        .await
        .unwrap();
    for (app, id) in [(&mut *c, 101), (&mut *a, 102), (&mut *b, 103)] {
        let author = if id == 103 { 2 } else { 0 };
        let mentioned: &[u64] = if id == 101 { &[5] } else { &[] };
        let answer = app
            .client
            .message_created(message(CHANNEL, id, author, mentioned, &[]))
            .await;
        assert_eq!(
            answer.unwrap().into_inner().updated,
            0,
            "message {id} again"
        );
    }
    for app in [&mut *a, &mut *b, &mut *c] {
        let listed = app
            .client
            .message_created(message(CHANNEL, 105, 0, &[], &[3]))
            .await;
        assert_eq!(listed.unwrap_err().code(), Code::InvalidArgument);
    }
    // The other nodes hear of this one only from the owner's copies.
    let owner = record.ring.owner(slot_of(CHANNEL)).unwrap().id.clone();
    let at_owner = match owner.as_str() {
        "a" => &mut *a,
        "b" => &mut *b,
        _ => &mut *c,
    };
    let last = at_owner
        .client
        .message_created(message(CHANNEL, 104, 0, &[], &[]))
        .await;
    assert_eq!(last.unwrap().into_inner().updated, 1);
    for &user in &members {
        let expected = match user {
            // The author of 101 read it; 103 (by user 2) is unread for them.
            1 => (0, 3),
            // Acked 103, their own.
            2 => (0, 1),
            5 => (1, 4),
            _ => (0, 4),
        };
        settles(&mut [&mut *a, &mut *b, &mut *c], user, CHANNEL, expected).await;
    }

    // Deleted through a node, again through another: lowered once.
    a.client
        .message_deleted(deleted(CHANNEL, 101, &[5], &[]))
        .await
        .unwrap();
    c.client
        .message_deleted(deleted(CHANNEL, 101, &[5], &[]))
        .await
        .unwrap();
    settles(&mut [&mut *a, &mut *b, &mut *c], 5, CHANNEL, (0, 3)).await;
    settles(&mut [&mut *a, &mut *b, &mut *c], 7, CHANNEL, (0, 3)).await;
}

/// A channel's slot moves (a node joins and takes half, then leaves): its
/// owner writes it as it lets go, the new owner loads it before it serves
/// it, and its counts go on from where they were, on both nodes.
#[tokio::test]
async fn a_channel_counted_by_channel_moves_with_its_slot_and_back() {
    let (store, ring) = shared();
    let mut a = member("a", &store, &ring).await;
    let mut b = member("b", &store, &ring).await;
    add(&ring, "a", &a, 100).await;
    add(&ring, "b", &b, 0).await;
    // Many channels, so that some move to b; one member each, on a.
    let channels: Vec<u64> = (1_000..1_040).collect();
    const MEMBER: u64 = 3;
    for &channel in &channels {
        let switched = a
            .client
            .set_channel_counting(switch(channel, SWITCHED_AT))
            .await;
        assert!(switched.unwrap().into_inner().applied);
        join(&mut a, MEMBER, channel).await;
        a.client
            .message_created(message(channel, 101, 0, &[MEMBER], &[]))
            .await
            .unwrap();
    }
    set_weight(&ring, "b", 100).await;
    let record = ring.load().await.unwrap();
    let moved = (channels.iter())
        .filter(|&&c| record.ring.owner(slot_of(c)).unwrap().id == "b")
        .count();
    assert!(moved > 0, "no channel moved to b");
    // a wrote the channels it let go before b served them (the others wait
    // for the 30 s write delay; their switch was written at once).
    for stored in store.load_channels().await.unwrap() {
        let id = stored.channel_id();
        let on_b = record.ring.owner(slot_of(id)).unwrap().id == "b";
        let expected = if on_b { 101 } else { SWITCHED_AT };
        assert_eq!(stored.last_message_id(), expected, "channel {id}");
    }
    // On b now (or still on a), each channel takes the next message once,
    // whichever node it is sent to, and the first one is not taken again.
    for &channel in &channels {
        b.client
            .message_created(message(channel, 102, 0, &[], &[]))
            .await
            .unwrap();
        let again = a
            .client
            .message_created(message(channel, 101, 0, &[MEMBER], &[]))
            .await;
        assert_eq!(again.unwrap().into_inner().updated, 0, "channel {channel}");
    }
    for &channel in &channels {
        settles(&mut [&mut a, &mut b], MEMBER, channel, (1, 2)).await;
    }
    // And back to a.
    set_weight(&ring, "b", 0).await;
    for &channel in &channels {
        a.client
            .message_created(message(channel, 103, 0, &[], &[]))
            .await
            .unwrap();
        b.client
            .message_deleted(deleted(channel, 101, &[MEMBER], &[]))
            .await
            .unwrap();
    }
    for &channel in &channels {
        settles(&mut [&mut a, &mut b], MEMBER, channel, (0, 2)).await;
    }
}

/// A node that was not in the ring when channels were switched (none was
/// sent a copy) and joins after: it counts their messages by channel from
/// its first request, and serves those whose slots it takes from their
/// state as written.
#[tokio::test]
async fn a_node_that_joins_after_a_switch_counts_by_channel_from_its_first_request() {
    let (store, ring) = shared();
    let mut a = member("a", &store, &ring).await;
    let mut b = member("b", &store, &ring).await;
    let mut late = member("c", &store, &ring).await;
    add(&ring, "a", &a, 100).await;
    add(&ring, "b", &b, 100).await;
    let channels: Vec<u64> = (2_000..2_030).collect();
    const MEMBER: u64 = 4;
    const MENTIONED: u64 = 5;
    for &channel in &channels {
        let switched = a
            .client
            .set_channel_counting(switch(channel, SWITCHED_AT))
            .await;
        assert!(switched.unwrap().into_inner().applied);
        join(&mut a, MEMBER, channel).await;
    }
    add(&ring, "c", &late, 100).await;
    let record = ring.load().await.unwrap();
    let on_c = (channels.iter())
        .filter(|&&c| record.ring.owner(slot_of(c)).unwrap().id == "c")
        .count();
    assert!(on_c > 0 && on_c < channels.len(), "{on_c} channels on c");
    for &channel in &channels {
        let sent = message(channel, 101, 0, &[MENTIONED], &[]);
        let answer = late.client.message_created(sent).await.unwrap();
        assert_eq!(answer.into_inner().updated, 2, "channel {channel}");
    }
    for &channel in &channels {
        settles(&mut [&mut a, &mut b, &mut late], MEMBER, channel, (0, 1)).await;
        settles(&mut [&mut a, &mut b, &mut late], MENTIONED, channel, (1, 1)).await;
    }
}

/// A node drained to weight 0 and stopped (a rolling restart, a scale-in)
/// is still in the ring but owns no slot and serves nobody: a switch does
/// not wait for it to take a copy.
#[tokio::test]
async fn a_switch_does_not_wait_for_a_stopped_node_that_owns_no_slot() {
    let (store, ring) = shared();
    let mut a = member("a", &store, &ring).await;
    let b = member("b", &store, &ring).await;
    let stopped = member("c", &store, &ring).await;
    add(&ring, "a", &a, 100).await;
    add(&ring, "b", &b, 100).await;
    add(&ring, "c", &stopped, 0).await;
    stopped.stop().await;
    for channel in 3_000..3_010 {
        let switched = a
            .client
            .set_channel_counting(switch(channel, SWITCHED_AT))
            .await;
        assert!(switched.unwrap().into_inner().applied, "channel {channel}");
    }
}

/// A message with a bad mention list is refused whole on a fleet: its
/// channel does not take it first (a valid retry then counts it once).
#[tokio::test]
async fn a_message_refused_as_invalid_is_not_taken_by_its_channel() {
    let (store, ring) = shared();
    let mut a = member("a", &store, &ring).await;
    let mut b = member("b", &store, &ring).await;
    add(&ring, "a", &a, 100).await;
    add(&ring, "b", &b, 100).await;
    const CHANNEL: u64 = 91;
    assert!(
        a.client
            .set_channel_counting(switch(CHANNEL, SWITCHED_AT))
            .await
            .unwrap()
            .into_inner()
            .applied
    );
    join(&mut a, 1, CHANNEL).await;
    for app in [&mut a, &mut b] {
        let bad = message(CHANNEL, 101, 0, &[0], &[]);
        let refused = app.client.message_created(bad).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    }
    let valid = b
        .client
        .message_created(message(CHANNEL, 101, 0, &[], &[]))
        .await;
    assert_eq!(valid.unwrap().into_inner().updated, 1, "taken by the retry");
    settles(&mut [&mut a, &mut b], 1, CHANNEL, (0, 1)).await;
}
