//! The journal through the service (issue 36): a change is answered only
//! once its journal sync returns, and a failing disk gets UNAVAILABLE with
//! nothing applied until it takes the journal again.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use readstates::app::Application;
use readstates::config::{Config, StoreKind};
use readstates::journal::disk::faulty::{Faults, FaultyDisk};
use readstates::metrics::scrape;
use readstates::proto::ApplyResult;
use readstates::proto::apply_item::Change;
use readstates::proto::apply_result::Outcome;
use readstates::store::memory::MemoryStore;
use readstates::test_support::ack;
use tonic::Code;

use crate::apply::{Applier, batch};
use crate::helpers::{TestApp, eventually, start_with, test_config};

/// A node journaling on a disk the test makes fail (the store is in
/// memory, but the node is configured as the embedded store's, which
/// journals).
async fn spawn_journaled(dir: &tempfile::TempDir) -> (TestApp, Arc<Faults>) {
    let config = Config {
        store: StoreKind::Embedded,
        data_dir: dir.path().to_owned(),
        ..test_config()
    };
    let disk = Arc::new(FaultyDisk::default());
    let faults = disk.faults();
    let app = Application::build_with_disk(config, Arc::new(MemoryStore::new()), disk);
    (start_with(app.await.expect("build")).await, faults)
}

async fn last_acked(app: &mut TestApp, user_id: u64, channel_id: u64) -> Option<u64> {
    let states = app.all_read_states(user_id).await.read_states;
    (states.iter().find(|s| s.channel_id == channel_id)).map(|s| s.last_acked_id)
}

#[tokio::test]
async fn a_change_is_answered_only_once_its_journal_sync_returns() {
    let dir = tempfile::tempdir().unwrap();
    let (app, faults) = spawn_journaled(&dir).await;
    faults.hold();
    let mut client = app.client.clone();
    let acked = tokio::spawn(async move { client.ack(ack(1, 2, 3)).await });
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!acked.is_finished(), "answered before its sync returned");
    faults.release();
    let answer = acked.await.unwrap().expect("answered once synced");
    assert!(answer.into_inner().applied);
}

#[tokio::test]
async fn a_full_disk_gets_unavailable_and_nothing_is_applied_until_it_has_room() {
    let dir = tempfile::tempdir().unwrap();
    let (mut app, faults) = spawn_journaled(&dir).await;
    let failures = async |app: &TestApp| {
        scrape::value(&app.metrics().await, "readstates_journal_failures_total")
    };
    let before = failures(&app).await;
    app.client
        .ack(ack(1, 10, 100))
        .await
        .expect("a disk with room");

    faults.full.store(true, Ordering::SeqCst);
    let failed = app.client.ack(ack(1, 10, 200)).await.unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert!(failed.message().contains("journal"), "{failed:?}");
    // The journal is failing now: refused before it is applied.
    let refused = app.client.ack(ack(1, 11, 300)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert_eq!(
        last_acked(&mut app, 1, 11).await,
        None,
        "applied while the journal failed"
    );
    assert!(failures(&app).await > before, "counted");

    faults.full.store(false, Ordering::SeqCst);
    let client = app.client.clone();
    eventually("acks taken again once the disk has room", async || {
        client.clone().ack(ack(1, 11, 300)).await.is_ok()
    })
    .await;
    assert_eq!(last_acked(&mut app, 1, 11).await, Some(300));
    // The one answered UNAVAILABLE while it was applied stays applied: a
    // retry is counted once.
    app.client.ack(ack(1, 10, 200)).await.expect("retried");
    assert_eq!(last_acked(&mut app, 1, 10).await, Some(200));
}

#[tokio::test]
async fn a_failing_fsync_gets_unavailable_too() {
    let dir = tempfile::tempdir().unwrap();
    let (app, faults) = spawn_journaled(&dir).await;
    faults.failing_syncs.store(true, Ordering::SeqCst);
    let failed = app.client.clone().ack(ack(1, 10, 100)).await.unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    faults.failing_syncs.store(false, Ordering::SeqCst);
    let client = app.client.clone();
    eventually("acks taken again once syncs succeed", async || {
        client.clone().ack(ack(1, 11, 100)).await.is_ok()
    })
    .await;
}

/// On `Apply`, a response's items are synced together, once, before it
/// is sent: none is answered before its sync returns, and a failed sync
/// answers each UNAVAILABLE.
#[tokio::test]
async fn an_apply_response_is_sent_only_once_its_items_are_synced() {
    let dir = tempfile::tempdir().unwrap();
    let (app, faults) = spawn_journaled(&dir).await;
    let mut applier = Applier::open(&app).await;
    let acks = |message_id| {
        (1..=3)
            .map(|user| Change::Ack(ack(user, 10, message_id)))
            .collect()
    };
    applier.apply(acks(100)).await;

    faults.hold();
    applier.send(batch(acks(200))).await;
    let early = tokio::time::timeout(Duration::from_millis(300), applier.results.message()).await;
    assert!(
        early.is_err(),
        "answered before its sync returned: {early:?}"
    );
    faults.release();
    let answered: Vec<ApplyResult> = applier.next().await.unwrap();
    assert_eq!(answered.len(), 3);
    assert!(
        answered
            .iter()
            .all(|r| matches!(r.outcome, Some(Outcome::Ack(_)))),
        "{answered:?}"
    );

    faults.failing_syncs.store(true, Ordering::SeqCst);
    for outcome in applier.apply(acks(300)).await {
        match outcome {
            Outcome::Error(error) => assert_eq!(error.code, Code::Unavailable as i32, "{error:?}"),
            other => panic!("answered OK though its sync failed: {other:?}"),
        }
    }
}

#[tokio::test]
async fn a_journal_left_behind_is_replayed_also_with_the_journal_off() {
    use readstates::journal::disk::Fs;
    use readstates::journal::{Journal, JournalConfig, JournalMode, record};
    use readstates::read_state::{Key, UserReadStates};

    let dir = tempfile::tempdir().unwrap();
    let journal_dir = dir.path().join("journal");
    // What a node killed with an unwritten ack leaves.
    let (journal, _) = Journal::open(
        JournalConfig::new(journal_dir.clone(), JournalMode::Sync),
        Arc::new(Fs),
    )
    .unwrap();
    let mut user = UserReadStates::default();
    user.ack(Key::channel(10), 100, 1);
    journal.append(|out| record::append_user(out, 1, 0, user.view()));
    journal.close(false);

    let config = Config {
        store: StoreKind::Embedded,
        data_dir: dir.path().to_owned(),
        journal: JournalMode::Off,
        ..test_config()
    };
    let store = Arc::new(MemoryStore::new());
    let app = Application::build_with_store(config, store.clone());
    let mut app = start_with(app.await.expect("build")).await;
    assert_eq!(last_acked(&mut app, 1, 10).await, Some(100));
    app.client.ack(ack(2, 10, 5)).await.expect("acked");
    app.stop().await;
    let segments = (std::fs::read_dir(&journal_dir).unwrap())
        .filter(|e| (e.as_ref().unwrap().path().extension()).is_some_and(|x| x == "journal"))
        .count();
    assert_eq!(
        segments, 0,
        "deleted once written, and nothing new journaled"
    );
}
