//! A TCP proxy between a node and Cassandra that a test can cut: the node
//! keeps its peers, and loses the store (issue 37, "cut from Cassandra but
//! not from its peers"). The driver reaches the node it was given through
//! the proxy, since it keeps the contact point's port for a single node.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

pub struct Proxy {
    /// Where the node connects (`host:port`).
    pub address: String,
    cut: Arc<AtomicBool>,
    links: Arc<Mutex<Vec<AbortHandle>>>,
    accepting: JoinHandle<()>,
}

impl Proxy {
    /// Forwards every connection to `upstream` until cut.
    pub async fn start(upstream: String) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let address = listener.local_addr().expect("address").to_string();
        let cut = Arc::new(AtomicBool::new(false));
        let links: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let accepting = tokio::spawn({
            let (cut, links) = (cut.clone(), links.clone());
            async move {
                while let Ok((mut client, _)) = listener.accept().await {
                    if cut.load(Ordering::SeqCst) {
                        // Refused: closed at once.
                        continue;
                    }
                    let upstream = upstream.clone();
                    let link = tokio::spawn(async move {
                        if let Ok(mut server) = TcpStream::connect(&upstream).await {
                            let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                        }
                    });
                    links.lock().unwrap().push(link.abort_handle());
                }
            }
        });
        Proxy {
            address,
            cut,
            links,
            accepting,
        }
    }

    /// Cuts every connection and refuses new ones (`true`), or forwards
    /// again.
    pub fn cut(&self, cut: bool) {
        self.cut.store(cut, Ordering::SeqCst);
        if cut {
            for link in self.links.lock().unwrap().drain(..) {
                link.abort();
            }
        }
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accepting.abort();
        self.cut(true);
    }
}
