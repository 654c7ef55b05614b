//! How the estimators' answers combine into one, every rule in this file with its reason:
//! - which MiB figure leads ([`precedence`], [`SIMULATED_PRECEDENCE`]);
//! - how far from its training data a learned correction of the simulated figure is trusted
//!   ([`correction_applies`], [`within_measured_range`]) and how the bound widens with the
//!   distance ([`bound_widening`]);
//! - the floors: a learned figure never below the framework's fixed cost, and whatever leads
//!   held to physics ([`Physics::settle`]), the simulated bound capped by the card where the
//!   step runs (in `Partial::finish`);
//! - the memory class: the class of the figure, with the classifiers' doubt kept in the
//!   probabilities ([`Estimate::class_for`], [`FIGURE_CLASS_WEIGHT`]).
//!
//! The training pipeline (`training/gpucast_training`, `combine`) scores its estimators with the
//! same rules.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::estimator::{AnalyticRun, Estimator};
use super::extrapolation::Extrapolation;
use super::load::SimulatedModel;
use super::manifest::{EstimatorKind, Requirement};
use super::onnx::InferenceError;
use super::{
    ClassAnswer, Estimate, EstimateError, EstimatorRun, ExtrapolationAnswer, MibAnswer, Query,
    ANALYTIC_VERSION, FIRST_PRINCIPLES, HORUS, SIMULATED, TRACED_FIRST_PRINCIPLES, TRAINING_STEP,
};
use crate::bound::learned;
use crate::bound::learned::{
    simulated_bound, simulated_setup_quantiles, training_step_quantiles, widened_bound,
};
use crate::job::{Family, Job, MemoryClasses, ResidualQuantiles};
use crate::physics::{self, analytic};
use crate::physics::{BreakdownSource, Physics};

/// Which MiB figure leads, in one place. Higher wins; between equals, the later in the
/// manifest. Physics first, learning second:
/// - 3, a regressor that requires the job's simulation: it starts from the simulated figure
///   and learns only what the simulation cannot see (workspaces, the allocator's real
///   behaviour), so it is the most accurate figure there can be, near the jobs it was trained
///   on (see [`correction_applies`]: farther away it does not run); the physics floor still
///   holds it.
/// - 2, the `simulated` estimator: a replay of the whole training step through a model of
///   the caching allocator, which no regressor trained on layer lists or traces can match
///   where no simulation regressor is loaded or applies.
/// - 1, a regressor that requires the traced saved tensors: they are the best single
///   predictor of activation memory (grouped CV median 3.0 % against 7.0 % without).
/// - 0, the family's plain regressor: any job, from its layers alone.
pub fn precedence(requires: &[Requirement]) -> u8 {
    if requires.contains(&Requirement::Simulation) {
        3
    } else if requires.contains(&Requirement::SavedTensors) {
        1
    } else {
        0
    }
}

/// The `simulated` estimator's place in [`precedence`].
pub const SIMULATED_PRECEDENCE: u8 = 2;

/// Whether the learned correction applies to a job standing at `reach`
/// ([`learned::correction_applies`]).
pub fn correction_applies(reach: &Extrapolation) -> bool {
    learned::correction_applies(reach.ratio, reach.far)
}

/// How far the bound of a job standing at `reach` widens ([`learned::bound_widening`]).
pub fn bound_widening(reach: &Extrapolation) -> f64 {
    learned::bound_widening(reach.ratio, reach.near, reach.max_widen)
}

/// A correction of the simulated figure is learned from peaks measured on one card (the
/// entry's `capacity_mib`): jobs that ran out of memory there only say "more than the card",
/// so nothing taught the correction what a step too large for that card needs, and it pulled
/// such figures down (a 67 GB step, in-domain by its features, came out at 47 GB). It applies
/// only where the step runs on that card (`min capacity + context <= capacity`); beyond, the
/// simulated figure leads.
pub fn within_measured_range(
    min_capacity_bytes: u64,
    cuda_context_mib: f64,
    capacity_mib: u64,
) -> bool {
    min_capacity_bytes as f64 / (1024.0 * 1024.0) + cuda_context_mib <= capacity_mib as f64
}

