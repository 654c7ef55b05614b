//! Where a job is to run: the GPU it is asked about, that GPU's calibration profile, and
//! whether (and how many copies of) the job fits there.

use crate::devices::profiles::ProfileStore;
use crate::devices::sku::{self, GpuSelector, Sku, SkuError};
use crate::devices::{DeviceError, GpuDevices};
use crate::estimators::MibAnswer;

/// The card the training data was measured on: estimates are for it unless a GPU is named.
pub const REFERENCE_SKU: &str = "a100-40gb";

/// A GPU an estimate is placed on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Target {
    /// Profile key: a catalogue id (`h100-80gb`) or the slug of an unknown attached GPU.
    pub gpu: String,
    pub capacity_mib: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("gpu: {0}")]
    Sku(#[from] SkuError),
    #[error("gpu: 'attached' was asked for, but {0}")]
    NoDevice(DeviceError),
}

impl Target {
    /// Resolves a request's `gpu` field; `None` means the reference card.
    pub fn resolve(selector: Option<&str>, devices: &dyn GpuDevices) -> Result<Target, PlacementError> {
        let sku = match selector {
            None => Sku::by_id(REFERENCE_SKU).expect("the reference SKU is in the catalogue"),
            Some(raw) => match GpuSelector::parse(raw)? {
                GpuSelector::Sku(sku) => sku,
                GpuSelector::Attached => {
                    let device = devices.attached().map_err(PlacementError::NoDevice)?;
                    return Ok(Target { gpu: device.profile_key(), capacity_mib: device.memory_total_mib });
                }
            },
        };
        Ok(Target { gpu: sku.id.to_string(), capacity_mib: sku.capacity_mib })
    }
}

/// An estimate moved onto a target GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub target: Target,
    pub estimate_mib: f64,
    pub upper_bound_mib: f64,
    /// Observations behind the profile used; `None` when the GPU has no profile yet.
    pub profile_observations: Option<u64>,
    pub fit: sku::Fit,
}

/// Applies the target's calibration profile (if it has one) and checks the fit against its
/// capacity using the upper bound: a scheduler reserves the bound, not the estimate.
pub fn place(answer: &MibAnswer, target: Target, profiles: &ProfileStore) -> Placement {
    let calibrated = profiles.calibrate(&target.gpu, answer.estimate_mib, Some(answer.upper_bound_mib));
    let (estimate_mib, upper_bound_mib, profile_observations) = match &calibrated {
        Some(c) => (c.estimate_mib, c.upper_bound_mib, Some(c.observations)),
        None => (answer.estimate_mib, answer.upper_bound_mib, None),
    };
    let fit = sku::fit(target.capacity_mib, upper_bound_mib);
    Placement { target, estimate_mib, upper_bound_mib, profile_observations, fit }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{FakeDevices, NoDevices};

    fn answer(estimate_mib: f64, upper_bound_mib: f64) -> MibAnswer {
        MibAnswer { estimate_mib, upper_bound_mib, confidence: 0.95, reference_capacity_mib: Some(40_960) }
    }

    #[test]
    fn without_a_gpu_the_reference_card_is_the_target() {
        let target = Target::resolve(None, &NoDevices::new("none")).unwrap();
        assert_eq!(target, Target { gpu: "a100-40gb".into(), capacity_mib: 40_960 });
    }

    #[test]
    fn attached_needs_a_device_and_uses_its_capacity() {
        let error = Target::resolve(Some("attached"), &NoDevices::new("no driver")).unwrap_err();
        assert!(error.to_string().contains("no driver"), "{error}");
        let devices = FakeDevices::single("NVIDIA H100 80GB HBM3", 81_559);
        let target = Target::resolve(Some("attached"), &devices).unwrap();
        assert_eq!(target, Target { gpu: "h100-80gb".into(), capacity_mib: 81_559 });
    }

    #[test]
    fn fit_uses_the_upper_bound_and_counts_copies() {
        let dir = tempfile::tempdir().unwrap();
        let (profiles, _) = ProfileStore::load(dir.path()).unwrap();
        let target = Target::resolve(Some("a100-80gb"), &NoDevices::new("none")).unwrap();
        let placement = place(&answer(9_000.0, 20_000.0), target.clone(), &profiles);
        assert_eq!(placement.fit, sku::Fit { fits: true, max_colocated: 4 });
        assert_eq!(placement.profile_observations, None);
        let placement = place(&answer(39_000.0, 90_000.0), target, &profiles);
        assert_eq!(placement.fit, sku::Fit { fits: false, max_colocated: 0 });
    }

    #[test]
    fn a_profile_moves_the_estimate_onto_its_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let (profiles, _) = ProfileStore::load(dir.path()).unwrap();
        for _ in 0..3 {
            profiles.observe("h100-80gb", 10_000.0, 10_500.0).unwrap();
        }
        let target = Target::resolve(Some("H100 80GB"), &NoDevices::new("none")).unwrap();
        let placement = place(&answer(10_000.0, 11_000.0), target, &profiles);
        assert_eq!(placement.profile_observations, Some(3));
        assert!((placement.estimate_mib - 10_500.0).abs() < 1.0, "{placement:?}");
        assert!(placement.upper_bound_mib >= placement.estimate_mib);
    }
}
