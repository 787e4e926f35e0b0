//! How the nodes of a fleet prove to each other that they are: every call a
//! node makes on another (the `Fleet` service, forwarded and passed-on
//! requests, the Apply streams that carry them, relayed Watch streams)
//! carries a token derived from the fleet's shared secret
//! (`--fleet-secret`), and a node honours a node-only call or marker only
//! with it (see [`crate::grpc::node_calls`]).
//!
//! The token (`x-readstates-node-token`) is an HMAC-SHA256 under the
//! secret of the fleet's name (its keyspace), the sending node's id and
//! an expiry a few minutes ahead, so the secret never travels and a token
//! proves more than membership: which fleet (fleets that share a secret do
//! not take each other's calls), which node (a call that names its sender,
//! a `Mirror` start or a `HandOver`, must name the token's node), and when
//! (a token seen on a plaintext port works for minutes, not until the
//! secret is rotated). It is checked in constant time. Over TLS it travels
//! encrypted; in plaintext, the gRPC port must be reachable only from the
//! fleet and its gateways (a Kubernetes NetworkPolicy, `deploy/k8s/`).
//!
//! Builds before this one sent a static token (an HMAC of a fixed label,
//! `x-readstates-fleet-token`): only while upgrading (`--fleet-auth
//! upgrading`) does a node send that one too and take it.

use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use ring::hmac;
use tonic::metadata::{AsciiMetadataValue, MetadataMap};

use crate::clock::MAX_AHEAD;

/// The metadata key of a node's token.
pub const TOKEN: &str = "x-readstates-node-token";

/// The metadata key of the static token of the builds before
/// ([`TOKEN`]'s), sent and taken only while upgrading.
pub const STATIC_TOKEN: &str = "x-readstates-fleet-token";

/// The shortest secret taken: 128 bits of a random one.
pub const MIN_SECRET_BYTES: usize = 16;

/// How long a token is good for; a node makes a new one once half of it
/// has passed, so a call never carries one about to expire.
pub const LIFETIME: Duration = Duration::from_secs(300);

/// What the static token signs.
const STATIC_LABEL: &[u8] = b"readstates fleet node v1";

/// The fleet's secret, as this node shows and checks it.
pub struct FleetCredential {
    key: hmac::Key,
    /// The fleet's name (its keyspace), signed into every token.
    fleet: String,
    /// This node's id, signed into the tokens it sends.
    node: String,
    /// Also send and take the static token of the builds before.
    upgrading: bool,
    static_token: AsciiMetadataValue,
    /// The token this node sends, and when it expires (Unix seconds).
    current: Mutex<(u64, Option<AsciiMetadataValue>)>,
}

impl Clone for FleetCredential {
    fn clone(&self) -> FleetCredential {
        FleetCredential {
            key: self.key.clone(),
            fleet: self.fleet.clone(),
            node: self.node.clone(),
            upgrading: self.upgrading,
            static_token: self.static_token.clone(),
            current: Mutex::new(self.lock().clone()),
        }
    }
}

impl std::fmt::Debug for FleetCredential {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "FleetCredential({} of {}, <redacted>)",
            self.node, self.fleet
        )
    }
}

/// Why a node-only call was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Refusal {
    /// It carried no token.
    Missing,
    /// It carried a token that is not the fleet's (another secret or
    /// fleet, or not a token at all).
    Wrong,
    /// Its token expired, or expires further ahead than any node makes.
    Expired,
    /// It carried only the static token of the builds before, which this
    /// node takes only while upgrading.
    Static,
    /// This node has no secret (a standalone node): no call is a node's.
    NoFleet,
}

impl Refusal {
    /// The `reason` label of the refusal's metric.
    pub fn name(self) -> &'static str {
        match self {
            Refusal::Missing => "missing",
            Refusal::Wrong => "wrong",
            Refusal::Expired => "expired",
            Refusal::Static => "static",
            Refusal::NoFleet => "no_fleet",
        }
    }
}

/// Who a call's token says made it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Speaker {
    /// The node the token names.
    Node(String),
    /// A node of a build before, by the static token (while upgrading).
    Unnamed,
}

