//! The stream's bounds on what its items hold, at the level of its items
//! (the end-to-end behaviour is `tests/api/apply.rs`'s).

use std::sync::Arc;

use super::*;
use crate::cache::{Cache, CacheConfig};
use crate::config::Config;
use crate::grpc::ServiceConfig;
use crate::proto::GetBadgeCountsRequest;
use crate::store::memory::MemoryStore;

/// Found in review of issue 35, item 3: the items of one batch all began
/// at once, so a batch of 1,000 GetBadgeCounts of 1,000 users each (20 MB
/// of answers) went past the stream's bounds in one step. Items begin only
/// while there is room; the rest wait, held, and begin as answers go out.
#[tokio::test]
async fn a_batch_of_heavy_items_begins_only_as_far_as_there_is_room() {
    let cache = Cache::new(CacheConfig::default(), Arc::new(MemoryStore::new()));
    let config = ServiceConfig::from(&Config::default());
    let service = ReadStatesService::new(cache, config, tokio_util::sync::CancellationToken::new());
    let mut items = Items::new(&service, Hop::First);
    let counts = GetBadgeCountsRequest {
        user_ids: (1..=1_000).collect(),
    };
    let heavy = |id| ApplyItem {
        id,
        change: Some(Change::GetBadgeCounts(counts.clone())),
        ..ApplyItem::default()
    };
    // Loaded (and cached) by a first item, so the others are done at once.
    items
        .read(
            Instant::now(),
            ApplyRequest {
                items: vec![heavy(0)],
                timeout_ms: 0,
            },
        )
        .unwrap();
    while let Some(done) = items.waiting.next().await {
        items.done(done);
    }
    let batch = ApplyRequest {
        items: (1..=1_000).map(heavy).collect(),
        timeout_ms: 0,
    };
    items.read(Instant::now(), batch).unwrap();
    let begun = 1_001 - items.held.len();
    assert!(items.held.len() > 500, "{begun} begun at once");
    assert!(items.answered_bytes < MAX_ANSWERED_BYTES + 32 * 1024);
    // As answers go out, the rest begin, each answered once.
    let mut answered = std::collections::HashSet::new();
    while !items.is_empty() {
        // As the stream's confirmation would (see `serve`).
        items.confirm(items.answered.len() - items.confirmed, None);
        let response = items.take_answered().into_inner();
        for result in response.results {
            assert!(answered.insert(result.id), "{} answered twice", result.id);
        }
        if items.may_resume() {
            items.resume();
        }
    }
    assert_eq!(answered.len(), 1_001);
}
