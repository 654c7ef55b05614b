//! What a software environment (driver, CUDA, PyTorch, cuDNN/cuBLAS, allocator settings) and
//! the stack that trains in it (a framework's engine, its master copies, buffers and kernels)
//! change in a job's memory, learned per category from a few observed peaks.
//!
//! The fit has two stages:
//!
//! 1. **The stack's factor** `f` on everything the allocator holds (model state, buffers,
//!    activations, temporaries, cache), the context left to stage 2. A framework changes
//!    exactly those bytes (fp32 master weights and gradient buffers, bucket sizes, its own
//!    kernels' saved tensors): InternEvo's runs lie 1.27-1.65x their figures, and one factor
//!    per stack would leave ~6 % of their 32 % (issue 44); over the published runs, one factor
//!    per framework leaves 0.2-23 % (docs/reports/stack-learning.md, "floor"). `ln f`
//!    is a robust (Huber) weighted mean of the observations' `ln(allocator part observed /
//!    predicted)`, shrunk toward 0 with the spread between stacks ([`BETWEEN_STACKS_LOG_SD`])
//!    as its prior: one observation of a large job moves the figure 61 % of the way (in log),
//!    three 82 %, and a small job, whose residual may be its context's, less
//!    ([`CONTEXT_SPREAD_MIB`]). `f` stays
//!    within [`FACTOR_RANGE`], the most any number of observations may move an answer.
//! 2. **The categories** on the stack-scaled breakdown, as below: the context, the allocator's
//!    fixed cost and, from [`MIN_SAMPLES_FOR_SCALES`] observations on, the activation and cache
//!    scales relative to the stack's (per category where the rows disagree with one factor).
//!
//! The bound of an environment is its own from the first observation: the predictive
//! distribution of a new job's `ln(observed / figure)` given the observations' scatter around
//! the factor, with a prior scatter [`WITHIN_STACK_LOG_SD`] worth [`WITHIN_STACK_PRIOR_DOF`]
//! observations (a normal model with unknown spread: a Student t with `prior_dof + n` degrees
//! of freedom, [`StackSpread`]). It narrows as consistent rows come, widens when they scatter,
//! and from the rank `(n + 1) c` on the held-out residuals' conformal quantile takes over.
//!
//! Stage 2's model, on the stack-scaled breakdown:
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
//! `c` once there are enough samples for that rank (19 at 0.95); until then the stack's
//! predictive spread answers (stage 1).

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
/// The range of the stack's factor ([`EnvironmentFit::stack_factor`]): the most any number
/// of observations may move an environment's answers (with stage 2's context and fixed cost
/// within their own ranges). Why: over the published runs the frameworks' median
/// `observed / figure` lies within 0.90-1.38 (single runs up to 3.75, a framework's setups
/// disagreeing), InternEvo's within 1.27-1.65 (issue 44); beyond 2x the job is mis-described
/// (the wrong model, setup or card), which calibration must not learn as a property of the
/// stack.
pub const FACTOR_RANGE: (f64, f64) = (0.5, 2.0);
/// The spread of `ln f` between stacks, the factor's prior (mean 0: physics is right on
/// average). Measured on the published runs (training/gpucast_training/stacks.py's rows): the
/// log-sd of the ten frameworks' median `ln(observed / figure)` is 0.11, but physics was
/// partly checked on those sources; the stacks held back from it lie further out (InternEvo's
/// runs 21-39 % above their figures, an older model code path 22 %), so the prior is wider.
pub const BETWEEN_STACKS_LOG_SD: f64 = 0.25;
/// The prior scatter of one stack's jobs around its factor, log-sd. Measured on the published
/// runs: around each framework's median `ln(observed / figure)`, 1.48 MAD is 0.16 and the sd
/// 0.28 (heavy tails: a framework's rows mix setups). Through the service, leave one
/// framework out, three observations: 0.2 worth 2 observations left 2.3 % of the asked runs
/// above the 0.95 bound on average over ten frameworks (one framework above 8 %) at a median
/// width of 1.45x; 0.15 worth 1 left 5.6 % (three above 8 %) at 1.35x
/// (docs/reports/stack-learning.md, and its version at commit 95c605a): coverage first, a
/// missed OOM costing more than a refused fit. With [`BETWEEN_STACKS_LOG_SD`] it makes the
/// spread of a never-observed stack's jobs, `sqrt(0.25² + 0.2²) = 0.32` (a 0.95 margin of
/// x1.70): the
/// published runs' own 0.95 quantile of `ln(observed / figure)`, each framework weighted
/// alike, is 0.53 (x1.70).
pub const WITHIN_STACK_LOG_SD: f64 = 0.2;
/// How many observations the prior scatter is worth: two, so that a stack's own scatter takes
/// over from its third observation.
pub const WITHIN_STACK_PRIOR_DOF: f64 = 2.0;
/// How far a job's fixed costs (context, workspaces) may lie from physics' before they are
/// fitted, MiB: a small job's residual says less about the stack's factor than a large one's.
pub const CONTEXT_SPREAD_MIB: f64 = 512.0;
/// Huber's threshold on an observation's standardised log residual around the factor: beyond
/// it an observation counts linearly, so one wild reading among consistent ones moves the
/// factor by at most `FACTOR_HUBER` standard deviations over the observations' count.
pub const FACTOR_HUBER: f64 = 1.5;
const ITERATIONS: usize = 50;

