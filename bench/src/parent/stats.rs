//! Order statistics of the report: nearest-rank percentiles, the median of the runs, and the
//! summary of a latency distribution.

use serde::Serialize;

/// A latency distribution's summary, milliseconds.
#[derive(Debug, Clone, Copy, Default, Serialize, PartialEq)]
pub(super) struct Spread {
    pub(super) rows: usize,
    pub(super) p50_ms: f64,
    pub(super) p99_ms: f64,
    pub(super) p999_ms: f64,
    pub(super) max_ms: f64,
}

impl Spread {
    /// The summary of `values` (milliseconds), `None` when there are none.
    pub(super) fn of(mut values: Vec<f64>) -> Option<Self> {
        if values.is_empty() {
            return None;
        }
        Some(Self {
            rows: values.len(),
            p50_ms: percentile(&mut values, 0.50),
            p99_ms: percentile(&mut values, 0.99),
            p999_ms: percentile(&mut values, 0.999),
            max_ms: percentile(&mut values, 1.0),
        })
    }
}

/// Nearest-rank percentile.
pub(super) fn percentile(values: &mut [f64], p: f64) -> f64 {
    values.sort_by(f64::total_cmp);
    let rank = ((p * values.len() as f64).ceil() as usize).clamp(1, values.len());
    values[rank - 1]
}

/// The median (of an even count, the mean of the two middle values); `values` must not be empty.
pub(super) fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 { values[mid] } else { (values[mid - 1] + values[mid]) / 2.0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spread_takes_nearest_ranks() {
        let spread = Spread::of((1..=1000).rev().map(f64::from).collect()).unwrap();
        assert_eq!(spread, Spread { rows: 1000, p50_ms: 500.0, p99_ms: 990.0, p999_ms: 999.0, max_ms: 1000.0 });
        // Ten values: the 99th percentile is the tenth (rank ⌈9.9⌉), not the ninth.
        let ten = Spread::of((1..=10).map(f64::from).collect()).unwrap();
        assert_eq!((ten.p50_ms, ten.p99_ms, ten.p999_ms), (5.0, 10.0, 10.0));
        assert_eq!(Spread::of(Vec::new()), None);
    }

    #[test]
    fn the_median_of_an_even_count_is_the_middle_pair_s_mean() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(vec![4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
