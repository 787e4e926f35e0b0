//! The Cassandra under test, and `readstates` processes talking to it.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use readstates::cluster::ring_store::cassandra::CassandraRingStore;
use readstates::metrics::scrape;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::store::Store;
use readstates::store::cassandra::{self, CassandraConfig, CassandraStore};
use tonic::transport::Channel;

pub const KEYSPACE: &str = "readstates_test";
/// The secret the test fleets' nodes share (`fleet_secret`).
pub const FLEET_SECRET: &str = "the test fleet's own secret";

/// `READSTATES_TEST_CASSANDRA`, or the port `scripts/cassandra.sh` uses.
pub fn nodes() -> String {
    std::env::var("READSTATES_TEST_CASSANDRA").unwrap_or_else(|_| "127.0.0.1:9042".to_owned())
}

pub fn config(nodes: &str) -> CassandraConfig {
    CassandraConfig {
        nodes: nodes.split(',').map(str::to_owned).collect(),
        keyspace: KEYSPACE.to_owned(),
        username: None,
        password: None,
        consistency: scylla::statement::Consistency::LocalQuorum,
        datacenter: None,
        replication: "{'class': 'SimpleStrategy', 'replication_factor': 1}".to_owned(),
    }
}

/// Applies the schema once per test binary, then connects a store of the
/// test's own (a session lives on the runtime that made it).
pub async fn store() -> CassandraStore {
    store_at(&nodes()).await
}

/// [`store`], for the Cassandra at `nodes`: the schema is applied once per
/// cluster per test binary (the outage test runs a Cassandra of its own).
pub async fn store_at(nodes: &str) -> CassandraStore {
    static MIGRATED: tokio::sync::Mutex<BTreeSet<String>> =
        tokio::sync::Mutex::const_new(BTreeSet::new());
    let config = config(nodes);
    let mut migrated = MIGRATED.lock().await;
    if !migrated.contains(nodes) {
        let session = cassandra::connect(&config).await.unwrap_or_else(|e| {
            panic!("no Cassandra at {nodes}: {e}; start one with scripts/cassandra.sh start")
        });
        cassandra::schema::migrate(&session, &config.keyspace, &config.replication)
            .await
            .expect("migrate");
        migrated.insert(nodes.to_owned());
    }
    drop(migrated);
    CassandraStore::connect(&config).await.expect("connect")
}

/// A keyspace of the test's own (the ring is one row per keyspace), with
/// the schema applied, and a ring store on it.
pub async fn fresh_keyspace(name: &str) -> (String, CassandraRingStore) {
    let keyspace = format!("readstates_{name}_{}", readstates::clock::now_micros());
    let mut config = config(&nodes());
    config.keyspace = keyspace.clone();
    let session = cassandra::connect(&config)
        .await
        .unwrap_or_else(|e| panic!("no Cassandra at {}: {e}", nodes()));
    cassandra::schema::migrate(&session, &keyspace, &config.replication)
        .await
        .expect("migrate");
    let store = CassandraRingStore::with_session(session, &keyspace)
        .await
        .expect("ring statements prepare");
    (keyspace, store)
}

/// User ids no other test, and no earlier run, has used.
pub fn fresh_users(count: u64) -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let base = readstates::clock::now_micros() << 10;
    base + NEXT.fetch_add(count, Ordering::SeqCst)
}

/// A `readstates serve` process on ports of its own.
pub struct Server {
    child: Child,
    pub grpc: SocketAddr,
    pub metrics: SocketAddr,
    /// Every log line it wrote (JSON).
    log: Arc<Mutex<Vec<String>>>,
    /// Its own journal directory, unless the test gave one
    /// (`--journal-dir`, to restart it in place).
    _journal: Option<tempfile::TempDir>,
}

impl Server {
    /// Starts `readstates serve --store cassandra` with `args` on top.
    pub fn start(nodes: &str, args: &[&str]) -> Server {
        Server::start_in(KEYSPACE, "127.0.0.1:0", nodes, args)
    }

    /// [`Server::start`] in `keyspace`, listening on `listen`.
    pub fn start_in(keyspace: &str, listen: &str, nodes: &str, args: &[&str]) -> Server {
        Server::try_start_in(keyspace, listen, nodes, args)
            .unwrap_or_else(|log| panic!("readstates did not start serving; its log:\n{log}"))
    }