/// The range `[low, high]` an environment's fit may take a device figure to, around physics'
/// `figure`, MiB: the factor's range, and a CUDA context's range beyond it; its bound at most
/// the `high` of the uncalibrated bound. The largest effect of any number of observations,
/// wrong ones included (docs/user/calibration.md).
pub fn reach(figure: f64) -> (f64, f64) {
    (
        figure * FACTOR_RANGE.0,
        figure * FACTOR_RANGE.1 + CONTEXT_RANGE_MIB.1,
    )
}

/// The predictive spread of a new job's `ln(observed / figure)` in a stack: a Student t with
/// `dof` degrees of freedom and this `scale` (the posterior scatter, widened by the factor's
/// own uncertainty).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StackSpread {
    pub scale: f64,
    pub dof: f64,
}

impl StackSpread {
    /// Before any observation: the factor unknown within the spread between stacks.
    fn prior() -> StackSpread {
        StackSpread {
            scale: (WITHIN_STACK_LOG_SD.powi(2) + BETWEEN_STACKS_LOG_SD.powi(2)).sqrt(),
            dof: WITHIN_STACK_PRIOR_DOF,
        }
    }

    /// A job of a stack the physics does not follow, never observed: its factor anywhere
    /// within the spread between stacks, its own scatter around it; both known from the
    /// published runs (a normal: the spreads are not estimated from the job's own rows).
    pub fn between_stacks() -> StackSpread {
        StackSpread {
            dof: f64::INFINITY,
            ..StackSpread::prior()
        }
    }

    /// The spread of a stack's factor alone, never observed: where the figures of the other
    /// stacks lie around physics' (their jobs' own scatter aside).
    pub fn stack_factor() -> StackSpread {
        StackSpread {
            scale: BETWEEN_STACKS_LOG_SD,
            dof: f64::INFINITY,
        }
    }

    /// The log margin at `confidence`: the t quantile times the scale.
    pub fn log_margin(&self, confidence: f64) -> f64 {
        student_t_quantile(confidence.clamp(0.5, 0.9999), self.dof) * self.scale
    }
}

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
    /// The stack's factor on what the allocator holds (stage 1): 1 is physics.
    pub stack_factor: f64,
    /// A new job's `ln(observed / figure)` in this stack, predicted from the observations.
    pub spread: StackSpread,
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
            stack_factor: 1.0,
            spread: StackSpread::prior(),
        }
    }
}

/// A breakdown with what the allocator holds times `factor` (the context outside stays).
fn stack_scaled(p: &Breakdown, factor: f64) -> Breakdown {
    Breakdown {
        parameters: p.parameters * factor,
        gradients: p.gradients * factor,
        optimizer_state: p.optimizer_state * factor,
        activations: p.activations * factor,
        temporaries: p.temporaries * factor,
        collective_buffers: p.collective_buffers * factor,
        paged_optimizer_state: p.paged_optimizer_state * factor,
        allocator_cache: p.allocator_cache * factor,
        cuda_context: p.cuda_context,
    }
}

