//! Full-jitter exponential backoff: a retry waits `uniform(0, min(cap, base × 2^attempts))`.

use std::time::Duration;

use rand::RngExt;

/// The upper bound of the retry delay after `attempts` claims: `min(cap, base × 2^attempts)`.
pub(crate) fn backoff_ceiling(attempts: i32, base: Duration, cap: Duration) -> Duration {
    let exp = attempts.clamp(0, 62) as u32;
    base.checked_mul(1u32.checked_shl(exp.min(31)).unwrap_or(u32::MAX)).unwrap_or(cap).min(cap)
}

/// A retry delay drawn uniformly from `[0, min(cap, base × 2^attempts)]`.
pub(crate) fn full_jitter(attempts: i32, base: Duration, cap: Duration) -> Duration {
    let ceiling = backoff_ceiling(attempts, base, cap);
    if ceiling.is_zero() {
        return Duration::ZERO;
    }
    let micros = ceiling.as_micros().min(u64::MAX as u128) as u64;
    Duration::from_micros(rand::rng().random_range(0..=micros))
}

/// A delay drawn uniformly from the upper half of `[0, min(cap, base × 2^attempts)]`: spread,
/// yet never much shorter than the ceiling (for reconnects and held deliveries, where a near-zero
/// pause would only hammer what is down).
pub(crate) fn half_jitter(attempts: i32, base: Duration, cap: Duration) -> Duration {
    backoff_ceiling(attempts, base, cap).mul_f64(rand::rng().random_range(0.5..=1.0))
}

/// `d` scaled by a random factor in `[0.75, 1.25]`, so that idle workers do not poll in step.
pub(crate) fn jittered(d: Duration) -> Duration {
    d.mul_f64(rand::rng().random_range(0.75..=1.25))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ceiling_doubles_then_caps() {
        let (base, cap) = (Duration::from_secs(1), Duration::from_secs(300));
        assert_eq!(backoff_ceiling(0, base, cap), Duration::from_secs(1));
        assert_eq!(backoff_ceiling(1, base, cap), Duration::from_secs(2));
        assert_eq!(backoff_ceiling(8, base, cap), Duration::from_secs(256));
        assert_eq!(backoff_ceiling(9, base, cap), cap);
        assert_eq!(backoff_ceiling(1000, base, cap), cap);
        assert_eq!(backoff_ceiling(-1, base, cap), Duration::from_secs(1));
    }

    #[test]
    fn jitter_stays_in_range_and_spreads() {
        let (base, cap) = (Duration::from_millis(100), Duration::from_secs(5));
        let draws: Vec<_> = (0..200).map(|_| full_jitter(3, base, cap)).collect();
        assert!(draws.iter().all(|d| *d <= Duration::from_millis(800)));
        let distinct: std::collections::HashSet<_> = draws.iter().collect();
        assert!(distinct.len() > 150, "draws should be spread, got {} distinct", distinct.len());
    }
}
