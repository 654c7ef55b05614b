//! Where a job is to run, beside the engine that answers it: the GPU a request names, that
//! GPU's calibration profile applied to the answer, whether (and how many copies of) the job
//! fits there, and the order in which to offer the cards of a list.
//!
//! - [`target`]: the card a request asks about, resolved in the catalogue, on the host or
//!   described by the request.
//! - [`fit`]: whether a job fits a card and how many copies of it do.
//! - [`rank`]: the order of a list's cards.
//! - here: [`place`], the answer moved onto a card by its profile, held to physics, and the
//!   decision read from the peak's distribution.

mod rank;
mod target;

pub use crate::bound::fit::{copies_within, decide, fit, Fit, FitBasis};
pub use rank::{rank, Candidate};
pub use target::{
    GpuAsk, PlacementError, Target, MAX_CUSTOM_CAPACITY_MIB, MAX_CUSTOM_NAME_CHARS,
    MAX_CUSTOM_PROFILES, REFERENCE_SKU,
};

use crate::bound::PeakDistribution;
use crate::calibration::environment::StackSpread;
use crate::calibration::label::Stack;
use crate::calibration::store::ProfileSnapshot;
use crate::estimators::MibAnswer;
use crate::job::MemoryFraction;
use crate::physics::assumed::AssumedRange;
use crate::physics::Physics;

/// The `stack` a request left unsaid, as an assumed field: transformers on PyTorch is
/// assumed, and what the other stacks would answer lies within the spread between stacks'
/// factors on the part a stack changes (all but the CUDA context), at `confidence` either
/// side. Listed, not added to the bound: the held-out errors the bound reads were measured
/// over published runs of many stacks, and a stack named and not modelled gets the spread
/// between stacks itself ([`place`]).
pub fn unsaid_stack(physics: &Physics, estimate_mib: f64, confidence: f64) -> AssumedRange {
    let context = physics.parts.cuda_context.clamp(0.0, estimate_mib);
    let margin = StackSpread::stack_factor().log_margin(confidence);
    let part = estimate_mib - context;
    AssumedRange {
        field: "stack",
        assumed: Stack::Transformers.as_str(),
        down_mib: part * (1.0 - (-margin).exp()),
        up_mib: part * (margin.exp() - 1.0),
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
    /// The environment whose profile was used; `None` for the GPU's own (or none).
    pub profile_environment: Option<String>,
    pub fit: Fit,
    pub fit_basis: FitBasis,
    /// The distribution of the peak the bound and the decision were read from.
    pub peak: PeakDistribution,
    /// What the bound rests on.
    pub basis: BoundBasis,
}

/// What a bound rests on (`memory.uncertainty.basis`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BoundBasis {
    /// The held-out errors of the job's group over the published and measured jobs: right
    /// for the stack they were measured on (transformers and PEFT on PyTorch, DeepSpeed
    /// ZeRO-2, FSDP), not known for others; observations of an environment narrow it.
    HeldOutGroups,
    /// The GPU's own calibration profile (its line and residuals).
    GpuProfile,
    /// The named environment's own observations: its stack's factor and their scatter.
    Environment,
    /// A stack the physics does not follow, without observations of its environment: the
    /// bound holds the spread between stacks ([`environment::StackSpread::between_stacks`]).
    BetweenStacks,
}

impl BoundBasis {
    pub fn as_str(self) -> &'static str {
        match self {
            BoundBasis::HeldOutGroups => "held_out_groups",
            BoundBasis::GpuProfile => "gpu_profile",
            BoundBasis::Environment => "environment",
            BoundBasis::BetweenStacks => "between_stacks",
        }
    }
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
    stack: Option<Stack>,
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
    // A stack observed to hold less than physics says lowers the model state in the floor.
    let floor = match &calibrated {
        Some(c) if c.cuda_context_mib.is_some() || c.stack_factor.is_some() => physics
            .floor_in_stack_mib(
                c.cuda_context_mib.unwrap_or(physics.parts.cuda_context),
                c.stack_factor.unwrap_or(1.0),
            ),
        _ => physics.floor_mib(),
    };
    let mut settled = physics.settle_above(floor, estimate_mib, upper_bound_mib);
    let mut basis = match &calibrated {
        Some(c) if c.stack_factor.is_some() => BoundBasis::Environment,
        Some(_) => BoundBasis::GpuProfile,
        None => BoundBasis::HeldOutGroups,
    };
    // A stack the held-out errors were not measured on, and no observation of it: the bound
    // holds the spread between stacks on the part a stack changes (all but the context).
    if basis != BoundBasis::Environment && stack.is_some_and(|s| !s.is_modelled()) {
        let context = physics.parts.cuda_context.clamp(0.0, settled.estimate_mib);
        let margin = StackSpread::between_stacks().log_margin(confidence);
        let between = context + (settled.estimate_mib - context) * margin.exp();
        settled.upper_bound_mib = settled.upper_bound_mib.max(between);
        basis = BoundBasis::BetweenStacks;
    }
    // The distribution the decision reads: the answer's, or around a calibrated figure with
    // the spread the profile's bound implies (observations narrow or widen it).
    let mut peak = *distribution;
    if calibrated.is_some() || basis == BoundBasis::BetweenStacks {
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
    let (oom_probability, fits) = decide(&peak, target.capacity_mib, physics, fraction, confidence);
    fit.oom_probability = oom_probability;
    fit.fits = fits;
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
        profile_environment: calibrated.as_ref().and_then(|c| c.environment.clone()),
        fit,
        fit_basis,
        peak,
        basis,
    }
}

#[cfg(test)]
mod tests;
