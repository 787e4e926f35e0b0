//! Settings that cannot work together, refused at start with the reason.

use std::time::Duration;

use super::{Config, ConfigError, Consistency, MAX_WRITE_DELAY, StoreKind};
use crate::cluster::credential::MIN_SECRET_BYTES;

impl Config {
    /// Refuses settings that cannot work, saying why.
    pub fn check(&self) -> Result<(), ConfigError> {
        let refuse = |why: &str| Err(ConfigError(why.to_owned()));
        if matches!(self.consistency, Consistency::One | Consistency::LocalOne) {
            return refuse(
                "consistency ONE and LOCAL_ONE are refused: a user loaded again after a clean \
                 eviction could be read from a replica that missed its last write, and served \
                 (and written back) without it; use LOCAL_QUORUM, QUORUM, EACH_QUORUM or ALL",
            );
        }
        let positive = [
            ("cache_capacity", self.cache_capacity),
            ("shards", self.shards),
            ("write_concurrency", self.write_concurrency),
            ("max_evicted_unwritten", self.max_evicted_unwritten),
            ("max_concurrent_requests", self.max_concurrent_requests),
            ("deletion_dedup_capacity", self.deletion_dedup_capacity),
            ("watch_buffer", self.watch_buffer),
            ("max_apply_streams", self.max_apply_streams),
        ];
        for (name, value) in positive {
            if value == 0 {
                return refuse(&format!(
                    "{name} must be at least 1: with 0 no request could ever be served"
                ));
            }
        }
        if self.write_delay > MAX_WRITE_DELAY {
            return refuse(&format!(
                "write_delay must be at most {}: every change would wait that long for its write",
                humantime::format_duration(MAX_WRITE_DELAY)
            ));
        }
        if self.node_id.is_some() {
            if self.store != StoreKind::Cassandra {
                return refuse(
                    "node_id needs store = cassandra: the embedded and memory stores are one \
                     node's own, and the ring lives in Cassandra",
                );
            }
            match &self.advertise {
                None => {
                    return refuse(
                        "node_id needs advertise: the host:port other nodes reach this one at",
                    );
                }
                Some(address) if !readstates_routing::address::is_valid(address) => {
                    return refuse(&format!(
                        "advertise {address:?} is not host:port (a DNS name, an IPv4 address or \
                         [an IPv6 address], and a port from 1 to 65535)"
                    ));
                }
                Some(_) => {}
            }
            if self.ring_poll.is_zero() {
                return refuse("ring_poll must be above 0");
            }
            if self.lease < Duration::from_millis(100) || self.lease_margin.is_zero() {
                return refuse("lease must be at least 100ms, and lease_margin above 0");
            }
            match &self.fleet_secret {
                None => {
                    return refuse(
                        "node_id needs fleet_secret: the secret the fleet's nodes share, without \
                         which anyone who reaches the gRPC port could speak as a node",
                    );
                }
                Some(secret) if secret.expose().len() < MIN_SECRET_BYTES => {
                    return refuse(&format!(
                        "fleet_secret must be at least {MIN_SECRET_BYTES} bytes (a random one)"
                    ));
                }
                Some(_) => {}
            }
        } else if self.join_weight.is_some() || !self.drain_timeout.is_zero() {
            return refuse(
                "join_weight and drain_timeout need node_id: only a node of a fleet has a ring                  to join or drain",
            );
        }
        match (&self.tls_cert, &self.tls_key) {
            (Some(_), None) | (None, Some(_)) => {
                return refuse("tls_cert and tls_key go together: a certificate and its key");
            }
            (None, None) if self.tls_client_ca.is_some() => {
                return refuse("tls_client_ca needs tls_cert and tls_key: mTLS is TLS first");
            }
            (Some(_), Some(_)) => {
                if self.node_id.is_some() && self.tls_client_ca.is_none() {
                    return refuse(
                        "a fleet node over TLS needs tls_client_ca: nodes call each other over \
                         mTLS, verified against it",
                    );
                }
                if self.tls_handshake_timeout.is_zero() || self.tls_poll.is_zero() {
                    return refuse("tls_handshake_timeout and tls_poll must be above 0");
                }
            }
            (None, None) => {}
        }
        if self.shutdown_timeout.is_zero() {
            return refuse(
                "shutdown_timeout must be above 0: shutdown would give up on every unwritten change",
            );
        }
        Ok(())
    }
}
