//! A calibration profile: what the service has learned about one GPU model (SKU) from the peaks
//! of jobs that really ran on it, and how it moves an estimate onto that GPU.
//!
//! The estimators were trained on one GPU (an A100 40GB). On another SKU the same job needs a
//! different amount: the CUDA context and library workspaces differ by architecture and driver
//! (an offset) and allocator behaviour scales with the job (a scale). A profile holds
//! `observed ≈ offset_mib + scale × predicted_mib`, fitted robustly to the observations, and
//! the quantiles of the relative residual, from which the upper bound is widened.

use std::collections::BTreeMap;
use std::io;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use super::environment::EnvironmentFit;
use super::fit::{fit_profile, median_prediction, residual_quantiles, Fitted, MAX_STEP};
pub use super::fit::{Sample, MIN_ESTIMATE_MIB, MIN_SAMPLES_FOR_SCALE, QUANTILES, SCALE_RANGE};
use super::step_time::HostFit;
use crate::devices::valid_key;

/// The profile file format this code reads and writes.
pub const SCHEMA_VERSION: u32 = 1;
/// Observations kept per SKU for refits (the most recent ones); `observations` counts all.
pub const MAX_SAMPLES: usize = 1000;
/// The residual quantile that widens a calibrated estimate into its upper bound.
pub const UPPER_QUANTILE: &str = "0.95";
/// Below this many observations the residual quantiles are too rough to widen a bound with.
pub const MIN_OBSERVATIONS_FOR_QUANTILE_BOUND: u64 = 10;
/// The most calibration may move an answer, whatever was observed, however often and by
/// whom: a factor and a fixed cost around the uncalibrated figure ([`reach`]).
///
/// Why: the per-update step bounds how fast a profile moves, not how far; a patient caller
/// (or a broken probe) holding the majority of a GPU's observations would otherwise move its
/// answers anywhere. Environments differ by a CUDA context (hundreds of MiB to a GiB) and by
/// allocator and kernel choices (tens of per cent); a correction beyond this says the
/// observations are of other jobs than the ones described.
pub const MAX_TOTAL_FACTOR: f64 = 1.5;
/// See [`MAX_TOTAL_FACTOR`], MiB.
pub const MAX_TOTAL_SHIFT_MIB: f64 = 1024.0;

/// The range `[low, high]` a calibrated figure may take around the uncalibrated `figure`:
/// `(figure - MAX_TOTAL_SHIFT_MIB) / MAX_TOTAL_FACTOR` to
/// `figure x MAX_TOTAL_FACTOR + MAX_TOTAL_SHIFT_MIB`.
pub fn reach(figure: f64) -> (f64, f64) {
    (
        ((figure - MAX_TOTAL_SHIFT_MIB) / MAX_TOTAL_FACTOR).max(MIN_ESTIMATE_MIB),
        figure * MAX_TOTAL_FACTOR + MAX_TOTAL_SHIFT_MIB,
    )
}

/// Largest memory figure accepted, MiB (16 TiB: far beyond any single GPU).
const MAX_MIB: f64 = 16.0 * 1024.0 * 1024.0;
/// What the service has learned about one SKU (or one SKU in one environment): derived from
/// the stored observations. Profile files of former versions had this format.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CalibrationProfile {
    pub schema_version: u32,
    /// The profile key: a catalogue id (`a100-40gb`) or a slug of an unknown GPU's name.
    pub sku: String,
    /// The environment whose observations this profile is fitted to; `None` for the GPU's
    /// own profile (all its observations).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment: Option<String>,
    pub offset_mib: f64,
    pub scale: f64,
    /// Quantiles of `observed / (offset + scale × predicted) - 1`, keyed `"0.5"`, `"0.9"`, ...
    pub residual_quantiles: BTreeMap<String, f64>,
    /// The stored observations this profile rests on (the samples keep only the last
    /// [`MAX_SAMPLES`]; the store keeps a bounded number per key).
    pub observations: u64,
    /// RFC 3339, UTC.
    pub updated_at: String,
    pub updated_at_unix: u64,
    pub samples: Vec<Sample>,
    /// What the environment changes in the breakdown ([`super::environment`]), fitted to the
    /// observations that carry a predicted breakdown; only an environment's profile has one.
    /// Derived like the rest, never read from a file.
    #[serde(skip)]
    pub environment_fit: Option<EnvironmentFit>,
    /// The host's cost per op fitted to the observations that carry a step time
    /// ([`super::step_time`]). Derived like the rest, never read from a file.
    #[serde(skip)]
    pub host_fit: Option<HostFit>,
}

