//! Where a job is to run: the GPU it is asked about, that GPU's calibration profile, and
//! whether (and how many copies of) the job fits there.

use crate::calibration::store::ProfileStore;
use crate::devices::performance::GpuPerformance;
use crate::devices::sku::{GpuSelector, Sku, SkuError};
use crate::devices::{DeviceError, GpuDevices};
use crate::domain::physics::Physics;
use crate::domain::MemoryFraction;
use crate::estimators::MibAnswer;

/// The card the training data was measured on: estimates are for it unless a GPU is named.
pub const REFERENCE_SKU: &str = "a100-40gb";

/// A GPU an estimate is placed on.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// Profile key: a catalogue id (`h100-80gb`) or the slug of an unknown attached GPU.
    pub gpu: String,
    pub capacity_mib: u64,
    /// Peak throughput for the performance model; `None` for a card known only by its memory
    /// (an attached card the catalogue lacks, a custom card).
    pub performance: Option<GpuPerformance>,
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
    pub fn resolve(
        selector: Option<&str>,
        devices: &dyn GpuDevices,
    ) -> Result<Target, PlacementError> {
        let sku = match selector {
            None => Sku::by_id(REFERENCE_SKU).expect("the reference SKU is in the catalogue"),
            Some(raw) => match GpuSelector::parse(raw)? {
                GpuSelector::Sku(sku) => sku,
                GpuSelector::Attached => {
                    let device = devices.attached().map_err(PlacementError::NoDevice)?;
                    return Ok(Target {
                        gpu: device.profile_key(),
                        capacity_mib: device.memory_total_mib,
                        performance: device
                            .sku
                            .as_deref()
                            .and_then(Sku::by_id)
                            .map(|s| s.performance),
                    });
                }
            },
        };
        Ok(Target {
            gpu: sku.id.to_string(),
            capacity_mib: sku.capacity_mib,
            performance: Some(sku.performance),
        })
    }
}

/// An estimate moved onto a target GPU.
#[derive(Debug, Clone, PartialEq)]
pub struct Placement {
    pub target: Target,
    pub estimate_mib: f64,
    pub upper_bound_mib: f64,
    /// True when the figure was raised to the physics floor (before or after calibration).
    pub floored: bool,
    /// Observations behind the profile used; `None` when the GPU has no profile yet.
    pub profile_observations: Option<u64>,
    pub fit: Fit,
    pub fit_basis: FitBasis,
}

/// What `fits` and `max_colocated` rest on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitBasis {
    /// The upper bound (a job without a simulation): a scheduler reserves the bound.
    UpperBound,
    /// The simulation's minimum capacity and reserved peak.
    Simulation,
}

/// Applies the target's calibration profile (if it has one), holds the result to physics (a
/// profile is learning too), and checks the fit against the target's capacity.
pub fn place(
    answer: &MibAnswer,
    target: Target,
    profiles: &ProfileStore,
    physics: &Physics,
    fraction: Option<MemoryFraction>,
) -> Placement {
    let calibrated = profiles.calibrate(
        &target.gpu,
        answer.estimate_mib,
        Some(answer.upper_bound_mib),
    );
    let (estimate_mib, upper_bound_mib, profile_observations) = match &calibrated {
        Some(c) => (c.estimate_mib, c.upper_bound_mib, Some(c.observations)),
        None => (answer.estimate_mib, answer.upper_bound_mib, None),
    };
    let settled = physics.settle(estimate_mib, upper_bound_mib);
    let (fit, fit_basis) = fit(
        target.capacity_mib,
        settled.upper_bound_mib,
        physics,
        fraction,
    );
    Placement {
        target,
        estimate_mib: settled.estimate_mib,
        upper_bound_mib: settled.upper_bound_mib,
        floored: answer.floored || settled.floored,
        profile_observations,
        fit,
        fit_basis,
    }
}

