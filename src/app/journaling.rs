//! The journal's part in the application: opened and replayed before the
//! node serves, trimmed once a second while it runs, closed last.

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::BoxError;
use crate::cache::Cache;
use crate::config::Config;
use crate::journal::disk::Disk;
use crate::journal::{Journal, JournalConfig, JournalMode, Trimmer, replay};
use crate::metrics;

/// How often the trimmer deletes what the store holds.
const TRIM_EVERY: Duration = Duration::from_secs(1);

/// Opens the journal `config` asks for on `disk`, lays what it holds over
/// the cache (see [`Cache::replay`]) and journals every later change.
/// Without one (`--journal off`, write-through), a journal left by an
/// earlier start is still replayed, and deleted once written.
pub fn open(
    config: &Config,
    cache: &Cache,
    disk: Arc<dyn Disk>,
) -> Result<Option<Arc<Journal>>, BoxError> {
    let (journal_config, journaling) = match config.journal() {
        Some(journal_config) => (journal_config, true),
        None if left_behind(&config.journal_dir()) => {
            // Nothing is appended: the writer only wakes now and then.
            let mode = JournalMode::Interval(Duration::from_secs(1));
            let journal_config = JournalConfig {
                skip_corrupt: config.journal_skip_corrupt,
                ..JournalConfig::new(config.journal_dir(), mode)
            };
            (journal_config, false)
        }
        None => return Ok(None),
    };
    let started = std::time::Instant::now();
    let dir = journal_config.dir.clone();
    let (journal, replayed) = Journal::open(journal_config, disk)?;
    let (records, users, channels) = (
        replayed.records,
        replayed.users.len(),
        replayed.channels.len(),
    );
    let (torn, skipped) = (replayed.torn_bytes, replayed.skipped_bytes);
    cache.replay(replayed);
    tracing::info!(
        dir = %dir.display(),
        records,
        users,
        channels,
        torn_bytes = torn,
        skipped_bytes = skipped,
        took_ms = started.elapsed().as_millis() as u64,
        "journal replayed"
    );
    let journal = Arc::new(journal);
    if journaling {
        cache.set_journal(journal.clone());
    }
    Ok(Some(journal))
}

/// Whether `dir` holds segments of a journal.
fn left_behind(dir: &std::path::Path) -> bool {
    let segment = |entry: std::fs::DirEntry| {
        (entry.path().extension()).is_some_and(|e| e == replay::EXTENSION)
    };
    (std::fs::read_dir(dir).into_iter().flatten().flatten()).any(segment)
}

/// Deletes the journal's segments the store holds, every [`TRIM_EVERY`],
/// until `stop`.
pub fn spawn_trimmer(
    journal: Arc<Journal>,
    cache: Arc<Cache>,
    stop: CancellationToken,
) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut trimmer = Trimmer::new(journal.clone());
        let mut tick = tokio::time::interval(TRIM_EVERY);
        loop {
            tokio::select! {
                _ = tick.tick() => {}
                () = stop.cancelled() => return,
            }
            // Off the runtime's workers: finding the oldest unwritten
            // change looks at every cached user (9 to 21 ms at 2 M read
            // states, each second: the p99 of every request behind it),
            // and deleting segments is file I/O.
            let cache = cache.clone();
            let trimming = tokio::task::spawn_blocking(move || {
                trimmer.trim(|| cache.oldest_unwritten());
                trimmer
            });
            trimmer = match trimming.await {
                Ok(trimmer) => trimmer,
                Err(error) => {
                    tracing::error!(%error, "journal: the trimmer failed; segments are no longer deleted");
                    return;
                }
            };
            metrics::journal_segments(journal.segments());
        }
    })
}