/// A prediction moved onto one SKU by its profile.
#[derive(Debug, Clone, PartialEq)]
pub struct Calibrated {
    pub sku: String,
    /// The environment of the profile used; `None` when it was the GPU's own.
    pub environment: Option<String>,
    pub estimate_mib: f64,
    pub upper_bound_mib: f64,
    /// How many observations the profile rests on.
    pub observations: u64,
    pub offset_mib: f64,
    pub scale: f64,
    /// The CUDA context an environment's fit found, where one applied: the figure is held
    /// to the floor with this context instead of physics' own.
    pub cuda_context_mib: Option<f64>,
    /// The stack's factor an environment's fit found, where one applied: the floor's model
    /// state is held to it where it is below 1.
    pub stack_factor: Option<f64>,
}

impl Calibrated {
    /// Held within [`reach`] of the uncalibrated `predicted_mib` (the estimate) and
    /// `upper_mib` (the bound, the estimate when none), the bound never below the estimate.
    pub fn within_reach(mut self, predicted_mib: f64, upper_mib: Option<f64>) -> Calibrated {
        let (low, high) = reach(predicted_mib);
        self.estimate_mib = self.estimate_mib.clamp(low, high);
        let upper = upper_mib
            .filter(|u| u.is_finite())
            .map_or(predicted_mib, |u| u.max(predicted_mib));
        self.upper_bound_mib = self
            .upper_bound_mib
            .min(reach(upper).1)
            .max(self.estimate_mib);
        self
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ProfileError {
    #[error("`{0}` is not a valid profile key (lower-case letters, digits and '-', at most 64)")]
    InvalidSku(String),
    #[error("invalid observation: {0}")]
    InvalidObservation(String),
    #[error("invalid profile: {0}")]
    Invalid(String),
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("observation store: {0}")]
    Store(String),
}

/// A profile file that was not loaded, and why; the service starts without it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProfileWarning {
    pub path: PathBuf,
    pub reason: String,
}

impl std::fmt::Display for ProfileWarning {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.reason)
    }
}

pub(crate) fn check_mib(what: &str, value: f64) -> Result<(), ProfileError> {
    if value.is_finite() && value > 0.0 && value <= MAX_MIB {
        Ok(())
    } else {
        Err(ProfileError::InvalidObservation(format!(
            "{what} must be a positive number of MiB up to {MAX_MIB}, got {value}"
        )))
    }
}

impl CalibrationProfile {
    /// A profile fitted to these samples (the last [`MAX_SAMPLES`] of them are kept).
    pub fn fitted(
        sku: &str,
        observations: u64,
        samples: Vec<Sample>,
        now_unix: u64,
    ) -> CalibrationProfile {
        let skip = samples.len().saturating_sub(MAX_SAMPLES);
        let samples: Vec<Sample> = samples.into_iter().skip(skip).collect();
        let Fitted {
            offset_mib,
            scale,
            residual_quantiles,
        } = fit_profile(&samples);
        CalibrationProfile {
            schema_version: SCHEMA_VERSION,
            sku: sku.to_string(),
            environment: None,
            offset_mib,
            scale,
            residual_quantiles,
            observations: observations.max(samples.len() as u64),
            updated_at: rfc3339(now_unix),
            updated_at_unix: now_unix,
            samples,
            environment_fit: None,
            host_fit: None,
        }
    }

