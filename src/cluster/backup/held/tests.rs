//! What a backup holds, fed batches as a sender's journal frames them.

use super::*;
use crate::clock;
use crate::read_state::{Key, UserReadStates};

/// A batch of one frame: `user_id` acked `channel_id` to `message_id`.
pub(crate) fn ack(user_id: u64, channel_id: u64, message_id: u64, version: u64) -> Vec<u8> {
    let mut user = UserReadStates::default();
    user.ack(Key::channel(channel_id), message_id, version);
    let mut frames = Vec::new();
    record::frame(&mut frames, |out| {
        record::append_user(out, user_id, 0, user.view());
    });
    frames
}

fn acked(taken: &Taken, user_id: u64, channel_id: u64) -> Option<u64> {
    let user = taken.users.iter().find(|w| w.user_id == user_id)?;
    let state = user
        .read_states
        .iter()
        .find(|s| s.channel_id == channel_id)?;
    Some(state.last_acked_id)
}

#[test]
fn batches_collapse_newest_first_and_a_trim_drops_only_what_is_written() {
    let backups = Backups::default();
    let stream = backups.open("n1", "i1", "t");
    assert_eq!(backups.batch("n1", stream, ack(1, 10, 5, 100), 10), Ok(10));
    // Older, arriving later: the newer version stays.
    assert_eq!(backups.batch("n1", stream, ack(1, 10, 4, 90), 20), Ok(20));
    assert_eq!(backups.batch("n1", stream, ack(2, 10, 7, 110), 30), Ok(30));
    backups.complete_at("n1", stream, 0);
    // What was appended up to 20 is written: user 1 goes, user 2 stays.
    backups.trimmed("n1", stream, 20);
    assert!(
        backups
            .held_for("n1")
            .is_some_and(|(batches, _, complete)| batches == 1 && complete)
    );
    let taken = backups.take("n1", stream).expect("held");
    assert_eq!(acked(&taken, 2, 10), Some(7));
    assert_eq!(acked(&taken, 1, 10), None);

    let stream = backups.open("n1", "i1", "t");
    backups.batch("n1", stream, ack(1, 10, 5, 100), 10).unwrap();
    backups.batch("n1", stream, ack(1, 10, 4, 90), 20).unwrap();
    let taken = backups.take("n1", stream).expect("held");
    assert_eq!(acked(&taken, 1, 10), Some(5), "the newer version wins");
}

#[test]
fn a_stream_its_sender_ends_lets_go_and_one_that_breaks_is_kept_once_complete() {
    let backups = Backups::default();
    let stream = backups.open("n1", "i1", "t");
    backups.batch("n1", stream, ack(1, 10, 5, 100), 10).unwrap();
    backups.ended("n1", stream);
    assert_eq!(backups.held_for("n1"), None);

    let stream = backups.open("n1", "i1", "t");
    backups.complete_at("n1", stream, 20);
    backups.batch("n1", stream, ack(1, 10, 5, 100), 10).unwrap();
    backups.broke("n1", stream);
    assert!(
        backups.broken().is_empty(),
        "not complete: nothing to take over with"
    );
    let stream = backups.open("n1", "i1", "t");
    backups.complete_at("n1", stream, 20);
    backups.batch("n1", stream, ack(1, 10, 5, 100), 20).unwrap();
    backups.broke("n1", stream);
    assert_eq!(backups.broken(), vec![("n1".to_owned(), stream)]);
}

#[test]
fn a_newer_stream_from_the_same_node_replaces_the_older_one() {
    let backups = Backups::default();
    let old = backups.open("n1", "i1", "t");
    backups.batch("n1", old, ack(1, 10, 5, 100), 10).unwrap();
    let new = backups.open("n1", "i1", "t");
    assert!(backups.batch("n1", old, ack(1, 10, 6, 101), 20).is_err());
    backups.broke("n1", old);
    backups.ended("n1", old);
    assert!(backups.take("n1", old).is_none());
    assert_eq!(
        backups.held_for("n1"),
        Some((0, 0, false)),
        "emptied by the newer"
    );
    assert!(backups.take("n1", new).is_some());
}

