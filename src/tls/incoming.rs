//! The TLS accept loop: every accepted connection gets its own handshake
//! task, bounded by `tls_handshake_timeout`, and only finished handshakes
//! reach the gRPC server.
//!
//! A bad handshake (plaintext, garbage, a certificate refused, a client
//! that stops halfway) fails its own connection and nothing else: it is
//! counted in `readstates_tls_handshake_failures_total{reason}`, logged at
//! most once a second, and the loop goes on accepting. At most
//! [`MAX_HANDSHAKES`] run at once. (A tonic release once
//! ended the whole server on one handshake's I/O error; the tests in
//! `tests/api/tls.rs` keep each case end to end.)

use std::convert::Infallible;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use metrics::counter;
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls;
use tokio_rustls::server::TlsStream;
use tokio_stream::wrappers::ReceiverStream;

use super::Tls;
use crate::metrics::TLS_HANDSHAKE_FAILURES;

/// Finished handshakes waiting for the server to take them.
const READY: usize = 64;
/// Handshakes under way at once. Beyond it a new connection is closed at
/// once (counted as `overload`): each holds up to 64 KiB of rustls buffers
/// until its timeout, and its key exchange runs on the cores that serve
/// requests.
pub const MAX_HANDSHAKES: usize = 1024;
/// After an accept error that is not one connection's (out of file
/// descriptors, say), the loop pauses this long instead of spinning.
const ACCEPT_PAUSE: Duration = Duration::from_millis(50);

/// The connections of `listener` once their TLS handshakes finish, as the
/// gRPC server takes them. The loop stops, and the port closes, when the
/// server drops the stream (at shutdown).
pub fn incoming(
    listener: TcpListener,
    tls: Arc<Tls>,
    handshake_timeout: Duration,
) -> ReceiverStream<Result<TlsStream<TcpStream>, Infallible>> {
    let (ready, stream) = mpsc::channel(READY);
    tokio::spawn(accept_loop(listener, tls, handshake_timeout, ready));
    ReceiverStream::new(stream)
}

/// Only finished handshakes: a failure ends with its own connection, never
/// as an error of the stream.
type Ready = mpsc::Sender<Result<TlsStream<TcpStream>, Infallible>>;

async fn accept_loop(listener: TcpListener, tls: Arc<Tls>, timeout: Duration, ready: Ready) {
    let throttle = Arc::new(LogThrottle::default());
    // Dropped with the loop: handshakes under way at shutdown are cut.
    let mut handshakes = JoinSet::new();
    loop {
        let (tcp, peer) = tokio::select! {
            () = ready.closed() => return,
            Some(_) = handshakes.join_next(), if !handshakes.is_empty() => continue,
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    if !is_connection_error(&error) {
                        if let Some(suppressed) = throttle.allow() {
                            tracing::warn!(%error, suppressed, "accepting a TCP connection failed");
                        }
                        tokio::time::sleep(ACCEPT_PAUSE).await;
                    }
                    continue;
                }
            },
        };
        if handshakes.len() >= MAX_HANDSHAKES {
            drop(tcp);
            failed(Reason::Overload, None, peer, &throttle);
            continue;
        }
        let _ = tcp.set_nodelay(true);
        let acceptor = TlsAcceptor::from(tls.server_config());
        let (ready, throttle) = (ready.clone(), throttle.clone());
        handshakes.spawn(async move {
            let (reason, error) = match tokio::time::timeout(timeout, acceptor.accept(tcp)).await {
                Ok(Ok(stream)) => {
                    let _ = ready.send(Ok(stream)).await;
                    return;
                }
                Ok(Err(error)) => (Reason::of(&error), Some(error)),
                Err(_) => (Reason::Timeout, None),
            };
            failed(reason, error, peer, &throttle);
        });
    }
}

fn failed(reason: Reason, error: Option<io::Error>, peer: SocketAddr, throttle: &LogThrottle) {
    counter!(TLS_HANDSHAKE_FAILURES, "reason" => reason.label()).increment(1);
    let error = error.map_or_else(|| reason.label().to_owned(), |e| e.to_string());
    if reason == Reason::Closed {
        // TCP health checks of load balancers do this all day.
        tracing::debug!(%peer, %error, "connection closed before its TLS handshake finished");
    } else if let Some(suppressed) = throttle.allow() {
        tracing::warn!(%peer, reason = reason.label(), %error, suppressed, "TLS handshake failed");
    }
}

