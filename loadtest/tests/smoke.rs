//! A short run of the load generator against a real readstates on port 0
//! (and against the baseline server): requests succeed, the report and the
//! chart are written.

use std::path::Path;
use std::time::Duration;

use loadtest::baseline;
use loadtest::commands::{self, NamedTarget, RunArgs, StreamArgs};
use loadtest::report::Report;
use loadtest::workload::Workload;
use readstates::app::Application;
use readstates::config::{Config, Settings, StoreKind};

fn workload() -> Workload {
    Workload::from_file(&Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads/smoke.toml"))
        .unwrap()
}

/// readstates with the memory store and a short write delay, so that the
/// run sees store writes.
async fn readstates() -> (NamedTarget, tokio::sync::oneshot::Sender<()>) {
    let config = Config::resolve(Settings {
        listen: Some("127.0.0.1:0".parse().unwrap()),
        metrics_listen: Some("127.0.0.1:0".parse().unwrap()),
        store: Some(StoreKind::Memory),
        write_delay: Some(Duration::from_millis(100)),
        ..Settings::default()
    });
    let app = Application::build(config).await.unwrap();
    let target = NamedTarget {
        name: "readstates".into(),
        url: format!("grpc://{}", app.grpc_addr()),
        metrics: Some(app.metrics_addr()),
    };
    let (stop, stopped) = tokio::sync::oneshot::channel();
    tokio::spawn(app.run_until(async {
        let _ = stopped.await;
    }));
    (target, stop)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_loop_against_readstates_writes_a_report_and_a_chart() {
    let (target, _stop) = readstates().await;
    let dir = tempfile::tempdir().unwrap();
    let (report_path, chart_path) = (
        dir.path().join("report.json"),
        dir.path().join("over-time.svg"),
    );
    let args = RunArgs {
        target,
        rate: Some(0),
        duration: None,
        report: Some(report_path.clone()),
        chart: Some(chart_path.clone()),
        // Watch streams open during the run (Watchers::start fails unless
        // every subscription gets its first event).
        watch_users: 20,
        watch_streams: 2,
        concurrency: None,
        stream: unary(),
    };
    let report = commands::run(workload(), args).await.unwrap();
    assert_eq!(report.mode, "closed");
    assert!(report.requests > 100, "{}", report.table());
    assert_eq!(report.errors, 0, "{}", report.table());
    assert_eq!(report.ops.len(), 5, "every operation of the mix ran");
    assert!(report.latency.p50_us > 0 && report.latency.p50_us <= report.latency.p999_us);
    let store = report
        .store
        .clone()
        .expect("store writes read from /metrics");
    assert!(store.changes > 0);

    let saved: Report =
        serde_json::from_str(&std::fs::read_to_string(&report_path).unwrap()).unwrap();
    assert_eq!(saved, report);
    assert!(
        std::fs::read_to_string(&chart_path)
            .unwrap()
            .starts_with("<svg")
    );
}

fn unary() -> StreamArgs {
    StreamArgs {
        stream_batch: 0,
        streams: 0,
    }
}

/// The changes over Apply streams, the reads unary: every one answered OK,
/// and the changes reach the store.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_over_apply_streams_succeeds() {
    let (target, _stop) = readstates().await;
    let args = RunArgs {
        target,
        rate: Some(0),
        duration: Some(Duration::from_secs(2)),
        report: None,
        chart: None,
        watch_users: 0,
        watch_streams: 0,
        concurrency: Some(64),
        stream: StreamArgs {
            stream_batch: 16,
            streams: 2,
        },
    };
    let report = commands::run(workload(), args).await.unwrap();
    assert!(report.requests > 100, "{}", report.table());
    assert_eq!(report.errors, 0, "{}", report.table());
    assert_eq!(report.ops.len(), 5, "every operation of the mix ran");
    let store = report.store.expect("store writes read from /metrics");
    assert!(store.changes > 0 && store.writes > 0.0, "{store:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_loop_holds_its_rate_against_the_baseline() {
    let listener = baseline::bind("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let url = format!("grpc://{}", listener.local_addr().unwrap());
    tokio::spawn(baseline::serve(listener, 20));
    let target = NamedTarget {
        name: "baseline".into(),
        url,
        metrics: None,
    };
    let args = RunArgs {
        target,
        rate: Some(400),
        duration: Some(Duration::from_secs(2)),
        report: None,
        chart: None,
        watch_users: 0,
        watch_streams: 0,
        concurrency: None,
        stream: unary(),
    };
    let report = commands::run(workload(), args).await.unwrap();
    assert_eq!(report.mode, "open");
    assert_eq!(report.errors, 0, "{}", report.table());
    // 400/s for 2 s, all of it answered.
    assert!(
        (report.requests as i64 - 800).abs() <= 2,
        "{}",
        report.table()
    );
    assert!(report.timeline.len() >= 2);
}
