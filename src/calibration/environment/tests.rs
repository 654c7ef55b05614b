use super::*;

/// A job with 4 GiB of model state, `activations` and a cache of a tenth of them.
fn job(activations: f64) -> Breakdown {
    job_with_cache(activations, 0.1 * activations)
}

fn job_with_cache(activations: f64, allocator_cache: f64) -> Breakdown {
    Breakdown {
        parameters: 1000.0,
        gradients: 1000.0,
        optimizer_state: 2000.0,
        activations,
        temporaries: 100.0,
        allocator_cache,
        cuda_context: 1700.0,
        ..Breakdown::default()
    }
}

/// What a stack holding `factor` times physics' allocator bytes shows on the device.
fn in_stack(predicted: &Breakdown, factor: f64) -> f64 {
    predicted.cuda_context + factor * (predicted.total() - predicted.cuda_context)
}

/// What an environment with a 600 MiB context, activations ×1.3 and cache ×0.8 shows.
fn observed(predicted: &Breakdown) -> f64 {
    4100.0 + 1.3 * predicted.activations + 0.8 * predicted.allocator_cache + 600.0
}

const MANY: [f64; 10] = [
    500.0, 1500.0, 3000.0, 4500.0, 6000.0, 8000.0, 10_000.0, 13_000.0, 16_000.0, 20_000.0,
];

/// Ten jobs whose caches do not follow their activations (so the two scales can be told
/// apart).
fn ten() -> Vec<EnvironmentSample> {
    const CACHES: [f64; 10] = [
        400.0, 100.0, 900.0, 300.0, 1200.0, 200.0, 800.0, 1500.0, 600.0, 1000.0,
    ];
    MANY.iter()
        .zip(CACHES)
        .map(|(&a, c)| {
            let job = job_with_cache(a, c);
            EnvironmentSample::device(job, observed(&job))
        })
        .collect()
}

/// `n` jobs of a stack holding 1.4x physics' bytes, each off by up to `scatter` (relative).
fn stack_of(n: usize, scatter: f64) -> Vec<EnvironmentSample> {
    (0..n)
        .map(|i| {
            let job = job(6000.0 + 3000.0 * i as f64);
            let wobble = 1.0 + scatter * if i % 2 == 0 { 1.0 } else { -1.0 };
            EnvironmentSample::device(job, in_stack(&job, 1.4 * wobble))
        })
        .collect()
}

#[test]
fn one_observation_of_a_stack_moves_the_figure_most_of_the_way() {
    let fit = fit_environment(&stack_of(1, 0.0));
    // ln 1.4 shrunk by the prior between stacks: 1 / (1 + (0.2 / 0.25)^2) of the way.
    assert!(fit.stack_factor > 1.2 && fit.stack_factor < 1.4, "{fit:?}");
    let other = job(15_000.0);
    let truth = in_stack(&other, 1.4);
    let before = other.total();
    let (estimate, bound) = apply(&fit, &other, 0.95);
    assert!(
        (truth - estimate) < 0.5 * (truth - before),
        "{estimate} moved less than half the way from {before} to {truth}"
    );
    assert!(
        bound > truth,
        "one observation's bound covers the stack: {bound}"
    );
}

#[test]
fn three_observations_bring_a_stack_within_its_own_scatter() {
    let fit = fit_environment(&stack_of(3, 0.03));
    let other = job(12_500.0);
    let truth = in_stack(&other, 1.4);
    let (estimate, bound) = apply(&fit, &other, 0.95);
    assert!(
        (estimate / truth - 1.0).abs() < 0.05,
        "{estimate} vs {truth}"
    );
    assert!(
        bound > truth && bound / estimate < 1.4,
        "{bound} / {estimate}"
    );
}

#[test]
fn the_bound_narrows_as_consistent_rows_come_and_widens_when_they_scatter() {
    let margin = |n: usize, scatter: f64| log_margin(&fit_environment(&stack_of(n, scatter)), 0.95);
    assert!(
        margin(1, 0.0) > margin(3, 0.02),
        "{} {}",
        margin(1, 0.0),
        margin(3, 0.02)
    );
    assert!(margin(3, 0.02) > margin(10, 0.02));
    assert!(margin(5, 0.25) > margin(5, 0.02));
    // Nineteen rows: the rank 20 x 0.95 exists, the environment's own conformal quantile
    // answers.
    assert!(fit_environment(&stack_of(19, 0.02))
        .log_residual_quantiles
        .contains_key("0.95"));
}

#[test]
fn many_observations_recover_the_environment() {
    let fit = fit_environment(&ten());
    let job = job(7000.0);
    let (estimate, bound) = apply(&fit, &job, 0.95);
    let truth = observed(&job);
    assert!(
        (estimate / truth - 1.0).abs() < 0.03,
        "{estimate} vs {truth}"
    );
    assert!(bound >= estimate);
}