    /// [`Server::start_in`], or the log of a process that did not start.
    pub fn try_start_in(
        keyspace: &str,
        listen: &str,
        nodes: &str,
        args: &[&str],
    ) -> Result<Server, String> {
        // Each server journals on its own, unless told where.
        let journal =
            (!args.contains(&"--journal-dir")).then(|| tempfile::tempdir().expect("tempdir"));
        let journal_args = (journal.iter())
            .flat_map(|dir| ["--journal-dir".to_owned(), dir.path().display().to_string()]);
        let mut child = Command::new(env!("CARGO_BIN_EXE_readstates"))
            .args([
                "serve",
                "--store",
                "cassandra",
                "--keyspace",
                keyspace,
                "--cassandra-nodes",
                nodes,
            ])
            .args([
                "--listen",
                listen,
                "--metrics-listen",
                "127.0.0.1:0",
                "--log-format",
                "json",
            ])
            .args(args)
            .args(journal_args)
            .env_remove("RUST_LOG")
            // Taken by fleet nodes only: what they prove to each other with.
            .env("READSTATES_FLEET_SECRET", FLEET_SECRET)
            .stderr(Stdio::piped())
            .spawn()
            .expect("start readstates");
        let (ready, addresses) = mpsc::channel();
        let stderr = BufReader::new(child.stderr.take().expect("stderr"));
        let log = Arc::new(Mutex::new(Vec::new()));
        let kept = log.clone();
        std::thread::spawn(move || {
            let echo = std::env::var_os("TEST_LOG").is_some();
            for line in stderr.lines().map_while(Result::ok) {
                if echo {
                    eprintln!("{line}");
                }
                kept.lock().unwrap().push(line.clone());
                let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) else {
                    continue;
                };
                if event["message"] == "serving" {
                    let addr = |key: &str| event[key].as_str().and_then(|a| a.parse().ok());
                    let _ = ready.send((addr("grpc"), addr("metrics")));
                }
            }
        });
        match addresses.recv_timeout(Duration::from_secs(30)) {
            Ok((Some(grpc), Some(metrics))) => Ok(Server {
                child,
                grpc,
                metrics,
                log,
                _journal: journal,
            }),
            other => {
                let _ = child.kill();
                let _ = child.wait();
                let lines = log.lock().unwrap().join("\n");
                Err(format!("({other:?})\n{lines}"))
            }
        }
    }

    pub async fn client(&self) -> ReadStatesClient<Channel> {
        ReadStatesClient::connect(format!("http://{}", self.grpc))
            .await
            .expect("connect")
    }

    pub async fn metric(&self, series: &str) -> f64 {
        let text = scrape::fetch(self.metrics).await.expect("/metrics");
        scrape::value(&text, series)
    }

    /// Every log line so far (to print when a test fails).
    pub fn log(&self) -> String {
        self.log.lock().unwrap().join("\n")
    }

    /// The log lines whose `message` is `message`.
    pub fn logged(&self, message: &str) -> Vec<serde_json::Value> {
        let log = self.log.lock().unwrap();
        log.iter()
            .filter_map(|line| serde_json::from_str::<serde_json::Value>(line).ok())
            .filter(|event| event["message"] == message)
            .collect()
    }

    /// SIGKILL, as a crash: nothing is written on the way out.
    pub fn crash(&self) {
        self.signal("KILL");
    }

    /// SIGSTOP: the process freezes (a node that stopped answering), until
    /// [`Server::resume`].
    pub fn freeze(&self) {
        self.signal("STOP");
    }

    /// SIGCONT, after [`Server::freeze`].
    pub fn resume(&self) {
        self.signal("CONT");
    }

    /// SIGTERM without waiting: the exit comes from [`Server::wait_for_exit`].
    pub fn signal_terminate(&self) {
        self.signal("TERM");
    }

    fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .args([&format!("-{name}"), &self.child.id().to_string()])
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for the process to exit.
    pub fn wait_for_exit(&mut self) -> ExitStatus {
        let status = self.child.wait().expect("wait");
        // Let the log reader take the last lines.
        std::thread::sleep(Duration::from_millis(100));
        status
    }

    /// SIGTERM, as an orchestrator stops it; waits for the exit.
    pub fn terminate(mut self) -> ExitStatus {
        self.signal_terminate();
        self.child.wait().expect("wait")
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Checks each user's unread count over the channels from `counted_from`
/// against what MessageCreated answered: `counted` maps a user to the
/// messages acknowledged and those left unanswered, so the count must be at
/// least the first and at most both (never a message counted twice).
/// Returns the unanswered ones.
pub async fn check_counts<'a>(
    store: &CassandraStore,
    counted: impl IntoIterator<Item = (&'a u64, &'a (u32, u32))>,
    counted_from: u64,
) -> u32 {
    let mut unanswered = 0;
    for (&user_id, &(ok, unknown)) in counted {
        let unread: u32 = store
            .load(user_id)
            .await
            .unwrap()
            .read_states
            .iter()
            .filter(|s| s.channel_id >= counted_from)
            .map(|s| u32::from(s.unread_count))
            .sum();
        assert!(
            (ok..=ok + unknown).contains(&unread),
            "user {user_id}: {unread} counted, {ok} acknowledged, {unknown} unanswered"
        );
        unanswered += unknown;
    }
    unanswered
}

/// Polls `check` until it holds or `limit` passes.
pub async fn eventually(limit: Duration, mut check: impl AsyncFnMut() -> bool) -> bool {
    let deadline = tokio::time::Instant::now() + limit;
    while tokio::time::Instant::now() < deadline {
        if check().await {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    check().await
}
