//! TLS and mTLS end to end, with certificates each test makes from a CA of
//! its own (rcgen). Each kind of bad handshake fails only its own
//! connection, counted by reason: a client connected before it, and one
//! connecting after it, are served (a tonic release once let one
//! handshake's I/O error end the whole server). Certificates rotate without
//! a restart, and fleet nodes call each other over mTLS.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::TokioIo;
use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, date_time_ymd,
};
use readstates::app::Application;
use readstates::cluster::admin::{self, RingChange};
use readstates::cluster::ring_store::RingStore;
use readstates::cluster::ring_store::memory::MemoryRingStore;
use readstates::config::Config;
use readstates::metrics::scrape;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::proto::{AckRequest, GetReadStatesRequest};
use readstates::store::memory::MemoryStore;
use readstates::tls::incoming::MAX_HANDSHAKES;
use readstates_routing::Node;
use readstates_routing::client::{Connect, FleetClient};
use tempfile::TempDir;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};
use tonic::transport::{Channel, Endpoint, Uri};

use crate::helpers::{
    TestApp, eventually, spawn_app_connected, spawn_member_connected, start_process, test_config,
};

/// Handshake failures are counted process-wide: TLS tests run one at a
/// time, so that each sees exactly its own.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Long enough for any good handshake on a loaded machine, short enough for
/// the timeout tests to wait it out.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(3);

struct Ca {
    issuer: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, PEM.
struct Issued {
    cert: String,
    key: String,
}

impl Ca {
    fn new(name: &str) -> Ca {
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.distinguished_name.push(DnType::CommonName, name);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let issuer = CertifiedIssuer::self_signed(params, KeyPair::generate().unwrap()).unwrap();
        Ca { issuer }
    }

    fn pem(&self) -> String {
        self.issuer.pem()
    }

    /// For `localhost` and 127.0.0.1, valid now (rcgen's default range).
    fn issue(&self, name: &str) -> Issued {
        self.issue_with(name, |_| {})
    }

    fn issue_expired(&self, name: &str) -> Issued {
        self.issue_with(name, |params| {
            params.not_before = date_time_ymd(2020, 1, 1);
            params.not_after = date_time_ymd(2021, 1, 1);
        })
    }

    fn issue_with(&self, name: &str, edit: impl FnOnce(&mut CertificateParams)) -> Issued {
        let mut params =
            CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()]).unwrap();
        params.distinguished_name.push(DnType::CommonName, name);
        edit(&mut params);
        let key = KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        Issued {
            cert: cert.pem(),
            key: key.serialize_pem(),
        }
    }
}

fn write(dir: &Path, name: &str, contents: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, contents).unwrap();
    path
}

/// A test server over TLS with `server`'s certificate; over mTLS if
/// `client_ca` is given. The files live in `dir`.
fn tls_config(dir: &Path, server: &Issued, client_ca: Option<&Ca>) -> Config {
    let mut config = test_config();
    config.tls_cert = Some(write(dir, "server.pem", &server.cert));
    config.tls_key = Some(write(dir, "server.key", &server.key));
    config.tls_client_ca = client_ca.map(|ca| write(dir, "client-ca.pem", &ca.pem()));
    config.tls_handshake_timeout = HANDSHAKE_TIMEOUT;
    config.tls_poll = Duration::from_millis(100);
    config
}

