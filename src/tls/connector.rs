//! Connections to other nodes over TLS, for tonic's `Endpoint`: TCP, then a
//! handshake with the client configuration of the moment (so a rotated
//! certificate is used by the next connection), verifying the peer's
//! certificate against the client CA for the host it was dialled by.

use std::io;
use std::sync::Arc;

use hyper_util::rt::TokioIo;
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::pki_types::ServerName;
use tonic::transport::{Endpoint, Uri};

use super::Tls;

/// A lazily connecting channel to `endpoint` (an `https://host:port` URI)
/// over TLS.
pub fn connect_lazy(endpoint: &Endpoint, tls: Arc<Tls>) -> tonic::transport::Channel {
    endpoint
        .connect_with_connector_lazy(tower::service_fn(move |uri: Uri| connect(uri, tls.clone())))
}

async fn connect(uri: Uri, tls: Arc<Tls>) -> io::Result<TokioIo<TlsStream<TcpStream>>> {
    let invalid =
        |what: &str| io::Error::new(io::ErrorKind::InvalidInput, format!("{uri}: {what}"));
    let config = tls
        .client_config()
        .ok_or_else(|| invalid("calls to other nodes over TLS need tls_client_ca"))?;
    // `Uri::host` keeps an IPv6 address's brackets.
    let host = uri.host().ok_or_else(|| invalid("no host"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let port = uri.port_u16().ok_or_else(|| invalid("no port"))?;
    let name = ServerName::try_from(host.to_owned()).map_err(|e| invalid(&e.to_string()))?;
    let tcp = TcpStream::connect((host, port)).await?;
    tcp.set_nodelay(true)?;
    let stream = TlsConnector::from(config).connect(name, tcp).await?;
    Ok(TokioIo::new(stream))
}
