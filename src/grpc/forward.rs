//! How a request goes to the node that serves its user: as an item of the
//! one Apply stream this node keeps to that node (see
//! [`GrpcPeers::applier`](crate::cluster::peers::GrpcPeers::applier)), so
//! that a forward costs a stream item, not a unary call; as its unary call
//! for GetReadStates and SetChannelCounting (no item carries them; the
//! latter goes to the channel's owner) and to a node that has no Apply
//! (an older build, during an upgrade).

use std::future::Future;

use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::proto::apply_item::Change;
use crate::proto::apply_result::Outcome;
use crate::proto::read_states_client::ReadStatesClient;
use crate::proto::*;

/// A request that may be sent to another node.
pub trait Forward: Clone + Send + Sized + 'static {
    type Response: Send + 'static;
    /// Whether an Apply item carries this kind of request.
    const ITEM: bool;
    /// The item's change; the request back if no item carries it.
    fn item(self) -> Result<Change, Self>;
    /// The response an item's outcome carries, if of this kind.
    fn response(outcome: Outcome) -> Option<Self::Response>;
    /// The unary call.
    fn call(
        client: ReadStatesClient<Channel>,
        request: Request<Self>,
    ) -> impl Future<Output = Result<Response<Self::Response>, Status>> + Send;
}

/// [`Forward`] for a request an item carries as `Change::$kind`.
macro_rules! item {
    ($request:ty, $response:ty, $kind:ident, $call:ident) => {
        impl Forward for $request {
            type Response = $response;
            const ITEM: bool = true;

            fn item(self) -> Result<Change, Self> {
                Ok(Change::$kind(self))
            }

            fn response(outcome: Outcome) -> Option<$response> {
                match outcome {
                    Outcome::$kind(response) => Some(response),
                    _ => None,
                }
            }

            async fn call(
                mut client: ReadStatesClient<Channel>,
                request: Request<Self>,
            ) -> Result<Response<$response>, Status> {
                client.$call(request).await
            }
        }
    };
}

item!(AckRequest, AckResponse, Ack, ack);
item!(BulkAckRequest, BulkAckResponse, BulkAck, bulk_ack);
item!(AckAllRequest, AckAllResponse, AckAll, ack_all);
item!(SetMutedRequest, SetMutedResponse, SetMuted, set_muted);
item!(
    DeleteReadStatesRequest,
    DeleteReadStatesResponse,
    DeleteReadStates,
    delete_read_states
);
item!(
    MessageCreatedRequest,
    MessageCreatedResponse,
    MessageCreated,
    message_created
);
item!(
    MessageDeletedRequest,
    MessageDeletedResponse,
    MessageDeleted,
    message_deleted
);
item!(
    GetBadgeCountsRequest,
    GetBadgeCountsResponse,
    GetBadgeCounts,
    get_badge_counts
);

/// [`Forward`] for a request no item carries: sent as its unary call.
macro_rules! unary {
    ($request:ty, $response:ty, $call:ident) => {
        impl Forward for $request {
            type Response = $response;
            const ITEM: bool = false;

            fn item(self) -> Result<Change, Self> {
                Err(self)
            }

            fn response(_: Outcome) -> Option<$response> {
                None
            }

            async fn call(
                mut client: ReadStatesClient<Channel>,
                request: Request<Self>,
            ) -> Result<Response<$response>, Status> {
                client.$call(request).await
            }
        }
    };
}

unary!(GetReadStatesRequest, GetReadStatesResponse, get_read_states);
unary!(FollowThreadRequest, FollowThreadResponse, follow_thread);
// To the channel's owner, which alone switches it.
unary!(
    SetChannelCountingRequest,
    SetChannelCountingResponse,
    set_channel_counting
);
