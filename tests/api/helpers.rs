//! `spawn_app()`: the real server on port 0 with its own store, and a client.
//! Set `TEST_LOG=1` to see the server's logs.

use std::net::SocketAddr;
use std::sync::{Arc, Once};
use std::time::Duration;

use readstates::app::{Application, BoxError};
use readstates::cluster::credential::FleetCredential;
use readstates::cluster::ring_store::RingStore;
use readstates::config::{Config, Settings, StoreKind};
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::{GetReadStatesRequest, GetReadStatesResponse};
use readstates::store::Store;
use readstates::write_behind::ShutdownReport;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

pub struct TestApp {
    pub addr: SocketAddr,
    pub metrics_addr: SocketAddr,
    pub client: ReadStatesClient<Channel>,
    stop: oneshot::Sender<()>,
    running: JoinHandle<Result<ShutdownReport, BoxError>>,
}

impl TestApp {
    /// Graceful shutdown, as on SIGTERM.
    pub async fn stop(self) -> ShutdownReport {
        let _ = self.stop.send(());
        self.running
            .await
            .expect("server task")
            .expect("server ran")
    }

    pub async fn channel(&self) -> Channel {
        plaintext(self.addr).await
    }

    /// Every read state of `user_id` (`GetReadStates` with no filter).
    pub async fn all_read_states(&mut self, user_id: u64) -> GetReadStatesResponse {
        let request = GetReadStatesRequest {
            user_id,
            ..GetReadStatesRequest::default()
        };
        self.client
            .get_read_states(request)
            .await
            .expect("GetReadStates")
            .into_inner()
    }

    /// The Prometheus text at `/metrics`.
    pub async fn metrics(&self) -> String {
        readstates::metrics::scrape::fetch(self.metrics_addr)
            .await
            .expect("/metrics")
    }
}

/// The secret of the tests' fleets.
pub const FLEET_SECRET: &str = "the test fleet's own secret";

/// Marks `request` as a call of the fleet's node `node`: with its token
/// under [`FLEET_SECRET`], in the tests' fleet (the default keyspace).
pub fn as_node<T>(request: &mut tonic::Request<T>, node: &str) {
    FleetCredential::new(FLEET_SECRET, "readstates", node).stamp(request.metadata_mut());
}

/// The test configuration: memory store, ports chosen by the OS, the
/// fleet's secret (taken only by nodes of a fleet).
pub fn test_config() -> Config {
    Config::resolve(Settings {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        store: Some(StoreKind::Memory),
        shards: Some(4),
        shutdown_timeout: Some(Duration::from_secs(10)),
        threads: Some(true),
        fleet_secret: Some(Some(FLEET_SECRET.parse().unwrap())),
        ..Settings::default()
    })
}

pub async fn spawn_app() -> TestApp {
    spawn_app_with(test_config()).await
}

pub async fn spawn_app_with(config: Config) -> TestApp {
    spawn_app_connected(config, plaintext).await
}

/// [`spawn_app_with`], its client connected by `connect` (over TLS, say).
pub async fn spawn_app_connected(
    config: Config,
    connect: impl AsyncFnOnce(SocketAddr) -> Channel,
) -> TestApp {
    init_log(&config);
    start(Application::build(config).await.expect("build"), connect).await
}

/// [`spawn_app_with`], on a store of the test's own.
pub async fn spawn_app_on(config: Config, store: Arc<dyn Store>) -> TestApp {
    init_log(&config);
    let app = Application::build_with_store(config, store).await;
    start(app.expect("build"), plaintext).await
}

/// A node of a fleet (`config.node_id`) whose ring is kept in `ring`.
pub async fn spawn_member(
    config: Config,
    store: Arc<dyn Store>,
    ring: Arc<dyn RingStore>,
) -> TestApp {
    spawn_member_connected(config, store, ring, plaintext).await
}

/// [`spawn_member`], its client connected by `connect`.
pub async fn spawn_member_connected(
    config: Config,
    store: Arc<dyn Store>,
    ring: Arc<dyn RingStore>,
    connect: impl AsyncFnOnce(SocketAddr) -> Channel,
) -> TestApp {
    init_log(&config);
    let app = Application::build_with(config, store, Some(ring)).await;
    start(app.expect("build"), connect).await
}