/// A client that trusts `trusts` and presents `identity`, if any.
fn client_config(trusts: &Ca, identity: Option<&Issued>) -> Arc<ClientConfig> {
    let mut roots = RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_slice(trusts.pem().as_bytes()).unwrap())
        .unwrap();
    let builder = ClientConfig::builder().with_root_certificates(roots);
    let mut config = match identity {
        Some(issued) => builder
            .with_client_auth_cert(
                vec![CertificateDer::from_pem_slice(issued.cert.as_bytes()).unwrap()],
                PrivateKeyDer::from_pem_slice(issued.key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    Arc::new(config)
}

/// A channel to `addr` over TLS as `config` says (connected eagerly, so a
/// handshake the client refuses is an error here).
async fn try_connect(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
) -> Result<Channel, tonic::transport::Error> {
    tls_endpoint(addr)
        .connect_with_connector(tls_connector(addr, config))
        .await
}

/// Bounded, so that a server that stopped serving fails the test instead
/// of hanging it.
fn tls_endpoint(addr: SocketAddr) -> Endpoint {
    Endpoint::from_shared(format!("https://localhost:{}", addr.port()))
        .unwrap()
        .connect_timeout(HANDSHAKE_TIMEOUT)
        .timeout(HANDSHAKE_TIMEOUT)
}

type Connecting =
    Pin<Box<dyn Future<Output = std::io::Result<TokioIo<TlsStream<TcpStream>>>> + Send>>;

/// TCP to `addr`, then TLS as `config` says, for the name `localhost`.
fn tls_connector(
    addr: SocketAddr,
    config: Arc<ClientConfig>,
) -> tower::util::ServiceFn<impl FnMut(Uri) -> Connecting + Send + Clone> {
    tower::service_fn(move |_: Uri| {
        let config = config.clone();
        Box::pin(async move {
            let tcp = TcpStream::connect(addr).await?;
            let name = ServerName::try_from("localhost").unwrap();
            let tls = TlsConnector::from(config).connect(name, tcp).await?;
            Ok(TokioIo::new(tls))
        }) as Connecting
    })
}

fn connect_with(config: Arc<ClientConfig>) -> impl AsyncFnOnce(SocketAddr) -> Channel {
    async move |addr| try_connect(addr, config).await.expect("TLS connect")
}

/// An Ack and a read back through `client`.
async fn call(client: &mut ReadStatesClient<Channel>, user_id: u64) -> Result<(), tonic::Status> {
    let ack = AckRequest {
        user_id,
        channel_id: 1,
        message_id: 10,
        ..AckRequest::default()
    };
    client.ack(ack).await?;
    let read = GetReadStatesRequest {
        user_id,
        ..GetReadStatesRequest::default()
    };
    let states = client.get_read_states(read).await?.into_inner().read_states;
    assert_eq!(states.first().map(|s| s.last_acked_id), Some(10));
    Ok(())
}

/// A new client with `config` (connecting and calling) succeeds or fails.
async fn new_client_call(addr: SocketAddr, config: Arc<ClientConfig>) -> Result<(), String> {
    let channel = try_connect(addr, config).await.map_err(|e| e.to_string())?;
    call(&mut ReadStatesClient::new(channel), 7)
        .await
        .map_err(|s| s.to_string())
}

async fn failures(app: &TestApp, reason: &str) -> u64 {
    let series = format!("readstates_tls_handshake_failures_total{{reason=\"{reason}\"}}");
    scrape::value(&app.metrics().await, &series) as u64
}

/// Waits for `reason`'s count to rise by `by` from `before`, and checks it
/// rose by exactly that.
async fn assert_failures(app: &TestApp, reason: &str, before: u64, by: u64) {
    let deadline = tokio::time::Instant::now() + HANDSHAKE_TIMEOUT * 2;
    while failures(app, reason).await < before + by && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert_eq!(
        failures(app, reason).await - before,
        by,
        "{reason} failures"
    );
}

/// A server over mTLS, with a client connected to it: what each bad
/// handshake case starts from.
/// Holds the TLS tests' lock, and counts the failures of one `reason`.
struct MutualTls {
    _dir: TempDir,
    ca: Ca,
    app: TestApp,
    good: Arc<ClientConfig>,
    reason: &'static str,
    /// `reason`'s count when the test began.
    before: u64,
    _serial: tokio::sync::MutexGuard<'static, ()>,
}

impl MutualTls {
    async fn start(reason: &'static str) -> MutualTls {
        MutualTls::start_with(reason, HANDSHAKE_TIMEOUT).await
    }

    async fn start_with(reason: &'static str, handshake_timeout: Duration) -> MutualTls {
        let serial = SERIAL.lock().await;
        let dir = TempDir::new().unwrap();
        let ca = Ca::new("readstates test CA");
        let mut config = tls_config(dir.path(), &ca.issue("server"), Some(&ca));
        config.tls_handshake_timeout = handshake_timeout;
        let good = client_config(&ca, Some(&ca.issue("gateway")));
        let mut app = spawn_app_connected(config, connect_with(good.clone())).await;
        call(&mut app.client, 1)
            .await
            .expect("a good client is served");
        let before = failures(&app, reason).await;
        MutualTls {
            _dir: dir,
            ca,
            app,
            good,
            reason,
            before,
            _serial: serial,
        }
    }

    /// The client connected before is still served, a new one is too, and
    /// the failure was counted under `reason`, once.
    async fn assert_others_served(mut self) {
        call(&mut self.app.client, 2)
            .await
            .expect("the client connected before is served");
        new_client_call(self.app.addr, self.good.clone())
            .await
            .expect("a client connecting after is served");
        assert_failures(&self.app, self.reason, self.before, 1).await;
        self.app.stop().await;
    }
}

#[tokio::test]
async fn a_plaintext_client_on_the_tls_port_fails_alone() {
    let tls = MutualTls::start("protocol").await;
    let channel = Channel::from_shared(format!("http://{}", tls.app.addr))
        .unwrap()
        .connect()
        .await;
    let result = match channel {
        Ok(channel) => call(&mut ReadStatesClient::new(channel), 3)
            .await
            .map_err(|s| s.to_string()),
        Err(e) => Err(e.to_string()),
    };
    assert!(result.is_err(), "plaintext was served over the TLS port");
    tls.assert_others_served().await;
}

#[tokio::test]
async fn garbage_bytes_fail_alone() {
    let tls = MutualTls::start("protocol").await;
    let mut tcp = TcpStream::connect(tls.app.addr).await.unwrap();
    let garbage: Vec<u8> = (0..1024u32).map(|i| (i * 7 + 3) as u8).collect();
    tcp.write_all(&garbage).await.unwrap();
    assert_closed(&mut tcp).await;
    tls.assert_others_served().await;
}

#[tokio::test]
async fn a_client_certificate_from_another_ca_fails_alone() {
    let stranger = |_: &Ca| Some(Ca::new("another CA").issue("stranger"));
    assert_refused_alone(stranger, "a certificate from another CA").await;
}

#[tokio::test]
async fn an_expired_client_certificate_fails_alone() {
    let expired = |ca: &Ca| Some(ca.issue_expired("expired"));
    assert_refused_alone(expired, "an expired certificate").await;
}

#[tokio::test]
async fn a_client_without_a_certificate_fails_alone_under_mtls() {
    assert_refused_alone(|_| None, "a client without a certificate").await;
}

/// A client presenting `identity` (made with the server's CA at hand), or
/// none, is refused under mTLS, and nobody else is disturbed.
async fn assert_refused_alone(identity: impl FnOnce(&Ca) -> Option<Issued>, what: &str) {
    let tls = MutualTls::start("certificate").await;
    let identity = identity(&tls.ca);
    let refused = new_client_call(tls.app.addr, client_config(&tls.ca, identity.as_ref())).await;
    assert!(refused.is_err(), "{what} was taken");
    tls.assert_others_served().await;
}

#[tokio::test]
async fn a_handshake_left_half_done_is_cut_at_the_timeout_alone() {
    let tls = MutualTls::start("timeout").await;
    let mut half = half_open(tls.app.addr).await;
    let started = tokio::time::Instant::now();
    assert_closed(&mut half).await;
    assert!(
        started.elapsed() >= HANDSHAKE_TIMEOUT - Duration::from_millis(500),
        "cut after {:?}, before the timeout",
        started.elapsed()
    );
    tls.assert_others_served().await;
}

/// A TCP connection closed before any byte (a load balancer's health
/// check) is counted apart, as `closed`.
#[tokio::test]
async fn a_connection_closed_before_its_handshake_is_counted_as_closed() {
    let tls = MutualTls::start("closed").await;
    drop(TcpStream::connect(tls.app.addr).await.unwrap());
    tls.assert_others_served().await;
}

/// Beyond `MAX_HANDSHAKES` under way, a new connection is closed at once
/// (a flood of handshakes is bounded in memory); once they time out, new
/// clients are served again.
#[tokio::test]
async fn beyond_the_handshake_cap_new_connections_are_closed_at_once() {
    let timeout = Duration::from_secs(10);
    let tls = MutualTls::start_with("overload", timeout).await;
    let mut held = Vec::new();
    for _ in 0..MAX_HANDSHAKES {
        held.push(half_open(tls.app.addr).await);
    }
    let mut beyond = half_open(tls.app.addr).await;
    let started = tokio::time::Instant::now();
    assert_closed(&mut beyond).await;
    assert!(
        started.elapsed() < timeout / 2,
        "closed only at the timeout"
    );
    assert_failures(&tls.app, tls.reason, tls.before, 1).await;
    eventually(
        "a new client served once the handshakes timed out",
        async || {
            new_client_call(tls.app.addr, tls.good.clone())
                .await
                .is_ok()
        },
    )
    .await;
    drop(held);
    tls.app.stop().await;
}

/// Hundreds of half-done handshakes do not keep a good client from being
/// served, and each is cut at the timeout.
#[tokio::test]
async fn hundreds_of_half_open_handshakes_do_not_starve_a_good_client() {
    const HALF_OPEN: u64 = 300;
    let mut tls = MutualTls::start("timeout").await;
    let mut held = Vec::new();
    for _ in 0..HALF_OPEN {
        held.push(half_open(tls.app.addr).await);
    }
    let started = tokio::time::Instant::now();
    new_client_call(tls.app.addr, tls.good.clone())
        .await
        .expect("a new client is served while hundreds of handshakes hang");
    call(&mut tls.app.client, 4).await.expect("and an old one");
    assert!(
        started.elapsed() < HANDSHAKE_TIMEOUT,
        "served only after the half-open handshakes timed out"
    );
    for tcp in &mut held {
        assert_closed(tcp).await;
    }
    assert_failures(&tls.app, tls.reason, tls.before, HALF_OPEN).await;
    tls.app.stop().await;
}

/// A connection that began a TLS record and never finished it.
async fn half_open(addr: SocketAddr) -> TcpStream {
    // Bounded: with the accept loop stuck, the listen backlog fills and
    // connecting hangs.
    let connect = tokio::time::timeout(HANDSHAKE_TIMEOUT, TcpStream::connect(addr));
    let mut tcp = connect
        .await
        .expect("the server stopped accepting")
        .unwrap();
    // A handshake record header announcing 512 bytes, and one of them.
    tcp.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01])
        .await
        .unwrap();
    tcp
}

