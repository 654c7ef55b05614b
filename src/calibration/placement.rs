//! Where a job is to run: the GPU it is asked about, that GPU's calibration profile, and
//! whether (and how many copies of) the job fits there.

use crate::calibration::store::ProfileSnapshot;
use crate::devices::performance::GpuPerformance;
use crate::devices::sku::{Catalogue, GpuSelector, SkuError};
use crate::devices::{derived, CUSTOM_PREFIX};
use crate::devices::{DeviceError, GpuDevices};
use crate::estimators::MibAnswer;
use crate::job::MemoryFraction;
use crate::physics::uncertainty::PeakDistribution;
use crate::physics::Physics;

/// The card the training data was measured on: estimates are for it unless a GPU is named.
pub const REFERENCE_SKU: &str = "a100-40gb";

/// Longest name of a custom card.
pub const MAX_CUSTOM_NAME_CHARS: usize = 64;
/// Largest memory of a custom card, MiB (1 TiB).
pub const MAX_CUSTOM_CAPACITY_MIB: u64 = 1 << 20;
/// Most custom cards with a calibration profile (each is a file and metric series).
pub const MAX_CUSTOM_PROFILES: usize = 256;

/// A GPU an estimate is placed on.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// Profile key: a catalogue id (`h100-80gb`), the slug of an unknown attached GPU, or
    /// `custom-<slug>-<capacity>mib` for a card described in the request.
    pub gpu: String,
    pub capacity_mib: u64,
    /// Peak throughput for the performance model: the catalogue's figures, or for an attached
    /// card the catalogue lacks those derived from NVML ([`derived`]); `None` for a custom card
    /// or an attached one whose driver does not say enough.
    pub performance: Option<GpuPerformance>,
}

/// What a request names as its GPU, before it is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuAsk<'a> {
    /// A catalogue id, name or alias, or `attached`.
    Name(&'a str),
    /// A card described by the request: known by its memory only.
    Custom { name: &'a str, capacity_mib: u64 },
}

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("gpu: {0}")]
    Sku(#[from] SkuError),
    #[error("gpu: 'attached' was asked for, but {0}")]
    NoDevice(DeviceError),
}

impl Target {
    /// Resolves a request's `gpu` field in `catalogue`; `None` means the reference card.
    pub fn resolve(
        ask: Option<GpuAsk<'_>>,
        catalogue: &Catalogue,
        devices: &dyn GpuDevices,
    ) -> Result<Target, PlacementError> {
        let sku = match ask {
            None => catalogue
                .by_id(REFERENCE_SKU)
                .or_else(|| Catalogue::builtin().by_id(REFERENCE_SKU))
                .expect("the reference SKU is in the built-in catalogue"),
            Some(GpuAsk::Custom { name, capacity_mib }) => return Ok(custom(name, capacity_mib)?),
            Some(GpuAsk::Name(raw)) => match catalogue.select(raw)? {
                GpuSelector::Sku(sku) => sku,
                GpuSelector::Attached => {
                    let device = devices.attached().map_err(PlacementError::NoDevice)?;
                    let performance = match device.sku_in(catalogue) {
                        Some(sku) => Some(sku.performance),
                        None => derived::performance_of(&device),
                    };
                    return Ok(Target {
                        gpu: device.profile_key_in(catalogue),
                        capacity_mib: device.memory_total_mib,
                        performance,
                    });
                }
            },
        };
        Ok(Target {
            gpu: sku.id.clone(),
            capacity_mib: sku.capacity_mib,
            performance: Some(sku.performance),
        })
    }
}

