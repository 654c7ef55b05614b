//! Whether a job fits a card, and how many copies of it fit side by side.

use super::PeakDistribution;
use crate::job::MemoryFraction;
use crate::physics::Physics;

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

/// What `fits` and `max_colocated` rest on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FitBasis {
    /// The upper bound (a job without a simulation): a scheduler reserves the bound.
    UpperBound,
    /// The simulation's minimum capacity and reserved peak.
    Simulation,
}

/// The decision at `confidence`: the probability that the job runs out of memory on a card of
/// `capacity_mib` (within the cap of a memory fraction: what the allocator may hold beside the
/// context), and whether that is at most 1 - confidence.
pub fn decide(
    peak: &PeakDistribution,
    capacity_mib: u64,
    physics: &Physics,
    fraction: Option<MemoryFraction>,
    confidence: f64,
) -> (f64, bool) {
    let capacity = capacity_mib as f64;
    let context = physics.parts.cuda_context;
    let room = match fraction {
        Some(f) => (f.get() * capacity).min(capacity - context) + context,
        None => capacity,
    };
    let oom_probability = peak.oom_probability(room);
    (
        oom_probability,
        oom_probability <= 1.0 - confidence + DECISION_TOLERANCE,
    )
}

/// Rounding room in comparing a probability with 1 - confidence: a bound read at the
/// confidence and a capacity equal to it are a fit.
const DECISION_TOLERANCE: f64 = 1e-9;
