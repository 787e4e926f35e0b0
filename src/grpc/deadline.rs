//! The client's deadline (`grpc-timeout`), enforced by the handler itself so
//! that it ends in DEADLINE_EXCEEDED: tonic's own timeout answers CANCELLED,
//! which tells a client nothing about why. Every change is all or nothing and
//! its apply has no `.await`, so a handler cut at its deadline has applied
//! all of it or none.

use std::time::Duration;

use tonic::metadata::MetadataMap;

/// Ends the handler this much before tonic's own timer (started a little
/// earlier, for the same deadline), so the handler's answer comes first.
const AHEAD_OF_TONIC: Duration = Duration::from_millis(2);

/// How long the handler may take: the request's `grpc-timeout`, less the
/// head start over tonic's timer. `None` when the client set no deadline.
pub fn budget(metadata: &MetadataMap) -> Option<Duration> {
    let value = metadata.get("grpc-timeout")?.to_str().ok()?;
    parse(value).map(|timeout| timeout.saturating_sub(AHEAD_OF_TONIC))
}

/// `grpc-timeout` is at most 8 digits and a unit: H, M, S, m, u or n.
fn parse(value: &str) -> Option<Duration> {
    let (digits, unit) = value.split_at(value.len().checked_sub(1)?);
    if digits.is_empty() || digits.len() > 8 {
        return None;
    }
    let amount: u64 = digits.parse().ok()?;
    Some(match unit {
        "H" => Duration::from_secs(amount * 3600),
        "M" => Duration::from_secs(amount * 60),
        "S" => Duration::from_secs(amount),
        "m" => Duration::from_millis(amount),
        "u" => Duration::from_micros(amount),
        "n" => Duration::from_nanos(amount),
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_every_unit_and_refuses_the_malformed() {
        assert_eq!(parse("2H"), Some(Duration::from_secs(7200)));
        assert_eq!(parse("3M"), Some(Duration::from_secs(180)));
        assert_eq!(parse("1S"), Some(Duration::from_secs(1)));
        assert_eq!(parse("250m"), Some(Duration::from_millis(250)));
        assert_eq!(parse("99999999u"), Some(Duration::from_micros(99_999_999)));
        assert_eq!(parse("5n"), Some(Duration::from_nanos(5)));
        for bad in ["", "S", "123456789S", "10x", "-1S", "1.5S"] {
            assert_eq!(parse(bad), None, "{bad:?}");
        }
    }
}
