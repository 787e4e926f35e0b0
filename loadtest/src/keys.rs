//! Drawing user ids: uniform, or Zipf-distributed so that a few users are
//! hot, as in real chat traffic. Rank 1 is the hottest user; ranks are
//! scattered over the id space so that hot users do not share a guild.

use rand::Rng;
use rand_distr::{Distribution as _, Zipf};

use crate::workload::Distribution;

#[derive(Clone, Debug)]
pub struct KeySampler {
    users: u64,
    zipf: Option<Zipf<f64>>,
}

impl KeySampler {
    pub fn new(users: u64, distribution: Distribution) -> KeySampler {
        let zipf = match distribution {
            Distribution::Uniform => None,
            // Validated: users > 0 and exponent > 0.
            Distribution::Zipf { exponent } => Zipf::new(users as f64, exponent).ok(),
        };
        KeySampler { users, zipf }
    }

    /// A user id in `1..=users`.
    pub fn user(&self, rng: &mut impl Rng) -> u64 {
        match &self.zipf {
            None => rng.random_range(1..=self.users),
            Some(zipf) => {
                let rank = (zipf.sample(rng) as u64).clamp(1, self.users);
                scatter(rank, self.users)
            }
        }
    }
}

/// A bijection of `1..=n` that spreads consecutive ranks apart (multiplying
/// by a constant coprime with n modulo n).
fn scatter(rank: u64, n: u64) -> u64 {
    let mut step = 0x9E37_79B9_7F4A_7C15 % n;
    while gcd(step, n) != 1 {
        step += 1;
    }
    ((u128::from(rank - 1) * u128::from(step)) % u128::from(n)) as u64 + 1
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use rand::SeedableRng;
    use rand::rngs::SmallRng;

    use super::*;

    #[test]
    fn scatter_is_a_bijection() {
        for n in [1, 2, 7, 10, 1000] {
            let mut seen: Vec<u64> = (1..=n).map(|r| scatter(r, n)).collect();
            seen.sort_unstable();
            assert_eq!(seen, (1..=n).collect::<Vec<_>>(), "n = {n}");
        }
    }

    #[test]
    fn uniform_stays_in_range_and_covers_it() {
        let sampler = KeySampler::new(10, Distribution::Uniform);
        let mut rng = SmallRng::seed_from_u64(1);
        let mut counts = HashMap::new();
        for _ in 0..10_000 {
            *counts.entry(sampler.user(&mut rng)).or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 10);
        assert!(counts.keys().all(|&u| (1..=10).contains(&u)));
        assert!(counts.values().all(|&c| c > 800 && c < 1_200), "{counts:?}");
    }

    #[test]
    fn zipf_follows_the_power_law() {
        let users = 1_000;
        let sampler = KeySampler::new(users, Distribution::Zipf { exponent: 1.0 });
        let mut rng = SmallRng::seed_from_u64(2);
        let mut counts = HashMap::new();
        let draws = 200_000;
        for _ in 0..draws {
            *counts.entry(sampler.user(&mut rng)).or_insert(0u64) += 1;
        }
        let count = |rank| counts.get(&scatter(rank, users)).copied().unwrap_or(0) as f64;
        // P(rank) = 1 / (rank * H(n)); H(1000) ~ 7.485.
        let expected_top = draws as f64 / 7.485;
        assert!(
            (count(1) / expected_top - 1.0).abs() < 0.05,
            "rank 1: {}",
            count(1)
        );
        let ratio = count(1) / count(2);
        assert!((ratio - 2.0).abs() < 0.2, "rank 1 / rank 2 = {ratio}");
        assert!(counts.keys().all(|&u| (1..=users).contains(&u)));
    }
}
