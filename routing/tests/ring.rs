//! Properties of the ring's weighted rendezvous assignment: weight changes
//! and removals move only what they must, and shares follow the weights.

use proptest::prelude::*;
use readstates_routing::ring::NO_OWNER;
use readstates_routing::{Node, Ring, RingError, SLOTS};

fn node(id: &str, weight: u32) -> Node {
    Node {
        id: id.to_owned(),
        address: format!("{id}:50051"),
        weight,
    }
}

fn ring_of(weights: &[u32]) -> Ring {
    let nodes = weights
        .iter()
        .enumerate()
        .map(|(i, &w)| node(&format!("node-{i}"), w))
        .collect();
    Ring::new(1, nodes).unwrap()
}

/// The owner id of every slot.
fn owners(ring: &Ring) -> Vec<Option<String>> {
    (0..SLOTS as u16)
        .map(|s| ring.owner(s).map(|n| n.id.clone()))
        .collect()
}

fn count(ring: &Ring, id: &str) -> usize {
    ring.slots_of(id).count()
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn raising_a_weight_moves_slots_only_onto_that_node(
        weights in prop::collection::vec(0u32..100, 1..7),
        pick in any::<prop::sample::Index>(),
        raise in 1u32..100,
    ) {
        let before = ring_of(&weights);
        let id = format!("node-{}", pick.index(weights.len()));
        let weight = before.node(&id).unwrap().weight + raise;
        let after = before.with_weight(&id, weight).unwrap();
        prop_assert_eq!(after.epoch(), before.epoch() + 1);
        for (slot, (old, new)) in owners(&before).iter().zip(owners(&after)).enumerate() {
            if *old != new {
                prop_assert_eq!(new.as_deref(), Some(id.as_str()), "slot {} moved elsewhere", slot);
            }
        }
    }

    #[test]
    fn removing_a_node_moves_only_its_slots(
        weights in prop::collection::vec(0u32..100, 2..7),
        pick in any::<prop::sample::Index>(),
    ) {
        let before = ring_of(&weights);
        let id = format!("node-{}", pick.index(weights.len()));
        let after = before.without(&id).unwrap();
        for (slot, (old, new)) in owners(&before).iter().zip(owners(&after)).enumerate() {
            if *old != new {
                prop_assert_eq!(old.as_deref(), Some(id.as_str()), "slot {} was not {}'s", slot, id);
            }
        }
        prop_assert_eq!(count(&after, &id), 0);
    }

    #[test]
    fn shares_follow_the_weights(weights in prop::collection::vec(0u32..100, 1..7)) {
        let ring = ring_of(&weights);
        let total: u32 = weights.iter().sum();
        for (i, &weight) in weights.iter().enumerate() {
            let got = count(&ring, &format!("node-{i}")) as f64;
            if total == 0 {
                prop_assert_eq!(got, 0.0);
                continue;
            }
            // Binomial: within 5 standard deviations (odds under 1e-6).
            let p = f64::from(weight) / f64::from(total);
            let expected = SLOTS as f64 * p;
            let sd = (SLOTS as f64 * p * (1.0 - p)).sqrt();
            prop_assert!((got - expected).abs() <= 5.0 * sd + 1.0,
                "node-{} of weight {}/{}: {} slots, expected {:.0}", i, weight, total, got, expected);
        }
    }
}

#[test]
fn a_canary_at_one_percent_takes_about_164_slots_and_gives_them_back() {
    let fleet = Ring::new(1, vec![node("a", 33), node("b", 33), node("c", 33)]).unwrap();
    let with_canary = fleet.with_node(node("canary", 0)).unwrap();
    assert_eq!(
        owners(&with_canary),
        owners(&fleet),
        "weight 0 owns nothing"
    );
    let one_percent = with_canary.with_weight("canary", 1).unwrap();
    let moved = count(&one_percent, "canary");
    assert!((120..=210).contains(&moved), "{moved} slots");
    let back = one_percent.with_weight("canary", 0).unwrap();
    assert_eq!(
        owners(&back),
        owners(&fleet),
        "its slots return to their owners"
    );
    assert_eq!(back.epoch(), 4);
}

/// The assignment is stored, not recomputed by readers, but a new build's
/// `ring` command computes it again: it must never change.
#[test]
fn the_assignment_function_never_changes() {
    let ring = Ring::new(7, vec![node("a", 1), node("b", 1), node("c", 2)]).unwrap();
    let counts: Vec<usize> = ["a", "b", "c"].iter().map(|id| count(&ring, id)).collect();
    let first: Vec<u16> = ring.owners()[..16].to_vec();
    // Computed by an independent Python implementation of the module doc.
    assert_eq!(counts, [4126, 3983, 8275]);
    assert_eq!(first, [2, 2, 0, 0, 2, 2, 2, 2, 2, 2, 2, 1, 2, 1, 2, 2]);
}

#[test]
fn no_weight_means_no_owner() {
    let ring = Ring::new(1, vec![node("a", 0)]).unwrap();
    assert!(ring.owners().iter().all(|&o| o == NO_OWNER));
    assert!(ring.owner_of(42).is_none());
    assert!(Ring::empty().owner_of(42).is_none());
}

#[test]
fn bad_rings_are_refused() {
    assert_eq!(
        Ring::new(1, vec![node("a", 1), node("a", 2)]),
        Err(RingError::DuplicateNode("a".into()))
    );
    assert!(matches!(
        Ring::new(1, vec![node("a b", 1)]),
        Err(RingError::BadNodeId(_))
    ));
    let mut no_port = node("a", 1);
    no_port.address = "host".into();
    assert!(matches!(
        Ring::new(1, vec![no_port]),
        Err(RingError::BadAddress { .. })
    ));
    let ring = Ring::new(1, vec![node("a", 1)]).unwrap();
    // Issue 24, item 5: anything but host:port was taken (a URL, a space in
    // the host) and took its node's users offline.
    for address in [
        "http://127.0.0.1:50051",
        "bad host:50051",
        "host:0",
        "host:65536",
        ":50051",
        "::1:50051",
        "[::1]",
        "[not-ip]:50051",
        "256.1.1.1:50051",
        "-host:50051",
        "host-.example:50051",
        "host..example:50051",
        "rs-0.readstates.default.svc:50051/",
    ] {
        let mut bad = node("b", 1);
        bad.address = address.into();
        assert_eq!(
            ring.with_node(bad),
            Err(RingError::BadAddress {
                id: "b".into(),
                address: address.into()
            }),
            "{address}"
        );
    }
    for address in [
        "127.0.0.1:50051",
        "[::1]:50051",
        "[2001:db8::7]:443",
        "localhost:1",
        "rs-0.readstates.default.svc.cluster.local:50051",
        "Node7:65535",
    ] {
        let mut good = node("b", 1);
        good.address = address.into();
        assert!(ring.with_node(good).is_ok(), "{address}");
    }
    // A ring an older version stored with such an address still reads, so
    // that its node can be removed.
    let mut stored_bad = node("a", 1);
    stored_bad.address = "http://127.0.0.1:50051".into();
    let stored = Ring::from_parts(1, vec![stored_bad], ring.owners().to_vec()).unwrap();
    assert!(stored.without("a").is_ok());
    assert_eq!(ring.without("z"), Err(RingError::UnknownNode("z".into())));
    assert!(matches!(
        Ring::from_parts(1, vec![node("a", 1)], vec![1; SLOTS]),
        Err(RingError::BadOwners(_))
    ));
    let stored = Ring::from_parts(1, ring.nodes().to_vec(), ring.owners().to_vec()).unwrap();
    assert_eq!(stored, ring);
}