/// Why a handshake failed, as the metric labels it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Reason {
    /// Not TLS, or TLS this server does not speak (a plaintext gRPC client,
    /// garbage, no protocol or cipher in common).
    Protocol,
    /// The client's certificate was missing, expired or not from the
    /// client CA, or the client refused this server's.
    Certificate,
    /// Not finished within `tls_handshake_timeout`.
    Timeout,
    /// The client closed the connection first (a TCP health check, say).
    Closed,
    /// The connection broke (reset, say).
    Io,
    /// [`MAX_HANDSHAKES`] were under way.
    Overload,
}

impl Reason {
    fn of(error: &io::Error) -> Reason {
        use rustls::Error as E;
        match error
            .get_ref()
            .and_then(|e| e.downcast_ref::<rustls::Error>())
        {
            Some(
                E::InvalidCertificate(_)
                | E::NoCertificatesPresented
                | E::InvalidCertRevocationList(_),
            ) => Reason::Certificate,
            // The client refused this server's certificate (expired, say).
            Some(E::AlertReceived(alert)) if is_certificate_alert(*alert) => Reason::Certificate,
            Some(_) => Reason::Protocol,
            None if error.kind() == io::ErrorKind::UnexpectedEof => Reason::Closed,
            None => Reason::Io,
        }
    }

    fn label(self) -> &'static str {
        match self {
            Reason::Protocol => "protocol",
            Reason::Certificate => "certificate",
            Reason::Timeout => "timeout",
            Reason::Closed => "closed",
            Reason::Io => "io",
            Reason::Overload => "overload",
        }
    }
}

fn is_certificate_alert(alert: rustls::AlertDescription) -> bool {
    use rustls::AlertDescription as A;
    matches!(
        alert,
        A::BadCertificate
            | A::UnsupportedCertificate
            | A::CertificateRevoked
            | A::CertificateExpired
            | A::CertificateUnknown
            | A::UnknownCA
            | A::CertificateRequired
    )
}

/// Errors of one connection, which the next accept does not share.
fn is_connection_error(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::ConnectionRefused
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::ConnectionReset
    )
}

/// At most one log line a second, so that a flood of bad handshakes does
/// not become a flood of logs; each line says how many it stood for.
#[derive(Debug, Default)]
struct LogThrottle {
    state: Mutex<(Option<Instant>, u64)>,
}

impl LogThrottle {
    const EVERY: Duration = Duration::from_secs(1);

    /// `Some(lines suppressed since the last one)` if this one may be logged.
    fn allow(&self) -> Option<u64> {
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        match state.0 {
            Some(last) if now.duration_since(last) < Self::EVERY => {
                state.1 += 1;
                None
            }
            _ => {
                state.0 = Some(now);
                Some(std::mem::take(&mut state.1))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_log_throttle_lets_one_line_a_second_through_and_counts_the_rest() {
        let throttle = LogThrottle::default();
        assert_eq!(throttle.allow(), Some(0));
        assert_eq!(throttle.allow(), None);
        assert_eq!(throttle.allow(), None);
        throttle.state.lock().unwrap().0 = Some(Instant::now() - LogThrottle::EVERY);
        assert_eq!(throttle.allow(), Some(2));
        assert_eq!(throttle.allow(), None);
    }

    #[test]
    fn failures_are_told_apart_by_their_rustls_error() {
        let wrap = |e: rustls::Error| io::Error::new(io::ErrorKind::InvalidData, e);
        let expired = rustls::Error::InvalidCertificate(rustls::CertificateError::Expired);
        assert_eq!(Reason::of(&wrap(expired)), Reason::Certificate);
        let none = rustls::Error::NoCertificatesPresented;
        assert_eq!(Reason::of(&wrap(none)), Reason::Certificate);
        let garbage = rustls::Error::InvalidMessage(rustls::InvalidMessage::InvalidContentType);
        assert_eq!(Reason::of(&wrap(garbage)), Reason::Protocol);
        let eof = io::Error::from(io::ErrorKind::UnexpectedEof);
        assert_eq!(Reason::of(&eof), Reason::Closed);
        let reset = io::Error::from(io::ErrorKind::ConnectionReset);
        assert_eq!(Reason::of(&reset), Reason::Io);
    }
}
