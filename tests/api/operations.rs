//! What operators and tools rely on: health, reflection, metrics, overload,
//! and a server that survives misbehaving connections.

use std::time::Duration;

use readstates::proto::GetReadStatesRequest;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::test_support::ack;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tonic::Code;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::ServerReflectionRequest;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;

use crate::helpers::{spawn_app, spawn_app_with, test_config};

#[tokio::test]
async fn health_reports_serving() {
    let app = spawn_app().await;
    let mut health = HealthClient::new(app.channel().await);
    let request = HealthCheckRequest {
        service: "readstates.v1.ReadStates".into(),
    };
    let status = health.check(request).await.unwrap().into_inner().status;
    assert_eq!(status, ServingStatus::Serving as i32);
}

#[tokio::test]
async fn reflection_lists_the_service() {
    let app = spawn_app().await;
    let mut reflection = ServerReflectionClient::new(app.channel().await);
    let request = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut responses = reflection
        .server_reflection_info(futures::stream::iter([request]))
        .await
        .unwrap()
        .into_inner();
    let response = responses.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = response.message_response else {
        panic!("unexpected {response:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    assert!(
        names.contains(&"readstates.v1.ReadStates".to_owned()),
        "{names:?}"
    );
    assert!(
        names.contains(&"grpc.health.v1.Health".to_owned()),
        "{names:?}"
    );
}

#[tokio::test]
async fn metrics_show_requests_and_the_build() {
    let mut app = spawn_app().await;
    app.client.ack(ack(1, 1, 1)).await.unwrap();
    let _ = app.client.ack(ack(0, 1, 1)).await;
    let text = app.metrics().await;
    let version = env!("CARGO_PKG_VERSION");
    assert!(
        text.contains(&format!(
            "readstates_build_info{{version=\"{version}\",node=\"standalone\"}} 1"
        )),
        "{text}"
    );
    let ok = readstates::metrics::scrape::value(
        &text,
        "readstates_requests_total{method=\"Ack\",code=\"OK\",node=\"standalone\"}",
    );
    assert!(ok >= 1.0, "{text}");
    assert!(text.contains(
        "readstates_requests_total{method=\"Ack\",code=\"INVALID_ARGUMENT\",node=\"standalone\"}"
    ));
    assert!(text.contains("readstates_request_duration_seconds_bucket{method=\"Ack\""));
}

#[tokio::test]
async fn overload_is_resource_exhausted() {
    let mut config = test_config();
    config.max_concurrent_requests = 0;
    let mut app = spawn_app_with(config).await;
    let status = app.client.ack(ack(1, 1, 1)).await.unwrap_err();
    assert_eq!(status.code(), Code::ResourceExhausted);
    assert!(status.message().contains("retry"), "{status:?}");
}

#[tokio::test]
async fn garbage_and_broken_connections_do_not_disturb_others() {
    let mut app = spawn_app().await;
    // Not HTTP/2 at all.
    let mut junk = TcpStream::connect(app.addr).await.unwrap();
    junk.write_all(&[0xde, 0xad, 0xbe, 0xef].repeat(1_000))
        .await
        .unwrap();
    // A valid preface, then a connection closed halfway through a frame.
    let mut cut = TcpStream::connect(app.addr).await.unwrap();
    cut.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x12\x04\x00\x00")
        .await
        .unwrap();
    drop(cut);
    // A client that gives up mid-request.
    let mut impatient = ReadStatesClient::new(app.channel().await);
    let request = tonic::Request::new(GetReadStatesRequest {
        user_id: 5,
        ..GetReadStatesRequest::default()
    });
    let _ =
        tokio::time::timeout(Duration::from_micros(1), impatient.get_read_states(request)).await;

    let response = app.client.ack(ack(1, 1, 1)).await.unwrap().into_inner();
    assert!(response.applied);
    drop(junk);
    let again = app.client.ack(ack(1, 1, 2)).await.unwrap().into_inner();
    assert!(again.applied, "still serving");
}

#[tokio::test]
async fn accepted_connections_have_nagle_off() {
    use futures::StreamExt;
    // A response is several small writes; with Nagle on, the later ones wait
    // for the client's delayed ACK (up to 40 ms at low request rates).
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let mut incoming = readstates::app::incoming(listener);
    let _client = TcpStream::connect(addr).await.unwrap();
    let accepted = incoming.next().await.unwrap().unwrap();
    assert!(accepted.nodelay().unwrap());
}

/// Found by an adversarial review: a scraper that sent half a request
/// header to `/metrics` kept shutdown from ever finishing (the metrics
/// listener's graceful shutdown waited for it with no limit), so the process
/// never exited with its status.
#[tokio::test]
async fn a_half_sent_metrics_request_does_not_hold_up_shutdown() {
    let app = spawn_app().await;
    let mut scraper = TcpStream::connect(app.metrics_addr).await.unwrap();
    scraper
        .write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    let stopped = tokio::time::timeout(Duration::from_secs(20), app.stop()).await;
    assert!(
        stopped.is_ok(),
        "shutdown hung on a half-sent metrics request"
    );
    drop(scraper);
}

/// Issue 35, item 7: at shutdown a Watch (or Apply) client lagging in flow
/// control got part of its events, then the connection ended without a
/// status. The server had sent everything and closed its socket; the
/// client's window updates then met a closed socket, whose reset made the
/// client's kernel drop what it had not read yet. A socket the server
/// closes is now read until the client closes it: what a client sends
/// after the server's last byte meets no reset. (Shown here on a
/// connection the server ends at once, for a preface that is not HTTP/2.)
#[tokio::test]
async fn a_connection_the_server_ends_lingers_until_the_client_closes_it() {
    let app = spawn_app().await;
    let mut client = TcpStream::connect(app.addr).await.unwrap();
    client.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(5), client.read_to_end(&mut answer));
    ended
        .await
        .expect("the server ends the connection")
        .unwrap();
    // Late bytes, as a client's window updates for what it reads.
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        client.write_all(&[0; 13]).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(100)).await;
    let mut after = [0u8; 16];
    let read = client.read(&mut after).await;
    assert!(matches!(read, Ok(0)), "reset by the server: {read:?}");
    drop(client);
    app.stop().await;
}
