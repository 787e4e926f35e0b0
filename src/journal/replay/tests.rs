//! Replay: collapsing, torn tails, corruption.

use std::sync::Arc;

use super::*;
use crate::journal::disk::Fs;
use crate::journal::{Journal, JournalConfig, JournalError, JournalMode};
use crate::read_state::{Key, UserReadStates};

fn config(dir: &Path) -> JournalConfig {
    JournalConfig::new(dir.to_owned(), JournalMode::Sync)
}

/// Journals user 1's acks of channel 5 at these message ids (each a new
/// version), and of users 2.. one each, then stops.
fn journal_acks(dir: &Path, acks: &[u64], others: u64) {
    let (journal, _) = Journal::open(config(dir), Arc::new(Fs)).unwrap();
    let mut user = UserReadStates::default();
    for (now, &message_id) in acks.iter().enumerate() {
        let before = user.version();
        user.ack(Key::channel(5), message_id, 1_000 + now as u64);
        journal.append(|out| record::append_user(out, 1, before, user.view()));
    }
    for user_id in 2..2 + others {
        let mut other = UserReadStates::default();
        other.ack(Key::channel(5), user_id, 1);
        journal.append(|out| record::append_user(out, user_id, 0, other.view()));
    }
    journal.close(false);
}

fn only_segment(dir: &Path) -> PathBuf {
    let files: Vec<PathBuf> = (std::fs::read_dir(dir).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == EXTENSION))
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    files[0].clone()
}

fn acked(replayed: &Replayed, user_id: u64) -> Option<u64> {
    let write = replayed.users.get(&user_id)?;
    write
        .read_states
        .iter()
        .find(|s| s.channel_id == 5)
        .map(|s| s.last_acked_id)
}

#[test]
fn the_newest_version_of_each_row_wins_whatever_the_order() {
    let dir = tempfile::tempdir().unwrap();
    journal_acks(dir.path(), &[10, 20, 30], 0);
    let segment = only_segment(dir.path());
    // The same records in reverse order: a replay that took the last one
    // read would end at 10.
    let bytes = std::fs::read(&segment).unwrap();
    let mut records = Vec::new();
    let mut at = MAGIC.len();
    while let Some((_, len)) = record::read(&bytes[at..]) {
        records.push(&bytes[at..at + len]);
        at += len;
    }
    assert_eq!(records.len(), 3);
    let mut reversed = MAGIC.to_vec();
    for record in records.iter().rev() {
        reversed.extend_from_slice(record);
    }
    std::fs::write(&segment, reversed).unwrap();
    let replayed = read_dir(dir.path(), false).unwrap();
    assert_eq!(replayed.records, 3);
    assert_eq!(acked(&replayed, 1), Some(30));
}

#[test]
fn a_torn_tail_is_dropped_and_cut_off() {
    let dir = tempfile::tempdir().unwrap();
    journal_acks(dir.path(), &[10, 20], 0);
    let segment = only_segment(dir.path());
    let whole = std::fs::metadata(&segment).unwrap().len();
    // The last record half written.
    let file = std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap();
    file.set_len(whole - 20).unwrap();
    let replayed = read_dir(dir.path(), false).unwrap();
    assert_eq!((replayed.records, acked(&replayed, 1)), (1, Some(10)));
    assert!(replayed.torn_bytes > 0);
    let cut = std::fs::metadata(&segment).unwrap().len();
    assert!(cut < whole - 20, "the torn record is cut off the file");
    // Read again: whole now.
    let again = read_dir(dir.path(), false).unwrap();
    assert_eq!((again.records, again.torn_bytes), (1, 0));
}

/// The segments of `dir`, oldest first.
fn segments(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = (std::fs::read_dir(dir).unwrap())
        .map(|e| e.unwrap().path())
        .filter(|path| path.extension().is_some_and(|e| e == EXTENSION))
        .collect();
    files.sort_unstable();
    files
}

/// Where the last record of `segment` starts.
fn last_record(segment: &Path) -> usize {
    let bytes = std::fs::read(segment).unwrap();
    let mut at = MAGIC.len();
    let mut last = at;
    while let Some((_, len)) = record::read(&bytes[at..]) {
        (last, at) = (at, at + len);
    }
    assert_eq!(at, bytes.len(), "whole records");
    last
}

/// Flips one bit in the last byte of `segment`: its last record no longer
/// reads, and nothing after it does.
fn flip_last_bit(segment: &Path) {
    let mut bytes = std::fs::read(segment).unwrap();
    *bytes.last_mut().unwrap() ^= 1;
    std::fs::write(segment, &bytes).unwrap();
}

/// Issue 53: one flipped bit in the last record of a sealed segment was
/// dropped as a torn tail, and the acknowledged change with it. Only the
/// newest segment can be torn by a crash (the writer makes a new one only
/// after the last is synced whole, and cuts one whose write failed back to
/// its last sync).
#[test]
fn damage_at_the_end_of_a_segment_that_is_not_the_newest_is_corruption() {
    let dir = tempfile::tempdir().unwrap();
    journal_acks(dir.path(), &[10, 20], 0);
    journal_acks(dir.path(), &[], 1);
    let [sealed, newest] = &segments(dir.path())[..] else {
        panic!("two segments");
    };
    let (whole, offset) = (
        std::fs::metadata(sealed).unwrap().len(),
        last_record(sealed),
    );
    flip_last_bit(sealed);

    refused_as_corrupt(dir.path(), sealed, offset as u64);
    assert_eq!(std::fs::metadata(sealed).unwrap().len(), whole, "cut");

    let replayed = read_dir(dir.path(), true).unwrap();
    assert_eq!(acked(&replayed, 1), Some(10), "lost with the skipped bytes");
    assert_eq!(acked(&replayed, 2), Some(2), "the newer segment is kept");
    assert_eq!(replayed.skipped_bytes, whole - offset as u64);
    assert_eq!(replayed.torn_bytes, 0);
    assert_eq!(replayed.segments, [sealed.clone(), newest.clone()]);
}