#[test]
fn frames_that_do_not_read_are_refused() {
    let backups = Backups::default();
    let stream = backups.open("n1", "i1", "t");
    let mut frames = ack(1, 10, 5, 100);
    let last = frames.len() - 1;
    frames[last] ^= 0xff;
    let refused = backups.batch("n1", stream, frames, 10);
    assert!(refused.is_err_and(|e| e.to_string().contains("offset 0")));
}

/// Found in review: an earlier incarnation's copy, kept broken once a new
/// start streams, still took in batches from its sender (cut from the ring
/// store but inside its lease, it went on answering), after its takeover
/// had written it ahead and said the copy was written. It takes no more.
#[test]
fn an_earlier_incarnations_copy_takes_no_batch_once_a_new_start_streams() {
    let backups = Backups::new();
    let old = backups.open("x", "i1", "b/x1/0");
    backups.batch("x", old, ack(7, 10, 5, 100), 10).unwrap();
    backups.complete_at("x", old, 0);
    let new = backups.open("x", "i2", "b/x2/0");
    assert!(backups.batch("x", new, ack(8, 10, 5, 100), 10).is_ok());
    let late = backups.batch("x", old, ack(7, 10, 6, 101), 20);
    assert!(late.is_err(), "a broken copy took a batch: {late:?}");
    let taken = backups.take("x", old).expect("the copy is kept");
    assert_eq!(acked(&taken, 7, 10), Some(5));
}

/// Issue 53, item 2: a forged stream's frame at version 2^62 was written
/// by the takeover (or the write ahead), and beat every later change of
/// the user for good. A version past the clock's bound is not taken; the
/// rest of the copy is.
#[test]
fn a_version_from_after_the_clock_is_not_taken_from_a_copy() {
    let backups = Backups::default();
    let stream = backups.open("n1", "i1", "t");
    let now = clock::now_micros();
    backups.batch("n1", stream, ack(1, 10, 5, now), 10).unwrap();
    backups
        .batch("n1", stream, ack(2, 10, 7, 1 << 62), 20)
        .unwrap();
    let ahead = now + clock::MAX_AHEAD.as_micros() as u64 + 10_000_000;
    backups
        .batch("n1", stream, ack(3, 10, 9, ahead), 30)
        .unwrap();
    let taken = backups.copy("n1", stream).expect("held");
    assert_eq!(acked(&taken, 1, 10), Some(5));
    assert_eq!(acked(&taken, 2, 10), None, "a forged version taken");
    assert_eq!(acked(&taken, 3, 10), None, "a version past the bound taken");
}

/// Issue 53, item 5: what a backup holds was unbounded while its senders'
/// store could not be written. A batch that would pass the budget is
/// refused (the sender answers on its journal alone); once the senders
/// trim what their store took, batches are taken again.
#[test]
fn a_batch_past_the_budget_is_refused_until_the_store_catches_up() {
    let one = ack(1, 10, 5, 100).len();
    let backups = Backups::with_budget(3 * one);
    let a = backups.open("a", "i1", "t");
    let b = backups.open("b", "i1", "t");
    backups.batch("a", a, ack(1, 10, 5, 100), 10).unwrap();
    backups.batch("b", b, ack(2, 10, 5, 100), 10).unwrap();
    backups.batch("a", a, ack(1, 10, 6, 101), 20).unwrap();
    let refused = backups.batch("b", b, ack(2, 10, 6, 101), 20);
    assert_eq!(
        refused,
        Err(Refused::Budget {
            held: 3 * one,
            more: one,
            budget: 3 * one
        })
    );
    backups.trimmed("a", a, 20);
    assert_eq!(backups.batch("b", b, ack(2, 10, 6, 101), 20), Ok(20));
}
