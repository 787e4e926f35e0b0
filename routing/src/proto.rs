//! The generated `readstates.v1` protobuf types, server and client, and the
//! descriptor set that server reflection serves.

#![allow(missing_debug_implementations, clippy::all, clippy::pedantic)]

tonic::include_proto!("readstates.v1");

/// Encoded `FileDescriptorSet` of `proto/readstates/v1/readstates.proto`.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/readstates_descriptor.bin"));
