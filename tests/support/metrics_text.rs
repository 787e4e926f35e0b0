//! Reading Prometheus text from a server's `/metrics`, shared by test binaries.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The body of `GET /metrics`.
pub async fn fetch(addr: SocketAddr) -> String {
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .expect("connect to /metrics");
    let request = "GET /metrics HTTP/1.1\r\nHost: test\r\nConnection: close\r\n\r\n";
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    response
}

/// The value of the sample whose name and labels start with `series`
/// (e.g. `readstates_store_operations_total{store="cassandra",operation="write",result="ok"`),
/// or 0 if there is none yet.
pub fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(series))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}
