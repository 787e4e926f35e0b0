//! Tokens: bound to the fleet, the node and a few minutes; the static
//! token of the builds before only while upgrading.

use super::*;

const SECRET: &str = "the fleet's secret, long enough";

fn stamped(credential: &FleetCredential) -> MetadataMap {
    let mut metadata = MetadataMap::new();
    credential.stamp(&mut metadata);
    metadata
}

#[test]
fn a_token_names_its_node_and_only_its_fleet_takes_it() {
    let ours = FleetCredential::new(SECRET, "fleet", "a");
    let metadata = stamped(&ours);
    assert_eq!(ours.verify(&metadata), Ok(Speaker::Node("a".into())));
    let checker = FleetCredential::new(SECRET, "fleet", "b");
    assert_eq!(checker.verify(&metadata), Ok(Speaker::Node("a".into())));
    // Issue 53, item 5: fleets that share a secret took each other's calls.
    let another_fleet = FleetCredential::new(SECRET, "another", "b");
    assert_eq!(another_fleet.verify(&metadata), Err(Refusal::Wrong));
    let another_secret = FleetCredential::new("another fleet's secret, long too", "fleet", "b");
    assert_eq!(another_secret.verify(&metadata), Err(Refusal::Wrong));
    assert_eq!(ours.verify(&MetadataMap::new()), Err(Refusal::Missing));
}

#[test]
fn a_token_names_no_other_node_and_expires_within_minutes() {
    let a = FleetCredential::new(SECRET, "fleet", "a");
    let now = unix_now();
    let check = |token: String| {
        let mut metadata = MetadataMap::new();
        metadata.insert(TOKEN, token.parse().unwrap());
        a.verify(&metadata)
    };
    let good = a.token("a", now + 100);
    assert_eq!(check(good.clone()), Ok(Speaker::Node("a".into())));
    // Another node's name, or a later expiry, on a's tag.
    let parts: Vec<&str> = good.splitn(4, '.').collect();
    let renamed = format!("v2.{}.{}.b", parts[1], parts[2]);
    assert_eq!(check(renamed), Err(Refusal::Wrong));
    let extended = format!("v2.{}.{}.a", now + 200, parts[2]);
    assert_eq!(check(extended), Err(Refusal::Wrong));
    // Issue 53, item 5: a token seen once worked until the secret changed.
    let skew = MAX_AHEAD.as_secs();
    assert_eq!(check(a.token("a", now - skew - 5)), Err(Refusal::Expired));
    let too_far = now + LIFETIME.as_secs() + skew + 5;
    assert_eq!(check(a.token("a", too_far)), Err(Refusal::Expired));
    for forged in ["", "v2", "v2.1.00.a", "v1.1.00.a", "zz"] {
        assert_eq!(check(forged.into()), Err(Refusal::Wrong), "{forged:?}");
    }
}

#[test]
fn the_static_token_of_the_builds_before_is_sent_and_taken_only_while_upgrading() {
    let required = FleetCredential::new(SECRET, "fleet", "a");
    assert!(stamped(&required).get(STATIC_TOKEN).is_none());
    let upgrading = FleetCredential::new(SECRET, "fleet", "a").upgrading(true);
    let both = stamped(&upgrading);
    assert!(both.get(STATIC_TOKEN).is_some() && both.get(TOKEN).is_some());
    let mut old = MetadataMap::new();
    old.insert(STATIC_TOKEN, both.get(STATIC_TOKEN).unwrap().clone());
    assert_eq!(upgrading.verify(&old), Ok(Speaker::Unnamed));
    assert_eq!(required.verify(&old), Err(Refusal::Static));
    old.insert(STATIC_TOKEN, "00".repeat(32).parse().unwrap());
    assert_eq!(upgrading.verify(&old), Err(Refusal::Wrong));
}

#[test]
fn the_secret_does_not_travel_and_is_not_printed() {
    let secret = "hunter2hunter2hunter2";
    let credential = FleetCredential::new(secret, "fleet", "a").upgrading(true);
    let metadata = stamped(&credential);
    for key in [TOKEN, STATIC_TOKEN] {
        let token = metadata.get(key).unwrap().to_str().unwrap();
        assert!(!token.contains(secret));
    }
    assert!(!format!("{credential:?}").contains(secret));
}
