//! One process per directory (issue 53): a second `readstates serve` on a
//! live node's journal (a compose file run twice, one `--node-id` on a
//! shared volume) used to replay, write and delete the live one's segments;
//! now it does not start, and names the holder. A kill -9 frees the
//! directory at once. The embedded store's file is redb's to lock.

use std::net::SocketAddr;
use std::path::Path;
use std::process::Stdio;
use std::time::Duration;

use readstates::app::Application;
use readstates::config::{Config, StoreKind};
use readstates::proto::GetReadStatesRequest;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::test_support::ack;
use tokio::process::{Child, Command};
use tonic::transport::Channel;

use crate::helpers::{eventually, spawn_app_with, test_config};

/// `readstates serve` on the embedded store in `data`, journaling into
/// `journal`, on a port of its own; killed when dropped.
fn serve(data: &Path, journal: &Path, stderr: Stdio) -> (Child, SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let server = Command::new(env!("CARGO_BIN_EXE_readstates"))
        .args(["serve", "--store", "embedded"])
        .args(["--metrics-listen", "127.0.0.1:0"])
        .arg("--listen")
        .arg(addr.to_string())
        .arg("--data-dir")
        .arg(data)
        .arg("--journal-dir")
        .arg(journal)
        .env_remove("RUST_LOG")
        .env("NO_COLOR", "1")
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("start readstates");
    (server, addr)
}

async fn connected(addr: SocketAddr) -> ReadStatesClient<Channel> {
    let url = format!("http://{addr}");
    eventually("the server serving", async || {
        ReadStatesClient::connect(url.clone()).await.is_ok()
    })
    .await;
    ReadStatesClient::connect(url).await.unwrap()
}

async fn last_acked(client: &mut ReadStatesClient<Channel>, user_id: u64) -> Option<u64> {
    let request = GetReadStatesRequest {
        user_id,
        ..GetReadStatesRequest::default()
    };
    let states = client.get_read_states(request).await.unwrap().into_inner();
    (states.read_states.iter())
        .find(|s| s.channel_id == 10)
        .map(|s| s.last_acked_id)
}

fn segments(journal: &Path) -> usize {
    (std::fs::read_dir(journal).unwrap())
        .filter(|e| (e.as_ref().unwrap().path().extension()).is_some_and(|x| x == "journal"))
        .count()
}

#[tokio::test]
async fn a_second_process_on_a_live_nodes_journal_does_not_start_and_a_kill_9_frees_it() {
    let dir = tempfile::tempdir().unwrap();
    let journal = dir.path().join("journal");
    // Stores of their own, so that only the journal is shared (the
    // embedded store's file has redb's lock).
    let (data_a, data_b) = (dir.path().join("a"), dir.path().join("b"));
    let (mut first, addr) = serve(&data_a, &journal, Stdio::null());
    let mut client = connected(addr).await;
    client.ack(ack(1, 10, 100)).await.expect("journaled");

    let (second, _) = serve(&data_b, &journal, Stdio::piped());
    let ended = tokio::time::timeout(Duration::from_secs(15), second.wait_with_output()).await;
    let output = ended
        .expect("a second process on a live journal started")
        .unwrap();
    assert!(!output.status.success());
    let log = String::from_utf8_lossy(&output.stderr);
    let holder = format!(
        "journal directory {} is locked by another process (pid {} on host ",
        journal.display(),
        first.id().unwrap()
    );
    assert!(
        log.contains(&holder) && log.contains("is this node running twice?"),
        "{log}"
    );
    // It took nothing from the first.
    assert!(segments(&journal) >= 1, "the live node's segments deleted");
    assert_eq!(last_acked(&mut client, 1).await, Some(100));

    first.start_kill().unwrap();
    first.wait().await.unwrap();
    // Restarted in place at once: the kernel let go of the lock with it,
    // and its journal replays (the store got nothing in the write delay).
    let (_third, addr) = serve(&data_a, &journal, Stdio::null());
    let mut client = connected(addr).await;
    assert_eq!(last_acked(&mut client, 1).await, Some(100));
}

/// Checked rather than locked again: redb locks its file (an OFD lock, so
/// two opens in one process conflict as two processes do) before the
/// journal is looked at.
#[tokio::test]
async fn a_second_node_on_an_embedded_stores_data_directory_does_not_start() {
    let dir = tempfile::tempdir().unwrap();
    let config = || Config {
        store: StoreKind::Embedded,
        data_dir: dir.path().to_owned(),
        ..test_config()
    };
    let first = spawn_app_with(config()).await;
    let error = Application::build(config())
        .await
        .map(|_| ())
        .expect_err("a second node on one data directory");
    let message = error.to_string();
    assert!(
        message.contains(&dir.path().join("readstates.redb").display().to_string())
            && message.contains("is this node running twice?"),
        "{message}"
    );
    first.stop().await;
    let again = spawn_app_with(config()).await;
    again.stop().await;
}