/// Whether a job fits a card of `capacity_mib`, and how many copies of it do.
///
/// With a simulation: the step runs where its minimum capacity fits beside the CUDA context
/// (the allocator frees its cache before it fails), and a copy occupies its reserved peak plus
/// the context. Without one: the job fits where its upper bound does, and a copy occupies the
/// bound. A `memory_fraction` f caps the allocator at f x capacity: the job must run within
/// that cap, and a copy then occupies the cap plus the context, whatever it would reserve
/// uncapped, since nothing lets it grow beyond (a cap of the whole card leaves room for no
/// other copy).
pub fn fit(
    capacity_mib: u64,
    upper_bound_mib: f64,
    physics: &Physics,
    fraction: Option<MemoryFraction>,
) -> (Fit, FitBasis) {
    let capacity = capacity_mib as f64;
    let context = physics.parts.cuda_context;
    // The most the allocator can hold: what the card leaves beside the context, at most the cap.
    let cap = |f: MemoryFraction| (f.get() * capacity).min(capacity - context);
    let (fits, occupied, basis) = match (physics.simulated, fraction) {
        (Some(peaks), None) => (
            peaks.runs_on_card(),
            peaks.reserved_mib + context,
            FitBasis::Simulation,
        ),
        (Some(peaks), Some(f)) => (
            peaks.min_capacity_mib <= cap(f),
            cap(f) + context,
            FitBasis::Simulation,
        ),
        (None, None) => {
            return (
                copies_within(capacity_mib, upper_bound_mib),
                FitBasis::UpperBound,
            )
        }
        (None, Some(f)) => (
            upper_bound_mib <= cap(f) + context,
            cap(f) + context,
            FitBasis::UpperBound,
        ),
    };
    if !fits {
        return (
            Fit {
                fits: false,
                max_colocated: 0,
            },
            basis,
        );
    }
    // A job that runs alone fits once, even where its uncapped reservation exceeds the card.
    (
        Fit {
            fits: true,
            max_colocated: copies_within(capacity_mib, occupied).max_colocated.max(1),
        },
        basis,
    )
}

/// Whether a job fits on one GPU, and how many copies of it fit side by side.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fit {
    pub fits: bool,
    /// floor(capacity / upper bound); 0 when one copy does not fit.
    pub max_colocated: u64,
}