/// The server closes `tcp` (within twice the handshake timeout).
async fn assert_closed(tcp: &mut TcpStream) {
    let mut buffer = [0u8; 4096];
    let closed = async {
        loop {
            match tcp.read(&mut buffer).await {
                Ok(0) | Err(_) => return,
                Ok(_) => {} // an alert, say
            }
        }
    };
    tokio::time::timeout(HANDSHAKE_TIMEOUT * 2, closed)
        .await
        .expect("the server never closed the connection");
}

/// TLS without client certificates; the certificate is replaced in place
/// (by a CA the old clients do not trust) and served without a restart,
/// while a rotation caught half-written (a new certificate beside the old
/// key) is refused and the old one kept.
#[tokio::test]
async fn a_rotated_certificate_is_served_without_a_restart() {
    let _serial = SERIAL.lock().await;
    let dir = TempDir::new().unwrap();
    let (old_ca, new_ca) = (Ca::new("old CA"), Ca::new("new CA"));
    let config = tls_config(dir.path(), &old_ca.issue("server"), None);
    let (cert, key) = (
        config.tls_cert.clone().unwrap(),
        config.tls_key.clone().unwrap(),
    );
    let (trusts_old, trusts_new) = (client_config(&old_ca, None), client_config(&new_ca, None));
    let mut app = spawn_app_connected(config, connect_with(trusts_old.clone())).await;
    call(&mut app.client, 1).await.unwrap();
    assert!(new_client_call(app.addr, trusts_new.clone()).await.is_err());

    // Half a rotation: the new certificate, the old key.
    let rotated = new_ca.issue("server");
    std::fs::write(&cert, &rotated.cert).unwrap();
    let reload_errors = "readstates_tls_reloads_total{result=\"error\"}";
    let errors_before = scrape::value(&app.metrics().await, reload_errors);
    eventually("the half rotation refused", async || {
        scrape::value(&app.metrics().await, reload_errors) > errors_before
    })
    .await;
    new_client_call(app.addr, trusts_old.clone())
        .await
        .expect("the old certificate is still served");

    std::fs::write(&key, &rotated.key).unwrap();
    eventually("the new certificate served", async || {
        new_client_call(app.addr, trusts_new.clone()).await.is_ok()
    })
    .await;
    assert!(
        new_client_call(app.addr, trusts_old.clone()).await.is_err(),
        "the old certificate is still served to new connections"
    );
    call(&mut app.client, 2)
        .await
        .expect("a connection made before the rotation goes on");
    app.stop().await;
}