/// Corrections of the step's uncertain terms a learned answer is trusted with: beyond, the
/// regressor answers a job unlike those it learned from (held out: carrying every correction
/// doubled the median error on published LLM runs, 17.9 -> 35.5 %).
pub const TRUSTED_CORRECTION: std::ops::RangeInclusive<f64> = 0.5..=2.0;

/// The factor that makes the training step of `reference` answer what a learned regressor
/// answered for it: the known terms and the context as counted, the uncertain ones
/// (activations, temporaries, allocator cache) scaled; 1 when the step sees no uncertain
/// bytes.
pub fn base_correction_factor(reference: &Physics, learned_mib: f64) -> f64 {
    let p = &reference.parts;
    let uncertain = p.activations + p.temporaries + p.allocator_cache;
    if uncertain <= 0.0 || !learned_mib.is_finite() {
        return 1.0;
    }
    (learned_mib - (p.total() - uncertain)) / uncertain
}

/// Why the learned estimators sit out a job whose setup they were not trained on.
pub const BUILT_FROM_CONFIG: &str = "learned estimators left out: the job was built from its \
transformer_config, with its activations counted tensor by tensor; the analytic training step \
answers it (physics)";

pub const OUTSIDE_LEARNED_SETUPS: &str = "learned estimators left out: they were trained on \
one-GPU jobs that train every parameter in fp32 or fp16 autocast with sgd, momentum, adam or \
adamw, without checkpointing or accumulation; the memory regressors answer this job's layers \
in that setup, and the training step of this job's setup carries their correction where it is \
trusted (memory.base_correction, docs/user/setups.md)";

/// The log ratio of `quantiles` at `confidence`, or the error naming the range they cover.
fn log_ratio_at(quantiles: &ResidualQuantiles, confidence: f64) -> Result<f64, EstimateError> {
    quantiles.log_ratio_at(confidence).ok_or_else(|| {
        let (low, high) = quantiles.range();
        EstimateError::ConfidenceOutOfRange {
            confidence,
            low,
            high,
        }
    })
}

/// Share of the class probability put on the MiB figure's class (> 0.5: it leads).
pub const FIGURE_CLASS_WEIGHT: f32 = 0.6;

impl Estimate {
    /// The classifiers' own combined answer (the first maximum of their mean), whatever the
    /// figure says; `None` for a family without classifiers. The manifest's `combined`
    /// validation figures are of this answer.
    pub fn classifiers_combined(&self) -> Option<ClassAnswer> {
        self.classifier_mean
            .as_ref()
            .map(|mean| class_answer(&self.classes, mean.clone()))
    }

    /// The memory class of an answer with MiB figure `figure_mib`: the class containing the
    /// figure, so that the two never disagree. The figure places a job better than the
    /// classifiers do (grouped CV, 8 GB classes: traced figure 0.886, plain figure 0.833,
    /// classifiers 0.834), but the probabilities keep 40 % of the classifiers' mean so that the
    /// answer still shows their doubt. Without a figure: the classifiers' mean alone.
    pub fn class_for(&self, figure_mib: Option<f64>) -> ClassAnswer {
        let classes = &self.classes;
        match (figure_mib, &self.classifier_mean) {
            (Some(figure), Some(mean)) => {
                let index = classes.classify(figure).index;
                let probabilities = mean
                    .iter()
                    .enumerate()
                    .map(|(i, p)| {
                        FIGURE_CLASS_WEIGHT * f32::from(u8::from(i == index))
                            + (1.0 - FIGURE_CLASS_WEIGHT) * p
                    })
                    .collect();
                ClassAnswer {
                    class: classes.class(index),
                    probabilities,
                }
            }
            (None, Some(mean)) => class_answer(classes, mean.clone()),
            (figure, None) => {
                // No classifier: the class of the figure, with all probability on it.
                let index = classes.classify(figure.unwrap_or(0.0)).index;
                let probabilities = (0..classes.len())
                    .map(|i| f32::from(u8::from(i == index)))
                    .collect();
                ClassAnswer {
                    class: classes.class(index),
                    probabilities,
                }
            }
        }
    }
}

