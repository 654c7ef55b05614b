//! What a software environment (driver, CUDA, PyTorch, cuDNN/cuBLAS, allocator settings) changes
//! in a job's memory, learned per category from a few observed peaks.
//!
//! A profile's line `observed ≈ offset + scale × predicted` ([`super::fit`]) moves every category
//! alike, so it cannot tell "this environment has a smaller CUDA context" from "this model's
//! activations are mis-estimated". Here the predicted [`Breakdown`] is kept apart:
//!
//! ```text
//! observed ≈ exact + activation_scale × activations + cache_scale × allocator_cache
//!            + allocator_fixed + context            (each term only where the figure counts it)
//! exact    = parameters + gradients + optimizer_state + temporaries + collective_buffers
//!            + paged_optimizer_state
//! ```
//!
//! - The exact categories are bytes physics counts (the model state, the layout's buffers):
//!   an environment does not change them, so they are never scaled.
//! - `context` is what the process pays outside the allocator (CUDA context, lazy module
//!   loading, library handles): it replaces physics' `cuda_context` and is held to
//!   [`CONTEXT_RANGE_MIB`].
//! - `allocator_fixed` is a fixed cost inside the allocator (cuBLAS/cuDNN workspaces, which
//!   PyTorch allocates through its caching allocator): it shows in every kind of figure, so it
//!   is what an allocated or reserved figure can teach; held to [`ALLOCATOR_FIXED_RANGE_MIB`].
//! - `activation_scale` and `cache_scale` (allocator behaviour, kernels saving more or less)
//!   need [`MIN_SAMPLES_FOR_SCALES`] observations, stay within [`SCALE_RANGE`] and are shrunk
//!   toward 1 as if [`PRIOR_SAMPLES`] observations had agreed with physics.
//! - The fixed costs are shrunk toward physics too, with a prior spread of
//!   [`FIXED_COST_PRIOR_MIB`] against a job's own error of [`JOB_RELATIVE_ERROR`]: a residual
//!   of a small job says more about a fixed cost than the same relative residual of a large one.
//!
//! The fit is a Huber regression on the relative residual (iteratively reweighted least
//! squares): a reading off by more than [`HUBER_DELTA`] counts linearly, not squared, so one
//! wild observation among ten moves the fit little. Its held-out residuals `log(observed /
//! fitted)` (each sample against a fit without its fold, [`CROSS_FOLDS`]) widen the estimate
//! into an upper bound: the residual at rank `(n + 1) c` is the bound's margin at confidence
//! `c` once there are enough samples for that rank (19 at 0.95), and until then the
//! uncalibrated bound's margin holds (split-conformal: the environment's own errors replace
//! the prior's as they accumulate, with coverage kept).

use std::collections::BTreeMap;

use crate::physics::Breakdown;

use super::fit::quantile;