/// Fleet nodes over mTLS call each other with their own certificates: the
/// slot handoff (`ReleaseSlots`) and forwarded requests both go through,
/// and so does a gateway's routing client with channels of its making.
#[tokio::test]
async fn fleet_nodes_call_each_other_over_mtls() {
    let _serial = SERIAL.lock().await;
    let (store, ring) = (
        Arc::new(MemoryStore::new()),
        Arc::new(MemoryRingStore::default()),
    );
    let ca = Ca::new("fleet CA");
    let gateway = client_config(&ca, Some(&ca.issue("gateway")));
    let mut nodes = Vec::new();
    let mut dirs = Vec::new();
    // Ids of their own: requests are counted per node id, process-wide.
    for id in ["tls-a", "tls-b"] {
        let dir = TempDir::new().unwrap();
        let mut config = tls_config(dir.path(), &ca.issue(id), Some(&ca));
        config.node_id = Some(id.to_owned());
        config.ring_poll = Duration::from_millis(50);
        let connect = connect_with(gateway.clone());
        nodes.push(spawn_member_connected(config, store.clone(), ring.clone(), connect).await);
        dirs.push(dir);
    }
    let (mut a, mut b) = (nodes.remove(0), nodes.remove(0));
    let add = async |id: &str, app: &TestApp| {
        let node = Node {
            id: id.to_owned(),
            address: app.addr.to_string(),
            weight: 100,
        };
        let record = admin::change(&*ring, RingChange::Add(node)).await.unwrap();
        admin::wait_served(&*ring, record.ring.epoch(), Duration::from_secs(20))
            .await
            .unwrap_or_else(|e| panic!("{e}"));
    };
    add("tls-a", &a).await;
    let users: Vec<u64> = (1..=100).collect();
    for &user in &users {
        call(&mut a.client, user).await.unwrap();
    }
    // b takes about half, released by a over mTLS (the changes were still
    // unwritten on a: 30 s write delay).
    add("tls-b", &b).await;
    let record = ring.load().await.unwrap();
    let on_b = users
        .iter()
        .filter(|&&u| record.ring.owner_of(u).unwrap().id == "tls-b")
        .count();
    assert!((1..100).contains(&on_b), "{on_b} users on b");

    // A gateway's routing client over mTLS, on channels of its making.
    let connect = Connect::new(move |address| {
        let addr: SocketAddr = address
            .parse()
            .map_err(|_| tonic::Status::invalid_argument(address))?;
        Ok(tls_endpoint(addr).connect_with_connector_lazy(tls_connector(addr, gateway.clone())))
    });
    let fleet = FleetClient::connect_with(&a.addr.to_string(), connect)
        .await
        .unwrap();
    for &user in &users {
        let request = AckRequest {
            user_id: user,
            channel_id: 2,
            message_id: 20,
            ..AckRequest::default()
        };
        let ack = |mut client: ReadStatesClient<Channel>| async move { client.ack(request).await };
        fleet
            .call(user, ack)
            .await
            .unwrap_or_else(|s| panic!("user {user}: {s:?}"));
    }
    // Straight to each owner: a request forwarded by a would count at both.
    let acks = |node: &str| {
        format!("readstates_requests_total{{method=\"Ack\",code=\"OK\",node=\"{node}\"}}")
    };
    let on_b = on_b as f64;
    assert_eq!(
        scrape::value(&a.metrics().await, &acks("tls-a")),
        200.0 - on_b
    );
    assert_eq!(scrape::value(&b.metrics().await, &acks("tls-b")), on_b);

    for &user in &users {
        let read = GetReadStatesRequest {
            user_id: user,
            ..GetReadStatesRequest::default()
        };
        // Through b, and through a (forwarded to b for b's users).
        for app in [&mut b, &mut a] {
            let states = app.client.get_read_states(read.clone()).await;
            let states = states.unwrap_or_else(|s| panic!("user {user}: {s:?}"));
            let mut states = states.into_inner().read_states;
            states.sort_by_key(|s| s.channel_id);
            let acked: Vec<u64> = states.iter().map(|s| s.last_acked_id).collect();
            assert_eq!(acked, [10, 20], "user {user}");
        }
    }
    a.stop().await;
    b.stop().await;
}

