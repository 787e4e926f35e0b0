//! Lingering close of the gRPC port's connections: once the server is done
//! with a connection, its side is shut down (a FIN, after every byte
//! written) and the socket is not closed at once but read, and what comes
//! discarded, until the client closes its side or [`LINGER`] passes.
//!
//! Why: a client still sending (window updates for the data it reads, ping
//! acks) to a socket already closed makes the kernel answer with a reset,
//! and a reset makes the client's kernel drop what it had received and not
//! yet read: the last events of a Watch stream, the last answers of an
//! Apply stream and their trailers, exactly what a slow reader is promised
//! at shutdown. Web servers call this a lingering close. The lingering
//! sockets are tracked, so that shutdown waits for them (see
//! [`Lingering::wait`]) before the process exits.

use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio_util::task::TaskTracker;
use tonic::transport::server::Connected;

/// How long a socket closed by the server is read before it is dropped:
/// the grace a client that keeps reading has at shutdown.
pub const LINGER: Duration = Duration::from_secs(10);

/// The sockets lingering after their connections ended.
#[derive(Clone, Debug, Default)]
pub struct Lingering {
    tracker: TaskTracker,
}

impl Lingering {
    /// `io`, closed lingering.
    pub fn wrap<T: Socket>(&self, io: T) -> LingeringIo<T> {
        LingeringIo {
            io: Some(io),
            tracker: self.tracker.clone(),
        }
    }

    /// Waits until every socket closed so far is done lingering (each
    /// within [`LINGER`]).
    pub async fn wait(&self) {
        self.tracker.close();
        self.tracker.wait().await;
    }
}

/// What a lingering socket can be: shut down and read from a task of its
/// own.
pub trait Socket: AsyncRead + AsyncWrite + Unpin + Send + 'static {}

impl<T: AsyncRead + AsyncWrite + Unpin + Send + 'static> Socket for T {}

/// A connection's socket, which lingers once the server drops it.
#[derive(Debug)]
pub struct LingeringIo<T: Socket> {
    /// Taken by the lingering task when dropped.
    io: Option<T>,
    tracker: TaskTracker,
}

impl<T: Socket> LingeringIo<T> {
    fn io(&mut self) -> &mut T {
        self.io.as_mut().expect("taken only when dropped")
    }
}

impl<T: Socket> AsyncRead for LingeringIo<T> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(self.io()).poll_read(cx, buf)
    }
}

impl<T: Socket> AsyncWrite for LingeringIo<T> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(self.io()).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(self.io()).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.as_ref().is_some_and(AsyncWrite::is_write_vectored)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(self.io()).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(self.io()).poll_shutdown(cx)
    }
}

impl<T: Socket + Connected> Connected for LingeringIo<T> {
    type ConnectInfo = T::ConnectInfo;

    fn connect_info(&self) -> Self::ConnectInfo {
        self.io
            .as_ref()
            .expect("taken only when dropped")
            .connect_info()
    }
}

impl<T: Socket> Drop for LingeringIo<T> {
    fn drop(&mut self) {
        let Some(mut io) = self.io.take() else { return };
        if tokio::runtime::Handle::try_current().is_err() {
            return;
        }
        self.tracker.spawn(async move {
            let mut discarded = [0u8; 4096];
            let lingering = async {
                // A second shutdown after the server's own is a no-op.
                if io.shutdown().await.is_ok() {
                    while let Ok(1..) = io.read(&mut discarded).await {}
                }
            };
            let _ = tokio::time::timeout(LINGER, lingering).await;
        });
    }
}
