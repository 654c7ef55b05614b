//! The fit behind a calibration profile: a robust line `observed ≈ offset + scale × predicted`
//! and the quantiles of the relative residual.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// Residual quantiles stored in every profile, as (key, probability).
pub const QUANTILES: [(&str, f64); 4] =
    [("0.5", 0.5), ("0.9", 0.9), ("0.95", 0.95), ("0.99", 0.99)];
/// Below this many observations only an offset is fitted (scale 1): a slope from a handful of
/// points is mostly noise.
pub const MIN_SAMPLES_FOR_SCALE: usize = 5;
/// The scale a fit may take. Outside it the data describe a different job mix or a broken
/// measurement, not a GPU: clamp rather than extrapolate wildly.
pub const SCALE_RANGE: (f64, f64) = (0.25, 4.0);
/// Smallest calibrated estimate, MiB: a negative offset must not produce a zero or negative need.
pub const MIN_ESTIMATE_MIB: f64 = 1.0;

/// The most one update may move a profile: its calibrated figure at the median prediction of
/// its samples, and its scale, each by at most this factor up or down.
///
/// Why: a profile moves every estimate for its GPU, so one batch of wrong observations (a
/// broken measurement, a mislabelled GPU, a hostile client) must not swing every answer at
/// once. Genuine shifts are still learned: the samples are kept whole and each update refits
/// from all of them, so a few updates reach the fit (1.25^3 ≈ 2).
pub const MAX_STEP: f64 = 1.25;

/// One observed job: what the unshifted model predicted and what the GPU showed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Sample {
    pub predicted_mib: f64,
    pub observed_mib: f64,
}

/// Relative spread (interquartile range over median) of the predictions below which a slope
/// is not identifiable and only an offset is fitted.
const MIN_RELATIVE_SPREAD: f64 = 0.1;
/// The result of a fit.
#[derive(Debug, Clone, PartialEq)]
pub struct Fitted {
    pub offset_mib: f64,
    pub scale: f64,
    pub residual_quantiles: BTreeMap<String, f64>,
}

/// Fits `observed ≈ offset + scale × predicted` and the residual quantiles.
///
/// Theil–Sen (the median of pairwise slopes, then the median intercept): one wild reading, a
/// job that crashed early or shared the GPU, moves it little, where least squares would follow
/// it. Offset only (scale 1) with fewer than [`MIN_SAMPLES_FOR_SCALE`] samples or when the
/// predictions are too alike to show a slope; the scale is clamped to [`SCALE_RANGE`].
pub fn fit_profile(samples: &[Sample]) -> Fitted {
    if samples.is_empty() {
        return Fitted {
            offset_mib: 0.0,
            scale: 1.0,
            residual_quantiles: BTreeMap::new(),
        };
    }
    let predicted: Vec<f64> = samples.iter().map(|s| s.predicted_mib).collect();
    let scale = if samples.len() < MIN_SAMPLES_FOR_SCALE
        || relative_spread(&predicted) < MIN_RELATIVE_SPREAD
    {
        1.0
    } else {
        theil_sen_slope(samples).map_or(1.0, |s| s.clamp(SCALE_RANGE.0, SCALE_RANGE.1))
    };
    let mut intercepts: Vec<f64> = samples
        .iter()
        .map(|s| s.observed_mib - scale * s.predicted_mib)
        .collect();
    let offset_mib = quantile(&mut intercepts, 0.5);
    Fitted {
        offset_mib,
        scale,
        residual_quantiles: residual_quantiles(samples, offset_mib, scale),
    }
}

/// Quantiles of `observed / (offset + scale × predicted) - 1` over non-empty `samples`.
pub fn residual_quantiles(
    samples: &[Sample],
    offset_mib: f64,
    scale: f64,
) -> BTreeMap<String, f64> {
    let mut residuals: Vec<f64> = samples
        .iter()
        .map(|s| {
            s.observed_mib / (offset_mib + scale * s.predicted_mib).max(MIN_ESTIMATE_MIB) - 1.0
        })
        .collect();
    QUANTILES
        .iter()
        .map(|(key, p)| (key.to_string(), quantile(&mut residuals, *p)))
        .collect()
}

