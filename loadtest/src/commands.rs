//! The subcommands: what `loadtest run`, `sweep` and `baseline-server` do
//! with their arguments, and where they write reports and charts.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;

use crate::chart;
use crate::report::Report;
use crate::runner::{RunConfig, Session};
use crate::sweep;
use crate::target::stream::StreamConfig;
use crate::watchers::Watchers;
use crate::workload::Workload;

/// One named target: `name=url`, or just a URL (named by itself).
#[derive(Clone, Debug)]
pub struct NamedTarget {
    pub name: String,
    pub url: String,
    pub metrics: Option<SocketAddr>,
}

impl std::str::FromStr for NamedTarget {
    type Err = String;

    /// `name=url[,metrics=host:port]`
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (name, rest) = s
            .split_once('=')
            .filter(|(n, _)| !n.contains("://"))
            .unwrap_or((s, s));
        let (url, metrics) = match rest.split_once(",metrics=") {
            Some((url, metrics)) => (
                url,
                Some(metrics.parse().map_err(|e| format!("{metrics}: {e}"))?),
            ),
            None => (rest, None),
        };
        Ok(NamedTarget {
            name: name.to_owned(),
            url: url.to_owned(),
            metrics,
        })
    }
}

/// How a run sends its changes: unary calls, or Apply streams in batches.
#[derive(Clone, Debug, clap::Args)]
pub struct StreamArgs {
    /// Send the changes (Ack, BulkAck, MessageCreated) over Apply streams,
    /// in batches of at most this many; 0 sends each as a unary call.
    /// Reads stay unary. Batches fill when `concurrency` is well above
    /// `stream-batch` times `streams`.
    #[arg(long, default_value_t = 0)]
    pub stream_batch: usize,
    /// Apply streams, over the workload's connections in turn.
    #[arg(long, default_value_t = 4)]
    pub streams: usize,
}

impl StreamArgs {
    fn config(&self) -> Option<StreamConfig> {
        (self.stream_batch > 0).then_some(StreamConfig {
            batch: self.stream_batch,
            streams: self.streams,
        })
    }
}

fn session_config(
    workload: &Arc<Workload>,
    target: &NamedTarget,
    stream: &StreamArgs,
) -> RunConfig {
    RunConfig {
        name: target.name.clone(),
        url: target.url.clone(),
        workload: workload.clone(),
        metrics: target.metrics,
        progress: true,
        stream: stream.config(),
    }
}

fn write_json(path: &Path, value: &impl serde::Serialize) -> anyhow::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    let json = serde_json::to_string_pretty(value)?;
    std::fs::write(path, json).with_context(|| format!("write {}", path.display()))
}

fn ms(us: u64) -> f64 {
    us as f64 / 1_000.0
}

/// What `loadtest run` does with a workload.
#[derive(Clone, Debug, clap::Args)]
pub struct RunArgs {
    /// `[name=]grpc://host:port[,metrics=host:port]` or `redis://host:port`.
    #[arg(long)]
    pub target: NamedTarget,
    /// Open-loop requests per second; 0 for a closed loop (default: the workload's).
    #[arg(long)]
    pub rate: Option<u64>,
    #[arg(long, value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// Closed-loop requests in flight (default: the workload's).
    #[arg(long)]
    pub concurrency: Option<usize>,
    /// Write the JSON report here.
    #[arg(long)]
    pub report: Option<PathBuf>,
    /// Write the p99.9-per-second chart (SVG) here.
    #[arg(long)]
    pub chart: Option<PathBuf>,
    /// Watch this many users (1..=N, the hottest under Zipf) during the run,
    /// over `--watch-streams` Watch streams, reading every event.
    #[arg(long, default_value_t = 0)]
    pub watch_users: u64,
    #[arg(long, default_value_t = 4)]
    pub watch_streams: usize,
    #[command(flatten)]
    pub stream: StreamArgs,
}

/// What `loadtest sweep` does with a workload.
#[derive(Clone, Debug, clap::Args)]
pub struct SweepArgs {
    #[arg(long = "target", required = true)]
    pub targets: Vec<NamedTarget>,
    /// The first rate, per second.
    #[arg(long, default_value_t = 1_000)]
    pub start: u64,
    /// Each rate is the last times this.
    #[arg(long, default_value_t = 1.5)]
    pub factor: f64,
    /// No rate above this.
    #[arg(long, default_value_t = 200_000)]
    pub max: u64,
    /// How long each rate runs.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "10s")]
    pub step: Duration,
    #[arg(long)]
    pub report: Option<PathBuf>,
    #[arg(long)]
    pub chart: Option<PathBuf>,
    #[command(flatten)]
    pub stream: StreamArgs,
}

