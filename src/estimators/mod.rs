//! The estimators: loaded once from `models/` as the manifest describes them, checked, then
//! run for every job of their family.
//!
//! - `load`: the manifest, the model files and their contracts, the `simulated` block.
//! - `run`: each family's estimators over a batch of jobs, the analytic figures once
//!   per job.
//! - [`combine`]: every rule that turns their answers into one (which figure leads, floors,
//!   bounds, the class).
//! - [`extrapolation`]: where a simulated job stands against the training domain.

pub mod combine;
mod estimator;
pub mod extrapolation;
pub mod features;
mod feedforward;
mod load;
pub mod manifest;
pub mod onnx;
mod run;

pub use estimator::Estimator;
pub use load::LoadError;
use load::SimulatedModel;

use std::collections::BTreeMap;
use std::time::Duration;

use crate::bound::PeakDistribution;
use crate::job::{Family, Job, LayerKind, MemoryClass, MemoryClasses};
use crate::physics::assumed::AssumedRange;
use crate::physics::Physics;
use extrapolation::{DomainSummary, Extrapolation, TrainingDomain};
use manifest::Manifest;
use onnx::InferenceError;

/// Why a valid job could not be estimated.
#[derive(Debug, thiserror::Error)]
pub enum EstimateError {
    #[error("family: no memory estimator is loaded for family '{0}'")]
    UnsupportedFamily(Family),
    #[error("layers[{index}].kind: '{kind}' is not in the vocabulary of estimator '{estimator}'")]
    KindNotInVocabulary {
        index: usize,
        kind: LayerKind,
        estimator: String,
    },
    #[error("layers: estimator '{estimator}' accepts at most {max} layers, got {got}")]
    TooManyTokens {
        estimator: String,
        max: usize,
        got: usize,
    },
    #[error("confidence: {confidence} is outside the calibrated range {low} to {high}")]
    ConfidenceOutOfRange {
        confidence: f64,
        low: f64,
        high: f64,
    },
    #[error(transparent)]
    Inference(#[from] InferenceError),
}

/// One classifier's answer.
#[derive(Debug, Clone)]
pub struct ClassAnswer {
    pub class: MemoryClass,
    pub probabilities: Vec<f32>,
}

#[derive(Debug, Clone)]
pub struct EstimatorRun {
    pub name: String,
    pub version: String,
    pub latency: Duration,
}

/// The MiB figure and its upper bound (at the query's confidence).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MibAnswer {
    pub estimate_mib: f64,
    pub upper_bound_mib: f64,
    /// True when the figure was raised to the physics floor.
    pub floored: bool,
}

/// One job to estimate: at what confidence, for a card of what capacity (the simulated figure
/// depends on the card: its allocator frees its cache before it fails).
#[derive(Debug, Clone, Copy)]
pub struct Query<'a> {
    pub job: &'a Job,
    pub confidence: f64,
    pub capacity_mib: u64,
    /// Whether the memory classifiers run: their opinions, and their share of the class
    /// probabilities. Nothing else in an answer reads them.
    pub classifiers: bool,
    /// The utilization targets whose learned regressors run (`None`: all of them); the
    /// answer leaves the others to the roofline.
    pub utilization: Option<&'a [&'a str]>,
}

/// Where a simulated job stands against the training domain, and what [`combine`]'s rule made
/// of it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExtrapolationAnswer {
    pub reach: Extrapolation,
    /// A regressor that requires the simulation ran and its figure leads.
    pub correction_applied: bool,
    /// The factor the bound's log ratio was multiplied by (1: not widened).
    pub bound_widened_by: f64,
}

/// Everything the estimators said about one job.
#[derive(Debug, Clone)]
pub struct Estimate {
    pub family: Family,
    /// The memory class: the class of the MiB figure where there is one (see
    /// [`Estimate::class_for`]), else the classifiers' combined answer.
    pub class: ClassAnswer,
    /// Each classifier's own answer, by estimator name.
    pub classifiers: BTreeMap<String, ClassAnswer>,
    /// The learned MiB figure and bound, when the family has a memory regressor.
    pub mib: Option<MibAnswer>,
    /// Each MiB estimator's own figure (regressors and analytic formulas), by name.
    pub mib_estimators: BTreeMap<String, f64>,
    /// Utilization fractions by target (`smact`, `smocc`, ...); absent targets have no model.
    pub utilization: BTreeMap<String, f32>,
    pub runs: Vec<EstimatorRun>,
    /// What physics says of the job on the queried card: the floor under the figure, the
    /// categories of its breakdown, the simulated peaks.
    pub physics: Physics,
    /// The distribution of the peak the figure and its bound are read from; `None` without a
    /// figure.
    pub distribution: Option<PeakDistribution>,
    /// The fields the request left unsaid that move the figure, widest first (an analytic
    /// step's answer only).
    pub assumed: Vec<AssumedRange>,
    /// The trusted factor a learned answer put on the training step's uncertain terms (of the
    /// job, or of its learned base for another setup); `None` when none applies.
    pub base_correction: Option<f64>,
    /// How far a simulated job is from the data the simulation regressors were trained on, and
    /// what followed from it; `None` without a simulation or without a training domain.
    pub extrapolation: Option<ExtrapolationAnswer>,
    /// Estimators of the family that could not take this job, and why (e.g. a sequence model
    /// with fewer positions than the job has layers); the answer rests on the others.
    pub left_out: Vec<String>,
    classes: MemoryClasses,
    /// The mean of the classifiers' probabilities; `None` for a family without classifiers.
    classifier_mean: Option<Vec<f32>>,
}

/// Names and version of the analytic estimators, which every family gets.
pub const FIRST_PRINCIPLES: &str = "first_principles";
/// Physics from the job's whole-step simulation; only for jobs that carry one.
pub const SIMULATED: &str = "simulated";
/// First principles with the job's traced saved tensors; only for jobs that carry them.
pub const TRACED_FIRST_PRINCIPLES: &str = "traced_first_principles";
pub const HORUS: &str = "horus";
/// The analytic training step of a setup the learned models do not know, per GPU.
pub const TRAINING_STEP: &str = "training_step";
pub const ANALYTIC_VERSION: &str = "1.0.0";

/// All loaded estimators, grouped by family.
pub struct Estimators {
    manifest: Manifest,
    estimators: Vec<Estimator>,
    simulated: Option<SimulatedModel>,
}
impl Estimators {
    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn all(&self) -> &[Estimator] {
        &self.estimators
    }

    /// The loaded training domain of the simulation regressors, if the manifest names one.
    pub fn simulated_domain(&self) -> Option<DomainSummary> {
        self.simulated
            .as_ref()?
            .domain
            .as_ref()
            .map(TrainingDomain::summary)
    }
}
