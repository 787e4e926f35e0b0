//! The directory lock: exclusive per open file, naming its holder.

use super::*;

#[test]
fn two_locks_of_one_directory_in_one_process_conflict_and_the_second_names_the_first() {
    let dir = tempfile::tempdir().unwrap();
    let first = DirLock::acquire(dir.path()).expect("a free directory");
    assert_eq!(first.holder().pid, std::process::id());
    assert_eq!(first.dir(), dir.path());

    let error = DirLock::acquire(dir.path()).expect_err("held by the first");
    let JournalError::Locked {
        dir: locked,
        holder,
    } = &error
    else {
        panic!("{error:?}");
    };
    assert_eq!(locked, dir.path());
    assert_eq!(holder, &first.holder().to_string());
    assert_eq!(
        error.to_string(),
        format!(
            "journal directory {} is locked by another process ({}): is this node running twice?",
            dir.path().display(),
            first.holder()
        )
    );

    drop(first);
    let second = DirLock::acquire(dir.path()).expect("free once the first is dropped");
    let written = std::fs::read_to_string(dir.path().join(LOCK_FILE)).unwrap();
    assert_eq!(Holder::parse(&written).as_ref(), Some(second.holder()));
}

#[test]
fn a_holder_that_has_not_written_yet_is_still_refused() {
    let dir = tempfile::tempdir().unwrap();
    // Another opener's lock, taken and not yet written.
    let other = File::create(dir.path().join(LOCK_FILE)).unwrap();
    other.try_lock().unwrap();

    let error = DirLock::acquire(dir.path()).expect_err("held");
    assert!(
        error.to_string().contains("(which did not say who it is)"),
        "{error}"
    );
    drop(other);
    DirLock::acquire(dir.path()).expect("free");
}

#[test]
fn a_missing_directory_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("a").join("journal");
    let lock = DirLock::acquire(&journal).expect("made and locked");
    assert!(journal.join(LOCK_FILE).is_file());
    assert!(!lock.holder().host.is_empty());
}

/// A restart in place finds the incarnation its predecessor recorded
/// (`docs/failover.md`, "Restarted in place"); one that recorded none
/// names none.
#[test]
fn the_next_holder_finds_the_incarnation_its_predecessor_recorded() {
    let dir = tempfile::tempdir().unwrap();
    let mut first = DirLock::acquire(dir.path()).unwrap();
    assert_eq!(first.predecessor(), None, "nobody held it before");
    first.record_incarnation("0123abcd").unwrap();
    drop(first);
    let second = DirLock::acquire(dir.path()).unwrap();
    let predecessor = second.predecessor().expect("the first is named");
    assert_eq!(predecessor.incarnation.as_deref(), Some("0123abcd"));
    assert_eq!(second.gone_predecessor(), Some("0123abcd"));
    assert_eq!(second.holder().incarnation, None);
    drop(second);
    let third = DirLock::acquire(dir.path()).unwrap();
    assert_eq!(third.gone_predecessor(), None);
}

/// Found in review: a copy of a live node's journal directory (a volume
/// cloned, or copied to a new host) carries its lock file, naming the live
/// process's incarnation; a start on the copy took the live node's lease
/// at once, and both served its users. The lock proves a predecessor gone
/// only for the file it locked, under the kernel that let go of it.
#[test]
fn a_copy_of_a_live_directory_names_no_gone_predecessor() {
    let live = tempfile::tempdir().unwrap();
    let mut holder = DirLock::acquire(live.path()).unwrap();
    holder.record_incarnation("live one").unwrap();
    let copy = tempfile::tempdir().unwrap();
    std::fs::copy(live.path().join(LOCK_FILE), copy.path().join(LOCK_FILE)).unwrap();
    let on_the_copy = DirLock::acquire(copy.path()).expect("another file: not locked");
    let named = on_the_copy
        .predecessor()
        .and_then(|p| p.incarnation.as_deref());
    assert_eq!(named, Some("live one"), "the copy names the live process");
    assert_eq!(
        on_the_copy.gone_predecessor(),
        None,
        "a live process taken for gone"
    );
    drop(holder);
}
