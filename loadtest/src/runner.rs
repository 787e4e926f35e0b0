//! Running a workload against a target: preload, warm-up, then measure in an
//! open loop (a fixed rate, latency from each request's due time) or a closed
//! loop (`concurrency` requests always in flight), printing a progress line
//! every second.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use rand::SeedableRng;
use rand::rngs::SmallRng;
use readstates::metrics::{self, scrape};
use tokio::sync::Semaphore;

use crate::op::{Generator, MessageIds, Op};
use crate::report::{Report, StoreWrites};
use crate::schedule::Schedule;
use crate::stats::Stats;
use crate::target::Target;
use crate::target::stream::StreamConfig;
use crate::workload::Workload;

/// How long in-flight requests may take to finish once sending has stopped.
const DRAIN: Duration = Duration::from_secs(10);
/// The longest [`Session::settle`] waits: well past the default 30 s write delay.
const SETTLE_LIMIT: Duration = Duration::from_secs(120);

#[derive(Clone, Debug)]
pub struct RunConfig {
    /// The name in reports and charts.
    pub name: String,
    pub url: String,
    pub workload: Arc<Workload>,
    /// The target's `/metrics` address, to count store writes.
    pub metrics: Option<SocketAddr>,
    /// Print the progress line every second.
    pub progress: bool,
    /// Send the changes over Apply streams.
    pub stream: Option<StreamConfig>,
}

/// A target connected and preloaded, ready for one or more measured runs.
#[derive(Debug)]
pub struct Session {
    config: RunConfig,
    target: Arc<Target>,
    generator: Generator,
}

impl Session {
    pub async fn start(config: RunConfig) -> anyhow::Result<Session> {
        let target = Arc::new(
            Target::connect(&config.url, config.workload.load.connections, config.stream).await?,
        );
        let generator = Generator::new(config.workload.clone(), MessageIds::new());
        let session = Session {
            config,
            target,
            generator,
        };
        if session.config.workload.load.preload {
            session.preload().await?;
        }
        Ok(session)
    }

    /// Every user gets a read state in each of its channels.
    async fn preload(&self) -> anyhow::Result<()> {
        let users = self.config.workload.keyspace.users;
        let started = Instant::now();
        let next = Arc::new(AtomicU64::new(1));
        let failed = Arc::new(AtomicBool::new(false));
        let mut workers = Vec::new();
        for _ in 0..self.config.workload.load.concurrency {
            let (target, generator, next, failed) = (
                self.target.clone(),
                self.generator.clone(),
                next.clone(),
                failed.clone(),
            );
            workers.push(tokio::spawn(async move {
                loop {
                    let user_id = next.fetch_add(1, Ordering::Relaxed);
                    if user_id > users || failed.load(Ordering::Relaxed) {
                        return Ok::<(), anyhow::Error>(());
                    }
                    let message_id = generator.message_ids().current();
                    let channels: Vec<u64> = generator.channels(user_id).collect();
                    for chunk in channels.chunks(100) {
                        let entries = chunk.iter().map(|&c| (c, message_id)).collect();
                        if let Err(e) = target.execute(&Op::BulkAck { user_id, entries }).await {
                            failed.store(true, Ordering::Relaxed);
                            return Err(anyhow::anyhow!("preload of user {user_id}: {e}"));
                        }
                    }
                }
            }));
        }
        for worker in workers {
            worker.await.context("preload worker")??;
        }
        if self.config.progress {
            eprintln!(
                "preloaded {users} users in {:.1} s",
                started.elapsed().as_secs_f64()
            );
        }
        Ok(())
    }

    /// Warms up, then measures for `duration` at `rate` (None: closed loop).
    /// With `count_writes` (and the target's metrics known), it also counts
    /// the store writes the run caused: it starts once earlier changes (the
    /// preload's, the warm-up's) are written and ends once its own are,
    /// which can take a write delay at each end.
    pub async fn measure(
        &self,
        rate: Option<u64>,
        duration: Duration,
        count_writes: bool,
    ) -> anyhow::Result<Report> {
        let load = &self.config.workload.load;
        if !load.warmup.is_zero() {
            self.drive(
                rate,
                load.warmup,
                Arc::new(Mutex::new(Stats::default())),
                false,
            )
            .await;
        }
        let before = if count_writes {
            self.settled_store_writes().await?
        } else {
            None
        };
        let stats = Arc::new(Mutex::new(Stats::default()));
        self.drive(rate, duration, stats.clone(), self.config.progress)
            .await;
        let after = if count_writes {
            self.settled_store_writes().await?
        } else {
            None
        };
        let stats = stats
            .lock()
            .map_err(|_| anyhow::anyhow!("stats lock poisoned"))?
            .clone();
        let mut report = Report::new(
            &self.config.name,
            &self.config.url,
            rate,
            load.concurrency,
            duration,
            &stats,
        );
        if let (Some((writes0, rows0)), Some((writes1, rows1))) = (before, after) {
            let writes = writes1 - writes0;
            report.store = Some(StoreWrites {
                writes,
                written_read_states: rows1 - rows0,
                changes: stats.changes,
                writes_per_change: writes / stats.changes.max(1) as f64,
            });
        }
        Ok(report)
    }

