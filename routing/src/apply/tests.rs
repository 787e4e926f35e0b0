//! The stream to one node, on its own: how it answers the changes of its
//! callers when it ends.

use super::*;
use crate::proto::AckRequest;

/// A caller that has room in the queue when the stream ends, and sends
/// its change after the stream answered what was queued (`apply` does
/// both on one thread while the stream ends on another), is answered: not
/// left waiting on a queue nobody reads, which its own `Applier` keeps
/// alive. Found by the fleet's crash test, where forwards to a killed node
/// raced the streams that failed to open to it.
#[tokio::test(flavor = "current_thread")]
async fn a_change_sent_as_the_stream_ends_is_answered() {
    let (queue, queued) = mpsc::channel(4);
    let state = Arc::new(AtomicU8::new(OPENING));
    let applier = Applier {
        queue,
        state: state.clone(),
    };
    let room = applier.queue.reserve().await.expect("room");
    let stream = Stream {
        queued,
        batch: 1,
        state,
    };
    let ending = tokio::spawn(stream.end(ENDED, not_sent()));
    tokio::task::yield_now().await;
    // It answered what was queued, and waits for what has room.
    assert!(!ending.is_finished());
    let (answer, answered) = oneshot::channel();
    room.send(Queued {
        change: Change::Ack(AckRequest::default()),
        until: None,
        answer,
    });
    let status = tokio::time::timeout(Duration::from_secs(5), answered)
        .await
        .expect("the change is answered")
        .expect("by the stream")
        .unwrap_err();
    assert_eq!(status.code(), Code::Unavailable, "{status:?}");
    ending.await.unwrap();
    assert!(applier.is_ended());
}