/// A card described by a request: its name (1 to 64 letters, digits, spaces, `-`, `_`, `.`,
/// with at least one letter or digit) and memory (1 to 1,048,576 MiB). Its profile key is
/// `custom-`, a slug of the name, whatever the name, and the capacity: a custom card named
/// like a catalogue card (`a100-40gb`) is not that card (its memory is the request's), so it
/// learns apart from it (`custom-a100-40gb-40000mib`). Names that differ only in case or
/// punctuation share a key when their capacity is the same; a card declared with another
/// capacity is another card, so declaring a larger one cannot lift a reading past the real
/// card's above-capacity refusal into its profile.
fn custom(name: &str, capacity_mib: u64) -> Result<Target, SkuError> {
    let chars = name.chars().count();
    let safe = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, ' ' | '-' | '_' | '.'));
    if chars == 0 || chars > MAX_CUSTOM_NAME_CHARS || !safe {
        return Err(SkuError::Custom(format!(
            "name: must be 1 to {MAX_CUSTOM_NAME_CHARS} letters, digits, spaces, `-`, `_` or `.`, got `{}`",
            crate::job::echo(name)
        )));
    }
    if !(1..=MAX_CUSTOM_CAPACITY_MIB).contains(&capacity_mib) {
        return Err(SkuError::Custom(format!(
            "capacity_mib: must be 1 to {MAX_CUSTOM_CAPACITY_MIB}, got {capacity_mib}"
        )));
    }
    let slug: Vec<String> = name
        .to_ascii_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect();
    if slug.is_empty() {
        return Err(SkuError::Custom(
            "name: must hold at least one letter or digit".into(),
        ));
    }
    // A profile key is at most 64 bytes: the prefix and the capacity leave the rest to the
    // slug.
    let suffix = format!("-{capacity_mib}mib");
    let mut slug = slug.join("-");
    slug.truncate(64 - CUSTOM_PREFIX.len() - suffix.len());
    let key = format!("{CUSTOM_PREFIX}{}{suffix}", slug.trim_end_matches('-'));
    Ok(Target {
        gpu: key,
        capacity_mib,
        performance: None,
    })
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
    /// The environment whose profile was used; `None` for the GPU's own (or none).
    pub profile_environment: Option<String>,
    pub fit: Fit,
    pub fit_basis: FitBasis,
    /// The distribution of the peak the bound and the decision were read from.
    pub peak: PeakDistribution,
}

/// What `fits` and `max_colocated` rest on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitBasis {
    /// The upper bound (a job without a simulation): a scheduler reserves the bound.
    UpperBound,
    /// The simulation's minimum capacity and reserved peak.
    Simulation,
}

/// Applies the target's calibration profile (if it has one: the profile of the GPU in
/// `environment`, else the GPU's own), holds the result to physics (a profile is learning
/// too), and checks the fit against the target's capacity. An environment's profile with an
/// environment fit applies it to physics' breakdown of the answered figure at `confidence`
/// ([`ProfileSnapshot::calibrate_breakdown`]); the GPU's own profile applies its line.
// Each argument is a distinct input of the decision; a struct would only rename them.
#[allow(clippy::too_many_arguments)]
pub fn place(
    answer: &MibAnswer,
    target: Target,
    environment: Option<&str>,
    profiles: &ProfileSnapshot,
    physics: &Physics,
    distribution: &PeakDistribution,
    fraction: Option<MemoryFraction>,
    confidence: f64,
) -> Placement {
    let calibrated = profiles.calibrate_breakdown(
        &target.gpu,
        environment,
        answer.estimate_mib,
        Some(answer.upper_bound_mib),
        &physics.breakdown(answer.estimate_mib),
        confidence,
    );
    let (estimate_mib, upper_bound_mib, profile_observations) = match &calibrated {
        Some(c) => (c.estimate_mib, c.upper_bound_mib, Some(c.observations)),
        None => (answer.estimate_mib, answer.upper_bound_mib, None),
    };
    // An environment's fitted context replaces physics' own in the floor: a smaller context
    // (lazy loading, a newer driver) lowers what the job can need.
    let floor = match calibrated.as_ref().and_then(|c| c.cuda_context_mib) {
        Some(context) => physics.floor_with_context_mib(context),
        None => physics.floor_mib(),
    };
    let settled = physics.settle_above(floor, estimate_mib, upper_bound_mib);
    // The distribution the decision reads: the answer's, or around a calibrated figure with
    // the spread the profile's bound implies (observations narrow or widen it).
    let mut peak = *distribution;
    if calibrated.is_some() {
        peak = physics.distribution(distribution.group, confidence, settled.estimate_mib, 1.0);
        peak.scale = distribution.scale;
        peak.assumed_log_range = distribution.assumed_log_range;
        peak.fit_bound(confidence, settled.upper_bound_mib);
    }
    let (mut fit, fit_basis) = fit(
        target.capacity_mib,
        settled.upper_bound_mib,
        physics,
        fraction,
    );
    // `fits` is the decision at the confidence: the probability of running out of memory on
    // the card (within the cap of a memory fraction) at most 1 - confidence.
    let room = match fraction {
        Some(f) => {
            let capacity = target.capacity_mib as f64;
            (f.get() * capacity).min(capacity - physics.parts.cuda_context)
                + physics.parts.cuda_context
        }
        None => target.capacity_mib as f64,
    };
    let oom_probability = peak.oom_probability(room);
    fit.oom_probability = oom_probability;
    fit.fits = oom_probability <= 1.0 - confidence + DECISION_TOLERANCE;
    fit.max_colocated = if fit.fits {
        fit.max_colocated.max(1)
    } else {
        0
    };
    Placement {
        target,
        estimate_mib: settled.estimate_mib,
        upper_bound_mib: settled.upper_bound_mib,
        floored: answer.floored || settled.floored,
        profile_observations,
        profile_environment: calibrated.and_then(|c| c.environment),
        fit,
        fit_basis,
        peak,
    }
}

