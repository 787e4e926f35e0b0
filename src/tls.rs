//! TLS for the gRPC port and for this node's calls to other nodes, by rustls
//! (on ring, no OpenSSL).
//!
//! [`Tls`] holds the current server and client configurations, built from
//! the PEM files named by `tls_cert`, `tls_key` and `tls_client_ca`, and
//! [`Tls::spawn_reloader`] reads the files again every `tls_poll`: a rotated
//! certificate is served to new connections without a restart, and a
//! rotation caught half-written (a new certificate beside the old key) is
//! refused and the old configuration kept until the files agree.
//!
//! - [`incoming`]: the accept loop, with a handshake per connection, apart
//!   from the others and bounded in time.
//! - [`connector`]: connections to other nodes, with this node's
//!   certificate as its client certificate (mTLS between nodes).

pub mod connector;
pub mod incoming;

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use metrics::counter;
use tokio::task::JoinHandle;
use tokio_rustls::rustls::pki_types::pem::PemObject;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, UnixTime};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{self, ClientConfig, RootCertStore, ServerConfig};
use tokio_util::sync::CancellationToken;

use crate::metrics::TLS_RELOADS;

/// gRPC runs on HTTP/2, which TLS clients ask for by ALPN (grpc-go
/// refuses a server that does not answer it).
const ALPN_H2: &[u8] = b"h2";

/// Where the PEM files are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain served, leaf first.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// With it, clients must present a certificate signed by one of these
    /// CAs (mTLS); other nodes' certificates are verified against it too.
    pub client_ca: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{path}: {error}")]
    Read {
        path: PathBuf,
        error: std::io::Error,
    },
    #[error("{path}: {what}")]
    Pem { path: PathBuf, what: String },
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    #[error("client CA: {0}")]
    ClientCa(#[from] rustls::server::VerifierBuilderError),
    #[error(
        "{path}: the other nodes would refuse this node's certificate ({error}): a fleet node \
         presents it to them, so it must be signed by tls_client_ca, valid now, and allow client \
         authentication"
    )]
    NodeCertificate { path: PathBuf, error: rustls::Error },
}

/// The current TLS configurations, replaced whole when the files change.
#[derive(Debug)]
pub struct Tls {
    files: TlsFiles,
    current: RwLock<Configs>,
    /// The files' contents the current configurations were built from.
    loaded: Mutex<Contents>,
}

#[derive(Clone, Debug)]
struct Configs {
    server: Arc<ServerConfig>,
    /// For calls to other nodes: only with a client CA, which is also what
    /// their certificates are verified against.
    client: Option<Arc<ClientConfig>>,
}

#[derive(Debug, PartialEq, Eq)]
struct Contents {
    cert: Vec<u8>,
    key: Vec<u8>,
    client_ca: Option<Vec<u8>>,
}

impl Tls {
    /// Reads the files and builds the configurations; any problem with them
    /// is an error here, at startup.
    pub fn load(files: TlsFiles) -> Result<Arc<Tls>, TlsError> {
        let contents = Contents::read(&files)?;
        let configs = Configs::build(&files, &contents)?;
        Ok(Arc::new(Tls {
            files,
            current: RwLock::new(configs),
            loaded: Mutex::new(contents),
        }))
    }