/// Observations below which only the fixed costs are fitted: two points cannot separate a
/// fixed cost from a scale and a single bad one would set it.
pub const MIN_SAMPLES_FOR_SCALES: usize = 3;
/// The range of the activation and cache scales. An environment changes how much a kernel saves
/// or how the allocator rounds and caches, by tens of percent; a factor beyond 2 means the job
/// is mis-described, which calibration must not learn as a property of the environment.
pub const SCALE_RANGE: (f64, f64) = (0.5, 2.0);
/// The range of the context, MiB. Why: a CUDA context with cuBLAS and cuDNN handles takes at
/// least ~250 MiB on any recent card even with lazy module loading (`CUDA_MODULE_LOADING=LAZY`,
/// the default since CUDA 11.7), and under 3 GiB with every kernel image loaded eagerly (large
/// fat binaries on a Hopper card with CUDA 11). A fit outside says the observations disagree
/// for another reason, so the rest stays in the residuals.
pub const CONTEXT_RANGE_MIB: (f64, f64) = (256.0, 3072.0);
/// The range of the fixed cost inside the allocator, MiB: workspaces (cuBLAS's are a few MiB
/// per handle and stream, cuDNN's can reach a few GiB for large convolutions) and the
/// allocator's rounding. Negative when physics' temporaries hold workspaces this environment
/// does not take.
pub const ALLOCATOR_FIXED_RANGE_MIB: (f64, f64) = (-2048.0, 4096.0);
/// The scales are shrunk toward 1 as if this many observations had agreed with physics: with
/// 3 observations a scale moves 60 % of the way the data pull it, with 10, 83 %.
pub const PRIOR_SAMPLES: f64 = 2.0;
/// Relative residual beyond which an observation's weight falls (Huber's threshold).
pub const HUBER_DELTA: f64 = 0.05;
/// The relative error of a single job's prediction that is not the environment's doing (the
/// model mis-estimated): the median error of the published rows before calibration is ~15 %.
/// It sets how far one observation may pull the fixed costs against their prior.
pub const JOB_RELATIVE_ERROR: f64 = 0.15;
/// The prior spread of the fixed costs (the context around physics' own, the allocator's fixed
/// cost around 0), MiB: contexts differ between environments by hundreds of MiB to a GiB. One
/// observation of a 4 GiB job moves the context ~3/4 of its residual, of a 40 GiB job ~3 %: a
/// 15 % error on a large job says little about a fixed cost.
pub const FIXED_COST_PRIOR_MIB: f64 = 1024.0;
/// Conformal quantiles of the held-out `log(observed / fitted)` kept in a fit, as (key,
/// probability); a key is absent while the samples are too few for its rank.
pub const QUANTILES: [(&str, f64); 5] = [
    ("0.5", 0.5),
    ("0.8", 0.8),
    ("0.9", 0.9),
    ("0.95", 0.95),
    ("0.99", 0.99),
];
/// The folds of the held-out residuals: each sample is compared with a fit on the others'
/// folds (every other sample below this many), so that a residual is an error on a job the
/// fit had not seen, as a new job's will be.
pub const CROSS_FOLDS: usize = 10;
/// The least log margin of the bound while the samples are too few for the confidence's rank
/// (×1.22).
pub const FEW_SAMPLES_LOG_MARGIN: f64 = 0.2;
const ITERATIONS: usize = 50;

/// What an observed figure counts: the kinds of peak published runs and probes report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Measure {
    /// What nvidia-smi shows: everything, the context included.
    Device,
    /// `torch.cuda.max_memory_reserved`: the allocator's segments (no context, no paged state).
    Reserved,
    /// `torch.cuda.max_memory_allocated` (or the active bytes): without the allocator's cache.
    Allocated,
    /// The reserved peak less the model's weights.
    ReservedMinusWeights,
    /// The allocated peak less the model's weights.
    AllocatedMinusWeights,
}

impl Measure {
    /// From the names public_training_memory.csv's rows use (`active` reads as allocated).
    pub fn parse(name: &str) -> Option<Measure> {
        Some(match name {
            "device" => Measure::Device,
            "reserved" => Measure::Reserved,
            "allocated" | "active" => Measure::Allocated,
            "reserved_minus_weights" => Measure::ReservedMinusWeights,
            "allocated_minus_weights" => Measure::AllocatedMinusWeights,
            _ => return None,
        })
    }

    /// Whether the figure counts the context and a paged optimizer's state (outside the
    /// allocator's segments).
    pub fn counts_context(self) -> bool {
        self == Measure::Device
    }

    pub fn counts_cache(self) -> bool {
        matches!(
            self,
            Measure::Device | Measure::Reserved | Measure::ReservedMinusWeights
        )
    }

    pub fn counts_weights(self) -> bool {
        !matches!(
            self,
            Measure::ReservedMinusWeights | Measure::AllocatedMinusWeights
        )
    }
}

/// One observed job: the service's breakdown of it (before any calibration) and its peak.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EnvironmentSample {
    pub predicted: Breakdown,
    pub observed_mib: f64,
    pub measure: Measure,
}

impl EnvironmentSample {
    /// A device-level observation (what the probe and nvidia-smi report).
    pub fn device(predicted: Breakdown, observed_mib: f64) -> EnvironmentSample {
        EnvironmentSample {
            predicted,
            observed_mib,
            measure: Measure::Device,
        }
    }
}