/// A flood of bad handshakes is not a flood of logs: rustls's own warning
/// for each (through the `log` bridge) stays out of the default level, and
/// ours is written at most once a second. The real binary, its log read.
#[tokio::test]
async fn bad_handshakes_are_logged_at_most_once_a_second() {
    const BAD: usize = 40;
    let _serial = SERIAL.lock().await;
    let dir = TempDir::new().unwrap();
    let ca = Ca::new("log CA");
    let config = tls_config(dir.path(), &ca.issue("server"), Some(&ca));
    let (cert, key, client_ca) = (
        config.tls_cert.unwrap(),
        config.tls_key.unwrap(),
        config.tls_client_ca.unwrap(),
    );
    let (server, addr) = start_process(
        &[
            "--tls-cert",
            cert.to_str().unwrap(),
            "--tls-key",
            key.to_str().unwrap(),
            "--tls-client-ca",
            client_ca.to_str().unwrap(),
        ],
        std::process::Stdio::piped(),
    );
    let good = client_config(&ca, Some(&ca.issue("gateway")));
    eventually("the server serving", async || {
        new_client_call(addr, good.clone()).await.is_ok()
    })
    .await;
    for _ in 0..BAD {
        let mut tcp = TcpStream::connect(addr).await.unwrap();
        // Application data before any handshake.
        tcp.write_all(&[0x17, 0x03, 0x03, 0x00, 0x05, 1, 2, 3, 4, 5])
            .await
            .unwrap();
        assert_closed(&mut tcp).await;
    }
    let pid = server.id().unwrap().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status();
    assert!(killed.unwrap().success());
    let output = server.wait_with_output().await.unwrap();
    let log = String::from_utf8_lossy(&output.stderr);
    let lines = |needle: &str| log.lines().filter(|l| l.contains(needle)).count();
    assert_eq!(lines("rustls"), 0, "rustls logs each bad handshake:\n{log}");
    let ours = lines("TLS handshake failed");
    assert!(
        (1..=5).contains(&ours),
        "{ours} lines for {BAD} bad handshakes:\n{log}"
    );
}

