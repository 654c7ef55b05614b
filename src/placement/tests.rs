//! The placement of answers on cards: targets, fits, copies, ranking.

use super::*;
use crate::calibration::store::ProfileStore;
use crate::devices::sku::Catalogue;
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
    let reference = Target::resolve(None, Catalogue::builtin(), &NoDevices::new("none")).unwrap();
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