/// What one environment changes, learned from its observations.
#[derive(Debug, Clone, PartialEq)]
pub struct EnvironmentFit {
    /// The observations it rests on.
    pub samples: usize,
    /// The environment's cost outside the allocator, MiB; `None` when no observation counted
    /// it (physics' own `cuda_context` stays).
    pub context_mib: Option<f64>,
    /// Fixed cost inside the allocator beyond physics' categories, MiB.
    pub allocator_fixed_mib: f64,
    pub activation_scale: f64,
    pub cache_scale: f64,
    /// Quantiles of `log(observed / fitted)` over the samples, keyed `"0.5"`, `"0.9"`, ...
    pub log_residual_quantiles: BTreeMap<String, f64>,
    /// The largest `log(observed / fitted)` among the samples (0 without samples).
    pub max_log_residual: f64,
}

impl Default for EnvironmentFit {
    /// No observation: physics as it is.
    fn default() -> EnvironmentFit {
        EnvironmentFit {
            samples: 0,
            context_mib: None,
            allocator_fixed_mib: 0.0,
            activation_scale: 1.0,
            cache_scale: 1.0,
            log_residual_quantiles: BTreeMap::new(),
            max_log_residual: 0.0,
        }
    }
}

/// The parameters in the order of the regression's columns.
const CONTEXT: usize = 0;
const FIXED: usize = 1;
const ACTIVATIONS: usize = 2;
const CACHE: usize = 3;
const PARAMETERS: usize = 4;

/// The figure's exact part: what the environment does not change.
fn exact_mib(p: &Breakdown, measure: Measure) -> f64 {
    let weights = if measure.counts_weights() {
        p.parameters
    } else {
        0.0
    };
    let paged = if measure.counts_context() {
        p.paged_optimizer_state
    } else {
        0.0
    };
    weights + p.gradients + p.optimizer_state + p.temporaries + p.collective_buffers + paged
}

/// The regression's row of a job: how much each parameter adds to its figure per unit.
fn design(p: &Breakdown, measure: Measure) -> [f64; PARAMETERS] {
    [
        if measure.counts_context() { 1.0 } else { 0.0 },
        1.0,
        p.activations.max(0.0),
        if measure.counts_cache() {
            p.allocator_cache.max(0.0)
        } else {
            0.0
        },
    ]
}

fn usable(sample: &EnvironmentSample) -> bool {
    sample.observed_mib.is_finite()
        && sample.observed_mib > 0.0
        && [
            sample.predicted.total(),
            sample.predicted.activations,
            sample.predicted.allocator_cache,
            sample.predicted.cuda_context,
        ]
        .iter()
        .all(|v| v.is_finite())
}

/// Fits what the environment of `samples` changes (see the module's doc). Samples with a
/// non-positive or non-finite figure are ignored; none leaves physics as it is.
///
/// Which parameters are free: the context when some sample counts it; the allocator's fixed
/// cost when some sample does not (with device figures only, the two cannot be told apart and
/// the context takes the fixed cost); the scales from [`MIN_SAMPLES_FOR_SCALES`] samples on,
/// when some sample has the category.
pub fn fit_environment(samples: &[EnvironmentSample]) -> EnvironmentFit {
    let samples: Vec<&EnvironmentSample> = samples.iter().filter(|s| usable(s)).collect();
    let mut fit = fit_parameters(&samples);
    let mut logs = held_out_log_residuals(&samples);
    logs.sort_by(f64::total_cmp);
    let n = logs.len();
    fit.max_log_residual = logs.last().copied().unwrap_or(0.0);
    fit.log_residual_quantiles = QUANTILES
        .iter()
        .filter_map(|(key, p)| {
            // The rank (n + 1) p, rounded up: a new job's residual lies above it with
            // probability at most 1 - p.
            let rank = ((n + 1) as f64 * p).ceil() as usize;
            (rank >= 1 && rank <= n).then(|| (key.to_string(), logs[rank - 1]))
        })
        .collect();
    fit
}

