//! `loadtest crash`: kill -9 of a readstates server at random moments
//! under open-loop acks, checked against a ledger of every acknowledged
//! ack. After each restart, before any new load, every key of the ledger
//! is read back: a key whose last acked message is below the ledger's lost
//! an acknowledged change (read later, a newer ack could hide the loss).

use std::collections::HashMap;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use readstates::proto::GetReadStatesRequest;
use readstates::proto::read_states_client::ReadStatesClient;
use readstates::test_support::ack;
use tokio::sync::mpsc;
use tonic::transport::Channel;

#[derive(Debug, clap::Args)]
pub struct CrashArgs {
    /// The readstates binary.
    #[arg(long, default_value = "target/release/readstates")]
    pub server: PathBuf,
    /// How many times the server is killed.
    #[arg(long, default_value_t = 20)]
    pub kills: usize,
    /// Acks per second, open loop.
    #[arg(long, default_value_t = 2_000.0)]
    pub rate: f64,
    #[arg(long, default_value_t = 10_000)]
    pub users: u64,
    /// Channels per user.
    #[arg(long, default_value_t = 10)]
    pub channels: u64,
    /// Each kill comes at a random moment up to this long after the load
    /// starts (at least a tenth of it).
    #[arg(long, default_value = "4s", value_parser = humantime::parse_duration)]
    pub up_to: Duration,
    #[arg(long, default_value = "127.0.0.1:50171")]
    pub listen: SocketAddr,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Arguments to `readstates serve` (the store and its directory), after
    /// `--`; the same for every start, so the server restarts in place.
    #[arg(last = true)]
    pub serve_args: Vec<String>,
}

/// What a start of the server said.
#[derive(Debug, Default)]
struct Started {
    /// Records its journal replayed, and how long that took.
    replayed: Option<(u64, u64)>,
    /// From the spawn to serving.
    took: Duration,
}

type Ledger = Arc<Mutex<HashMap<(u64, u64), u64>>>;

/// Lost keys printed so far (the first few say what was lost).
static SHOWN: AtomicU64 = AtomicU64::new(0);

pub async fn run(args: CrashArgs) -> anyhow::Result<()> {
    let mut rng = SmallRng::seed_from_u64(args.seed);
    let ledger: Ledger = Arc::default();
    let next_id = Arc::new(AtomicU64::new(1));
    let acknowledged = Arc::new(AtomicU64::new(0));
    let (mut lost, mut replays) = (0usize, Vec::new());
    let (mut server, _) = start(&args).await?;
    for round in 1..=args.kills {
        let client = connect(args.listen).await?;
        let load = tokio::spawn(generate(
            client,
            args.rate,
            (args.users, args.channels),
            SmallRng::seed_from_u64(args.seed ^ round as u64),
            (ledger.clone(), next_id.clone(), acknowledged.clone()),
        ));
        let wait = args.up_to.mul_f64(rng.random_range(0.1..1.0));
        tokio::time::sleep(wait).await;
        server.kill().context("kill -9")?;
        server.wait()?;
        load.abort();
        let _ = load.await;
        let (restarted, started) = start(&args).await?;
        server = restarted;
        let missing = check(args.listen, &ledger).await?;
        if missing > 0 {
            eprintln!("round {round}: {missing} acknowledged acks lost");
        }
        lost += missing;
        replays.push(started);
    }
    let _ = Command::new("kill")
        .args(["-TERM", &server.id().to_string()])
        .status();
    server.wait()?;
    let replayed: Vec<(u64, u64)> = replays.iter().filter_map(|s| s.replayed).collect();
    let records: u64 = replayed.iter().map(|r| r.0).sum();
    let mut times: Vec<u64> = replayed.iter().map(|r| r.1).collect();
    times.sort_unstable();
    let mut starts: Vec<u128> = replays.iter().map(|s| s.took.as_millis()).collect();
    starts.sort_unstable();
    println!(
        "kill -9 x{} at {}/s: acknowledged {}, lost {lost}, replayed {records} records in {} ms median ({} ms max); serving {} ms median after the start ({} ms max)",
        args.kills,
        args.rate,
        acknowledged.load(Ordering::Relaxed),
        times.get(times.len() / 2).copied().unwrap_or(0),
        times.last().copied().unwrap_or(0),
        starts.get(starts.len() / 2).copied().unwrap_or(0),
        starts.last().copied().unwrap_or(0),
    );
    if lost > 0 {
        bail!("{lost} acknowledged changes lost");
    }
    Ok(())
}

