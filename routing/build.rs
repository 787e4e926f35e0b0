//! Compiles the repository's `proto/` with protox (pure Rust, no system
//! `protoc`), generates the tonic client and server, and saves the
//! descriptor set that server reflection serves.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=../proto");
    let descriptors = protox::compile(["readstates/v1/readstates.proto"], ["../proto"])?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("readstates_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        // prost's, refusing an oversized Apply batch before decoding it.
        .codec_path("crate::codec::CheckedCodec")
        .compile_fds(descriptors)?;
    Ok(())
}