/// The median of the samples' predictions: where a profile's step is measured.
pub fn median_prediction(samples: &[Sample]) -> Option<f64> {
    let mut predicted: Vec<f64> = samples.iter().map(|s| s.predicted_mib).collect();
    (!predicted.is_empty()).then(|| quantile(&mut predicted, 0.5))
}

/// Interquartile range over the median.
fn relative_spread(values: &[f64]) -> f64 {
    let mut v = values.to_vec();
    let median = quantile(&mut v, 0.5);
    let iqr = quantile(&mut v, 0.75) - quantile(&mut v, 0.25);
    if median > 0.0 {
        iqr / median
    } else {
        0.0
    }
}

/// Median of the slopes between every pair of samples with distinct predictions
/// (at most `MAX_SAMPLES²/2` ≈ 500k slopes: a few milliseconds).
fn theil_sen_slope(samples: &[Sample]) -> Option<f64> {
    let mut slopes = Vec::with_capacity(samples.len() * (samples.len() - 1) / 2);
    for (i, a) in samples.iter().enumerate() {
        for b in &samples[i + 1..] {
            let dx = b.predicted_mib - a.predicted_mib;
            if dx.abs() > 1e-9 * a.predicted_mib.abs().max(1.0) {
                slopes.push((b.observed_mib - a.observed_mib) / dx);
            }
        }
    }
    (!slopes.is_empty()).then(|| quantile(&mut slopes, 0.5))
}

/// The `p` quantile with linear interpolation between order statistics (R's type 7).
/// `values` must be non-empty and finite; it is reordered.
pub(crate) fn quantile(values: &mut [f64], p: f64) -> f64 {
    values.sort_unstable_by(f64::total_cmp);
    let position = p.clamp(0.0, 1.0) * (values.len() - 1) as f64;
    let (lower, upper) = (position.floor() as usize, position.ceil() as usize);
    let weight = position - lower as f64;
    values[lower] + weight * (values[upper] - values[lower])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fit_recovers_an_exact_line_and_shrugs_off_an_outlier() {
        let mut samples: Vec<Sample> = (1..=40)
            .map(|i| {
                let predicted = 500.0 * i as f64;
                Sample {
                    predicted_mib: predicted,
                    observed_mib: 1.3 * predicted + 450.0,
                }
            })
            .collect();
        samples[7].observed_mib = 80_000.0;
        let fitted = fit_profile(&samples);
        assert!((fitted.scale - 1.3).abs() < 1e-9, "scale {}", fitted.scale);
        assert!(
            (fitted.offset_mib - 450.0).abs() < 1e-6,
            "offset {}",
            fitted.offset_mib
        );
        assert!(fitted.residual_quantiles["0.5"].abs() < 1e-9);
        assert!(
            fitted.residual_quantiles["0.99"] > 0.5,
            "the outlier shows in the tail"
        );
    }

    #[test]
    fn few_or_alike_observations_fit_an_offset_only() {
        let few = [
            Sample {
                predicted_mib: 1000.0,
                observed_mib: 1500.0,
            },
            Sample {
                predicted_mib: 4000.0,
                observed_mib: 4700.0,
            },
        ];
        let fitted = fit_profile(&few);
        assert_eq!(fitted.scale, 1.0);
        assert_eq!(fitted.offset_mib, 600.0);
        let alike: Vec<Sample> = (0..20)
            .map(|i| Sample {
                predicted_mib: 2000.0 + i as f64,
                observed_mib: 2600.0 + (i % 3) as f64 * 50.0,
            })
            .collect();
        assert_eq!(fit_profile(&alike).scale, 1.0);
        assert_eq!(fit_profile(&[]).scale, 1.0);
    }

    #[test]
    fn the_scale_is_clamped_to_a_sane_range() {
        let steep: Vec<Sample> = (1..=10)
            .map(|i| Sample {
                predicted_mib: 1000.0 * i as f64,
                observed_mib: 100.0 + 10_000.0 * i as f64,
            })
            .collect();
        assert_eq!(fit_profile(&steep).scale, SCALE_RANGE.1);
    }

    #[test]
    fn quantiles_interpolate() {
        assert_eq!(quantile(&mut [3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(quantile(&mut [1.0, 2.0, 3.0, 4.0], 0.5), 2.5);
        assert_eq!(quantile(&mut [5.0], 0.99), 5.0);
        assert!((quantile(&mut [0.0, 10.0], 0.95) - 9.5).abs() < 1e-12);
    }
}
