//! What timing a request costs (issue 56: at most 100 ns more a request):
//! a request's scope with the phases a cached ack goes through (one
//! `durable` wait measured, nothing slow), against the same request
//! untimed. Both poll an already-ready future on a current-thread runtime,
//! so the difference is the timing alone.
//!
//! cargo bench --bench timing

use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use readstates::test_support::bench_runtime;
use readstates::timing::{self, Phase};

async fn request() -> u64 {
    std::hint::black_box(7)
}

async fn timed_request() -> u64 {
    timing::measure(Phase::Durable, request()).await
}

fn bench(c: &mut Criterion) {
    let rt = bench_runtime();
    let mut group = c.benchmark_group("timing");
    group.measurement_time(Duration::from_secs(3));
    group.bench_function("untimed", |b| b.iter(|| rt.block_on(request())));
    group.bench_function("timed", |b| {
        b.iter(|| rt.block_on(timing::scope(timed_request())))
    });
    group.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
