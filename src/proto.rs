//! The `readstates.v1` API: generated in `readstates-routing` (which gateways
//! use too), so that the service and its clients share one definition.

pub use readstates_routing::proto::*;
