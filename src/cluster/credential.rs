//! How the nodes of a fleet prove to each other that they are: every call a
//! node makes on another (the `Fleet` service, forwarded and passed-on
//! requests, the Apply streams that carry them, relayed Watch streams)
//! carries a token derived from the fleet's shared secret
//! (`--fleet-secret`), and a node honours a node-only call or marker only
//! with it (see [`crate::grpc::node_calls`]).
//!
//! The token is an HMAC-SHA256 of a fixed label under the secret, so the
//! secret itself never travels, and it is checked in constant time. It
//! proves membership, not which member: every node holds the secret, and
//! what a node says of itself (a `HandOver`'s sender, say) is then checked
//! against the ring. Over TLS it travels encrypted; in plaintext, the
//! gRPC port must be reachable only from the fleet and its gateways (a
//! Kubernetes NetworkPolicy, `deploy/k8s/`).

use ring::hmac;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};

/// The metadata key of the token.
pub const TOKEN: &str = "x-readstates-fleet-token";

/// The shortest secret taken: 128 bits of a random one.
pub const MIN_SECRET_BYTES: usize = 16;

/// What the token signs: a version, so that a future scheme is told apart.
const LABEL: &[u8] = b"readstates fleet node v1";

/// The fleet's secret, as this node shows and checks it.
#[derive(Clone)]
pub struct FleetCredential {
    key: hmac::Key,
    token: AsciiMetadataValue,
}

impl std::fmt::Debug for FleetCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("FleetCredential(<redacted>)")
    }
}

/// Why a node-only call was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It carried no token.
    Missing,
    /// It carried a token that is not the fleet's.
    Wrong,
    /// This node has no secret (a standalone node): no call is a node's.
    NoFleet,
}

impl Refusal {
    /// The `reason` label of the refusal's metric.
    pub fn name(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Wrong => "wrong",
            Refusal::NoFleet => "no_fleet",
        }
    }
}

impl FleetCredential {
    pub fn new(secret: &str) -> FleetCredential {
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes());
        let tag = hmac::sign(&key, LABEL);
        let token = hex(tag.as_ref())
            .parse()
            .expect("hex digits are ASCII metadata");
        FleetCredential { key, token }
    }

    /// Adds this node's token to a call it makes on another node.
    pub fn stamp(&self, metadata: &mut MetadataMap) {
        metadata.insert(TOKEN, self.token.clone());
    }

    /// Whether `metadata` carries the fleet's token.
    pub fn verify(&self, metadata: &MetadataMap) -> Result<(), Refusal> {
        let token = metadata.get(TOKEN).ok_or(Refusal::Missing)?;
        let tag = unhex(token.as_bytes()).ok_or(Refusal::Wrong)?;
        hmac::verify(&self.key, LABEL, &tag).map_err(|_| Refusal::Wrong)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(text: &[u8]) -> Option<Vec<u8>> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let digit = |c: u8| (c as char).to_digit(16);
    text.chunks(2)
        .map(|pair| Some((digit(pair[0])? * 16 + digit(pair[1])?) as u8))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_secret_s_token_is_taken() {
        let ours = FleetCredential::new("the fleet's secret, long enough");
        let theirs = FleetCredential::new("another fleet's secret, long too");
        let mut metadata = MetadataMap::new();
        assert_eq!(ours.verify(&metadata), Err(Refusal::Missing));
        ours.stamp(&mut metadata);
        assert_eq!(ours.verify(&metadata), Ok(()));
        assert_eq!(theirs.verify(&metadata), Err(Refusal::Wrong));
        for forged in ["", "zz", "abc", "00"] {
            metadata.insert(TOKEN, forged.parse().unwrap());
            assert_eq!(ours.verify(&metadata), Err(Refusal::Wrong), "{forged:?}");
        }
    }

    #[test]
    fn the_secret_does_not_travel_and_is_not_printed() {
        let secret = "hunter2hunter2hunter2";
        let credential = FleetCredential::new(secret);
        let mut metadata = MetadataMap::new();
        credential.stamp(&mut metadata);
        let token = metadata.get(TOKEN).unwrap().to_str().unwrap();
        assert_eq!(token.len(), 64);
        assert!(!token.contains(secret));
        assert!(!format!("{credential:?}").contains(secret));
    }
}
