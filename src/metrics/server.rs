//! The HTTP listener that serves Prometheus text at `/metrics`.

use axum::Router;
use axum::routing::get;
use metrics_exporter_prometheus::PrometheusHandle;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Serves `/metrics` on `listener` until `stop` is cancelled.
pub async fn serve(
    listener: TcpListener,
    handle: PrometheusHandle,
    stop: CancellationToken,
) -> std::io::Result<()> {
    let render = move || std::future::ready(handle.render() + &super::latency::render());
    let app = Router::new().route("/metrics", get(render));
    axum::serve(listener, app)
        .with_graceful_shutdown(stop.cancelled_owned())
        .await
}
