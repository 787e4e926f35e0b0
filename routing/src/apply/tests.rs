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

/// Issue 35, item 13: a forward cut by the owner's death reached the
/// client as CANCELLED "safe to send again" with the headers every answer
/// of a node carries, and the client retried CANCELLED only with none.
/// What a node marks safe to send again is retried, through an Apply
/// item's error too; a node's other CANCELLED is not.
#[test]
fn what_a_node_marks_safe_to_send_again_is_retried() {
    let mut headers = MetadataMap::new();
    headers.insert("date", "Thu, 26 Nov 2026 15:03:03 GMT".parse().unwrap());
    headers.insert("content-type", "application/grpc".parse().unwrap());
    let with_headers = |status: Status| {
        let mut metadata = headers.clone();
        for (key, value) in status.metadata().iter().filter_map(|kv| match kv {
            tonic::metadata::KeyAndValueRef::Ascii(key, value) => Some((key, value)),
            tonic::metadata::KeyAndValueRef::Binary(..) => None,
        }) {
            metadata.insert(key.clone(), value.clone());
        }
        Status::with_metadata(status.code(), status.message(), metadata)
    };
    let cut = with_headers(unanswered());
    assert_eq!(cut.code(), Code::Cancelled);
    assert!(crate::client::not_applied(&cut), "{cut:?}");
    let deadline = with_headers(Status::cancelled("the node's deadline passed"));
    assert!(!crate::client::not_applied(&deadline), "{deadline:?}");
    // As an Apply item's error, and back.
    let item = ApplyError {
        code: Code::Cancelled as i32,
        message: cut.message().to_owned(),
        safe_to_retry: true,
        ..ApplyError::default()
    };
    assert!(crate::client::not_applied(&status(item)));
}
