//! A gRPC client of the tests' own HTTP/2 framing, for what tonic's client
//! never does: each message its own DATA frame, written all at once, and a
//! receive window opened only as far as the test reads (a reader that falls
//! behind).

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use bytes::{Buf, Bytes, BytesMut};
use futures::task::AtomicWaker;
use h2::client::{ResponseFuture, SendRequest};
use h2::{RecvStream, SendStream};
use prost::Message;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpSocket, TcpStream};

/// How much framing overhead of unread small DATA frames h2 tolerates before
/// it ends the connection itself (ENHANCE_YOUR_CALM, "too_many_data_frames").
/// h2's own default follows the connection window: half of 64 KiB here, about
/// 145 unread answers of 30 bytes, so a test task that fell behind its
/// connection's task on a busy host lost the connection to its own client
/// (a CI run of the subscribe burst did, after 57,935 answers). A tonic client
/// (hyper's 5 MiB connection window) tolerates 2.5 MiB; so does this one.
const SMALL_FRAME_BUDGET: usize = 5 << 19;

/// A connection whose streams each take at most `stream_window` bytes ahead
/// of what the test reads, until [`open_windows`] says otherwise.
pub async fn connect(addr: SocketAddr, stream_window: u32) -> SendRequest<Bytes> {
    connect_with_windows(addr, stream_window).await.0
}

/// [`connect`], and a sender that opens every window of the connection at
/// once (a new SETTINGS_INITIAL_WINDOW_SIZE and a large connection window),
/// as a client does that catches up all of a sudden.
pub async fn connect_with_windows(
    addr: SocketAddr,
    stream_window: u32,
) -> (SendRequest<Bytes>, tokio::sync::oneshot::Sender<u32>) {
    let tcp = TcpStream::connect(addr).await.expect("connect");
    let (client, mut connection) = h2::client::Builder::new()
        .initial_window_size(stream_window)
        .data_frame_budget(SMALL_FRAME_BUDGET)
        .handshake(tcp)
        .await
        .expect("HTTP/2 handshake");
    let (open, mut opened) = tokio::sync::oneshot::channel::<u32>();
    tokio::spawn(async move {
        let mut waiting = true;
        loop {
            tokio::select! {
                window = &mut opened, if waiting => {
                    waiting = false;
                    if let Ok(window) = window {
                        connection.set_target_window_size(window);
                        let _ = connection.set_initial_window_size(window);
                    }
                }
                _ = &mut connection => return,
            }
        }
    });
    (client, open)
}

/// A connection with large HTTP/2 windows whose socket the test stops
/// reading with [`Gate::close`] (a 4 KiB receive buffer, so the server's
/// writes soon block in TCP rather than in HTTP/2 flow control), as a
/// client does whose process stalls.
pub async fn connect_gated(addr: SocketAddr) -> (SendRequest<Bytes>, Arc<Gate>) {
    let socket = TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("receive buffer");
    let tcp = socket.connect(addr).await.expect("connect");
    let gate = Arc::new(Gate {
        closed: AtomicBool::new(false),
        opened: AtomicWaker::new(),
    });
    let io = Gated {
        tcp,
        gate: gate.clone(),
    };
    let (client, connection) = h2::client::Builder::new()
        .initial_window_size(16 << 20)
        .initial_connection_window_size(16 << 20)
        .handshake(io)
        .await
        .expect("HTTP/2 handshake");
    tokio::spawn(connection);
    (client, gate)
}

/// Whether the client reads its socket.
#[derive(Debug)]
pub struct Gate {
    closed: AtomicBool,
    opened: AtomicWaker,
}

impl Gate {
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
    }

    pub fn open(&self) {
        self.closed.store(false, Ordering::SeqCst);
        self.opened.wake();
    }
}

struct Gated {
    tcp: TcpStream,
    gate: Arc<Gate>,
}

impl AsyncRead for Gated {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.gate.opened.register(cx.waker());
        if self.gate.closed.load(Ordering::SeqCst) {
            return Poll::Pending;
        }
        Pin::new(&mut self.tcp).poll_read(cx, buf)
    }
}

impl AsyncWrite for Gated {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.tcp).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.tcp).poll_shutdown(cx)
    }
}

/// One call's two halves.
#[derive(Debug)]
pub struct Call {
    pub requests: SendStream<Bytes>,
    /// Until the response's headers came (a unary call's come after its
    /// request is complete).
    response: Option<ResponseFuture>,
    responses: Option<RecvStream>,
    buffered: BytesMut,
}

/// Opens a call of `method` (`/package.Service/Method`).
pub async fn open(client: &SendRequest<Bytes>, method: &str) -> Call {
    let request = http::Request::post(format!("http://readstates{method}"))
        .header("content-type", "application/grpc")
        .header("te", "trailers")
        .body(())
        .unwrap();
    let mut client = client.clone().ready().await.expect("connection up");
    let (response, requests) = client.send_request(request, false).expect("open the call");
    Call {
        requests,
        response: Some(response),
        responses: None,
        buffered: BytesMut::new(),
    }
}

impl Call {
    /// Queues `message` as one DATA frame of its own; `Err` once the
    /// stream or its connection is gone.
    pub fn send(&mut self, message: &impl Message) -> Result<(), h2::Error> {
        let mut frame = BytesMut::with_capacity(5 + message.encoded_len());
        frame.extend_from_slice(&[0]);
        frame.extend_from_slice(&(message.encoded_len() as u32).to_be_bytes());
        message.encode(&mut frame).unwrap();
        self.requests.send_data(frame.freeze(), false)
    }

    /// Ends the request stream (a unary call's request is then complete).
    pub fn finish(&mut self) {
        self.requests
            .send_data(Bytes::new(), true)
            .expect("stream open");
    }

    /// The next response message, opening the window by what it read;
    /// `Err` with the call's `grpc-status` (and message) once it ends.
    pub async fn next<M: Message + Default>(&mut self) -> Result<M, (String, String)> {
        if let Some(response) = self.response.take() {
            let response = response.await.expect("response headers");
            assert_eq!(response.status(), 200);
            self.responses = Some(response.into_body());
        }
        let responses = self.responses.as_mut().expect("response headers");
        loop {
            if self.buffered.len() >= 5 {
                let len = u32::from_be_bytes(self.buffered[1..5].try_into().unwrap()) as usize;
                if self.buffered.len() >= 5 + len {
                    self.buffered.advance(5);
                    let message = self.buffered.split_to(len);
                    return Ok(M::decode(message).expect("a response message"));
                }
            }
            match responses.data().await {
                Some(Ok(data)) => {
                    let _ = responses.flow_control().release_capacity(data.len());
                    self.buffered.extend_from_slice(&data);
                }
                Some(Err(e)) => return Err(("transport".into(), e.to_string())),
                None => {
                    let trailers = responses.trailers().await;
                    let field = |name: &str| {
                        let trailers = trailers.as_ref().ok().and_then(Option::as_ref);
                        trailers
                            .and_then(|t| t.get(name))
                            .map_or(String::new(), |v| v.to_str().unwrap_or("").to_owned())
                    };
                    return Err((field("grpc-status"), field("grpc-message")));
                }
            }
        }
    }
}