/// Starts the server and waits until it serves.
async fn start(args: &CrashArgs) -> anyhow::Result<(Child, Started)> {
    let began = Instant::now();
    let mut child = Command::new(&args.server)
        .arg("serve")
        .args(&args.serve_args)
        .args([
            "--listen",
            &args.listen.to_string(),
            "--metrics-listen",
            "127.0.0.1:0",
        ])
        .args(["--log-format", "json", "--log-level", "info"])
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("start {}", args.server.display()))?;
    let stderr = BufReader::new(child.stderr.take().context("stderr")?);
    let (events, mut told) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        for line in stderr.lines().map_while(Result::ok) {
            let Ok(event) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            // The server's log, echoed with CRASH_LOG set.
            if std::env::var_os("CRASH_LOG").is_some() {
                eprintln!("server: {line}");
            }
            if event["message"] == "journal replayed" || event["message"] == "serving" {
                let _ = events.send(event);
            } else if event["level"] == "ERROR" {
                eprintln!("server: {line}");
            }
        }
    });
    let mut started = Started::default();
    loop {
        let event = tokio::time::timeout(Duration::from_secs(60), told.recv())
            .await
            .context("the server did not start serving within 60 s")?
            .context("the server exited before serving")?;
        if event["message"] == "journal replayed" {
            let field = |name: &str| event[name].as_u64().unwrap_or(0);
            started.replayed = Some((field("records"), field("took_ms")));
        } else {
            started.took = began.elapsed();
            return Ok((child, started));
        }
    }
}

async fn connect(address: SocketAddr) -> anyhow::Result<ReadStatesClient<Channel>> {
    Ok(ReadStatesClient::connect(format!("http://{address}")).await?)
}

/// Open-loop acks at `rate` until aborted, each with a new, higher message
/// id; an acknowledged one raises its key in the ledger.
async fn generate(
    client: ReadStatesClient<Channel>,
    rate: f64,
    (users, channels): (u64, u64),
    mut rng: SmallRng,
    (ledger, next_id, acknowledged): (Ledger, Arc<AtomicU64>, Arc<AtomicU64>),
) {
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / rate));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    loop {
        tick.tick().await;
        let (user_id, channel_id) = (rng.random_range(1..=users), rng.random_range(1..=channels));
        let message_id = next_id.fetch_add(1, Ordering::Relaxed);
        let (mut client, ledger, acknowledged) =
            (client.clone(), ledger.clone(), acknowledged.clone());
        tokio::spawn(async move {
            if client
                .ack(ack(user_id, channel_id, message_id))
                .await
                .is_ok()
            {
                acknowledged.fetch_add(1, Ordering::Relaxed);
                let mut ledger = ledger.lock().unwrap_or_else(|p| p.into_inner());
                let held = ledger.entry((user_id, channel_id)).or_default();
                *held = (*held).max(message_id);
            }
        });
    }
}

/// Reads back every key of the ledger; returns how many are behind it.
async fn check(address: SocketAddr, ledger: &Ledger) -> anyhow::Result<usize> {
    let expected: HashMap<u64, Vec<(u64, u64)>> = {
        let ledger = ledger.lock().unwrap_or_else(|p| p.into_inner());
        let mut by_user: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
        for (&(user_id, channel_id), &message_id) in ledger.iter() {
            by_user
                .entry(user_id)
                .or_default()
                .push((channel_id, message_id));
        }
        by_user
    };
    let client = connect(address).await?;
    let reads = expected.into_iter().map(|(user_id, keys)| {
        let mut client = client.clone();
        async move {
            let request = GetReadStatesRequest {
                user_id,
                ..GetReadStatesRequest::default()
            };
            let held: HashMap<u64, u64> = (client.get_read_states(request).await?.into_inner().read_states)
                .into_iter()
                .map(|s| (s.channel_id, s.last_acked_id))
                .collect();
            let behind = (keys.iter())
                .filter(|(channel_id, message_id)| held.get(channel_id).copied().unwrap_or(0) < *message_id)
                .inspect(|(channel_id, message_id)| {
                    if SHOWN.fetch_add(1, Ordering::Relaxed) < 10 {
                        let held = held.get(channel_id).copied().unwrap_or(0);
                        eprintln!("lost: user {user_id} channel {channel_id}: acknowledged {message_id}, read {held}");
                    }
                })
                .count();
            Ok::<usize, tonic::Status>(behind)
        }
    });
    let mut behind = 0;
    let mut results = futures::stream::iter(reads).buffer_unordered(64);
    while let Some(result) = results.next().await {
        behind += result?;
    }
    Ok(behind)
}