/// What a figure of `measure` counts outside the allocator's scaled part, MiB: the context
/// where the figure counts it.
fn outside_mib(p: &Breakdown, measure: Measure) -> f64 {
    if measure.counts_context() {
        p.cuda_context.max(0.0)
    } else {
        0.0
    }
}

/// The part of a figure of `measure` the stack's factor scales, MiB.
fn scaled_part_mib(p: &Breakdown, measure: Measure) -> f64 {
    exact_mib(p, measure) + design(p, measure)[ACTIVATIONS] + design(p, measure)[CACHE]
}

/// Stage 1: the stack's factor and the predictive spread of a new job around it (see the
/// module's doc).
fn fit_stack(samples: &[&EnvironmentSample]) -> (f64, StackSpread) {
    // Each observation's log ratio of the scaled part, and its precision: the within-stack
    // scatter, plus what a fixed cost off by CONTEXT_SPREAD_MIB does to a part that small.
    let points: Vec<(f64, f64)> = samples
        .iter()
        .filter_map(|s| {
            let part = scaled_part_mib(&s.predicted, s.measure);
            if part <= 1.0 {
                return None;
            }
            let observed =
                (s.observed_mib - outside_mib(&s.predicted, s.measure)).max(FACTOR_RANGE.0 * part);
            let ratio = (observed / part).ln();
            let variance = WITHIN_STACK_LOG_SD.powi(2) + (CONTEXT_SPREAD_MIB / part).powi(2);
            Some((ratio, 1.0 / variance))
        })
        .collect();
    if points.is_empty() {
        return (1.0, StackSpread::prior());
    }
    let (lo, hi) = (FACTOR_RANGE.0.ln(), FACTOR_RANGE.1.ln());
    let prior_precision = BETWEEN_STACKS_LOG_SD.powi(-2);
    // Huber's weighted mean, shrunk toward 0: iteratively reweighted.
    let mut log_factor = 0.0;
    let mut huber = vec![1.0; points.len()];
    for _ in 0..ITERATIONS {
        let (num, den) = points
            .iter()
            .zip(&huber)
            .fold((0.0, prior_precision), |(n, d), ((r, w), h)| {
                (n + h * w * r, d + h * w)
            });
        let next = (num / den).clamp(lo, hi);
        huber = points
            .iter()
            .map(|(r, w)| {
                let z = ((r - next) * w.sqrt()).abs();
                (FACTOR_HUBER / z.max(1e-12)).min(1.0)
            })
            .collect();
        let moved = (next - log_factor).abs() > 1e-12;
        log_factor = next;
        if !moved {
            break;
        }
    }
    // The spread: a normal model whose scatter has WITHIN_STACK_LOG_SD as its prior, worth
    // WITHIN_STACK_PRIOR_DOF observations; each observation counts as much as its precision
    // says (a large job as one), its deviation clipped where Huber's weight did.
    let unit = WITHIN_STACK_LOG_SD.powi(-2);
    let counts: Vec<f64> = points
        .iter()
        .zip(&huber)
        .map(|((_, w), h)| (h * w / unit).min(1.0))
        .collect();
    let n: f64 = counts.iter().sum();
    let scatter: f64 = points
        .iter()
        .zip(&counts)
        .map(|((r, w), c)| {
            let clip = FACTOR_HUBER / w.sqrt();
            c * (r - log_factor).clamp(-clip, clip).powi(2)
        })
        .sum();
    // The factor's own uncertainty, in observations: the prior's (the within-stack scatter
    // over the spread between stacks) plus the observations'.
    let prior_count = (WITHIN_STACK_LOG_SD / BETWEEN_STACKS_LOG_SD).powi(2);
    let dof = WITHIN_STACK_PRIOR_DOF + n;
    let variance = (WITHIN_STACK_PRIOR_DOF * WITHIN_STACK_LOG_SD.powi(2) + scatter) / dof;
    let spread = StackSpread {
        scale: (variance * (1.0 + 1.0 / (prior_count + n))).sqrt(),
        dof,
    };
    (log_factor.exp(), spread)
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
    let mut fit = fit_both(&samples);
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
        let fit = fit_both(&others);
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

/// Both stages fitted to usable `samples`, without residual quantiles: the stack's factor,
/// then the categories on the breakdowns it scales.
fn fit_both(samples: &[&EnvironmentSample]) -> EnvironmentFit {
    let (stack_factor, spread) = fit_stack(samples);
    let scaled: Vec<EnvironmentSample> = samples
        .iter()
        .map(|s| EnvironmentSample {
            predicted: stack_scaled(&s.predicted, stack_factor),
            ..**s
        })
        .collect();
    let scaled: Vec<&EnvironmentSample> = scaled.iter().collect();
    EnvironmentFit {
        stack_factor,
        spread,
        ..fit_parameters(&scaled)
    }
}

/// Stage 2's parameters fitted to usable `samples`, without residual quantiles.
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
        ..EnvironmentFit::default()
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
    let predicted = &stack_scaled(predicted, fit.stack_factor);
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
    let predicted = &stack_scaled(predicted, fit.stack_factor);
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

/// The log margin of the bound at `confidence`: the environment's conformal quantile at or
/// above it once the samples are enough for its rank, never below 0; until then the stack's
/// predictive spread ([`StackSpread::log_margin`]).
pub fn log_margin(fit: &EnvironmentFit, confidence: f64) -> f64 {
    match fit.log_residual_quantiles.get(quantile_key(confidence)) {
        Some(margin) => margin.max(0.0),
        None => fit.spread.log_margin(confidence),
    }
}

/// The calibrated device figure of a job and its upper bound at `confidence`, MiB.
pub fn apply(fit: &EnvironmentFit, predicted: &Breakdown, confidence: f64) -> (f64, f64) {
    apply_measured(fit, predicted, Measure::Device, confidence)
}

/// [`apply`] for a figure of another kind (what a published run measured). The margin widens
/// the part the stack scales, not the context outside it.
pub fn apply_measured(
    fit: &EnvironmentFit,
    predicted: &Breakdown,
    measure: Measure,
    confidence: f64,
) -> (f64, f64) {
    let estimate = fitted_mib(fit, predicted, measure);
    let margin = log_margin(fit, confidence);
    let context = fit.context_mib.unwrap_or(predicted.cuda_context).max(0.0);
    let outside = if measure.counts_context() {
        context.min(estimate)
    } else {
        0.0
    };
    let bound = estimate + (estimate - outside) * margin.exp_m1();
    (estimate, bound)
}

/// The inverse of the standard normal CDF, by Newton's method on `erfc` (a handful of steps
/// from a logistic start).
fn normal_quantile(p: f64) -> f64 {
    let cdf = |z: f64| 0.5 * libm::erfc(-z / std::f64::consts::SQRT_2);
    let density = |z: f64| (-0.5 * z * z).exp() / (2.0 * std::f64::consts::PI).sqrt();
    let mut z = (p / (1.0 - p)).ln() / 1.7;
    for _ in 0..40 {
        let step = (cdf(z) - p) / density(z).max(1e-300);
        z -= step;
        if step.abs() < 1e-12 {
            break;
        }
    }
    z
}

/// Student's t quantile at `p` with `dof` degrees of freedom: the Cornish-Fisher expansion in
/// `1 / dof` (Abramowitz and Stegun 26.7.5), within 0.3 % of the exact quantile at 0.95 from
/// 2 degrees of freedom on; below 2 it is read at 2 (wider than the normal, which is what a
/// bound of one observation needs).
pub fn student_t_quantile(p: f64, dof: f64) -> f64 {
    let z = normal_quantile(p);
    let v = dof.max(2.0);
    let z2 = z * z;
    let g1 = (z2 + 1.0) * z / 4.0;
    let g2 = ((5.0 * z2 + 16.0) * z2 + 3.0) * z / 96.0;
    let g3 = (((3.0 * z2 + 19.0) * z2 + 17.0) * z2 - 15.0) * z / 384.0;
    let g4 = ((((79.0 * z2 + 776.0) * z2 + 1482.0) * z2 - 1920.0) * z2 - 945.0) * z / 92160.0;
    z + g1 / v + g2 / v.powi(2) + g3 / v.powi(3) + g4 / v.powi(4)
}

#[cfg(test)]
mod tests;