/// A crash during a rotation leaves the newest segment empty (made, never
/// written); the one before it was synced whole before it was made, so
/// damage at its end is still corruption.
#[test]
fn an_empty_newest_segment_does_not_make_the_one_before_it_torn() {
    let dir = tempfile::tempdir().unwrap();
    journal_acks(dir.path(), &[10, 20], 0);
    let sealed = only_segment(dir.path());
    let offset = last_record(&sealed);
    std::fs::write(dir.path().join(format!("{:020}.{EXTENSION}", 2)), b"").unwrap();
    let replayed = read_dir(dir.path(), false).unwrap();
    assert_eq!((replayed.records, replayed.torn_bytes), (2, 0));

    flip_last_bit(&sealed);
    let error = read_dir(dir.path(), false).unwrap_err();
    assert!(
        matches!(&error, JournalError::Corrupt { file, offset: at, .. } if (file, *at) == (&sealed, offset as u64)),
        "{error:?}"
    );
}

/// The newest segment's last record damaged reads as a torn tail (nothing
/// tells the two apart): dropped and cut off, as before.
#[test]
fn damage_at_the_end_of_the_newest_segment_is_a_torn_tail() {
    let dir = tempfile::tempdir().unwrap();
    journal_acks(dir.path(), &[10], 0);
    journal_acks(dir.path(), &[], 2);
    let [_, newest] = &segments(dir.path())[..] else {
        panic!("two segments");
    };
    let offset = last_record(newest);
    flip_last_bit(newest);
    let replayed = read_dir(dir.path(), false).unwrap();
    let users = (1..=3).map(|user| acked(&replayed, user));
    assert_eq!(users.collect::<Vec<_>>(), [Some(10), Some(2), None]);
    assert!(replayed.torn_bytes > 0);
    assert_eq!(std::fs::metadata(newest).unwrap().len(), offset as u64);
}

#[test]
fn a_corrupt_record_with_good_ones_after_it_stops_the_start_naming_file_and_offset() {
    let dir = tempfile::tempdir().unwrap();
    journal_acks(dir.path(), &[10], 5);
    let segment = only_segment(dir.path());
    let mut bytes = std::fs::read(&segment).unwrap();
    let offset = MAGIC.len();
    bytes[offset + record::HEADER + 3] ^= 0xff;
    std::fs::write(&segment, &bytes).unwrap();

    refused_as_corrupt(dir.path(), &segment, offset as u64);

    let replayed = read_dir(dir.path(), true).unwrap();
    assert_eq!(acked(&replayed, 1), None, "lost with the skipped bytes");
    assert_eq!(replayed.users.len(), 5, "the records after it are kept");
    assert!(replayed.skipped_bytes > 0);
}

#[test]
fn a_file_of_another_format_stops_the_start() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("00000000000000000001.journal"),
        b"not a journal at all",
    )
    .unwrap();
    assert!(matches!(
        read_dir(dir.path(), false),
        Err(JournalError::Corrupt { offset: 0, .. })
    ));
}

/// Issue 37: a write not made yet (a replayed user), journaled again for a
/// new backup, reads back as the same write.
#[test]
fn a_write_journaled_again_reads_back_the_same() {
    use crate::recent_deletions::{Deletion, Remembered};
    let state = |kind, channel_id, version| ReadState {
        channel_id,
        last_acked_id: 7,
        last_message_id: 9,
        version,
        mention_count: 1,
        unread_count: 2,
        kind,
        deleted: false,
        muted: false,
    };
    let write = UserWrite {
        user_id: 42,
        version: 300,
        delta_floor: 50,
        clear_below: Some(200),
        read_states: vec![state(Kind::Channel, 5, 250), state(Kind::Thread, 9, 300)],
        parents: [(9, 5)].into_iter().collect(),
        lowered: vec![Remembered {
            deletion: Deletion {
                channel_id: 5,
                message_id: 8,
                kind: Kind::Channel,
            },
            until_ms: 1_000,
        }],
    };
    let mut frames = Vec::new();
    record::frame(&mut frames, |out| record::append_write(out, &write));
    let (records, len) = record::read(&frames).expect("reads");
    assert_eq!(len, frames.len());
    let mut collapsing = Collapsing::default();
    records.into_iter().for_each(|r| collapsing.add(r));
    let (mut users, _) = collapsing.into_parts();
    let mut read = users.remove(&42).expect("the user");
    read.read_states.sort_by_key(|s| s.channel_id);
    assert_eq!(read, write);
}

/// Replaying `dir` without `--journal-skip-corrupt` stops at `file`'s
/// `offset` as corrupt, and says how to go on.
fn refused_as_corrupt(dir: &std::path::Path, file: &std::path::Path, offset: u64) {
    let error = read_dir(dir, false).unwrap_err();
    let JournalError::Corrupt {
        file: at_file,
        offset: at,
        ..
    } = &error
    else {
        panic!("{error:?}");
    };
    assert_eq!((at_file.as_path(), *at), (file, offset));
    assert!(
        error.to_string().contains("--journal-skip-corrupt"),
        "{error}"
    );
}