    /// This refit held to [`MAX_STEP`] from `previous` (the uncalibrated model, offset 0 and
    /// scale 1, for a new profile); true when it had to be held. The line keeps the fitted
    /// figure at the reference prediction where that is within the step; the residual
    /// quantiles are recomputed against the held line (wider, so the bound stays honest).
    pub fn held_to_step(
        mut self,
        previous: Option<&CalibrationProfile>,
    ) -> (CalibrationProfile, bool) {
        let Some(reference) = median_prediction(&self.samples) else {
            return (self, false);
        };
        let (before_offset, before_scale) =
            previous.map_or((0.0, 1.0), |p| (p.offset_mib, p.scale));
        let before = (before_offset + before_scale * reference).max(MIN_ESTIMATE_MIB);
        let fitted = self.offset_mib + self.scale * reference;
        let scale = self
            .scale
            .clamp(before_scale / MAX_STEP, before_scale * MAX_STEP);
        let figure = fitted.clamp(before / MAX_STEP, before * MAX_STEP);
        if scale == self.scale && figure == fitted {
            return (self, false);
        }
        self.scale = scale;
        self.offset_mib = figure - scale * reference;
        self.residual_quantiles = residual_quantiles(&self.samples, self.offset_mib, scale);
        (self, true)
    }

    /// The checks a file must pass to be loaded.
    pub fn validate(&self) -> Result<(), ProfileError> {
        let invalid = |m: String| Err(ProfileError::Invalid(m));
        if self.schema_version != SCHEMA_VERSION {
            return invalid(format!(
                "schema_version {} (this build reads {SCHEMA_VERSION})",
                self.schema_version
            ));
        }
        if !valid_key(&self.sku) {
            return Err(ProfileError::InvalidSku(self.sku.clone()));
        }
        if !self.offset_mib.is_finite() || self.offset_mib.abs() > MAX_MIB {
            return invalid(format!(
                "offset_mib {} is not a sane number of MiB",
                self.offset_mib
            ));
        }
        if !(self.scale.is_finite() && SCALE_RANGE.0 <= self.scale && self.scale <= SCALE_RANGE.1) {
            return invalid(format!("scale {} is outside {SCALE_RANGE:?}", self.scale));
        }
        for (key, value) in &self.residual_quantiles {
            let p: f64 = key.parse().map_err(|_| {
                ProfileError::Invalid(format!("quantile key `{key}` is not a number"))
            })?;
            if !(0.0 < p && p < 1.0 && value.is_finite() && *value > -1.0) {
                return invalid(format!(
                    "quantile {key} = {value} is not a valid relative residual"
                ));
            }
        }
        if self.samples.len() > MAX_SAMPLES {
            return invalid(format!(
                "{} samples (at most {MAX_SAMPLES})",
                self.samples.len()
            ));
        }
        if self.observations < self.samples.len() as u64 {
            return invalid(format!(
                "observations {} < {} samples",
                self.observations,
                self.samples.len()
            ));
        }
        for sample in &self.samples {
            check_mib("predicted_mib", sample.predicted_mib)
                .map_err(|e| ProfileError::Invalid(e.to_string()))?;
            check_mib("observed_mib", sample.observed_mib)
                .map_err(|e| ProfileError::Invalid(e.to_string()))?;
        }
        Ok(())
    }

    /// `offset + scale × predicted`, never below 1 MiB.
    pub fn apply(&self, predicted_mib: f64) -> f64 {
        (self.offset_mib + self.scale * predicted_mib).max(MIN_ESTIMATE_MIB)
    }