/// Fit of a job whose memory need is at most `upper_bound_mib` on a GPU of `capacity_mib`.
///
/// An upper bound that is not a finite positive number says nothing a scheduler could rely on,
/// so the answer is "does not fit" rather than a division by zero or an infinite count.
pub fn copies_within(capacity_mib: u64, upper_bound_mib: f64) -> Fit {
    if !upper_bound_mib.is_finite() || upper_bound_mib <= 0.0 {
        return Fit {
            fits: false,
            max_colocated: 0,
        };
    }
    // f64 holds every capacity exactly (< 2^53); the quotient is finite and non-negative.
    let copies = (capacity_mib as f64 / upper_bound_mib).floor();
    let max_colocated = if copies >= u64::MAX as f64 {
        u64::MAX
    } else {
        copies as u64
    };
    Fit {
        fits: max_colocated >= 1,
        max_colocated,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::{FakeDevices, NoDevices};

    fn answer(estimate_mib: f64, upper_bound_mib: f64) -> MibAnswer {
        MibAnswer {
            estimate_mib,
            upper_bound_mib,
            floored: false,
        }
    }

    /// A job whose analytic floor (model state + context) is 1,316 MiB.
    fn physics() -> Physics {
        let layers = vec![crate::domain::UncheckedLayer {
            kind: "linear",
            output_size: 1024,
            params: 1 << 20,
        }];
        Physics::analytic(&crate::domain::Job::parse(None, 256, layers.into_iter()).unwrap())
    }

    /// Reserved 10 GiB, runs on 9 GiB, 2 GiB at the peak by category, context 1,000 MiB.
    fn simulated(capacity_mib: u64) -> Physics {
        use crate::domain::{SimulatedCategories, UncheckedSimulation};
        let gib = 1u64 << 30;
        let layers = vec![crate::domain::UncheckedLayer {
            kind: "linear",
            output_size: 1024,
            params: 1 << 20,
        }];
        let raw = UncheckedSimulation {
            batch_size: 256,
            optimizer: None,
            precision: None,
            allocated_peak_bytes: 2 * gib,
            reserved_peak_bytes: 10 * gib,
            min_capacity_bytes: 9 * gib,
            breakdown_at_peak: SimulatedCategories {
                activations: 2 * gib,
                ..Default::default()
            },
            attention: None,
            interpolated: false,
            ..Default::default()
        };
        let job = crate::domain::Job::parse(None, 256, layers.into_iter())
            .unwrap()
            .with_simulation(Some(raw))
            .unwrap();
        Physics::simulated(job.simulation().unwrap(), 1000.0, capacity_mib)
    }

    fn fraction(f: f64) -> Option<MemoryFraction> {
        MemoryFraction::parse(Some(f)).unwrap()
    }

    #[test]
    fn the_reference_card_is_the_physics_reference() {
        let reference = Target::resolve(None, &NoDevices::new("none")).unwrap();
        assert_eq!(
            reference.capacity_mib,
            crate::domain::physics::REFERENCE_CAPACITY_MIB
        );
    }

    #[test]
    fn a_simulated_job_fits_by_its_minimum_capacity_and_colocates_by_its_reserved_peak() {
        // 9,216 + 1,000 MiB needed to run; 10,240 + 1,000 MiB occupied per copy.
        let (fit, basis) = fit(40_960, 99_999.0, &simulated(40_960), None);
        assert_eq!(
            (fit, basis),
            (
                Fit {
                    fits: true,
                    max_colocated: 3
                },
                FitBasis::Simulation
            )
        );
        // Enough to run but not to reserve the whole peak: one copy, the allocator frees its cache.
        assert_eq!(
            fit_of(10_216, None),
            Fit {
                fits: true,
                max_colocated: 1
            }
        );
        assert_eq!(
            fit_of(10_215, None),
            Fit {
                fits: false,
                max_colocated: 0
            }
        );
    }

    fn fit_of(capacity_mib: u64, fraction: Option<MemoryFraction>) -> Fit {
        fit(capacity_mib, 0.0, &simulated(capacity_mib), fraction).0
    }

    #[test]
    fn a_memory_fraction_caps_the_allocator_and_sets_what_a_copy_occupies() {
        // 0.25 x 40,960 = 10,240 MiB cap >= 9,216 needed: each copy occupies 11,240 MiB.
        assert_eq!(
            fit_of(40_960, fraction(0.25)),
            Fit {
                fits: true,
                max_colocated: 3
            }
        );
        // 0.2 x 40,960 = 8,192 MiB: the step does not run within the cap.
        assert_eq!(
            fit_of(40_960, fraction(0.2)),
            Fit {
                fits: false,
                max_colocated: 0
            }
        );
        // The whole card: one copy.
        assert_eq!(
            fit_of(40_960, fraction(1.0)),
            Fit {
                fits: true,
                max_colocated: 1
            }
        );
        // Without a simulation the bound must fit within the cap plus the context.
        let plain = physics();
        assert_eq!(
            fit(40_960, 11_540.0, &plain, fraction(0.25)).0,
            Fit {
                fits: true,
                max_colocated: 3
            }
        );
        assert_eq!(
            fit(40_960, 11_541.0, &plain, fraction(0.25)).0,
            Fit {
                fits: false,
                max_colocated: 0
            }
        );
        assert_eq!(
            fit(40_960, 11_541.0, &plain, None),
            (
                Fit {
                    fits: true,
                    max_colocated: 3
                },
                FitBasis::UpperBound
            )
        );
    }

    #[test]
    fn placing_holds_a_calibrated_figure_to_the_floor() {
        let dir = tempfile::tempdir().unwrap();
        let (profiles, _) = ProfileStore::load(dir.path()).unwrap();
        for _ in 0..3 {
            profiles.observe("h100-80gb", 10_000.0, 1_000.0).unwrap();
        }
        let target = Target::resolve(Some("h100-80gb"), &NoDevices::new("none")).unwrap();
        let placement = place(
            &answer(10_000.0, 11_000.0),
            target,
            &profiles,
            &physics(),
            None,
        );
        assert!(placement.floored, "{placement:?}");
        assert!((placement.estimate_mib - physics().floor_mib()).abs() < 1e-9);
        assert!(placement.upper_bound_mib >= placement.estimate_mib);
    }

    #[test]
    fn without_a_gpu_the_reference_card_is_the_target() {
        let target = Target::resolve(None, &NoDevices::new("none")).unwrap();
        assert_eq!(
            target,
            Target {
                gpu: "a100-40gb".into(),
                capacity_mib: 40_960,
                performance: Some(Sku::by_id("a100-40gb").unwrap().performance),
            }
        );
    }

    #[test]
    fn attached_needs_a_device_and_uses_its_capacity() {
        let error = Target::resolve(Some("attached"), &NoDevices::new("no driver")).unwrap_err();
        assert!(error.to_string().contains("no driver"), "{error}");
        let devices = FakeDevices::single("NVIDIA H100 80GB HBM3", 81_559);
        let target = Target::resolve(Some("attached"), &devices).unwrap();
        assert_eq!(
            target,
            Target {
                gpu: "h100-80gb".into(),
                capacity_mib: 81_559,
                performance: Some(Sku::by_id("h100-80gb").unwrap().performance),
            }
        );
    }

    #[test]
    fn fit_uses_the_upper_bound_and_counts_copies() {
        let dir = tempfile::tempdir().unwrap();
        let (profiles, _) = ProfileStore::load(dir.path()).unwrap();
        let target = Target::resolve(Some("a100-80gb"), &NoDevices::new("none")).unwrap();
        let placement = place(
            &answer(9_000.0, 20_000.0),
            target.clone(),
            &profiles,
            &physics(),
            None,
        );
        assert_eq!(
            placement.fit,
            Fit {
                fits: true,
                max_colocated: 4
            }
        );
        assert_eq!(placement.profile_observations, None);
        let placement = place(
            &answer(39_000.0, 90_000.0),
            target,
            &profiles,
            &physics(),
            None,
        );
        assert_eq!(
            placement.fit,
            Fit {
                fits: false,
                max_colocated: 0
            }
        );
    }

    #[test]
    fn a_profile_moves_the_estimate_onto_its_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let (profiles, _) = ProfileStore::load(dir.path()).unwrap();
        for _ in 0..3 {
            profiles.observe("h100-80gb", 10_000.0, 10_500.0).unwrap();
        }
        let target = Target::resolve(Some("H100 80GB"), &NoDevices::new("none")).unwrap();
        let placement = place(
            &answer(10_000.0, 11_000.0),
            target,
            &profiles,
            &physics(),
            None,
        );
        assert_eq!(placement.profile_observations, Some(3));
        assert!(
            (placement.estimate_mib - 10_500.0).abs() < 1.0,
            "{placement:?}"
        );
        assert!(placement.upper_bound_mib >= placement.estimate_mib);
    }

    #[test]
    fn max_colocated_is_the_floor_of_capacity_over_the_bound() {
        assert_eq!(
            copies_within(40_960, 10_000.0),
            Fit {
                fits: true,
                max_colocated: 4
            }
        );
        assert_eq!(
            copies_within(40_960, 10_240.0),
            Fit {
                fits: true,
                max_colocated: 4
            }
        );
        assert_eq!(
            copies_within(40_960, 10_240.5),
            Fit {
                fits: true,
                max_colocated: 3
            }
        );
        assert_eq!(
            copies_within(40_960, 40_960.0),
            Fit {
                fits: true,
                max_colocated: 1
            }
        );
        assert_eq!(
            copies_within(40_960, 40_960.1),
            Fit {
                fits: false,
                max_colocated: 0
            }
        );
        assert_eq!(
            copies_within(143_771, 1.0),
            Fit {
                fits: true,
                max_colocated: 143_771
            }
        );
        assert_eq!(
            copies_within(0, 100.0),
            Fit {
                fits: false,
                max_colocated: 0
            }
        );
    }

    #[test]
    fn a_meaningless_bound_never_fits() {
        for bound in [0.0, -1.0, f64::NAN, f64::INFINITY, f64::NEG_INFINITY] {
            assert_eq!(
                copies_within(40_960, bound),
                Fit {
                    fits: false,
                    max_colocated: 0
                },
                "bound {bound}"
            );
        }
        assert_eq!(
            copies_within(40_960, f64::MIN_POSITIVE).max_colocated,
            u64::MAX
        );
    }
}