/// Whether a job fits a card of `capacity_mib`, and how many copies of it do.
///
/// With a simulation: the step runs where its minimum capacity fits beside the CUDA context
/// (the allocator frees its cache before it fails), and a copy occupies its reserved peak plus
/// the context, or its upper bound where that is higher (the same distribution as the bound). Without one: the job fits where its upper bound does, and a copy occupies the
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
        // A copy occupies its reserved peak, or the bound where the doubt about the
        // simulation (its level's spread) reaches beyond: the copy beside it cannot take back
        // what this one reserves.
        (Some(peaks), None) => (
            peaks.runs_on_card(),
            (peaks.reserved_mib + context).max(upper_bound_mib),
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
                oom_probability: 0.0,
            },
            basis,
        );
    }
    // A job that runs alone fits once, even where its uncapped reservation exceeds the card.
    (
        Fit {
            fits: true,
            max_colocated: copies_within(capacity_mib, occupied).max_colocated.max(1),
            oom_probability: 0.0,
        },
        basis,
    )
}

/// Whether a job fits on one GPU, and how many copies of it fit side by side.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Fit {
    pub fits: bool,
    /// floor(capacity / upper bound); 0 when one copy does not fit.
    pub max_colocated: u64,
    /// The probability that the job runs out of memory there ([`place`] sets it; 0 before).
    pub oom_probability: f64,
}

/// Rounding room in comparing a probability with 1 - confidence: a bound read at the
/// confidence and a capacity equal to it are a fit.
const DECISION_TOLERANCE: f64 = 1e-9;

/// Fit of a job whose memory need is at most `upper_bound_mib` on a GPU of `capacity_mib`.
///
/// An upper bound that is not a finite positive number says nothing a scheduler could rely on,
/// so the answer is "does not fit" rather than a division by zero or an infinite count.
pub fn copies_within(capacity_mib: u64, upper_bound_mib: f64) -> Fit {
    if !upper_bound_mib.is_finite() || upper_bound_mib <= 0.0 {
        return Fit {
            fits: false,
            max_colocated: 0,
            oom_probability: 0.0,
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
        oom_probability: 0.0,
    }
}

/// One card of a `gpu` list, as [`rank`] weighs it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub fits: bool,
    /// The predicted step time; `None` where the card has no peak figures.
    pub step_time_ms: Option<f64>,
    pub capacity_mib: u64,
    /// The figure a scheduler reserves (the upper bound), to order the cards the job misses.
    pub upper_bound_mib: f64,
}