/// Each sample's `log(observed / fitted)` against a fit without its fold.
fn held_out_log_residuals(samples: &[&EnvironmentSample]) -> Vec<f64> {
    let n = samples.len();
    let folds = n.min(CROSS_FOLDS);
    let mut logs = Vec::with_capacity(n);
    for fold in 0..folds {
        let others: Vec<&EnvironmentSample> = samples
            .iter()
            .enumerate()
            .filter(|(i, _)| i % folds != fold)
            .map(|(_, s)| *s)
            .collect();
        let fit = fit_parameters(&others);
        logs.extend(
            samples
                .iter()
                .skip(fold)
                .step_by(folds)
                .map(|s| (s.observed_mib / fitted_mib(&fit, &s.predicted, s.measure)).ln()),
        );
    }
    logs
}

/// The environment's parameters fitted to usable `samples`, without residual quantiles.
fn fit_parameters(samples: &[&EnvironmentSample]) -> EnvironmentFit {
    let n = samples.len();
    if n == 0 {
        return EnvironmentFit::default();
    }
    let rows: Vec<[f64; PARAMETERS]> = samples
        .iter()
        .map(|s| design(&s.predicted, s.measure))
        .collect();
    let targets: Vec<f64> = samples
        .iter()
        .map(|s| s.observed_mib - exact_mib(&s.predicted, s.measure))
        .collect();
    // Squared relative residuals, in units of a job's own error: an error of 10 % weighs the
    // same on 2 GiB as on 80 GiB.
    let base: Vec<f64> = samples
        .iter()
        .map(|s| (JOB_RELATIVE_ERROR * s.observed_mib).powi(-2))
        .collect();

    let mut contexts: Vec<f64> = samples.iter().map(|s| s.predicted.cuda_context).collect();
    let physics_context =
        quantile(&mut contexts, 0.5).clamp(CONTEXT_RANGE_MIB.0, CONTEXT_RANGE_MIB.1);
    let counts_context = samples.iter().any(|s| s.measure.counts_context());
    let scales = n >= MIN_SAMPLES_FOR_SCALES;
    let free = [
        counts_context,
        samples.iter().any(|s| !s.measure.counts_context()),
        scales && rows.iter().any(|r| r[ACTIVATIONS] > 0.0),
        scales && rows.iter().any(|r| r[CACHE] > 0.0),
    ];
    let lower = [
        CONTEXT_RANGE_MIB.0,
        ALLOCATOR_FIXED_RANGE_MIB.0,
        SCALE_RANGE.0,
        SCALE_RANGE.0,
    ];
    let upper = [
        CONTEXT_RANGE_MIB.1,
        ALLOCATOR_FIXED_RANGE_MIB.1,
        SCALE_RANGE.1,
        SCALE_RANGE.1,
    ];
    let prior = [physics_context, 0.0, 1.0, 1.0];
    // The shrinkage: for a fixed cost its prior spread; for a scale, PRIOR_SAMPLES times the
    // curvature an average sample gives it.
    let mut shrink = [
        FIXED_COST_PRIOR_MIB.powi(-2),
        FIXED_COST_PRIOR_MIB.powi(-2),
        0.0,
        0.0,
    ];
    for j in [ACTIVATIONS, CACHE] {
        shrink[j] = PRIOR_SAMPLES
            * rows
                .iter()
                .zip(&base)
                .map(|(r, w)| w * r[j] * r[j])
                .sum::<f64>()
            / n as f64;
    }

    let mut theta = prior;
    for _ in 0..ITERATIONS {
        let weights: Vec<f64> = (0..n)
            .map(|i| {
                let fitted: f64 = (0..PARAMETERS).map(|j| rows[i][j] * theta[j]).sum();
                let relative = ((targets[i] - fitted) / samples[i].observed_mib).abs();
                base[i] * (HUBER_DELTA / relative.max(1e-12)).min(1.0)
            })
            .collect();
        let next = bounded_weighted_least_squares(
            &rows, &targets, &weights, &free, &prior, &shrink, &lower, &upper,
        );
        let moved = (0..PARAMETERS).any(|j| (next[j] - theta[j]).abs() > 1e-9 * (1.0 + theta[j]));
        theta = next;
        if !moved {
            break;
        }
    }

    EnvironmentFit {
        samples: n,
        context_mib: counts_context.then_some(theta[CONTEXT]),
        allocator_fixed_mib: theta[FIXED],
        activation_scale: theta[ACTIVATIONS],
        cache_scale: theta[CACHE],
        log_residual_quantiles: BTreeMap::new(),
        max_log_residual: 0.0,
    }
}

