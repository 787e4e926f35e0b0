//! Reading a running server's `/metrics` back: what the load generator uses
//! to count store writes, and what tests use to check metrics.

use std::net::SocketAddr;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// The body of `GET /metrics` (with the response head; samples are lines).
pub async fn fetch(addr: SocketAddr) -> std::io::Result<String> {
    let mut stream = tokio::net::TcpStream::connect(addr).await?;
    let request = "GET /metrics HTTP/1.1\r\nHost: readstates\r\nConnection: close\r\n\r\n";
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    if !response.starts_with("HTTP/1.1 200") {
        let status = response.lines().next().unwrap_or_default().to_owned();
        return Err(std::io::Error::other(format!("GET /metrics: {status}")));
    }
    Ok(response)
}

/// The sum of the samples whose name and labels start with `series` (e.g.
/// `readstates_store_operations_total{store="cassandra",operation="write",result="ok"`),
/// or 0 if there is none yet.
pub fn value(text: &str, series: &str) -> f64 {
    text.lines()
        .filter(|line| line.starts_with(series))
        .filter_map(|line| line.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    #[test]
    fn values_are_summed_over_matching_series() {
        let text = "# TYPE x counter\nx{a=\"1\",b=\"ok\"} 2\nx{a=\"2\",b=\"ok\"} 3.5\ny 7\n";
        assert_eq!(super::value(text, "x{"), 5.5);
        assert_eq!(super::value(text, "x{a=\"2\""), 3.5);
        assert_eq!(super::value(text, "y"), 7.0);
        assert_eq!(super::value(text, "z"), 0.0);
    }
}
