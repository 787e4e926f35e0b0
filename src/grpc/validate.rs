//! Checks of request fields, each naming the field and the limit it broke.
//! Field names are `Display` values (often `format_args!`), formatted only
//! when a check fails: valid requests allocate nothing here.

use std::fmt::Display;

use readstates_routing::{SLOTS, Slot};

use crate::error::Error;
use crate::read_state::{Key, Kind};

pub const MAX_CHANNEL_IDS: usize = 1_000;
pub const MAX_BULK_ACK_ENTRIES: usize = 100;
pub const MAX_MESSAGE_USERS: usize = 10_000;
pub const MAX_DELETE_KEYS: usize = 1_000;
pub const MAX_BADGE_USERS: usize = 1_000;
pub const MAX_WATCHED_USERS_PER_STREAM: usize = 100_000;
pub const MAX_APPLY_ITEMS: usize = 1_000;

/// A snowflake id, which is never 0.
pub fn id(field: impl Display, value: u64) -> Result<u64, Error> {
    if value == 0 {
        return Err(Error::invalid(field.to_string(), "must not be 0"));
    }
    Ok(value)
}

pub fn kind(field: impl Display, value: i32) -> Result<Kind, Error> {
    u8::try_from(value)
        .ok()
        .and_then(Kind::from_u8)
        .ok_or_else(|| {
            Error::invalid(
                field.to_string(),
                format!("unknown read state kind {value}"),
            )
        })
}

/// A `{channel_id, kind}` pair named `field`.
pub fn key(field: impl Display, channel_id: u64, kind: i32) -> Result<Key, Error> {
    Ok(Key {
        channel_id: id(format_args!("{field}.channel_id"), channel_id)?,
        kind: self::kind(format_args!("{field}.kind"), kind)?,
    })
}

pub fn at_most(field: impl Display, len: usize, limit: usize) -> Result<(), Error> {
    if len > limit {
        return Err(Error::invalid(
            field.to_string(),
            format!("{len} items, at most {limit} allowed"),
        ));
    }
    Ok(())
}

/// Every id in `values` is non-zero; errors name the index.
pub fn ids(field: impl Display, values: &[u64]) -> Result<(), Error> {
    match values.iter().position(|&v| v == 0) {
        Some(i) => Err(Error::invalid(format!("{field}[{i}]"), "must not be 0")),
        None => Ok(()),
    }
}

/// Slot numbers from the wire, each below [`SLOTS`].
pub fn slots(field: impl Display, values: &[u32]) -> Result<Vec<Slot>, Error> {
    values
        .iter()
        .map(|&slot| {
            Slot::try_from(slot)
                .ok()
                .filter(|&s| usize::from(s) < SLOTS)
                .ok_or_else(|| {
                    Error::invalid(field.to_string(), format!("{slot} is not below {SLOTS}"))
                })
        })
        .collect()
}