    /// Checks that the other nodes of a fleet would take this node's
    /// certificate when it calls them, so that a wrong one is refused at
    /// startup rather than at the first slot handoff.
    pub fn check_node_certificate(&self) -> Result<(), TlsError> {
        let contents = Contents::read(&self.files)?;
        let (Some(path), Some(pem)) = (&self.files.client_ca, &contents.client_ca) else {
            return Ok(());
        };
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::new(roots(path, pem)?), provider)
                .build()?;
        let chain = certificates(&self.files.cert, &contents.cert)?;
        verifier
            .verify_client_cert(&chain[0], &chain[1..], UnixTime::now())
            .map(|_| ())
            .map_err(|error| TlsError::NodeCertificate {
                path: self.files.cert.clone(),
                error,
            })
    }

    /// What a connection accepted now is served with.
    pub fn server_config(&self) -> Arc<ServerConfig> {
        self.current().server
    }

    /// What a connection to another node made now is made with (`None`
    /// without a client CA).
    pub fn client_config(&self) -> Option<Arc<ClientConfig>> {
        self.current().client
    }

    fn current(&self) -> Configs {
        self.current
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Reads the files again; when they changed, builds and installs new
    /// configurations. `Ok(true)` if it did; on an error the current ones
    /// stay.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let contents = Contents::read(&self.files)?;
        let mut loaded = self.loaded.lock().unwrap_or_else(|e| e.into_inner());
        if *loaded == contents {
            return Ok(false);
        }
        let configs = Configs::build(&self.files, &contents)?;
        *self.current.write().unwrap_or_else(|e| e.into_inner()) = configs;
        *loaded = contents;
        Ok(true)
    }

    /// Reloads every `every` until `stop`, logging and counting
    /// (`readstates_tls_reloads_total{result}`) each change and each failure.
    pub fn spawn_reloader(
        self: Arc<Self>,
        every: Duration,
        stop: CancellationToken,
    ) -> JoinHandle<()> {
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(every);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            tick.tick().await;
            loop {
                tokio::select! {
                    _ = tick.tick() => {}
                    () = stop.cancelled() => return,
                }
                // File reads block (a hung mount for ever): not on the
                // runtime's threads.
                let tls = self.clone();
                let Ok(reloaded) = tokio::task::spawn_blocking(move || tls.reload()).await else {
                    return;
                };
                match reloaded {
                    Ok(false) => {}
                    Ok(true) => {
                        counter!(TLS_RELOADS, "result" => "ok").increment(1);
                        tracing::info!(cert = %self.files.cert.display(), "TLS certificate reloaded");
                    }
                    Err(error) => {
                        counter!(TLS_RELOADS, "result" => "error").increment(1);
                        tracing::error!(%error, "TLS files changed but cannot be used; still serving the previous certificate");
                    }
                }
            }
        })
    }
}

impl Contents {
    fn read(files: &TlsFiles) -> Result<Contents, TlsError> {
        Ok(Contents {
            cert: read(&files.cert)?,
            key: read(&files.key)?,
            client_ca: files.client_ca.as_deref().map(read).transpose()?,
        })
    }
}

impl Configs {
    fn build(files: &TlsFiles, contents: &Contents) -> Result<Configs, TlsError> {
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let chain = certificates(&files.cert, &contents.cert)?;
        let key = PrivateKeyDer::from_pem_slice(&contents.key).map_err(|e| TlsError::Pem {
            path: files.key.clone(),
            what: format!("no private key: {e}"),
        })?;
        let roots = match (&files.client_ca, &contents.client_ca) {
            (Some(path), Some(pem)) => Some(Arc::new(roots(path, pem)?)),
            _ => None,
        };

        let builder = ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()?;
        let builder = match &roots {
            Some(roots) => builder.with_client_cert_verifier(
                WebPkiClientVerifier::builder_with_provider(roots.clone(), provider.clone())
                    .build()?,
            ),
            None => builder.with_no_client_auth(),
        };
        // `with_single_cert` also refuses a key that is not the
        // certificate's (a rotation caught between its two files).
        let mut server = builder.with_single_cert(chain.clone(), key.clone_key())?;
        server.alpn_protocols = vec![ALPN_H2.to_vec()];

        let client = match roots {
            Some(roots) => {
                let mut client = ClientConfig::builder_with_provider(provider)
                    .with_safe_default_protocol_versions()?
                    .with_root_certificates(roots)
                    .with_client_auth_cert(chain, key)?;
                client.alpn_protocols = vec![ALPN_H2.to_vec()];
                Some(Arc::new(client))
            }
            None => None,
        };
        Ok(Configs {
            server: Arc::new(server),
            client,
        })
    }
}

fn read(path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|error| TlsError::Read {
        path: path.to_owned(),
        error,
    })
}

fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let chain = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::Pem {
            path: path.to_owned(),
            what: e.to_string(),
        })?;
    if chain.is_empty() {
        return Err(TlsError::Pem {
            path: path.to_owned(),
            what: "no certificate".to_owned(),
        });
    }
    Ok(chain)
}

fn roots(path: &Path, pem: &[u8]) -> Result<RootCertStore, TlsError> {
    let mut roots = RootCertStore::empty();
    for certificate in certificates(path, pem)? {
        roots.add(certificate)?;
    }
    Ok(roots)
}