/// A fleet node presents its own certificate to the other nodes: one they
/// would refuse (another CA's, or one for servers only) stops it at
/// startup, not at its first slot handoff.
#[tokio::test]
async fn a_fleet_node_with_a_certificate_the_others_would_refuse_does_not_start() {
    let ca = Ca::new("fleet CA");
    let servers_only = ca.issue_with("servers only", |params| {
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
    });
    let strangers = Ca::new("another CA").issue("stranger");
    for (what, certificate) in [("servers only", servers_only), ("another CA", strangers)] {
        let dir = TempDir::new().unwrap();
        let mut config = tls_config(dir.path(), &certificate, Some(&ca));
        config.node_id = Some("refused".to_owned());
        let (store, ring) = (
            Arc::new(MemoryStore::new()),
            Arc::new(MemoryRingStore::default()),
        );
        let built = Application::build_with(config, store, Some(ring)).await;
        let error = built.expect_err(what).to_string();
        assert!(
            error.contains("the other nodes would refuse"),
            "{what}: {error}"
        );
    }
    // The same certificates serve a standalone node: its clients are not
    // its peers.
    let dir = TempDir::new().unwrap();
    let config = tls_config(
        dir.path(),
        &Ca::new("another CA").issue("server"),
        Some(&ca),
    );
    assert!(Application::build(config).await.is_ok());
}