#[test]
fn one_wild_reading_among_ten_moves_the_fit_little() {
    let clean = fit_environment(&stack_of(10, 0.03));
    let mut wild = stack_of(10, 0.03);
    wild[4].observed_mib *= 5.0;
    let wild = fit_environment(&wild);
    for a in [1000.0, 7000.0, 18_000.0] {
        let (c, _) = apply(&clean, &job(a), 0.95);
        let (w, _) = apply(&wild, &job(a), 0.95);
        assert!((w / c - 1.0).abs() < 0.05, "{a}: {w} vs {c}");
    }
    assert!(
        wild.max_log_residual > 1.0,
        "the wild one shows in the tail"
    );
}

#[test]
fn no_observation_moves_an_answer_beyond_its_reach() {
    // A first observation ten times the job, or a tenth of it: the factor stops at its
    // range, and the answer within reach of physics.
    let job = job(8000.0);
    for wrong in [10.0, 0.1] {
        let fit = fit_environment(&[EnvironmentSample::device(job, job.total() * wrong)]);
        assert!(
            FACTOR_RANGE.0 <= fit.stack_factor && fit.stack_factor <= FACTOR_RANGE.1,
            "{fit:?}"
        );
        let (estimate, _) = apply(&fit, &job, 0.95);
        let (low, high) = reach(job.total());
        assert!(low <= estimate && estimate <= high, "{estimate}");
    }
}

#[test]
fn allocated_figures_teach_the_allocator_and_not_the_context() {
    let allocated: Vec<EnvironmentSample> = [2000.0, 5000.0]
        .iter()
        .map(|&a| EnvironmentSample {
            predicted: job(a),
            observed_mib: 4100.0 + a + 300.0,
            measure: Measure::Allocated,
        })
        .collect();
    let fit = fit_environment(&allocated);
    assert_eq!(fit.context_mib, None);
    let (estimate, _) = apply_measured(&fit, &job(3000.0), Measure::Allocated, 0.95);
    let truth = 4100.0 + 3000.0 + 300.0;
    assert!(
        (estimate / truth - 1.0).abs() < 0.03,
        "{estimate} vs {truth}"
    );
}

#[test]
fn no_environment_takes_a_job_below_its_exact_bytes() {
    let fit = EnvironmentFit {
        allocator_fixed_mib: ALLOCATOR_FIXED_RANGE_MIB.0,
        activation_scale: SCALE_RANGE.0,
        context_mib: Some(CONTEXT_RANGE_MIB.0),
        ..EnvironmentFit::default()
    };
    let mut small = job(10.0);
    small.temporaries = 0.0;
    let (estimate, bound) = apply(&fit, &small, 0.95);
    assert_eq!(estimate, 4000.0 + CONTEXT_RANGE_MIB.0);
    assert!(bound > estimate, "the bound keeps a margin");
    let parts = calibrated_breakdown(&fit, &small);
    assert_eq!(
        parts.parameters + parts.gradients + parts.optimizer_state,
        4000.0
    );
    assert!(parts.temporaries >= 0.0 && parts.allocator_cache >= 0.0);
}

#[test]
fn no_samples_leave_physics_as_it_is() {
    let fit = fit_environment(&[]);
    assert_eq!(fit, EnvironmentFit::default());
    let (estimate, _) = apply(&fit, &job(3000.0), 0.95);
    assert!((estimate - job(3000.0).total()).abs() < 1e-9);
    assert_eq!(calibrated_breakdown(&fit, &job(3000.0)), job(3000.0));
}

#[test]
fn student_t_quantiles_match_the_tables() {
    // Exact values: t(0.95; 2) = 2.920, t(0.95; 5) = 2.015, t(0.95; 30) = 1.697,
    // t(0.99; 10) = 2.764, the normal's 0.975 = 1.960.
    for (p, dof, exact) in [
        (0.95, 2.0, 2.920),
        (0.95, 5.0, 2.015),
        (0.95, 30.0, 1.697),
        (0.99, 10.0, 2.764),
        (0.975, 1e9, 1.960),
    ] {
        let t = student_t_quantile(p, dof);
        assert!(
            (t / exact - 1.0).abs() < 0.005,
            "t({p}; {dof}) = {t}, not {exact}"
        );
    }
}

#[test]
fn measures_parse_from_the_public_rows_names() {
    assert_eq!(Measure::parse("active"), Some(Measure::Allocated));
    assert_eq!(
        Measure::parse("reserved_minus_weights"),
        Some(Measure::ReservedMinusWeights)
    );
    assert_eq!(Measure::parse("peak"), None);
}