/// Minimises `Σ w (y - x·θ)² + Σ shrink (θ - prior)²` over the free parameters within their
/// bounds (the others at their prior): solved unconstrained, then the parameter furthest out
/// of its bounds is held at the bound and the rest solved again, until all are inside.
#[allow(clippy::too_many_arguments)]
fn bounded_weighted_least_squares(
    rows: &[[f64; PARAMETERS]],
    targets: &[f64],
    weights: &[f64],
    free: &[bool; PARAMETERS],
    prior: &[f64; PARAMETERS],
    shrink: &[f64; PARAMETERS],
    lower: &[f64; PARAMETERS],
    upper: &[f64; PARAMETERS],
) -> [f64; PARAMETERS] {
    let mut held: [Option<f64>; PARAMETERS] = [None; PARAMETERS];
    for j in 0..PARAMETERS {
        if !free[j] {
            held[j] = Some(prior[j]);
        }
    }
    loop {
        let open: Vec<usize> = (0..PARAMETERS).filter(|&j| held[j].is_none()).collect();
        let mut theta = held.map(|h| h.unwrap_or(0.0));
        let m = open.len();
        let mut a = vec![vec![0.0; m + 1]; m];
        for (i, row) in rows.iter().enumerate() {
            let residual_target =
                targets[i] - (0..PARAMETERS).map(|j| row[j] * theta[j]).sum::<f64>();
            for (r, &jr) in open.iter().enumerate() {
                for (c, &jc) in open.iter().enumerate() {
                    a[r][c] += weights[i] * row[jr] * row[jc];
                }
                a[r][m] += weights[i] * row[jr] * residual_target;
            }
        }
        for (r, &j) in open.iter().enumerate() {
            a[r][r] += shrink[j];
            a[r][m] += shrink[j] * prior[j];
        }
        let Some(solution) = solve(a) else {
            // Singular (no weight on a free parameter): keep it at its prior.
            for &j in &open {
                held[j] = Some(prior[j]);
            }
            continue;
        };
        for (&j, value) in open.iter().zip(solution) {
            theta[j] = value;
        }
        let furthest = open
            .iter()
            .map(|&j| {
                let out = (lower[j] - theta[j]).max(theta[j] - upper[j]);
                (out / (upper[j] - lower[j]), j)
            })
            .filter(|&(out, _)| out > 0.0)
            .max_by(|a, b| a.0.total_cmp(&b.0));
        match furthest {
            Some((_, j)) => held[j] = Some(theta[j].clamp(lower[j], upper[j])),
            None => return theta,
        }
    }
}

/// Gaussian elimination with partial pivoting on an augmented `m × (m + 1)` matrix.
fn solve(mut a: Vec<Vec<f64>>) -> Option<Vec<f64>> {
    let m = a.len();
    for c in 0..m {
        let pivot = (c..m).max_by(|&x, &y| a[x][c].abs().total_cmp(&a[y][c].abs()))?;
        if a[pivot][c].abs() < 1e-300 {
            return None;
        }
        a.swap(c, pivot);
        let pivot_row = a[c].clone();
        for (r, row) in a.iter_mut().enumerate() {
            if r != c {
                let factor = row[c] / pivot_row[c];
                for (x, p) in row[c..].iter_mut().zip(&pivot_row[c..]) {
                    *x -= factor * p;
                }
            }
        }
    }
    Some((0..m).map(|i| a[i][m] / a[i][i]).collect())
}