/// What a family brings to every job's answer: its class bins and the `simulated` estimator.
#[derive(Clone, Copy)]
pub(super) struct FamilyModels<'a> {
    pub(super) family: Family,
    pub(super) classes: &'a MemoryClasses,
    pub(super) simulated: Option<&'a SimulatedModel>,
}

/// One job's answers as the estimators come in.
pub(super) struct Partial {
    classifiers: BTreeMap<String, ClassAnswer>,
    /// Each classifier's probabilities that ran on this job, in order; their mean is taken
    /// over those that ran (a classifier may be left out of a job, see `left_out`).
    classifier_outputs: Vec<Vec<f32>>,
    mib: Option<MibAnswer>,
    /// The [`precedence`] of the estimator `mib` came from.
    mib_precedence: u8,
    /// The log ratio of `mib`'s bound over its figure (at the job's confidence), before any
    /// widening.
    mib_log_ratio: f64,
    mib_estimators: BTreeMap<String, f64>,
    utilization: BTreeMap<String, f32>,
    pub(super) runs: Vec<EstimatorRun>,
    /// Estimators of the family that could not take this job, and why.
    pub(super) left_out: Vec<String>,
    /// A memory regressor answered below the CUDA context: the job lies outside what the
    /// learned figures know, so none of them leads (the others know less than it).
    below_learned: bool,
}

impl Partial {
    pub(super) fn new(n_estimators: usize) -> Partial {
        Partial {
            classifiers: BTreeMap::new(),
            classifier_outputs: Vec::new(),
            mib: None,
            mib_precedence: 0,
            mib_log_ratio: 0.0,
            mib_estimators: BTreeMap::new(),
            utilization: BTreeMap::new(),
            runs: Vec::with_capacity(n_estimators + 2),
            left_out: Vec::new(),
            below_learned: false,
        }
    }

    pub(super) fn apply(
        &mut self,
        estimator: &Estimator,
        classes: &MemoryClasses,
        output: Vec<f32>,
        confidence: f64,
    ) -> Result<(), EstimateError> {
        let first = output.first().copied().unwrap_or(f32::NAN);
        match estimator.entry.kind {
            EstimatorKind::MemoryClassifier => {
                self.classifier_outputs.push(output.clone());
                self.classifiers
                    .insert(estimator.entry.name.clone(), class_answer(classes, output));
            }
            EstimatorKind::MemoryRegressor => {
                let learned_mib = f64::from(first).exp();
                if !learned_mib.is_finite() {
                    return Err(InferenceError(format!(
                        "{} returned a non-finite figure",
                        estimator.name()
                    ))
                    .into());
                }
                // Every job pays the CUDA context and library workspaces (no training job of the
                // data peaked below ~1,440 MiB); a learned figure below them is an
                // extrapolation on a job far smaller than any it was trained on (a CNN on
                // 32 x 32 images against ImageNet's): listed, but the job's physics answers.
                let estimate_mib = learned_mib.max(analytic::FRAMEWORK_OVERHEAD_MIB);
                self.mib_estimators
                    .insert(estimator.entry.name.clone(), estimate_mib);
                if learned_mib < analytic::FRAMEWORK_OVERHEAD_MIB {
                    let reason = format!(
                        "{}: left out: it answered {learned_mib:.0} MiB, below the CUDA context \
                         every measured job paid, so the job is far smaller than any it learned \
                         from; physics answers",
                        estimator.entry.name
                    );
                    self.left_out.push(reason);
                    self.below_learned = true;
                    return Ok(());
                }
                let quantiles = estimator.quantiles.as_ref().expect("checked at load");
                let log_ratio = log_ratio_at(quantiles, confidence)?;
                let precedence = precedence(&estimator.entry.requires);
                if self.mib.is_some() && precedence < self.mib_precedence {
                    return Ok(());
                }
                self.mib_precedence = precedence;
                self.mib_log_ratio = log_ratio;
                self.mib = Some(MibAnswer {
                    estimate_mib,
                    upper_bound_mib: estimate_mib * log_ratio.exp(),
                    floored: false,
                });
            }
            EstimatorKind::UtilizationRegressor => {
                let target = estimator.entry.target.clone().unwrap_or_default();
                self.utilization.insert(target, first.clamp(0.0, 1.0));
            }
        }
        Ok(())
    }

