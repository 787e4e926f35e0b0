//! The ring in Cassandra: `readstates ring` changes it one epoch at a time,
//! racing changes take one epoch each, and a record reads back whole.

use std::process::Command;

use readstates::cluster::ring_store::RingRecord;
use readstates::cluster::ring_store::RingStore;
use readstates_routing::Node;

use crate::helpers::{fresh_keyspace, nodes};

/// Runs `readstates ring ARGS` on `keyspace`: (success, stdout, stderr).
fn ring(keyspace: &str, args: &[&str]) -> (bool, String, String) {
    ring_with(keyspace, args, &[])
}

/// [`ring`], with environment variables set.
fn ring_with(keyspace: &str, args: &[&str], env: &[(&str, &str)]) -> (bool, String, String) {
    let output = Command::new(env!("CARGO_BIN_EXE_readstates"))
        .args([
            "ring",
            "--keyspace",
            keyspace,
            "--cassandra-nodes",
            &nodes(),
        ])
        .args(args)
        .env_remove("RUST_LOG")
        .envs(env.iter().copied())
        .output()
        .expect("run readstates ring");
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

fn node(id: &str, weight: u32) -> Node {
    Node {
        id: id.to_owned(),
        address: format!("127.0.0.1:{}", 50000 + u16::from(id.as_bytes()[0])),
        weight,
    }
}

#[tokio::test]
async fn the_ring_command_changes_one_epoch_at_a_time() {
    let (keyspace, store) = fresh_keyspace("cli").await;
    let (ok, shown, _) = ring(&keyspace, &["show"]);
    assert!(ok && shown.starts_with("epoch 0\n"), "{shown}");

    // Issue 24, item 5: these were added, and their users failed with
    // "dns error" from then on.
    for address in ["http://127.0.0.1:50001", "bad host:50001"] {
        let (ok, _, err) = ring(&keyspace, &["add", "nx", address]);
        assert!(
            !ok && err.contains(&format!("address {address:?} is not host:port")),
            "{err}"
        );
    }
    assert_eq!(
        store.load().await.unwrap().ring.epoch(),
        0,
        "nothing changed"
    );

    let (ok, out, err) = ring(&keyspace, &["add", "a", "127.0.0.1:50001"]);
    assert!(ok, "{err}");
    assert_eq!(out, "epoch 1: 16384 slots move\n");
    // a does not serve epoch 1 yet: the next change waits for it.
    let (ok, _, err) = ring(&keyspace, &["add", "b", "127.0.0.1:50002"]);
    assert!(
        !ok && err.contains("still being handed over: a not serving"),
        "{err}"
    );
    store.report("a", 1).await.unwrap();
    let (ok, out, err) = ring(
        &keyspace,
        &["add", "b", "127.0.0.1:50002", "--weight", "300"],
    );
    assert!(ok, "{err}");
    assert!(out.starts_with("epoch 2: "), "{out}");

    let record = store.load().await.unwrap();
    assert_eq!(record.ring.epoch(), 2);
    let b = record.ring.slots_of("b").count();
    assert!(
        (11_800..=12_800).contains(&b),
        "b has 3/4 of the slots: {b}"
    );
    assert!(record.moving().all(|(_, from)| from == Some("a")));

    // a dies before it releases: only --force lets b go on without it.
    let (ok, _, err) = ring(&keyspace, &["release", "a"]);
    assert!(!ok && err.contains("pass --force"), "{err}");
    assert!(store.load().await.unwrap().released.is_empty());
    let (ok, out, err) = ring(&keyspace, &["release", "a", "--force"]);
    assert!(ok, "{err}");
    assert_eq!(
        out,
        format!("a: {b} slots released; their new owners serve them from the store\n")
    );
    let (_, shown, _) = ring(&keyspace, &["show"]);
    assert!(shown.contains("released by force: a"), "{shown}");
    assert!(shown.contains(&format!("a -> b: {b}")), "{shown}");
    assert!(shown.contains("waiting on: a, b"), "{shown}");

    // Served: `--wait` returns at once and says so.
    store.report("a", 2).await.unwrap();
    store.report("b", 2).await.unwrap();
    let (ok, out, err) = ring(&keyspace, &["set-weight", "b", "0", "--wait", "1s"]);
    assert!(
        !ok && err.contains("epoch 3 not served after 1s"),
        "{out}{err}"
    );
    store.report("a", 3).await.unwrap();
    let (_, shown, _) = ring(&keyspace, &["show"]);
    assert!(shown.contains("every slot served by its owner"), "{shown}");
    let (ok, _, err) = ring(&keyspace, &["remove", "z"]);
    assert!(!ok && err.contains("node z is not in the ring"), "{err}");
}

/// Issue 37: a node dead for good that nothing took over, and that the
/// current epoch waits for (it was to take slots), blocks every change;
/// `ring remove NODE --force` takes it out, its slots released at once.
#[tokio::test]
async fn the_ring_command_removes_a_dead_node_by_force() {
    let (keyspace, store) = fresh_keyspace("cli_force").await;
    let (ok, _, err) = ring(&keyspace, &["add", "a", "127.0.0.1:50001"]);
    assert!(ok, "{err}");
    store.report("a", 1).await.unwrap();
    let (ok, _, err) = ring(&keyspace, &["add", "b", "127.0.0.1:50002"]);
    assert!(ok, "{err}");
    // a let its slots go to b; b died before it served them.
    store.report("a", 2).await.unwrap();

    let (ok, _, err) = ring(&keyspace, &["remove", "b"]);
    assert!(!ok && err.contains("b not serving"), "{err}");
    let (ok, _, err) = ring(&keyspace, &["remove", "b", "--ignore-lease"]);
    assert!(!ok && err.contains("--force"), "{err}");
    let (ok, _, err) = ring(&keyspace, &["remove", "b", "--force"]);
    assert!(!ok && err.contains("fleet_secret"), "{err}");
    let secret = [("READSTATES_FLEET_SECRET", "the test fleet's own secret")];
    let (ok, out, err) = ring_with(&keyspace, &["remove", "b", "--force"], &secret);
    assert!(ok, "{err}");
    assert!(out.starts_with("epoch 3: b removed by force"), "{out}");

    let record = store.load().await.unwrap();
    assert!(record.ring.node("b").is_none(), "{:?}", record.ring);
    assert!(record.released.contains("b"), "its slots released at once");
    let (ok, _, err) = ring_with(&keyspace, &["remove", "b", "--force"], &secret);
    assert!(!ok && err.contains("node b is not in the ring"), "{err}");
}

#[tokio::test]
async fn racing_changes_take_one_epoch_each() {
    let (_, store) = fresh_keyspace("race").await;
    let store = std::sync::Arc::new(store);
    for epoch in 1..=3u64 {
        let current = store.load().await.unwrap();
        assert_eq!(current.ring.epoch(), epoch - 1);
        let candidates: Vec<RingRecord> = ["p", "q", "r", "s"]
            .iter()
            .map(|id| {
                let id = format!("{id}{epoch}");
                current.advance(current.ring.with_node(node(&id, 10)).unwrap())
            })
            .collect();
        let races: Vec<_> = candidates
            .iter()
            .cloned()
            .map(|next| {
                let store = store.clone();
                tokio::spawn(async move { store.advance(&next).await.unwrap() })
            })
            .collect();
        let mut won = Vec::new();
        for (candidate, race) in candidates.into_iter().zip(races) {
            if race.await.unwrap() {
                won.push(candidate);
            }
        }
        assert_eq!(won.len(), 1, "epoch {epoch}: exactly one change wins");
        assert_eq!(store.load().await.unwrap(), won[0]);
    }
}

#[tokio::test]
async fn a_record_reads_back_whole() {
    let (_, store) = fresh_keyspace("record").await;
    assert_eq!(store.load().await.unwrap(), RingRecord::empty());
    let first = RingRecord::empty()
        .advance(readstates_routing::Ring::new(1, vec![node("a", 1), node("b", 2)]).unwrap());
    assert!(store.advance(&first).await.unwrap());
    assert!(!store.advance(&first).await.unwrap(), "epoch 1 is taken");
    let second = first.advance(first.ring.without("a").unwrap());
    assert!(store.advance(&second).await.unwrap());
    assert!(store.release(2, "a").await.unwrap());
    assert!(
        !store.release(1, "b").await.unwrap(),
        "not the current epoch"
    );
    let loaded = store.load().await.unwrap();
    assert_eq!(loaded.ring, second.ring);
    assert_eq!(loaded.previous, first.ring);
    assert_eq!(loaded.released.iter().collect::<Vec<_>>(), ["a"]);
    store.report("b", 2).await.unwrap();
    assert_eq!(store.progress().await.unwrap().get("b"), Some(&2));
}
