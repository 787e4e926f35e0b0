//! A node's address, as the ring keeps it and as gateways and other nodes
//! dial it: `host:port`, the host a DNS name, an IPv4 literal or an IPv6
//! literal in brackets. Anything else (a URL, a space, a missing port) would
//! be accepted by the ring and then fail every request for the node's users,
//! so it is refused where an address enters: `ring add` and
//! `serve --advertise`.

use std::net::{Ipv4Addr, Ipv6Addr};

/// The longest DNS name (RFC 1035, without the trailing dot).
const MAX_HOST_LEN: usize = 253;
/// The longest label of a DNS name.
const MAX_LABEL_LEN: usize = 63;

/// Whether `address` is `host:port` as described in the module doc, with a
/// port from 1 to 65535.
pub fn is_valid(address: &str) -> bool {
    let Some((host, port)) = address.rsplit_once(':') else {
        return false;
    };
    let port_ok = !port.is_empty()
        && port.bytes().all(|b| b.is_ascii_digit())
        && port.parse::<u16>().is_ok_and(|p| p != 0);
    port_ok && is_host(host)
}

fn is_host(host: &str) -> bool {
    if let Some(literal) = host.strip_prefix('[') {
        return literal
            .strip_suffix(']')
            .is_some_and(|ip| ip.parse::<Ipv6Addr>().is_ok());
    }
    // All-numeric labels read as an IPv4 literal, so they must be one
    // (`256.1.1.1` is neither a name nor an address).
    if host.bytes().all(|b| b.is_ascii_digit() || b == b'.') {
        return host.parse::<Ipv4Addr>().is_ok();
    }
    host.len() <= MAX_HOST_LEN && host.split('.').all(is_label)
}

/// A DNS label: letters, digits and inner hyphens (RFC 1123).
fn is_label(label: &str) -> bool {
    !label.is_empty()
        && label.len() <= MAX_LABEL_LEN
        && !label.starts_with('-')
        && !label.ends_with('-')
        && label
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-')
}