    pub(super) fn finish(
        mut self,
        models: &FamilyModels,
        query: &Query,
        analytic: AnalyticRun,
        reach: Option<(Extrapolation, Duration)>,
        base: Option<&Job>,
    ) -> Result<Estimate, EstimateError> {
        let FamilyModels {
            family,
            classes,
            simulated,
        } = *models;
        // The classifiers' mean, summed in their order as p / n (the bits the manifest's
        // figures were computed with).
        let n_classifiers = self.classifier_outputs.len();
        let classifier_mean = (n_classifiers > 0).then(|| {
            let mut mean = vec![0.0f32; classes.len()];
            for output in &self.classifier_outputs {
                for (m, p) in mean.iter_mut().zip(output) {
                    *m += p / n_classifiers as f32;
                }
            }
            mean
        });
        let job = query.job;
        if self.below_learned {
            self.mib = None;
        }
        let AnalyticRun { figures, latencies } = analytic;
        let formulas = [
            (FIRST_PRINCIPLES, Some(figures.first_principles_mib)),
            (TRACED_FIRST_PRINCIPLES, figures.traced_first_principles_mib),
            (HORUS, Some(figures.horus_mib)),
        ];
        for ((name, mib), latency) in formulas.into_iter().zip(latencies) {
            let Some(mib) = mib else { continue };
            self.mib_estimators.insert(name.to_string(), mib);
            self.runs.push(EstimatorRun {
                name: name.into(),
                version: ANALYTIC_VERSION.into(),
                latency,
            });
        }
        let started = Instant::now();
        // The rule of `combine`: how far the bound widens with the distance from the training
        // data (the correction was not run beyond `far`).
        // Outside the learned setups the bound comes from residuals measured on such jobs
        // (`simulated_setup_quantiles`), not from widened ones.
        let widen = reach
            .as_ref()
            .filter(|_| job.learned_estimators_apply())
            .map_or(1.0, |(reach, _)| bound_widening(reach));
        let (mut physics, stages) = Physics::of_staged(
            job,
            simulated.map(|s| s.cuda_context_mib),
            query.capacity_mib,
        );
        // The step's own figure, before a learned correction scales it: what the unstated
        // fields' alternatives move (`physics::assumed`).
        let step_mib = physics::assumed::settled_figure(&physics);
        // The optimizer step's moment holds no activations: a step with them peaks at the
        // start of backward.
        let peak_at_backward = physics.parts.activations > 0.0;
        if let (Some(peaks), Some(model)) = (physics.simulated, simulated) {
            let figure = peaks.figure_mib();
            self.mib_estimators.insert(SIMULATED.to_string(), figure);
            if self.mib.is_none() || self.mib_precedence < SIMULATED_PRECEDENCE {
                // Outside the learned setups the residuals measured on published jobs of
                // those setups bound it, not the timm ones widened.
                let quantiles = if job.learned_estimators_apply() {
                    &model.quantiles
                } else {
                    simulated_setup_quantiles()
                };
                let log_ratio = log_ratio_at(quantiles, query.confidence)?;
                let upper_bound_mib = simulated_bound(
                    figure,
                    log_ratio,
                    widen,
                    peaks.runs_on_card(),
                    query.capacity_mib,
                );
                self.mib_precedence = SIMULATED_PRECEDENCE;
                self.mib_log_ratio = log_ratio;
                self.mib = Some(MibAnswer {
                    estimate_mib: figure,
                    upper_bound_mib,
                    floored: false,
                });
            } else if let Some(mib) = self.mib.as_mut().filter(|_| widen != 1.0) {
                // A correction near its data, but beyond `near`: its own bound, widened.
                mib.upper_bound_mib = widened_bound(mib.estimate_mib, self.mib_log_ratio, widen);
            }
            // The simulated estimator's time includes placing the job against the domain.
            let latency =
                started.elapsed() + reach.as_ref().map_or(Duration::ZERO, |(_, took)| *took);
            self.runs.push(EstimatorRun {
                name: SIMULATED.into(),
                version: model.version.clone(),
                latency,
            });
        }
        // The memory regressors' answer of a job counted from its layers (of the job, or of
        // its learned base for another setup) is a correction of the training step's
        // uncertain terms. A job of a learned setup is answered as the regressor answered it;
        // every other setup of the same layers gets the step corrected alike, so that a setup
        // that saves memory in the step saves it in the answer. Beyond `TRUSTED_CORRECTION`
        // the regressor is far from what it learned (a decoder LLM against vision models) and
        // another setup's step answers alone. (Held out, answering a learned setup's job by the
        // step whenever its correction is untrusted raised the MLP median error from 0.4 to
        // 10.4 %: the regressors are right where the step is not.)
        let reference = base.or_else(|| {
            (job.counted_from_layers() && job.learned_estimators_apply()).then_some(job)
        });
        let mut base_correction = None;
        if let (Some(reference), Some(learned)) = (reference, self.mib) {
            let factor = base_correction_factor(&Physics::step(reference), learned.estimate_mib);
            let trusted = TRUSTED_CORRECTION.contains(&factor);
            base_correction = Some(factor).filter(|_| trusted);
            if base.is_some() {
                self.mib = None;
                if trusted {
                    physics = physics.with_uncertain_scaled(factor);
                }
            }
        }
        if self.mib.is_none() && physics.source != BreakdownSource::Simulation {
            // Outside the learned setups, without a simulation, the analytic step leads; inside
            // them, where every regressor was left out, the job's counted terms.
            let figure = physics.parts.total();
            let log_ratio = log_ratio_at(training_step_quantiles(), query.confidence)?;
            if physics.source == BreakdownSource::Step {
                self.mib_estimators
                    .insert(TRAINING_STEP.to_string(), figure);
                self.runs.push(EstimatorRun {
                    name: TRAINING_STEP.into(),
                    version: ANALYTIC_VERSION.into(),
                    latency: started.elapsed(),
                });
            }
            self.mib_log_ratio = log_ratio;
            self.mib = Some(MibAnswer {
                estimate_mib: figure,
                upper_bound_mib: figure * log_ratio.exp(),
                floored: false,
            });
        }
        let extrapolation = reach.map(|(reach, _)| ExtrapolationAnswer {
            reach,
            correction_applied: self.mib.is_some() && self.mib_precedence > SIMULATED_PRECEDENCE,
            bound_widened_by: widen,
        });
        // Whatever leads, physics holds it: never below the floor. The bound is the
        // distribution of the figure's terms read at the confidence (known terms carry no
        // width), never below the figure.
        let mut distribution = None;
        let mut assumed = Vec::new();
        if let Some(mib) = self.mib.as_mut() {
            let settled = physics.settle(mib.estimate_mib, mib.upper_bound_mib);
            mib.estimate_mib = settled.estimate_mib;
            mib.floored = settled.floored;
            let mut peak = physics.distribution(
                job.uncertainty_group(),
                query.confidence,
                settled.estimate_mib,
                widen,
            );
            // Where the analytic step answers, each field the request left unsaid is run at
            // its other values: the range it leaves open widens the bound. (A learned or
            // simulated figure's own errors already hold what its training jobs left unsaid.)
            if physics.source == BreakdownSource::Step {
                assumed =
                    physics::assumed::ranges(job, stages.as_ref(), step_mib, peak_at_backward);
                peak.assumed_log_range =
                    crate::bound::distribution::log_range(&assumed, settled.estimate_mib);
            }
            mib.upper_bound_mib = peak.quantile(query.confidence).max(settled.estimate_mib);
            distribution = Some(peak);
        }
        let mut estimate = Estimate {
            family,
            class: ClassAnswer {
                class: classes.class(0),
                probabilities: Vec::new(),
            },
            classifiers: self.classifiers,
            mib: self.mib,
            mib_estimators: self.mib_estimators,
            utilization: self.utilization,
            runs: self.runs,
            physics,
            distribution,
            assumed,
            base_correction,
            extrapolation,
            classes: classes.clone(),
            classifier_mean,
            left_out: self.left_out,
        };
        estimate.class = estimate.class_for(estimate.mib.map(|m| m.estimate_mib));
        Ok(estimate)
    }
}