/// The categories of a job as this environment holds them (device level): activations and
/// cache scaled, the context replaced, the allocator's fixed cost in the temporaries (taken
/// out of the temporaries, then the cache, when it is negative). The exact categories stay.
pub fn calibrated_breakdown(fit: &EnvironmentFit, predicted: &Breakdown) -> Breakdown {
    let mut parts = *predicted;
    parts.activations = predicted.activations.max(0.0) * fit.activation_scale;
    parts.allocator_cache = predicted.allocator_cache.max(0.0) * fit.cache_scale;
    if let Some(context) = fit.context_mib {
        parts.cuda_context = context;
    }
    let mut fixed = fit.allocator_fixed_mib;
    if fixed >= 0.0 {
        parts.temporaries += fixed;
    } else {
        for category in [&mut parts.temporaries, &mut parts.allocator_cache] {
            let taken = (-fixed).min(category.max(0.0));
            *category -= taken;
            fixed += taken;
        }
    }
    parts
}

/// The fitted figure of a job measured as `measure`: never below its exact model state and
/// buffers (and, when the figure counts it, the least context).
pub fn fitted_mib(fit: &EnvironmentFit, predicted: &Breakdown, measure: Measure) -> f64 {
    let x = design(predicted, measure);
    let context = fit.context_mib.unwrap_or(predicted.cuda_context);
    let theta = [
        context,
        fit.allocator_fixed_mib,
        fit.activation_scale,
        fit.cache_scale,
    ];
    let figure =
        exact_mib(predicted, measure) + (0..PARAMETERS).map(|j| x[j] * theta[j]).sum::<f64>();
    figure.max(floor_mib(predicted, measure)).max(1.0)
}

/// The bytes no environment removes: the model state and the layout's buffers, the paged state
/// and the least context where the figure counts them.
fn floor_mib(p: &Breakdown, measure: Measure) -> f64 {
    let weights = if measure.counts_weights() {
        p.parameters
    } else {
        0.0
    };
    let outside = if measure.counts_context() {
        p.paged_optimizer_state + CONTEXT_RANGE_MIB.0.min(p.cuda_context.max(0.0))
    } else {
        0.0
    };
    weights + p.gradients + p.optimizer_state + p.collective_buffers + outside
}

/// The key of the stored quantile that answers at `confidence`: the first at or above it.
fn quantile_key(confidence: f64) -> &'static str {
    QUANTILES
        .iter()
        .find(|(_, p)| *p >= confidence - 1e-12)
        .unwrap_or(&QUANTILES[QUANTILES.len() - 1])
        .0
}

/// Whether the fit rests on enough samples for its own quantile at `confidence`.
fn has_own_quantile(fit: &EnvironmentFit, confidence: f64) -> bool {
    fit.log_residual_quantiles
        .contains_key(quantile_key(confidence))
}

/// The log margin of the bound at `confidence`: the stored conformal quantile at or above it,
/// never below 0. While the samples are too few for that quantile's rank, the fit cannot know
/// its own spread across jobs, so the margin is the largest of the held-out residuals seen,
/// [`FEW_SAMPLES_LOG_MARGIN`] and `prior_log_margin`: the uncalibrated bound's margin for the
/// job, which a few observations may not narrow.
pub fn log_margin(fit: &EnvironmentFit, confidence: f64, prior_log_margin: f64) -> f64 {
    match fit.log_residual_quantiles.get(quantile_key(confidence)) {
        Some(margin) => margin.max(0.0),
        None => fit
            .max_log_residual
            .max(FEW_SAMPLES_LOG_MARGIN)
            .max(prior_log_margin),
    }
}

/// The calibrated device figure of a job and its upper bound at `confidence`, MiB;
/// `prior_log_margin` is `ln(bound / estimate)` of the job's uncalibrated answer
/// ([`log_margin`]).
pub fn apply(
    fit: &EnvironmentFit,
    predicted: &Breakdown,
    confidence: f64,
    prior_log_margin: f64,
) -> (f64, f64) {
    apply_measured(
        fit,
        predicted,
        Measure::Device,
        confidence,
        prior_log_margin,
    )
}