/// The order in which to offer the cards of a `gpu` list, as indices into `candidates`: the
/// cards the job fits first, fastest predicted step first (a card without a prediction after
/// those with one), then the smaller card (it leaves the larger free for jobs that need it);
/// then the cards it misses, nearest to fitting first. Stable: equal cards keep the caller's
/// order.
pub fn rank(candidates: &[Candidate]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..candidates.len()).collect();
    order.sort_by(|&a, &b| {
        let (a, b) = (&candidates[a], &candidates[b]);
        let shortfall = |c: &Candidate| c.upper_bound_mib / c.capacity_mib.max(1) as f64;
        b.fits.cmp(&a.fits).then_with(|| {
            if a.fits {
                let time = |c: &Candidate| c.step_time_ms.unwrap_or(f64::INFINITY);
                time(a)
                    .total_cmp(&time(b))
                    .then(a.capacity_mib.cmp(&b.capacity_mib))
            } else {
                shortfall(a).total_cmp(&shortfall(b))
            }
        })
    });
    order
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::calibration::store::ProfileStore;
    use crate::devices::{FakeDevices, NoDevices};
    use crate::job::{Detail, Family, Group, SetupFamily};

    const LAYERS: Group = Group {
        detail: Detail::Layers,
        family: SetupFamily::Full,
        model: Family::Mlp,
    };

    fn answer(estimate_mib: f64, upper_bound_mib: f64) -> MibAnswer {
        MibAnswer {
            estimate_mib,
            upper_bound_mib,
            floored: false,
        }
    }

    /// A job whose analytic floor (model state + context) is 1,316 MiB.
    fn physics() -> Physics {
        let layers = vec![crate::job::UncheckedLayer {
            kind: "linear",
            output_size: 1024,
            params: 1 << 20,
        }];
        Physics::analytic(&crate::job::Job::parse(None, 256, layers.into_iter()).unwrap())
    }

    /// Reserved 10 GiB, runs on 9 GiB, 2 GiB at the peak by category, context 1,000 MiB.
    fn simulated(capacity_mib: u64) -> Physics {
        use crate::job::{SimulatedCategories, UncheckedSimulation};
        let gib = 1u64 << 30;
        let layers = vec![crate::job::UncheckedLayer {
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
        let job = crate::job::Job::parse(None, 256, layers.into_iter())
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
        let reference =
            Target::resolve(None, Catalogue::builtin(), &NoDevices::new("none")).unwrap();
        assert_eq!(
            reference.capacity_mib,
            crate::physics::REFERENCE_CAPACITY_MIB
        );
    }

    #[test]
    fn a_simulated_job_fits_by_its_minimum_capacity_and_colocates_by_its_reserved_peak() {
        // 9,216 + 1,000 MiB needed to run; 10,240 + 1,000 MiB occupied per copy, or the
        // bound where the doubt reaches beyond.
        let (wide, _) = fit(40_960, 20_000.0, &simulated(40_960), None);
        assert_eq!(wide.max_colocated, 2);
        let (fit, basis) = fit(40_960, 11_000.0, &simulated(40_960), None);
        assert_eq!(
            (fit, basis),
            (
                Fit {
                    fits: true,
                    max_colocated: 3,
                    oom_probability: 0.0
                },
                FitBasis::Simulation
            )
        );
        // Enough to run but not to reserve the whole peak: one copy, the allocator frees its cache.
        assert_eq!(
            fit_of(10_216, None),
            Fit {
                fits: true,
                max_colocated: 1,
                oom_probability: 0.0
            }
        );
        assert_eq!(
            fit_of(10_215, None),
            Fit {
                fits: false,
                max_colocated: 0,
                oom_probability: 0.0
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
                max_colocated: 3,
                oom_probability: 0.0
            }
        );
        // 0.2 x 40,960 = 8,192 MiB: the step does not run within the cap.
        assert_eq!(
            fit_of(40_960, fraction(0.2)),
            Fit {
                fits: false,
                max_colocated: 0,
                oom_probability: 0.0
            }
        );
        // The whole card: one copy.
        assert_eq!(
            fit_of(40_960, fraction(1.0)),
            Fit {
                fits: true,
                max_colocated: 1,
                oom_probability: 0.0
            }
        );
        // Without a simulation the bound must fit within the cap plus the context.
        let plain = physics();
        assert_eq!(
            fit(40_960, 11_540.0, &plain, fraction(0.25)).0,
            Fit {
                fits: true,
                max_colocated: 3,
                oom_probability: 0.0
            }
        );
        assert_eq!(
            fit(40_960, 11_541.0, &plain, fraction(0.25)).0,
            Fit {
                fits: false,
                max_colocated: 0,
                oom_probability: 0.0
            }
        );
        assert_eq!(
            fit(40_960, 11_541.0, &plain, None),
            (
                Fit {
                    fits: true,
                    max_colocated: 3,
                    oom_probability: 0.0
                },
                FitBasis::UpperBound
            )
        );
    }

    #[test]
    fn placing_holds_a_calibrated_figure_to_the_floor() {
        let dir = tempfile::tempdir().unwrap();
        let (profiles, _) = ProfileStore::load(dir.path()).unwrap();
        // More batches than are replayed one step at a time: the profile reaches the fit.
        for _ in 0..=crate::calibration::store::REPLAYED_BATCHES + 3 {
            profiles.observe("h100-80gb", 2_000.0, 200.0).unwrap();
        }
        let target = Target::resolve(
            Some(GpuAsk::Name("h100-80gb")),
            Catalogue::builtin(),
            &NoDevices::new("none"),
        )
        .unwrap();
        // Calibration reaches down to (2,000 - 1,024) / 1.5 = 651 MiB, below the 1,316 floor.
        let placement = place(
            &answer(2_000.0, 2_200.0),
            target,
            None,
            &profiles.snapshot(),
            &physics(),
            &physics().distribution(LAYERS, 0.95, 2_000.0, 1.0),
            None,
            0.95,
        );
        assert!(placement.floored, "{placement:?}");
        assert!((placement.estimate_mib - physics().floor_mib()).abs() < 1e-9);
        assert!(placement.upper_bound_mib >= placement.estimate_mib);
    }

    #[test]
    fn without_a_gpu_the_reference_card_is_the_target() {
        let target = Target::resolve(None, Catalogue::builtin(), &NoDevices::new("none")).unwrap();
        assert_eq!(
            target,
            Target {
                gpu: "a100-40gb".into(),
                capacity_mib: 40_960,
                performance: Some(Catalogue::builtin().by_id("a100-40gb").unwrap().performance),
            }
        );
    }

    #[test]
    fn attached_needs_a_device_and_uses_its_capacity() {
        let error = Target::resolve(
            Some(GpuAsk::Name("attached")),
            Catalogue::builtin(),
            &NoDevices::new("no driver"),
        )
        .unwrap_err();
        assert!(error.to_string().contains("no driver"), "{error}");
        let devices = FakeDevices::single("NVIDIA H100 80GB HBM3", 81_559);
        let target = Target::resolve(
            Some(GpuAsk::Name("attached")),
            Catalogue::builtin(),
            &devices,
        )
        .unwrap();
        assert_eq!(
            target,
            Target {
                gpu: "h100-80gb".into(),
                capacity_mib: 81_559,
                performance: Some(Catalogue::builtin().by_id("h100-80gb").unwrap().performance),
            }
        );
    }

    #[test]
    fn an_attached_card_the_catalogue_lacks_gets_nvml_derived_peaks() {
        let devices = FakeDevices::single("NVIDIA RTX PRO 6000 Blackwell", 97_887).with_hardware(
            Some("12.0"),
            Some(188),
            Some(2617),
            Some(14_001),
            Some(512),
        );
        let ask = Some(GpuAsk::Name("attached"));
        let target = Target::resolve(ask, Catalogue::builtin(), &devices).unwrap();
        assert_eq!(target.gpu, "rtx-pro-6000-blackwell");
        assert_eq!(target.capacity_mib, 97_887);
        assert_eq!(target.performance.unwrap().sm_count, 188);
        let bare = FakeDevices::single("NVIDIA RTX PRO 6000 Blackwell", 97_887);
        let target = Target::resolve(ask, Catalogue::builtin(), &bare).unwrap();
        assert_eq!(target.performance, None);
    }

    #[test]
    fn a_custom_card_is_its_own_profile_even_when_named_like_a_catalogue_card() {
        fn resolve(name: &str, capacity_mib: u64) -> Result<Target, PlacementError> {
            Target::resolve(
                Some(GpuAsk::Custom { name, capacity_mib }),
                Catalogue::builtin(),
                &NoDevices::new("none"),
            )
        }
        assert_eq!(
            resolve("My Lab Card v2", 12_000).unwrap(),
            Target {
                gpu: "custom-my-lab-card-v2-12000mib".into(),
                capacity_mib: 12_000,
                performance: None,
            }
        );
        assert_eq!(
            resolve("a100-40gb", 40_000).unwrap().gpu,
            "custom-a100-40gb-40000mib"
        );
        // One card whatever its name's case or punctuation; another with another capacity.
        assert_eq!(
            resolve("Lab Card", 16_384).unwrap().gpu,
            resolve("lab.card", 16_384).unwrap().gpu
        );
        assert_ne!(
            resolve("LAB_CARD", 16_384).unwrap().gpu,
            resolve("LAB_CARD", MAX_CUSTOM_CAPACITY_MIB).unwrap().gpu
        );
        let long = resolve(&"x".repeat(64), 1).unwrap().gpu;
        assert!(crate::devices::valid_key(&long), "{long}");
        for (name, capacity) in [
            ("", 1000),
            ("---", 1000),
            ("../etc", 1000),
            ("card", 0),
            ("card", MAX_CUSTOM_CAPACITY_MIB + 1),
        ] {
            let error = resolve(name, capacity).unwrap_err().to_string();
            assert!(error.starts_with("gpu: "), "{error}");
        }
        assert!(
            resolve(&"y".repeat(10_000), 1)
                .unwrap_err()
                .to_string()
                .len()
                < 300
        );
    }

    #[test]
    fn fit_uses_the_upper_bound_and_counts_copies() {
        let dir = tempfile::tempdir().unwrap();
        let (profiles, _) = ProfileStore::load(dir.path()).unwrap();
        let target = Target::resolve(
            Some(GpuAsk::Name("a100-80gb")),
            Catalogue::builtin(),
            &NoDevices::new("none"),
        )
        .unwrap();
        let placement = place(
            &answer(9_000.0, 20_000.0),
            target.clone(),
            None,
            &profiles.snapshot(),
            &physics(),
            &physics().distribution(LAYERS, 0.95, 9_000.0, 1.0),
            None,
            0.95,
        );
        assert!(placement.fit.fits && placement.fit.max_colocated == 4);
        assert!(placement.fit.oom_probability < 1e-6, "{placement:?}");
        assert_eq!(placement.profile_observations, None);
        let placement = place(
            &answer(200_000.0, 210_000.0),
            target,
            None,
            &profiles.snapshot(),
            &physics(),
            &physics().distribution(LAYERS, 0.95, 200_000.0, 1.0),
            None,
            0.95,
        );
        assert!(!placement.fit.fits && placement.fit.max_colocated == 0);
        assert!(placement.fit.oom_probability > 0.99, "{placement:?}");
    }

    #[test]
    fn a_profile_moves_the_estimate_onto_its_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let (profiles, _) = ProfileStore::load(dir.path()).unwrap();
        for _ in 0..3 {
            profiles.observe("h100-80gb", 10_000.0, 10_500.0).unwrap();
        }
        let target = Target::resolve(
            Some(GpuAsk::Name("H100 80GB")),
            Catalogue::builtin(),
            &NoDevices::new("none"),
        )
        .unwrap();
        let placement = place(
            &answer(10_000.0, 11_000.0),
            target,
            None,
            &profiles.snapshot(),
            &physics(),
            &physics().distribution(LAYERS, 0.95, 10_000.0, 1.0),
            None,
            0.95,
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
                max_colocated: 4,
                oom_probability: 0.0
            }
        );
        assert_eq!(
            copies_within(40_960, 10_240.0),
            Fit {
                fits: true,
                max_colocated: 4,
                oom_probability: 0.0
            }
        );
        assert_eq!(
            copies_within(40_960, 10_240.5),
            Fit {
                fits: true,
                max_colocated: 3,
                oom_probability: 0.0
            }
        );
        assert_eq!(
            copies_within(40_960, 40_960.0),
            Fit {
                fits: true,
                max_colocated: 1,
                oom_probability: 0.0
            }
        );
        assert_eq!(
            copies_within(40_960, 40_960.1),
            Fit {
                fits: false,
                max_colocated: 0,
                oom_probability: 0.0
            }
        );
        assert_eq!(
            copies_within(143_771, 1.0),
            Fit {
                fits: true,
                max_colocated: 143_771,
                oom_probability: 0.0
            }
        );
        assert_eq!(
            copies_within(0, 100.0),
            Fit {
                fits: false,
                max_colocated: 0,
                oom_probability: 0.0
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
                    max_colocated: 0,
                    oom_probability: 0.0
                },
                "bound {bound}"
            );
        }
        assert_eq!(
            copies_within(40_960, f64::MIN_POSITIVE).max_colocated,
            u64::MAX
        );
    }
    #[test]
    fn cards_rank_by_fit_then_step_time_then_size() {
        let card = |fits, step_time_ms, capacity_mib, upper_bound_mib| Candidate {
            fits,
            step_time_ms,
            capacity_mib,
            upper_bound_mib,
        };
        let candidates = [
            card(false, Some(10.0), 16_384, 30_000.0), // misses by 83 %
            card(true, Some(40.0), 81_920, 30_000.0),
            card(true, None, 49_152, 30_000.0), // no peak figures: after the timed ones
            card(true, Some(20.0), 81_559, 30_000.0), // fastest
            card(false, None, 24_576, 30_000.0), // misses by 22 %: nearest to fitting
            card(true, Some(40.0), 40_960, 30_000.0), // as fast as the 80 GB card, smaller
        ];
        assert_eq!(rank(&candidates), vec![3, 5, 1, 2, 4, 0]);
        assert_eq!(rank(&[]), Vec::<usize>::new());
        let same = [card(true, Some(1.0), 1, 1.0), card(true, Some(1.0), 1, 1.0)];
        assert_eq!(
            rank(&same),
            vec![0, 1],
            "equal cards keep the caller's order"
        );
        let nan = [
            card(true, Some(f64::NAN), 1, 1.0),
            card(true, Some(1.0), 1, 1.0),
        ];
        assert_eq!(rank(&nan).len(), 2, "a NaN time does not panic the sort");
    }
}