pub(super) fn class_answer(classes: &MemoryClasses, probabilities: Vec<f32>) -> ClassAnswer {
    // First maximum wins, so a tie resolves to the smaller class deterministically.
    let index = probabilities
        .iter()
        .enumerate()
        .fold(
            (0, f32::MIN),
            |best, (i, &p)| if p > best.1 { (i, p) } else { best },
        )
        .0;
    ClassAnswer {
        class: classes.class(index),
        probabilities,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_measured_setup_quantiles_are_valid_and_cover_the_default_confidence() {
        for quantiles in [training_step_quantiles(), simulated_setup_quantiles()] {
            assert!(log_ratio_at(quantiles, 0.95).unwrap() > 0.0);
            assert!(log_ratio_at(quantiles, 0.3).is_err());
        }
    }

    fn reach(ratio: f64) -> Extrapolation {
        Extrapolation {
            distance: ratio.is_finite().then_some(ratio * 1.7),
            typical_distance: 1.7,
            ratio,
            outside_setup: !ratio.is_finite(),
            near: 1.0,
            far: 2.0,
            max_widen: 3.0,
        }
    }

    #[test]
    fn the_correction_applies_up_to_far_and_not_beyond_nor_outside_the_setups() {
        for ratio in [0.0, 0.5, 1.0, 1.999, 2.0] {
            assert!(correction_applies(&reach(ratio)), "{ratio}");
        }
        for ratio in [2.001, 10.0, f64::INFINITY] {
            assert!(!correction_applies(&reach(ratio)), "{ratio}");
        }
    }

    #[test]
    fn a_correction_applies_only_to_steps_that_run_on_the_card_it_was_measured_on() {
        let gib = 1u64 << 30;
        assert!(within_measured_range(30 * gib, 1_700.0, 40_960));
        assert!(within_measured_range(39 * gib, 1_024.0, 40_960)); // 39,936 + 1,024 = 40,960
        assert!(!within_measured_range(39 * gib, 1_025.0, 40_960));
        assert!(!within_measured_range(64 * gib, 1_700.0, 40_960));
    }

    #[test]
    fn the_bound_widens_from_near_in_proportion_to_the_ratio_up_to_max_widen() {
        let widen = |ratio: f64| bound_widening(&reach(ratio));
        assert_eq!(widen(0.0), 1.0);
        assert_eq!(widen(1.0), 1.0);
        assert_eq!(widen(1.5), 1.5);
        assert_eq!(widen(2.5), 2.5);
        assert_eq!(widen(3.0), 3.0);
        assert_eq!(widen(40.0), 3.0);
        assert_eq!(widen(f64::INFINITY), 3.0);
        assert_eq!(widen(f64::NAN), 3.0);
        // With near 2, the bound starts widening at twice the typical distance.
        let late = Extrapolation {
            near: 2.0,
            ..reach(3.0)
        };
        assert_eq!(bound_widening(&late), 1.5);
    }

    #[test]
    fn a_simulation_regressor_leads_then_physics_then_the_traced_then_the_plain_regressor() {
        let simulation = precedence(&[Requirement::Simulation, Requirement::SavedTensors]);
        let traced = precedence(&[Requirement::SavedTensors]);
        let plain = precedence(&[]);
        assert!(
            simulation > SIMULATED_PRECEDENCE && SIMULATED_PRECEDENCE > traced && traced > plain
        );
    }
}