/// [`apply`] for a figure of another kind (what a published run measured).
pub fn apply_measured(
    fit: &EnvironmentFit,
    predicted: &Breakdown,
    measure: Measure,
    confidence: f64,
    prior_log_margin: f64,
) -> (f64, f64) {
    let estimate = fitted_mib(fit, predicted, measure);
    let margin = log_margin(fit, confidence, prior_log_margin);
    let mut bound = estimate * margin.exp();
    if !has_own_quantile(fit, confidence) {
        // Too few samples to know the fit's own errors: the fit may move the figure, but not
        // below the uncalibrated bound, whose coverage the held-out quantiles measured. That
        // bound's margin is a ratio of the device's figure: on another measure it is the same
        // MiB above that measure's figure, not the same ratio.
        let physics = EnvironmentFit::default();
        let device = fitted_mib(&physics, predicted, Measure::Device);
        let prior = fitted_mib(&physics, predicted, measure) + device * prior_log_margin.exp_m1();
        bound = bound.max(prior);
    }
    (estimate, bound)
}

#[cfg(test)]
mod tests {
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

    /// What an environment with a 600 MiB context, activations ×1.3 and cache ×0.8 shows.
    fn observed(predicted: &Breakdown) -> f64 {
        4100.0 + 1.3 * predicted.activations + 0.8 * predicted.allocator_cache + 600.0
    }