    /// Waits until the target has written every change (its unwritten
    /// gauge reads 0), if its metrics are known.
    async fn settle(&self) -> anyhow::Result<()> {
        let Some(addr) = self.config.metrics else {
            return Ok(());
        };
        let started = Instant::now();
        let mut told = false;
        loop {
            let text = scrape::fetch(addr)
                .await
                .map_err(|e| anyhow::anyhow!("/metrics at {addr}: {e}"))?;
            let unwritten = scrape::value(&text, &format!("{} ", metrics::UNWRITTEN_READ_STATES));
            if unwritten == 0.0 {
                return Ok(());
            }
            if started.elapsed() > SETTLE_LIMIT {
                anyhow::bail!("{unwritten} read states still unwritten after {SETTLE_LIMIT:?}");
            }
            if self.config.progress && !told {
                eprintln!("waiting for {unwritten} unwritten read states to be written");
                told = true;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }

    /// The store counters once every change is written.
    async fn settled_store_writes(&self) -> anyhow::Result<Option<(f64, f64)>> {
        self.settle().await?;
        self.store_writes().await
    }

    async fn store_writes(&self) -> anyhow::Result<Option<(f64, f64)>> {
        let Some(addr) = self.config.metrics else {
            return Ok(None);
        };
        let text = scrape::fetch(addr)
            .await
            .map_err(|e| anyhow::anyhow!("/metrics at {addr}: {e}"))?;
        let writes = text
            .lines()
            .filter(|l| {
                l.starts_with(metrics::STORE_OPERATIONS)
                    && l.contains("operation=\"write\"")
                    && l.contains("result=\"ok\"")
            })
            .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
            .sum();
        Ok(Some((writes, scrape::value(&text, metrics::STORE_WRITTEN))))
    }

    /// Sends for `duration`, recording into `stats`, with per-second windows.
    async fn drive(
        &self,
        rate: Option<u64>,
        duration: Duration,
        stats: Arc<Mutex<Stats>>,
        progress: bool,
    ) {
        let start = Instant::now();
        let ticker = tokio::spawn(tick_windows(stats.clone(), start, progress));
        match rate {
            Some(rate) => self.open_loop(rate, start, duration, stats.clone()).await,
            None => self.closed_loop(start + duration, stats.clone()).await,
        }
        ticker.abort();
        // The last (partial) second, with the requests that finished late.
        if let Ok(mut stats) = stats.lock() {
            stats.close_window();
        }
    }

    async fn closed_loop(&self, end: Instant, stats: Arc<Mutex<Stats>>) {
        let mut workers = Vec::new();
        for worker in 0..self.config.workload.load.concurrency {
            let (target, generator, stats) =
                (self.target.clone(), self.generator.clone(), stats.clone());
            workers.push(tokio::spawn(async move {
                let mut rng =
                    SmallRng::seed_from_u64(worker as u64 ^ readstates::clock::now_micros());
                while Instant::now() < end {
                    let op = generator.next(&mut rng);
                    let sent = Instant::now();
                    let result = target.execute(&op).await;
                    record(&stats, &op, sent.elapsed(), &result);
                }
            }));
        }
        for worker in workers {
            let _ = worker.await;
        }
    }

    /// A thread schedules (its sleeps are far finer than tokio's 1 ms timer);
    /// the runtime sends. Requests beyond `max_in_flight` are dropped and
    /// counted, not queued.
    async fn open_loop(
        &self,
        rate: u64,
        start: Instant,
        duration: Duration,
        stats: Arc<Mutex<Stats>>,
    ) {
        let limit = self.config.workload.load.max_in_flight;
        let in_flight = Arc::new(Semaphore::new(limit));
        let runtime = tokio::runtime::Handle::current();
        let (target, generator, permits) = (
            self.target.clone(),
            self.generator.clone(),
            in_flight.clone(),
        );
        let end = start + duration;
        let scheduler = std::thread::spawn(move || {
            let mut rng = SmallRng::seed_from_u64(readstates::clock::now_micros());
            let mut schedule = Schedule::new(start, rate);
            while schedule.peek() < end {
                let wait = schedule.peek().saturating_duration_since(Instant::now());
                if !wait.is_zero() {
                    std::thread::sleep(wait);
                }
                for due in schedule.due(Instant::now()) {
                    if due >= end {
                        break;
                    }
                    let op = generator.next(&mut rng);
                    let (target, stats) = (target.clone(), stats.clone());
                    let Ok(permit) = permits.clone().try_acquire_owned() else {
                        record(
                            &stats,
                            &op,
                            Duration::ZERO,
                            &Err("Dropped (client at max_in_flight)".into()),
                        );
                        continue;
                    };
                    runtime.spawn(async move {
                        let result = target.execute(&op).await;
                        record(&stats, &op, due.elapsed(), &result);
                        drop(permit);
                    });
                }
            }
        });
        let _ = tokio::task::spawn_blocking(move || scheduler.join()).await;
        // Let the requests still in flight finish, and count them.
        let _ = tokio::time::timeout(DRAIN, in_flight.acquire_many(limit as u32)).await;
    }
}

fn record(stats: &Mutex<Stats>, op: &Op, latency: Duration, result: &Result<(), String>) {
    if let Ok(mut stats) = stats.lock() {
        stats.record(op.kind(), latency, result, op.changes());
    }
}

/// Closes a window every second of the run and prints the progress line.
async fn tick_windows(stats: Arc<Mutex<Stats>>, start: Instant, progress: bool) {
    let mut second = 1u64;
    loop {
        tokio::time::sleep_until((start + Duration::from_secs(second)).into()).await;
        let window = match stats.lock() {
            Ok(mut stats) => stats.close_window(),
            Err(_) => return,
        };
        if progress {
            eprintln!(
                "{:>4}s {:>8} req/s {:>6} errors  p50 {:>6} µs  p99.9 {:>7} µs  max {:>7} µs",
                window.second,
                window.requests,
                window.errors,
                window.p50_us,
                window.p999_us,
                window.max_us
            );
        }
        second += 1;
    }
}
