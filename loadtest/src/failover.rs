//! `loadtest failover`: open-loop acks through the fleet client while the
//! script around it kills or freezes a node of the fleet, checked against a
//! ledger of every acknowledged ack. Once the load is over and the write
//! delay has passed, every key of the ledger is read from Cassandra itself:
//! a stored ack below the ledger's is an acknowledged change lost.
//!
//! The longest an acknowledged ack waited (the fleet client retrying "not
//! applied" answers meanwhile) is how long the failed node's users went
//! unserved.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use anyhow::Context;
use hdrhistogram::Histogram;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use readstates::config::Config;
use readstates::store::Store;
use readstates::store::cassandra::CassandraStore;
use readstates::test_support::ack;
use readstates_routing::client::FleetClient;
use tokio::task::JoinSet;

#[derive(Debug, clap::Args)]
pub struct FailoverArgs {
    /// A node of the fleet, `host:port`: the client reads the ring there.
    #[arg(long)]
    pub entry: String,
    /// Acks per second, open loop.
    #[arg(long, default_value_t = 2_000.0)]
    pub rate: f64,
    /// How long the load runs.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "30s")]
    pub duration: Duration,
    /// How long after the load the store is read: past the write delay.
    #[arg(long, value_parser = humantime::parse_duration, default_value = "40s")]
    pub settle: Duration,
    #[arg(long, default_value_t = 10_000)]
    pub users: u64,
    /// Channels per user.
    #[arg(long, default_value_t = 10)]
    pub channels: u64,
    /// The fleet's Cassandra, `host:port`.
    #[arg(long)]
    pub cassandra_nodes: String,
    /// The fleet's keyspace.
    #[arg(long)]
    pub keyspace: String,
    /// What happened during the load, for the summary ("killing a node").
    #[arg(long, default_value = "a fault")]
    pub what: String,
}

/// The users of this run, clear of any other workload's.
const FIRST_USER: u64 = 7_000_000_000;

pub async fn run(args: FailoverArgs) -> anyhow::Result<()> {
    let client = FleetClient::connect(&args.entry)
        .await
        .context("the fleet's entry node")?;
    // Above every id acked before: each ack of the run is its key's newest.
    let next_id = Arc::new(AtomicU64::new(readstates::clock::now_micros()));
    let ledger: Arc<Mutex<HashMap<(u64, u64), u64>>> = Arc::default();
    let latency = Arc::new(Mutex::new(Histogram::<u64>::new(3)?));
    let errors = Arc::new(Mutex::new((0u64, None::<String>)));
    let mut rng = SmallRng::seed_from_u64(1);
    let mut tasks = JoinSet::new();
    let every = Duration::from_secs_f64(1.0 / args.rate);
    let started = Instant::now();
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    while started.elapsed() < args.duration {
        ticks.tick().await;
        let user_id = FIRST_USER + rng.random_range(0..args.users);
        let channel_id = 1 + rng.random_range(0..args.channels);
        let message_id = next_id.fetch_add(1, Ordering::Relaxed);
        let (client, ledger, latency, errors) = (
            client.clone(),
            ledger.clone(),
            latency.clone(),
            errors.clone(),
        );
        tasks.spawn(async move {
            let sent = Instant::now();
            let answer = client
                .call(user_id, |mut node| async move {
                    node.ack(ack(user_id, channel_id, message_id)).await
                })
                .await;
            match answer {
                Ok(_) => {
                    let waited = sent.elapsed().as_micros() as u64;
                    latency.lock().unwrap().record(waited.max(1)).unwrap();
                    let mut ledger = ledger.lock().unwrap();
                    let acked = ledger.entry((user_id, channel_id)).or_default();
                    *acked = (*acked).max(message_id);
                }
                Err(status) => {
                    let mut errors = errors.lock().unwrap();
                    errors.0 += 1;
                    errors.1.get_or_insert_with(|| status.to_string());
                }
            }
        });
    }
    while tasks.join_next().await.is_some() {}
    let seconds = started.elapsed().as_secs_f64();
    tokio::time::sleep(args.settle).await;

    let mut config = Config::default().cassandra();
    config.nodes = vec![args.cassandra_nodes.clone()];
    config.keyspace = args.keyspace.clone();
    let store = CassandraStore::connect(&config)
        .await
        .context("Cassandra")?;
    let ledger = std::mem::take(&mut *ledger.lock().unwrap());
    let mut by_user: HashMap<u64, Vec<(u64, u64)>> = HashMap::new();
    for ((user_id, channel_id), acked) in &ledger {
        by_user
            .entry(*user_id)
            .or_default()
            .push((*channel_id, *acked));
    }
    let mut lost = 0usize;
    for (user_id, keys) in by_user {
        let stored = store.load(user_id).await.context("reading back")?;
        for (channel_id, acked) in keys {
            let kept = (stored.read_states.iter())
                .find(|s| {
                    s.channel_id == channel_id && s.kind == readstates::read_state::Kind::Channel
                })
                .map_or(0, |s| s.last_acked_id);
            if kept < acked {
                lost += 1;
            }
        }
    }
    let latency = latency.lock().unwrap();
    let (errors, first_error) = errors.lock().unwrap().clone();
    let answered = latency.len();
    println!(
        "{} at {:.0}/s for {:.0} s: {answered} acks answered, {errors} errors, p99.9 {:.1} ms, \
         served again after {} ms, lost {lost} of {} keys acknowledged",
        args.what,
        args.rate,
        seconds,
        latency.value_at_quantile(0.999) as f64 / 1000.0,
        latency.max() / 1000,
        ledger.len(),
    );
    if let Some(error) = first_error {
        println!("first error: {error}");
    }
    Ok(())
}