    fn samples(activations: &[f64]) -> Vec<EnvironmentSample> {
        activations
            .iter()
            .map(|&a| EnvironmentSample::device(job(a), observed(&job(a))))
            .collect()
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

    #[test]
    fn one_device_observation_moves_only_the_context() {
        let fit = fit_environment(&samples(&[4000.0]));
        assert_eq!(fit.activation_scale, 1.0);
        assert_eq!(fit.cache_scale, 1.0);
        assert_eq!(fit.allocator_fixed_mib, 0.0);
        // Physics says 10200 with a 1700 MiB context; 10220 was seen: the context takes the
        // residual, shrunk toward physics (one 10 GiB job says little about a fixed cost).
        let context = fit.context_mib.unwrap();
        assert!(context > 1700.0 && context < 1720.0, "{context}");
    }

    #[test]
    fn the_context_stays_within_physical_limits() {
        // Twenty readings of a small job: physics' 1700 MiB context is not there at all...
        let small = job(100.0);
        let low = vec![EnvironmentSample::device(small, small.total() - 1700.0); 20];
        let fit = fit_environment(&low);
        assert_eq!(fit.context_mib, Some(CONTEXT_RANGE_MIB.0));
        assert!(
            fit.max_log_residual < 0.0,
            "what the context cannot take stays a residual"
        );
        // ... or 6 GiB more.
        let high = vec![EnvironmentSample::device(small, small.total() + 6000.0); 20];
        assert_eq!(
            fit_environment(&high).context_mib,
            Some(CONTEXT_RANGE_MIB.1)
        );
    }

    #[test]
    fn many_observations_recover_the_environment() {
        let fit = fit_environment(&ten());
        // Shrunk toward physics (1, and its own context) by the priors: most of the way to
        // the truth (activations ×1.3, cache ×0.8, a 600 MiB context), not all.
        assert!(
            fit.activation_scale > 1.1 && fit.activation_scale < 1.3,
            "{fit:?}"
        );
        assert!(fit.cache_scale > 0.8 && fit.cache_scale < 1.0, "{fit:?}");
        let context = fit.context_mib.unwrap();
        assert!(context > 600.0 && context < 1700.0, "{fit:?}");
        let job = job(7000.0);
        let (estimate, bound) = apply(&fit, &job, 0.95, 0.0);
        let truth = observed(&job);
        assert!(
            (estimate / truth - 1.0).abs() < 0.03,
            "{estimate} vs {truth}"
        );
        assert!(bound >= estimate);
    }

    #[test]
    fn one_wild_reading_among_ten_moves_the_fit_little() {
        let clean = fit_environment(&ten());
        let mut wild = ten();
        wild[4].observed_mib *= 5.0;
        let wild = fit_environment(&wild);
        for a in [1000.0, 7000.0, 18_000.0] {
            let (c, _) = apply(&clean, &job(a), 0.95, 0.0);
            let (w, _) = apply(&wild, &job(a), 0.95, 0.0);
            assert!((w / c - 1.0).abs() < 0.02, "{a}: {w} vs {c}");
        }
        assert!(
            wild.max_log_residual > 1.0,
            "the wild one shows in the tail"
        );
    }

    #[test]
    fn allocated_figures_teach_the_allocator_fixed_cost_and_not_the_context() {
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
        // 300 MiB more in both, shrunk toward 0 by its prior.
        let fixed = fit.allocator_fixed_mib;
        assert!(fixed > 150.0 && fixed < 300.0, "{fit:?}");
        let (estimate, _) = apply(&fit, &job(3000.0), 0.95, 0.0);
        assert!((estimate - (4100.0 + 3000.0 + 300.0 + fixed + 1700.0)).abs() < 1e-6);
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
        let (estimate, bound) = apply(&fit, &small, 0.95, 0.0);
        assert_eq!(estimate, 4000.0 + CONTEXT_RANGE_MIB.0);
        assert!(bound > estimate, "few samples: the bound keeps a margin");
        let parts = calibrated_breakdown(&fit, &small);
        assert_eq!(
            parts.parameters + parts.gradients + parts.optimizer_state,
            4000.0
        );
        assert!(parts.temporaries >= 0.0 && parts.allocator_cache >= 0.0);
    }

    #[test]
    fn a_few_observations_do_not_narrow_the_uncalibrated_bound() {
        let samples = |n: usize| -> Vec<EnvironmentSample> {
            (0..n)
                .map(|i| EnvironmentSample {
                    predicted: job(1000.0 + 500.0 * i as f64),
                    observed_mib: job(1000.0 + 500.0 * i as f64).total(),
                    measure: Measure::Device,
                })
                .collect()
        };
        // Three exact observations: the residuals say nothing of other jobs' spread.
        let few = fit_environment(&samples(3));
        assert_eq!(log_margin(&few, 0.95, 0.0), FEW_SAMPLES_LOG_MARGIN);
        assert_eq!(log_margin(&few, 0.95, 0.4), 0.4);
        let (estimate, bound) = apply(&few, &job(3000.0), 0.95, 0.4);
        assert!((bound / estimate - 0.4_f64.exp()).abs() < 1e-9);
        // Nineteen: the rank 20 x 0.95 exists, the environment's own quantiles answer,
        // whatever the prior; with 18 the prior still holds.
        let many = fit_environment(&samples(19));
        assert!(many.log_residual_quantiles.contains_key("0.95"));
        assert_eq!(log_margin(&many, 0.95, 0.4), log_margin(&many, 0.95, 0.0));
        let fewer = fit_environment(&samples(18));
        assert_eq!(log_margin(&fewer, 0.95, 0.4), 0.4);
    }

    #[test]
    fn a_few_observations_may_lower_the_figure_but_not_the_uncalibrated_bound() {
        // Three jobs that used 30 % less than predicted: the figure falls, the bound holds.
        let lower: Vec<EnvironmentSample> = (0..3)
            .map(|i| EnvironmentSample {
                predicted: job(4000.0 + 2000.0 * i as f64),
                observed_mib: 0.7 * job(4000.0 + 2000.0 * i as f64).total(),
                measure: Measure::Device,
            })
            .collect();
        let fit = fit_environment(&lower);
        let (estimate, bound) = apply(&fit, &job(5000.0), 0.95, 0.4);
        assert!(estimate < 0.95 * job(5000.0).total(), "{estimate}");
        assert!(
            bound >= job(5000.0).total() * 0.4_f64.exp() - 1e-9,
            "{bound}"
        );
    }

    #[test]
    fn no_samples_leave_physics_as_it_is() {
        let fit = fit_environment(&[]);
        assert_eq!(fit, EnvironmentFit::default());
        let (estimate, _) = apply(&fit, &job(3000.0), 0.95, 0.0);
        assert!((estimate - job(3000.0).total()).abs() < 1e-9);
        assert_eq!(calibrated_breakdown(&fit, &job(3000.0)), job(3000.0));
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
}