/// `loadtest run`: one measured run; the report as a table, JSON and an
/// over-time chart.
pub async fn run(mut workload: Workload, args: RunArgs) -> anyhow::Result<Report> {
    if let Some(concurrency) = args.concurrency {
        workload.load.concurrency = concurrency;
    }
    let workload = Arc::new(workload);
    let rate = args.rate.or(Some(workload.load.rate)).filter(|&r| r > 0);
    let duration = args.duration.unwrap_or(workload.load.duration);
    let session = Session::start(session_config(&workload, &args.target, &args.stream)).await?;
    let watchers = match args.watch_users {
        0 => None,
        users => {
            let address = args
                .target
                .url
                .strip_prefix("grpc://")
                .context("--watch-users needs a grpc:// target")?;
            let watchers = Watchers::start(address, users, args.watch_streams).await?;
            eprintln!("watching {users} users over {} streams", args.watch_streams);
            Some(watchers)
        }
    };
    let report = session.measure(rate, duration, true).await?;
    println!("{}", report.table());
    if let Some(watchers) = &watchers {
        println!(
            "watch: {} events received (warm-up included), {} resyncs",
            watchers.events(),
            watchers.resyncs()
        );
    }
    if let Some(path) = args.report {
        write_json(&path, &report)?;
    }
    if let Some(path) = args.chart {
        let points = report
            .timeline
            .iter()
            .map(|w| (w.second as f64, ms(w.p999_us)))
            .collect();
        let title = format!("{}: p99.9 of each second", report.name);
        chart::over_time(&path, &title, &[(report.name.clone(), points)])?;
    }
    Ok(report)
}

/// `loadtest sweep`: steps each target's rate up to saturation; one chart
/// of p99.9 against throughput with a line per target.
pub async fn sweep(workload: Workload, args: SweepArgs) -> anyhow::Result<Vec<Vec<Report>>> {
    let workload = Arc::new(workload);
    let rates = sweep::rates(args.start, args.factor, args.max);
    let (targets, step) = (args.targets, args.step);
    let mut all = Vec::new();
    for target in &targets {
        eprintln!("sweep of {} ({})", target.name, target.url);
        let mut config = session_config(&workload, target, &args.stream);
        config.progress = false;
        let session = Session::start(config).await?;
        all.push(sweep::run(&session, &rates, step).await?);
    }
    if let Some(path) = args.report {
        write_json(&path, &all)?;
    }
    if let Some(path) = args.chart {
        let series: Vec<chart::Series> = all
            .iter()
            .zip(&targets)
            .map(|(reports, target)| {
                let points = reports
                    .iter()
                    .map(|r| (r.throughput, ms(r.latency.p999_us)))
                    .collect();
                (target.name.clone(), points)
            })
            .collect();
        chart::latency_vs_throughput(&path, "p99.9 latency against throughput", &series)?;
    }
    Ok(all)
}

/// `loadtest summary`: one line per report in `dir` (`*.json` of one run
/// each), as a Markdown table.
pub fn summary(dir: &Path) -> anyhow::Result<String> {
    let mut reports = Vec::new();
    let entries = std::fs::read_dir(dir).with_context(|| format!("read {}", dir.display()))?;
    for entry in entries {
        let path = entry?.path();
        if path.extension().is_some_and(|e| e == "json") {
            let text = std::fs::read_to_string(&path)
                .with_context(|| format!("read {}", path.display()))?;
            // Sweep files hold lists of reports; they have their own chart.
            if let Ok(report) = serde_json::from_str::<Report>(&text) {
                reports.push((
                    path.file_stem()
                        .unwrap_or_default()
                        .to_string_lossy()
                        .into_owned(),
                    report,
                ));
            }
        }
    }
    reports.sort_by(|a, b| a.0.cmp(&b.0));
    let mut out = String::from(
        "| run | mode | ok/s | p50 ms | p99 ms | p99.9 ms | errors | store writes per change | worst/median 1 s p99.9 |\n\
         | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    for (file, r) in &reports {
        let mode = r
            .target_rate
            .map_or("closed".to_owned(), |rate| format!("open {rate}/s"));
        let writes = r
            .store
            .as_ref()
            .map_or("".to_owned(), |s| format!("{:.4}", s.writes_per_change));
        out += &format!(
            "| {file} | {mode} | {:.0} | {:.3} | {:.3} | {:.3} | {} | {writes} | {:.2} |\n",
            r.throughput,
            ms(r.latency.p50_us),
            ms(r.latency.p99_us),
            ms(r.latency.p999_us),
            r.errors,
            r.spike_ratio()
        );
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn summary_tables_every_run_report() {
        let dir = tempfile::tempdir().unwrap();
        let report = Report {
            name: "memory".into(),
            throughput: 1234.4,
            ..Report::default()
        };
        write_json(&dir.path().join("a-memory.json"), &report).unwrap();
        write_json(&dir.path().join("sweep.json"), &vec![vec![report.clone()]]).unwrap();
        let table = summary(dir.path()).unwrap();
        assert_eq!(table.lines().count(), 3, "{table}");
        assert!(table.contains("| a-memory | closed | 1234 |"), "{table}");
    }

    #[test]
    fn targets_parse_with_and_without_names() {
        let plain: NamedTarget = "grpc://127.0.0.1:1".parse().unwrap();
        assert_eq!(
            (plain.name.as_str(), plain.url.as_str()),
            ("grpc://127.0.0.1:1", "grpc://127.0.0.1:1")
        );
        let named: NamedTarget = "memory=grpc://127.0.0.1:1,metrics=127.0.0.1:2"
            .parse()
            .unwrap();
        assert_eq!(
            (named.name.as_str(), named.url.as_str()),
            ("memory", "grpc://127.0.0.1:1")
        );
        assert_eq!(named.metrics, Some("127.0.0.1:2".parse().unwrap()));
        assert!(
            "x=grpc://a,metrics=nonsense"
                .parse::<NamedTarget>()
                .is_err()
        );
    }
}
