//! The workload, as data: who the users are, how keys are drawn, which
//! operations in what proportion, and how hard to push. Read from a TOML file
//! (see `loadtest/workloads/*.toml`, every key commented).

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use serde::{Deserialize, Serialize};

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Workload {
    pub keyspace: Keyspace,
    pub mix: Mix,
    #[serde(default)]
    pub message_created: MessageCreatedShape,
    #[serde(default)]
    pub bulk_ack: BulkAckShape,
    #[serde(default)]
    pub badge_counts: BadgeCountsShape,
    pub load: Load,
}

/// Users live in guilds of `guild_size`; every member of a guild has a read
/// state in each of its `channels_per_user` channels, and messages in a
/// channel reach that guild's members.
#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Keyspace {
    pub users: u64,
    pub channels_per_user: u64,
    pub guild_size: u64,
    #[serde(default)]
    pub distribution: Distribution,
}

#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(tag = "kind", rename_all = "lowercase", deny_unknown_fields)]
pub enum Distribution {
    #[default]
    Uniform,
    /// Rank r is drawn with probability proportional to 1 / r^exponent.
    Zipf { exponent: f64 },
}

/// Relative weights of the operations.
#[derive(Clone, Debug, Default, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Mix {
    #[serde(default)]
    pub get_read_states: u32,
    #[serde(default)]
    pub ack: u32,
    #[serde(default)]
    pub bulk_ack: u32,
    #[serde(default)]
    pub message_created: u32,
    #[serde(default)]
    pub get_badge_counts: u32,
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct MessageCreatedShape {
    /// Guild members mentioned (mention and unread counts rise).
    pub mentions: u64,
    /// Further guild members whose unread count rises.
    pub unread_recipients: u64,
}

impl Default for MessageCreatedShape {
    fn default() -> Self {
        MessageCreatedShape {
            mentions: 1,
            unread_recipients: 10,
        }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BulkAckShape {
    pub entries: u64,
}

impl Default for BulkAckShape {
    fn default() -> Self {
        BulkAckShape { entries: 10 }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct BadgeCountsShape {
    pub users: u64,
}

impl Default for BadgeCountsShape {
    fn default() -> Self {
        BadgeCountsShape { users: 20 }
    }
}

#[derive(Clone, Debug, Deserialize, Serialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct Load {
    /// Connections to the target; requests are spread over them.
    pub connections: usize,
    /// Closed loop: requests in flight (one worker each).
    pub concurrency: usize,
    /// Open loop: the most requests in flight; beyond it new ones are
    /// dropped and counted as errors (so a stalled target cannot make this
    /// tool grow without bound).
    #[serde(default = "default_max_in_flight")]
    pub max_in_flight: usize,
    /// Open loop: requests per second. 0: closed loop.
    #[serde(default)]
    pub rate: u64,
    #[serde(with = "humantime_serde")]
    pub duration: Duration,
    /// Run this long before measuring.
    #[serde(default, with = "humantime_serde")]
    pub warmup: Duration,
    /// Before measuring, give every user a read state in each of its channels.
    #[serde(default)]
    pub preload: bool,
}

fn default_max_in_flight() -> usize {
    10_000
}

impl Workload {
    pub fn from_file(path: &Path) -> anyhow::Result<Workload> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
        let workload: Workload =
            toml::from_str(&text).with_context(|| format!("parse {}", path.display()))?;
        workload
            .validate()
            .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        Ok(workload)
    }

    pub fn validate(&self) -> Result<(), String> {
        let k = &self.keyspace;
        if k.users == 0 || k.channels_per_user == 0 || k.guild_size == 0 {
            return Err("keyspace: users, channels_per_user and guild_size must be above 0".into());
        }
        if let Distribution::Zipf { exponent } = k.distribution
            && !(exponent > 0.0 && exponent.is_finite())
        {
            return Err(format!(
                "keyspace.distribution: zipf exponent {exponent} must be above 0"
            ));
        }
        let m = &self.mix;
        if m.get_read_states + m.ack + m.bulk_ack + m.message_created + m.get_badge_counts == 0 {
            return Err("mix: every weight is 0".into());
        }
        if self.bulk_ack.entries == 0 || self.bulk_ack.entries > 100 {
            return Err("bulk_ack.entries: 1 to 100".into());
        }
        if self.badge_counts.users == 0 || self.badge_counts.users > 1_000 {
            return Err("badge_counts.users: 1 to 1000".into());
        }
        if self.load.connections == 0 || self.load.concurrency == 0 || self.load.max_in_flight == 0
        {
            return Err("load: connections, concurrency and max_in_flight must be above 0".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_sample_workload_parses_and_is_valid() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads");
        let mut seen = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "toml") {
                Workload::from_file(&path).unwrap();
                seen += 1;
            }
        }
        assert!(seen >= 2, "sample workloads");
    }

    #[test]
    fn nonsense_is_refused() {
        let text = std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("workloads/mixed.toml"),
        )
        .unwrap();
        let mut workload: Workload = toml::from_str(&text).unwrap();
        workload.keyspace.distribution = Distribution::Zipf { exponent: 0.0 };
        assert!(workload.validate().is_err());
        assert!(toml::from_str::<Workload>(&text.replace("[mix]", "[mixx]")).is_err());
    }
}