impl Speaker {
    /// Whether this speaker may say it is `node`: the token's node, or any
    /// node for the static token (it names none).
    pub fn may_be(&self, node: &str) -> bool {
        match self {
            Speaker::Node(named) => named == node,
            Speaker::Unnamed => true,
        }
    }
}

impl FleetCredential {
    /// The credential of `node` in `fleet` (its keyspace) under `secret`.
    pub fn new(secret: &str, fleet: &str, node: &str) -> FleetCredential {
        let key = hmac::Key::new(hmac::HMAC_SHA256, secret.as_bytes());
        let static_token = hex(hmac::sign(&key, STATIC_LABEL).as_ref())
            .parse()
            .expect("hex digits are ASCII metadata");
        FleetCredential {
            key,
            fleet: fleet.to_owned(),
            node: node.to_owned(),
            upgrading: false,
            static_token,
            current: Mutex::new((0, None)),
        }
    }

    /// Also sends and takes the static token of the builds before
    /// (`--fleet-auth upgrading`).
    pub fn upgrading(mut self, upgrading: bool) -> FleetCredential {
        self.upgrading = upgrading;
        self
    }

    /// Adds this node's token to a call it makes on another node.
    pub fn stamp(&self, metadata: &mut MetadataMap) {
        let now = unix_now();
        let token = {
            let mut current = self.lock();
            if current.0 < now + LIFETIME.as_secs() / 2 {
                let expires = now + LIFETIME.as_secs();
                // A node id that is no ASCII metadata sends none, and its
                // calls are refused as such (ring ids are ASCII).
                let token = self.token(&self.node, expires).parse().ok();
                *current = (expires, token);
            }
            current.1.clone()
        };
        if let Some(token) = token {
            metadata.insert(TOKEN, token);
        }
        if self.upgrading {
            metadata.insert(STATIC_TOKEN, self.static_token.clone());
        }
    }

    /// Who `metadata`'s token says made the call, if it is this fleet's and
    /// current.
    pub fn verify(&self, metadata: &MetadataMap) -> Result<Speaker, Refusal> {
        let Some(token) = metadata.get(TOKEN) else {
            return match metadata.get(STATIC_TOKEN) {
                None => Err(Refusal::Missing),
                Some(_) if !self.upgrading => Err(Refusal::Static),
                Some(token) => {
                    let tag = unhex(token.as_bytes()).ok_or(Refusal::Wrong)?;
                    hmac::verify(&self.key, STATIC_LABEL, &tag).map_err(|_| Refusal::Wrong)?;
                    Ok(Speaker::Unnamed)
                }
            };
        };
        let token = token.to_str().map_err(|_| Refusal::Wrong)?;
        let mut parts = token.splitn(4, '.');
        let (Some("v2"), Some(expires), Some(tag), Some(node)) =
            (parts.next(), parts.next(), parts.next(), parts.next())
        else {
            return Err(Refusal::Wrong);
        };
        let expires: u64 = expires.parse().map_err(|_| Refusal::Wrong)?;
        let tag = unhex(tag.as_bytes()).ok_or(Refusal::Wrong)?;
        let signed = self.signed(node, expires);
        hmac::verify(&self.key, signed.as_bytes(), &tag).map_err(|_| Refusal::Wrong)?;
        // Clocks differ by up to the fleet's skew, either way.
        let now = unix_now();
        let skew = MAX_AHEAD.as_secs();
        if expires + skew < now || expires > now + LIFETIME.as_secs() + skew {
            return Err(Refusal::Expired);
        }
        Ok(Speaker::Node(node.to_owned()))
    }

    /// `node`'s token expiring at `expires`: `v2.<expires>.<tag>.<node>`
    /// (the node last: an id may hold dots).
    fn token(&self, node: &str, expires: u64) -> String {
        let tag = hmac::sign(&self.key, self.signed(node, expires).as_bytes());
        format!("v2.{expires}.{}.{node}", hex(tag.as_ref()))
    }

    fn signed(&self, node: &str, expires: u64) -> String {
        format!(
            "readstates fleet node v2\n{}\n{node}\n{expires}",
            self.fleet
        )
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (u64, Option<AsciiMetadataValue>)> {
        self.current.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn unix_now() -> u64 {
    (SystemTime::now().duration_since(UNIX_EPOCH)).map_or(0, |since| since.as_secs())
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
mod tests;
