//! The slot of a user: `slot = mix(user_id) % 16384`, where `mix` is the
//! splitmix64 finalizer (Steele, Lea and Flood; the output function of Java's
//! `SplittableRandom`), on wrapping 64-bit unsigned arithmetic:
//!
//! ```text
//! z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
//! z = (z ^ (z >> 27)) * 0x94d049bb133111eb
//! z =  z ^ (z >> 31)
//! ```
//!
//! Snowflake ids carry a timestamp in their high bits and a counter in their
//! low ones, so neither bits alone spread users evenly; the mix does. The
//! function is fixed forever: changing it would move every user at once.
//! `routing/slots.csv` holds test vectors for gateways written in other
//! languages.

/// Slots in the ring; a power of two, so `%` is a mask.
pub const SLOTS: usize = 16_384;

/// A slot number, below [`SLOTS`].
pub type Slot = u16;

/// The splitmix64 finalizer: a bijection on `u64` whose every output bit
/// depends on every input bit.
pub const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The slot of `user_id`.
pub const fn slot_of(user_id: u64) -> Slot {
    (mix(user_id) % SLOTS as u64) as Slot
}

#[cfg(test)]
mod tests {
    use super::*;

    /// splitmix64 seeded with 0 adds the golden gamma before each mix; its
    /// first outputs, from the reference implementation, pin `mix` down
    /// independently of this code.
    #[test]
    fn mix_is_the_splitmix64_finalizer() {
        const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;
        let outputs: Vec<u64> = (1..=3).map(|i| mix(GAMMA.wrapping_mul(i))).collect();
        assert_eq!(
            outputs,
            [
                0xe220_a839_7b1d_cdaf,
                0x6e78_9e6a_a1b9_65f4,
                0x06c4_5d18_8009_454f
            ]
        );
    }

    #[test]
    fn the_test_vectors_hold() {
        let vectors = include_str!("../slots.csv");
        let mut checked = 0;
        for line in vectors.lines().filter(|l| !l.starts_with('#')).skip(1) {
            let fields: Vec<&str> = line.split(',').collect();
            let user_id: u64 = fields[0].parse().unwrap();
            let mixed = u64::from_str_radix(fields[1].trim_start_matches("0x"), 16).unwrap();
            let slot: Slot = fields[2].parse().unwrap();
            assert_eq!(mix(user_id), mixed, "mix({user_id})");
            assert_eq!(slot_of(user_id), slot, "slot_of({user_id})");
            checked += 1;
        }
        assert!(checked >= 20, "only {checked} vectors");
    }

    #[test]
    fn snowflakes_spread_evenly() {
        // Ids minted by one worker 1 ms apart: only high bits and a counter
        // change, the worst case for a weak hash.
        let mut per_slot = vec![0u32; SLOTS];
        let users = SLOTS as u64 * 16;
        for i in 0..users {
            let snowflake = ((1_700_000_000_000 + i) << 22) | (i & 0xfff);
            per_slot[usize::from(slot_of(snowflake))] += 1;
        }
        let (min, max) = (
            per_slot.iter().min().unwrap(),
            per_slot.iter().max().unwrap(),
        );
        // Poisson(16): below 1 or above 40 has odds under 1e-6 per slot.
        assert!(*min >= 1 && *max <= 40, "min {min}, max {max}");
    }
}