fn init_log(config: &Config) {
    static LOG: Once = Once::new();
    LOG.call_once(|| {
        if std::env::var_os("TEST_LOG").is_some() {
            readstates::telemetry::init(config);
        }
    });
}

/// Waits until `condition` holds, at most 20 s.
pub async fn eventually(what: &str, mut condition: impl AsyncFnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    while !condition().await {
        assert!(tokio::time::Instant::now() < deadline, "never: {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The real binary, `readstates serve --store memory` with `args`, on a
/// port of its own, serving (plaintext); killed when dropped.
pub async fn spawn_process(args: &[&str]) -> (tokio::process::Child, SocketAddr) {
    let (server, addr) = start_process(args, std::process::Stdio::inherit());
    eventually("the server serving", async || {
        ReadStatesClient::connect(format!("http://{addr}"))
            .await
            .is_ok()
    })
    .await;
    (server, addr)
}

/// [`spawn_process`] with its stderr to `stderr`, not waiting for it to
/// serve (a caller over TLS checks that itself).
pub fn start_process(
    args: &[&str],
    stderr: std::process::Stdio,
) -> (tokio::process::Child, SocketAddr) {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let server = tokio::process::Command::new(env!("CARGO_BIN_EXE_readstates"))
        .args([
            "serve",
            "--store",
            "memory",
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .arg("--listen")
        .arg(addr.to_string())
        .args(args)
        .env_remove("RUST_LOG")
        .stderr(stderr)
        .kill_on_drop(true)
        .spawn()
        .expect("start readstates");
    (server, addr)
}

/// SIGTERM, as an orchestrator stops a server.
pub fn terminate(server: &tokio::process::Child) {
    let pid = server.id().expect("running").to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("kill");
    assert!(killed.success());
}

/// A plaintext channel to `addr`.
pub async fn plaintext(addr: SocketAddr) -> Channel {
    Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .expect("connect")
}

/// An application the test built itself, serving, its client connected
/// over plaintext.
pub async fn start_with(app: Application) -> TestApp {
    start(app, plaintext).await
}

async fn start(app: Application, connect: impl AsyncFnOnce(SocketAddr) -> Channel) -> TestApp {
    let (addr, metrics_addr) = (app.grpc_addr(), app.metrics_addr());
    let (stop, stopped) = oneshot::channel();
    let running = tokio::spawn(app.run_until(async {
        let _ = stopped.await;
    }));
    let client = ReadStatesClient::new(connect(addr).await);
    TestApp {
        addr,
        metrics_addr,
        client,
        stop,
        running,
    }
}

/// Field 1 of a request carrying bytes that are no protobuf: a request
/// stream of it cannot be decoded.
#[derive(Clone, PartialEq, prost::Message)]
struct Garbage {
    #[prost(bytes = "vec", tag = "1")]
    junk: Vec<u8>,
}

/// Opens a client stream on `path` (`/package.Service/Method`), sends one
/// frame of garbage, and reads until the stream ends: the status it ends
/// with, within 5 s.
pub async fn garbage_stream(app: &TestApp, path: &'static str) -> tonic::Status {
    let mut grpc = tonic::client::Grpc::new(app.channel().await);
    grpc.ready().await.unwrap();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static(path);
    // What comes back never decodes as anything but empty: only the status
    // matters.
    let codec = tonic_prost::ProstCodec::<Garbage, ()>::default();
    let requests = tokio_stream::iter(vec![Garbage {
        junk: vec![0xff; 16],
    }]);
    let outcome = async {
        let mut responses = grpc
            .streaming(tonic::Request::new(requests), path, codec)
            .await?
            .into_inner();
        while responses.message().await?.is_some() {}
        Ok::<(), tonic::Status>(())
    };
    tokio::time::timeout(Duration::from_secs(5), outcome)
        .await
        .expect("ends")
        .expect_err("an error status")
}

/// A connection to `app` whose streams have a 64 KiB receive window
/// (hyper's default is 2 MiB), so that a client that stops reading holds
/// the server back soon.
pub async fn small_window_channel(app: &TestApp) -> Channel {
    Channel::from_shared(format!("http://{}", app.addr))
        .unwrap()
        .initial_stream_window_size(65_535)
        .connect()
        .await
        .unwrap()
}