    /// The calibrated estimate and upper bound for a job the unshifted model put at
    /// `predicted_mib`, with an upper bound of `upper_mib` when it gave one.
    ///
    /// The upper bound is the larger of the model's own bound moved onto this SKU and, once
    /// the profile rests on [`MIN_OBSERVATIONS_FOR_QUANTILE_BOUND`] observations, the estimate
    /// widened by the [`UPPER_QUANTILE`] residual: for scheduling, erring high costs a little
    /// packing, erring low costs an OOM.
    pub fn calibrate(&self, predicted_mib: f64, upper_mib: Option<f64>) -> Calibrated {
        let estimate_mib = self.apply(predicted_mib);
        let mut upper_bound_mib = estimate_mib;
        if let Some(upper) = upper_mib.filter(|u| u.is_finite()) {
            upper_bound_mib = upper_bound_mib.max(self.apply(upper));
        }
        if self.observations >= MIN_OBSERVATIONS_FOR_QUANTILE_BOUND {
            if let Some(q) = self.residual_quantiles.get(UPPER_QUANTILE) {
                upper_bound_mib = upper_bound_mib.max(estimate_mib * (1.0 + q.max(0.0)));
            }
        }
        Calibrated {
            sku: self.sku.clone(),
            environment: self.environment.clone(),
            estimate_mib,
            upper_bound_mib,
            observations: self.observations,
            offset_mib: self.offset_mib,
            scale: self.scale,
            cuda_context_mib: None,
            stack_factor: None,
        }
        .within_reach(predicted_mib, upper_mib)
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` for seconds since the Unix epoch (UTC; Howard Hinnant's
/// days-to-civil algorithm), so no date crate is needed for one timestamp.
pub fn rfc3339(unix_seconds: u64) -> String {
    let days = (unix_seconds / 86_400) as i64;
    let secs = unix_seconds % 86_400;
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs % 3600 / 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_quantile_bound_applies_only_with_enough_observations() {
        let mut profile = CalibrationProfile::fitted("l4", 3, vec![], 0);
        profile
            .residual_quantiles
            .insert(UPPER_QUANTILE.into(), 0.2);
        assert_eq!(profile.calibrate(1000.0, None).upper_bound_mib, 1000.0);
        profile.observations = MIN_OBSERVATIONS_FOR_QUANTILE_BOUND;
        assert!((profile.calibrate(1000.0, None).upper_bound_mib - 1200.0).abs() < 1e-9);
        assert!((profile.calibrate(1000.0, Some(1500.0)).upper_bound_mib - 1500.0).abs() < 1e-9);
        profile.offset_mib = -5000.0;
        assert_eq!(
            profile.calibrate(1000.0, None).estimate_mib,
            1.0,
            "never below 1 MiB"
        );
    }

    #[test]
    fn a_refit_moves_the_figure_at_most_one_step() {
        let samples = vec![
            Sample {
                predicted_mib: 1000.0,
                observed_mib: 10.0,
            };
            3
        ];
        let fitted = CalibrationProfile::fitted("t4", 3, samples.clone(), 0);
        let (held, limited) = fitted.held_to_step(None);
        assert!(limited);
        assert!(
            (held.apply(1000.0) - 1000.0 / MAX_STEP).abs() < 1e-9,
            "{held:?}"
        );
        let (again, limited) =
            CalibrationProfile::fitted("t4", 3, samples, 0).held_to_step(Some(&held));
        assert!(limited);
        assert!((again.apply(1000.0) - 1000.0 / MAX_STEP / MAX_STEP).abs() < 1e-9);
        let near = vec![
            Sample {
                predicted_mib: 1000.0,
                observed_mib: 1100.0,
            };
            3
        ];
        let (kept, limited) = CalibrationProfile::fitted("t4", 3, near, 0).held_to_step(None);
        assert!(!limited);
        assert!((kept.apply(1000.0) - 1100.0).abs() < 1e-9);
    }

    #[test]
    fn rfc3339_formats_known_instants() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_700_000_000), "2023-11-14T22:13:20Z");
        assert_eq!(rfc3339(4_102_444_799), "2099-12-31T23:59:59Z");
    }
}
