//! How far each field a request left unsaid moves the figure (`job::assumed`): the analytic
//! step run again with each of the field's other values. The ranges widen the bound
//! (`crate::bound`) and tell the caller which field to state to narrow it.

use super::peak::Physics;
use super::step::{self, StepStages};
use crate::job::setup::OptimizerImplementation;
use crate::job::{Alternative, Job};

/// How far one assumed field moves the figure over the values it could take: at most
/// `down_mib` lower, at most `up_mib` higher (both >= 0).
#[derive(Debug, Clone, PartialEq)]
pub struct AssumedRange {
    pub field: &'static str,
    pub assumed: &'static str,
    pub down_mib: f64,
    pub up_mib: f64,
}

impl AssumedRange {
    pub fn width_mib(&self) -> f64 {
        self.down_mib + self.up_mib
    }
}

/// Ranges narrower than this are left out: stating the field would not move the answer.
const MIN_RANGE_MIB: f64 = 1.0;

/// For a job the analytic step answers with `step_mib` (its own step's figure, before any
/// learned correction): each assumed field's moves of it over the field's alternatives, widest
/// first. Each alternative is the analytic step of the same layers again, with only the
/// stages the field reaches run again ([`StepStages::beside`]: the implementation its model
/// state's temporaries, the optimizer or master copy the state, a loss, attention or
/// checkpointing what backward keeps); but not for
/// another optimizer implementation when the step peaks at the start of backward
/// (`peak_at_backward`): the implementation only sets the optimizer step's temporaries, and
/// the alternatives only lower them, so they cannot move that peak.
/// `stages`: the job's own step, stage by stage, when already run.
pub fn ranges(
    job: &Job,
    stages: Option<&StepStages>,
    step_mib: f64,
    peak_at_backward: bool,
) -> Vec<AssumedRange> {
    if job.assumptions().is_empty() {
        return Vec::new();
    }
    let own;
    let base = match stages {
        Some(stages) => stages,
        None => {
            own = StepStages::of(job, job.setup(), job.known_activations());
            &own
        }
    };
    let mut out: Vec<AssumedRange> = job
        .assumptions()
        .iter()
        .filter_map(|assumption| {
            let (mut low, mut high) = (0.0f64, 0.0f64);
            for alternative in &assumption.alternatives {
                if peak_at_backward
                    && matches!(alternative, Alternative::OptimizerImplementation(_))
                {
                    continue;
                }
                let moved = step_figure(job, base, alternative) - step_mib;
                low = low.min(moved);
                high = high.max(moved);
            }
            (high - low >= MIN_RANGE_MIB).then_some(AssumedRange {
                field: assumption.field,
                assumed: assumption.assumed,
                down_mib: -low,
                up_mib: high,
            })
        })
        .collect();
    out.sort_by(|a, b| b.width_mib().total_cmp(&a.width_mib()));
    out
}

/// The analytic step's figure of `job` with `alternative` in place of the assumed value, as
/// the answer reads a figure ([`Physics::settle`]): `base`'s stages that the alternative does
/// not reach reused.
fn step_figure(job: &Job, base: &StepStages, alternative: &Alternative) -> f64 {
    let mut setup = job.setup().clone();
    let mut known = job.known_activations();
    match alternative {
        Alternative::Loss(_, other) | Alternative::Attention(other) => known = Some(*other),
        Alternative::OptimizerImplementation(implementation) => {
            setup.implementation = *implementation;
        }
        Alternative::Precision(precision, other) => {
            setup.precision = *precision;
            // A master copy belongs to pure 16-bit training only.
            setup.fp32_master &= precision.is_pure_16bit();
            known = *other;
        }
        Alternative::Optimizer(optimizer) => {
            setup.optimizer = *optimizer;
            // bitsandbytes' optimizers run fused only, the others keep the request's way.
            if !optimizer.runs_as(setup.implementation) {
                setup.implementation = OptimizerImplementation::Fused;
            }
        }
        Alternative::Checkpointing(checkpointing) => setup.checkpointing = checkpointing.clone(),
        Alternative::MasterWeights => setup.fp32_master = true,
        Alternative::Zero(zero) => setup.zero = *zero,
        Alternative::ExpertLayout(layout) => {
            if let Some(lora) = setup.lora.as_mut() {
                lora.expert_layout = *layout;
            }
        }
    }
    let memory = base.beside(job, &setup, known);
    // Debug builds (every test run) hold the reuse to the step run whole.
    debug_assert_eq!(memory, step::analytic_step_as(job, &setup, known));
    settled_figure(&Physics::from_step(&memory))
}

/// A step's figure held to its floor, as the answer reads it.
pub fn settled_figure(physics: &Physics) -> f64 {
    let total = physics.parts.total();
    physics.settle(total, total).estimate_mib
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bound::distribution::log_range;

    fn range(down: f64, up: f64) -> AssumedRange {
        AssumedRange {
            field: "f",
            assumed: "a",
            down_mib: down,
            up_mib: up,
        }
    }

    #[test]
    fn the_log_range_adds_each_fields_moves() {
        assert_eq!(log_range(&[], 1000.0), 0.0);
        let r = log_range(&[range(200.0, 0.0), range(100.0, 100.0)], 1000.0);
        assert!((r - (1100.0f64 / 700.0).ln()).abs() < 1e-12, "{r}");
    }
}
