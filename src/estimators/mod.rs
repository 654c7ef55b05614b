//! The estimators: loaded once from `models/` as the manifest describes them, checked, then
//! run for every job of their family.

pub mod combine;
pub mod extrapolation;
pub mod manifest;
pub mod onnx;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::domain::features::{
    raw_token_feature, AggregateFeatures, FeatureSpec, TokenFeatures, TOKEN_FEATURES,
};
use crate::domain::physics::{Physics, REFERENCE_CAPACITY_MIB};
use crate::domain::{
    analytic, Family, Job, LayerKind, MemoryClass, MemoryClasses, ResidualQuantiles,
};
use combine::{precedence, SIMULATED_PRECEDENCE};
use extrapolation::{DomainSummary, Extrapolation, TrainingDomain};
use manifest::{
    EstimatorEntry, EstimatorKind, FileRef, InputSpec, Manifest, Requirement, SimulatedEntry,
    MANIFEST_FILE, SUPPORTED_SCHEMA_VERSION,
};
use onnx::{InferenceError, Model, ModelInput, OnnxModel};

/// Why the models could not be loaded. Each message names the file at fault, on one line.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: invalid manifest: {reason}")]
    Manifest { path: PathBuf, reason: String },
    #[error("{path}: sha256 is {actual}, the manifest says {expected}")]
    Checksum {
        path: PathBuf,
        expected: String,
        actual: String,
    },
    #[error("{path}: {reason}")]
    Model { path: PathBuf, reason: String },
    #[error("{path}: invalid training domain: {reason}")]
    Domain { path: PathBuf, reason: String },
    #[error("ONNX Runtime: {0}")]
    Runtime(String),
}

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

enum Input {
    Aggregate(Vec<FeatureSpec>),
    Sequence {
        vocab: Vec<LayerKind>,
        token_features: Vec<FeatureSpec>,
        max_tokens: usize,
    },
}

/// One loaded estimator.
pub struct Estimator {
    pub entry: EstimatorEntry,
    pub family: Family,
    input: Input,
    model: Box<dyn Model>,
    classes: Option<MemoryClasses>,
    quantiles: Option<ResidualQuantiles>,
}

impl Estimator {
    pub fn name(&self) -> &str {
        &self.entry.name
    }

    /// Whether the job carries what this estimator needs.
    pub fn applies_to(&self, job: &Job) -> bool {
        self.entry
            .requires
            .iter()
            .all(|requirement| match requirement {
                Requirement::SavedTensors => job.saved_tensors().is_some(),
                Requirement::Simulation => job.simulation().is_some(),
            })
    }

    /// Runs this estimator alone on one job: class probabilities, or a one-element regression
    /// output.
    pub fn run(&self, job: &Job, aggregate: &AggregateFeatures) -> Result<Vec<f32>, EstimateError> {
        self.run_many(&[job], std::slice::from_ref(aggregate))
            .pop()
            .expect("one job in, one answer out")
    }

    /// Runs this estimator on many jobs with as few model calls as possible: one for aggregate
    /// inputs, one per distinct layer count for sequences (so no padding changes an answer).
    pub fn run_many(
        &self,
        jobs: &[&Job],
        aggregates: &[AggregateFeatures],
    ) -> Vec<Result<Vec<f32>, EstimateError>> {
        match &self.input {
            Input::Aggregate(specs) => {
                let rows: Vec<f32> = aggregates
                    .iter()
                    .flat_map(|a| a.normalised(specs))
                    .collect();
                let input = ModelInput::Aggregate {
                    rows: &rows,
                    n_rows: jobs.len(),
                };
                split_rows(self.model.infer(input), jobs.len())
            }
            Input::Sequence {
                vocab,
                token_features,
                max_tokens,
            } => {
                let mut answers: Vec<Result<Vec<f32>, EstimateError>> =
                    Vec::with_capacity(jobs.len());
                let mut by_length: BTreeMap<usize, Vec<(usize, TokenFeatures)>> = BTreeMap::new();
                for (i, job) in jobs.iter().enumerate() {
                    let n_layers = job.layers().len();
                    let tokens = if n_layers > *max_tokens {
                        Err(EstimateError::TooManyTokens {
                            estimator: self.entry.name.clone(),
                            max: *max_tokens,
                            got: n_layers,
                        })
                    } else {
                        TokenFeatures::of(
                            job,
                            |k| vocab.iter().position(|v| *v == k),
                            token_features,
                        )
                        .map_err(|(index, kind)| {
                            EstimateError::KindNotInVocabulary {
                                index,
                                kind,
                                estimator: self.entry.name.clone(),
                            }
                        })
                    };
                    match tokens {
                        Ok(tokens) => {
                            by_length.entry(n_layers).or_default().push((i, tokens));
                            answers.push(Ok(Vec::new()));
                        }
                        Err(e) => answers.push(Err(e)),
                    }
                }
                for (n_tokens, group) in by_length {
                    let kind_ids: Vec<i64> = group
                        .iter()
                        .flat_map(|(_, t)| t.kind_ids.iter().copied())
                        .collect();
                    let features: Vec<f32> = group
                        .iter()
                        .flat_map(|(_, t)| t.features.iter().copied())
                        .collect();
                    let input = ModelInput::Sequence {
                        kind_ids: &kind_ids,
                        features: &features,
                        n_rows: group.len(),
                        n_tokens,
                        n_features: token_features.len(),
                    };
                    for ((i, _), answer) in group
                        .iter()
                        .zip(split_rows(self.model.infer(input), group.len()))
                    {
                        answers[*i] = answer;
                    }
                }
                answers
            }
        }
    }
}

/// Splits a row-major model output into one row per job.
fn split_rows(
    output: Result<Vec<f32>, InferenceError>,
    n_rows: usize,
) -> Vec<Result<Vec<f32>, EstimateError>> {
    match output {
        Ok(values) if n_rows > 0 && values.len() % n_rows == 0 && !values.is_empty() => values
            .chunks(values.len() / n_rows)
            .map(|row| Ok(row.to_vec()))
            .collect(),
        Ok(values) => {
            let error = InferenceError(format!(
                "{} outputs cannot be split into {n_rows} rows",
                values.len()
            ));
            (0..n_rows).map(|_| Err(error.clone().into())).collect()
        }
        Err(e) => (0..n_rows).map(|_| Err(e.clone().into())).collect(),
    }
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

/// The MiB figure, its upper bound and the card it is checked against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MibAnswer {
    pub estimate_mib: f64,
    pub upper_bound_mib: f64,
    pub confidence: f64,
    /// Capacity of the card the regressor was trained on.
    pub reference_capacity_mib: Option<u64>,
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
    /// How far a simulated job is from the data the simulation regressors were trained on, and
    /// what followed from it; `None` without a simulation or without a training domain.
    pub extrapolation: Option<ExtrapolationAnswer>,
    classes: MemoryClasses,
    /// The mean of the classifiers' probabilities; `None` for a family without classifiers.
    classifier_mean: Option<Vec<f32>>,
}

impl Estimate {
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

/// Names and version of the analytic estimators, which every family gets.
pub const FIRST_PRINCIPLES: &str = "first_principles";
/// Share of the class probability put on the MiB figure's class (> 0.5: it leads).
const FIGURE_CLASS_WEIGHT: f32 = 0.6;
/// Physics from the job's whole-step simulation; only for jobs that carry one.
pub const SIMULATED: &str = "simulated";
/// First principles with the job's traced saved tensors; only for jobs that carry them.
pub const TRACED_FIRST_PRINCIPLES: &str = "traced_first_principles";
pub const HORUS: &str = "horus";
pub const ANALYTIC_VERSION: &str = "1.0.0";

/// The `simulated` estimator as loaded from the manifest.
struct SimulatedModel {
    cuda_context_mib: f64,
    quantiles: ResidualQuantiles,
    version: String,
    /// Where the regressors that correct the simulated figure were trained; `None`: no domain
    /// was given, and the correction applies to every simulated job.
    domain: Option<TrainingDomain>,
}

impl SimulatedModel {
    fn load(entry: &SimulatedEntry) -> Result<SimulatedModel, String> {
        // The context of any CUDA process is hundreds of MiB, never more than a few GiB.
        if !(entry.cuda_context_mib.is_finite()
            && (0.0..=65_536.0).contains(&entry.cuda_context_mib))
        {
            return Err(format!(
                "simulated: cuda_context_mib must be a number from 0 to 65,536, got {}",
                entry.cuda_context_mib
            ));
        }
        let levels = entry
            .residual_quantiles
            .iter()
            .map(|l| (l.confidence, l.log_ratio))
            .collect();
        let quantiles = ResidualQuantiles::new(levels).map_err(|e| format!("simulated: {e}"))?;
        Ok(SimulatedModel {
            cuda_context_mib: entry.cuda_context_mib,
            quantiles,
            version: entry.version.clone(),
            domain: None,
        })
    }
}

/// Reads, checks and loads the training domain the manifest names.
fn load_domain(dir: &Path, reference: &FileRef) -> Result<TrainingDomain, LoadError> {
    let path = dir.join(&reference.file);
    let bytes = std::fs::read(&path).map_err(|source| LoadError::Read {
        path: path.clone(),
        source,
    })?;
    let actual = hex::encode(Sha256::digest(&bytes));
    if !actual.eq_ignore_ascii_case(&reference.sha256) {
        return Err(LoadError::Checksum {
            path,
            expected: reference.sha256.clone(),
            actual,
        });
    }
    let aggregate = AggregateFeatures::of(&probe_job());
    TrainingDomain::parse(&bytes, |name| aggregate.get(name).is_some())
        .map_err(|reason| LoadError::Domain { path, reason })
}

/// All loaded estimators, grouped by family.
pub struct Estimators {
    manifest: Manifest,
    estimators: Vec<Estimator>,
    simulated: Option<SimulatedModel>,
}
impl Estimators {
    /// Loads and checks every estimator of `dir/manifest.json`: file present, checksum equal,
    /// features known, graph inputs and outputs as the contract says.
    pub fn load(
        dir: &Path,
        ort_dylib: &Path,
        sessions_per_model: usize,
    ) -> Result<Estimators, LoadError> {
        let manifest_path = dir.join(MANIFEST_FILE);
        let manifest_bytes = std::fs::read(&manifest_path).map_err(|source| LoadError::Read {
            path: manifest_path.clone(),
            source,
        })?;
        let manifest: Manifest =
            serde_json::from_slice(&manifest_bytes).map_err(|e| LoadError::Manifest {
                path: manifest_path.clone(),
                reason: e.to_string(),
            })?;
        let invalid = |reason: String| LoadError::Manifest {
            path: manifest_path.clone(),
            reason,
        };
        if manifest.schema_version != SUPPORTED_SCHEMA_VERSION {
            return Err(invalid(format!(
                "schema_version {} is not supported (expected {SUPPORTED_SCHEMA_VERSION})",
                manifest.schema_version
            )));
        }
        if manifest.estimators.is_empty() {
            return Err(invalid("no estimators listed".into()));
        }
        let mut simulated = manifest
            .simulated
            .as_ref()
            .map(SimulatedModel::load)
            .transpose()
            .map_err(invalid)?;
        if let (Some(model), Some(domain)) = (
            simulated.as_mut(),
            manifest.simulated.as_ref().and_then(|s| s.domain.as_ref()),
        ) {
            model.domain = Some(load_domain(dir, domain)?);
        }
        let environment = onnx::environment(ort_dylib).map_err(LoadError::Runtime)?;
        let mut estimators = Vec::with_capacity(manifest.estimators.len());
        for entry in &manifest.estimators {
            let path = dir.join(&entry.file);
            let Checked {
                family,
                input,
                classes,
                quantiles,
            } = check_entry(entry)
                .map_err(|reason| invalid(format!("estimator '{}': {reason}", entry.name)))?;
            let bytes = std::fs::read(&path).map_err(|source| LoadError::Read {
                path: path.clone(),
                source,
            })?;
            let actual = hex::encode(Sha256::digest(&bytes));
            if !actual.eq_ignore_ascii_case(&entry.sha256) {
                return Err(LoadError::Checksum {
                    path,
                    expected: entry.sha256.clone(),
                    actual,
                });
            }
            let input_names: &[&str] = match input {
                Input::Aggregate(_) => &["features"],
                Input::Sequence { .. } => &["kind_ids", "token_features", "mask"],
            };
            let model = OnnxModel::load(
                environment,
                &bytes,
                input_names,
                &entry.output,
                sessions_per_model,
            )
            .map_err(|reason| LoadError::Model {
                path: path.clone(),
                reason,
            })?;
            estimators.push(Estimator {
                entry: entry.clone(),
                family,
                input,
                model: Box::new(model),
                classes,
                quantiles,
            });
        }
        for pair in estimators.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if a.family == b.family
                && a.classes.is_some()
                && b.classes.is_some()
                && a.classes != b.classes
            {
                return Err(invalid(format!(
                    "estimators '{}' and '{}' classify family {} into different bins",
                    a.name(),
                    b.name(),
                    a.family
                )));
            }
        }
        Ok(Estimators {
            manifest,
            estimators,
            simulated,
        })
    }

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

    /// Runs every estimator of the job's family for the reference card (the A100 40 GB of the
    /// training data); the upper bound is at `confidence`.
    pub fn estimate(&self, job: &Job, confidence: f64) -> Result<Estimate, EstimateError> {
        self.estimate_on(job, confidence, REFERENCE_CAPACITY_MIB)
    }

    /// [`Estimators::estimate`] for a card of `capacity_mib`.
    pub fn estimate_on(
        &self,
        job: &Job,
        confidence: f64,
        capacity_mib: u64,
    ) -> Result<Estimate, EstimateError> {
        self.estimate_queries(&[Query {
            job,
            confidence,
            capacity_mib,
        }])
        .pop()
        .expect("one job in, one answer out")
    }

    /// Estimates many jobs (each with its confidence) for the reference card.
    pub fn estimate_many(&self, jobs: &[(&Job, f64)]) -> Vec<Result<Estimate, EstimateError>> {
        let queries: Vec<Query> = jobs
            .iter()
            .map(|&(job, confidence)| Query {
                job,
                confidence,
                capacity_mib: REFERENCE_CAPACITY_MIB,
            })
            .collect();
        self.estimate_queries(&queries)
    }

    /// Estimates many jobs, calling each model once per family rather than once per job.
    /// Per-estimator latencies are the call's time per job.
    pub fn estimate_queries(&self, queries: &[Query]) -> Vec<Result<Estimate, EstimateError>> {
        let mut answers: Vec<Option<Result<Estimate, EstimateError>>> =
            (0..queries.len()).map(|_| None).collect();
        for family in [Family::Mlp, Family::Cnn, Family::Transformer] {
            let indices: Vec<usize> = (0..queries.len())
                .filter(|&i| queries[i].job.family() == family)
                .collect();
            if indices.is_empty() {
                continue;
            }
            let group: Vec<Query> = indices.iter().map(|&i| queries[i]).collect();
            for (i, answer) in indices
                .into_iter()
                .zip(self.estimate_family(family, &group))
            {
                answers[i] = Some(answer);
            }
        }
        answers
            .into_iter()
            .map(|a| a.expect("every job has a family"))
            .collect()
    }

    /// Whether a simulated job's step runs on the card a simulation regressor's labels were
    /// measured on ([`combine::within_measured_range`]).
    fn within_measured_range(&self, job: &Job, entry: &EstimatorEntry) -> bool {
        match (
            job.simulation(),
            self.simulated.as_ref(),
            entry.capacity_mib,
        ) {
            (Some(simulation), Some(model), Some(capacity_mib)) => combine::within_measured_range(
                simulation.min_capacity_bytes,
                model.cuda_context_mib,
                capacity_mib,
            ),
            _ => true,
        }
    }

    fn estimate_family(
        &self,
        family: Family,
        jobs: &[Query],
    ) -> Vec<Result<Estimate, EstimateError>> {
        let members: Vec<&Estimator> = self
            .estimators
            .iter()
            .filter(|e| e.family == family)
            .collect();
        let n_classifiers = members
            .iter()
            .filter(|e| e.entry.kind == EstimatorKind::MemoryClassifier)
            .count();
        let Some(classes) = members.iter().find_map(|e| e.classes.as_ref()) else {
            return jobs
                .iter()
                .map(|_| Err(EstimateError::UnsupportedFamily(family)))
                .collect();
        };
        let job_refs: Vec<&Job> = jobs.iter().map(|query| query.job).collect();
        let aggregates: Vec<AggregateFeatures> = job_refs
            .iter()
            .map(|job| AggregateFeatures::of(job))
            .collect();
        // Only simulated jobs are placed against the training domain: nothing for the others.
        let domain = self.simulated.as_ref().and_then(|s| s.domain.as_ref());
        let reaches: Vec<Option<(Extrapolation, Duration)>> = job_refs
            .iter()
            .zip(&aggregates)
            .map(|(job, aggregate)| {
                let domain = domain.filter(|_| job.simulation().is_some())?;
                let started = Instant::now();
                Some((domain.locate(job, aggregate), started.elapsed()))
            })
            .collect();
        let mut partials: Vec<Result<Partial, EstimateError>> = jobs
            .iter()
            .map(|_| Ok(Partial::new(classes.len(), members.len())))
            .collect();
        for estimator in &members {
            let applicable: Vec<usize> = (0..jobs.len())
                .filter(|&i| estimator.applies_to(job_refs[i]))
                // Far from the training data a simulation regressor is not applied at all, nor
                // beyond the card its labels were measured on.
                .filter(|&i| {
                    !estimator.entry.requires.contains(&Requirement::Simulation)
                        || (reaches[i]
                            .as_ref()
                            .is_none_or(|(reach, _)| combine::correction_applies(reach))
                            && self.within_measured_range(job_refs[i], &estimator.entry))
                })
                .collect();
            if applicable.is_empty() {
                continue;
            }
            let started = Instant::now();
            let outputs = if applicable.len() == jobs.len() {
                estimator.run_many(&job_refs, &aggregates)
            } else {
                let some_jobs: Vec<&Job> = applicable.iter().map(|&i| job_refs[i]).collect();
                let some_aggregates: Vec<AggregateFeatures> =
                    applicable.iter().map(|&i| aggregates[i].clone()).collect();
                estimator.run_many(&some_jobs, &some_aggregates)
            };
            let latency = started.elapsed() / applicable.len() as u32;
            for (&i, output) in applicable.iter().zip(outputs) {
                let (partial, confidence) = (&mut partials[i], jobs[i].confidence);
                let Ok(state) = partial else { continue };
                let applied = output.and_then(|output| {
                    state.apply(estimator, classes, n_classifiers, output, confidence)
                });
                match applied {
                    Ok(()) => state.runs.push(EstimatorRun {
                        name: estimator.entry.name.clone(),
                        version: estimator.entry.version.clone(),
                        latency,
                    }),
                    Err(e) => *partial = Err(e),
                }
            }
        }
        partials
            .into_iter()
            .zip(jobs)
            .zip(reaches)
            .map(|((partial, query), reach)| {
                partial.and_then(|state| {
                    state.finish(
                        family,
                        query,
                        classes,
                        n_classifiers,
                        self.simulated.as_ref(),
                        reach,
                    )
                })
            })
            .collect()
    }
}

/// One job's answers as the estimators come in.
struct Partial {
    classifiers: BTreeMap<String, ClassAnswer>,
    mean: Vec<f32>,
    mib: Option<MibAnswer>,
    /// The [`precedence`] of the estimator `mib` came from.
    mib_precedence: u8,
    /// The log ratio of `mib`'s bound over its figure (at the job's confidence), before any
    /// widening.
    mib_log_ratio: f64,
    mib_estimators: BTreeMap<String, f64>,
    utilization: BTreeMap<String, f32>,
    runs: Vec<EstimatorRun>,
}

impl Partial {
    fn new(n_classes: usize, n_estimators: usize) -> Partial {
        Partial {
            classifiers: BTreeMap::new(),
            mean: vec![0.0; n_classes],
            mib: None,
            mib_precedence: 0,
            mib_log_ratio: 0.0,
            mib_estimators: BTreeMap::new(),
            utilization: BTreeMap::new(),
            runs: Vec::with_capacity(n_estimators + 2),
        }
    }

    fn apply(
        &mut self,
        estimator: &Estimator,
        classes: &MemoryClasses,
        n_classifiers: usize,
        output: Vec<f32>,
        confidence: f64,
    ) -> Result<(), EstimateError> {
        let first = output.first().copied().unwrap_or(f32::NAN);
        match estimator.entry.kind {
            EstimatorKind::MemoryClassifier => {
                for (m, p) in self.mean.iter_mut().zip(&output) {
                    *m += p / n_classifiers as f32;
                }
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
                // extrapolation on a job far smaller than any it was trained on.
                let estimate_mib = learned_mib.max(analytic::FRAMEWORK_OVERHEAD_MIB);
                let quantiles = estimator.quantiles.as_ref().expect("checked at load");
                let log_ratio = quantiles.log_ratio_at(confidence).ok_or_else(|| {
                    let (low, high) = quantiles.range();
                    EstimateError::ConfidenceOutOfRange {
                        confidence,
                        low,
                        high,
                    }
                })?;
                self.mib_estimators
                    .insert(estimator.entry.name.clone(), estimate_mib);
                let precedence = precedence(&estimator.entry.requires);
                if self.mib.is_some() && precedence < self.mib_precedence {
                    return Ok(());
                }
                self.mib_precedence = precedence;
                self.mib_log_ratio = log_ratio;
                self.mib = Some(MibAnswer {
                    estimate_mib,
                    upper_bound_mib: estimate_mib * log_ratio.exp(),
                    confidence,
                    reference_capacity_mib: estimator.entry.capacity_mib,
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

    fn finish(
        mut self,
        family: Family,
        query: &Query,
        classes: &MemoryClasses,
        n_classifiers: usize,
        simulated: Option<&SimulatedModel>,
        reach: Option<(Extrapolation, Duration)>,
    ) -> Result<Estimate, EstimateError> {
        let job = query.job;
        let formulas = [
            (
                FIRST_PRINCIPLES,
                (|job| Some(analytic::first_principles_mib(job))) as fn(&Job) -> Option<f64>,
            ),
            (
                TRACED_FIRST_PRINCIPLES,
                analytic::traced_first_principles_mib,
            ),
            (HORUS, |job| Some(analytic::horus_mib(job))),
        ];
        for (name, formula) in formulas {
            let started = Instant::now();
            let Some(mib) = formula(job) else { continue };
            self.mib_estimators.insert(name.to_string(), mib);
            self.runs.push(EstimatorRun {
                name: name.into(),
                version: ANALYTIC_VERSION.into(),
                latency: started.elapsed(),
            });
        }
        let started = Instant::now();
        // The rule of `combine`: how far the bound widens with the distance from the training
        // data (the correction was not run beyond `far`).
        let widen = reach
            .as_ref()
            .map_or(1.0, |(reach, _)| combine::bound_widening(reach));
        let physics = Physics::of(
            job,
            simulated.map(|s| s.cuda_context_mib),
            query.capacity_mib,
        );
        if let (Some(peaks), Some(model)) = (physics.simulated, simulated) {
            let figure = peaks.figure_mib();
            self.mib_estimators.insert(SIMULATED.to_string(), figure);
            if self.mib.is_none() || self.mib_precedence < SIMULATED_PRECEDENCE {
                let log_ratio =
                    model
                        .quantiles
                        .log_ratio_at(query.confidence)
                        .ok_or_else(|| {
                            let (low, high) = model.quantiles.range();
                            EstimateError::ConfidenceOutOfRange {
                                confidence: query.confidence,
                                low,
                                high,
                            }
                        })?;
                let mut upper_bound_mib = figure * (log_ratio * widen).exp();
                if peaks.runs_on_card() {
                    // Where the step runs, the allocator cannot hold more than the card has: a
                    // peak above the capacity cannot be read, whatever the residuals say.
                    upper_bound_mib = upper_bound_mib.min(query.capacity_mib as f64).max(figure);
                }
                self.mib_precedence = SIMULATED_PRECEDENCE;
                self.mib_log_ratio = log_ratio;
                self.mib = Some(MibAnswer {
                    estimate_mib: figure,
                    upper_bound_mib,
                    confidence: query.confidence,
                    reference_capacity_mib: Some(query.capacity_mib),
                    floored: false,
                });
            } else if let Some(mib) = self.mib.as_mut().filter(|_| widen != 1.0) {
                // A correction near its data, but beyond `near`: its own bound, widened.
                mib.upper_bound_mib = mib.estimate_mib * (self.mib_log_ratio * widen).exp();
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
        let extrapolation = reach.map(|(reach, _)| ExtrapolationAnswer {
            reach,
            correction_applied: self.mib.is_some() && self.mib_precedence > SIMULATED_PRECEDENCE,
            bound_widened_by: widen,
        });
        // Whatever leads, physics holds it: never below the floor, the bound never below it.
        if let Some(mib) = self.mib.as_mut() {
            let settled = physics.settle(mib.estimate_mib, mib.upper_bound_mib);
            mib.estimate_mib = settled.estimate_mib;
            mib.upper_bound_mib = settled.upper_bound_mib;
            mib.floored = settled.floored;
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
            extrapolation,
            classes: classes.clone(),
            classifier_mean: (n_classifiers > 0).then_some(self.mean),
        };
        estimate.class = estimate.class_for(estimate.mib.map(|m| m.estimate_mib));
        Ok(estimate)
    }
}

fn class_answer(classes: &MemoryClasses, probabilities: Vec<f32>) -> ClassAnswer {
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

struct Checked {
    family: Family,
    input: Input,
    classes: Option<MemoryClasses>,
    quantiles: Option<ResidualQuantiles>,
}

/// A valid job to ask the feature extractors which names they know.
fn probe_job() -> Job {
    Job::parse(
        None,
        1,
        std::iter::once(crate::domain::UncheckedLayer {
            kind: "linear",
            output_size: 1,
            params: 1,
        }),
    )
    .expect("a one-layer job is valid")
}

/// Checks a manifest entry against what this build can compute.
fn check_entry(entry: &EstimatorEntry) -> Result<Checked, String> {
    let family =
        Family::parse(&entry.family).ok_or_else(|| format!("unknown family '{}'", entry.family))?;
    let probe_job = probe_job();
    let input = match &entry.input {
        InputSpec::Aggregate { features } => {
            let aggregate = AggregateFeatures::of(&probe_job);
            check_specs(features, |name| aggregate.get(name).is_some())?;
            Input::Aggregate(features.clone())
        }
        InputSpec::Sequence {
            kind_vocab,
            token_features,
            max_tokens,
        } => {
            let vocab = kind_vocab
                .iter()
                .map(|k| {
                    LayerKind::parse(k)
                        .ok_or_else(|| format!("unknown layer kind '{k}' in kind_vocab"))
                })
                .collect::<Result<Vec<_>, _>>()?;
            check_specs(token_features, |name| {
                TOKEN_FEATURES.contains(&name) && raw_token_feature(&probe_job, 0, name).is_some()
            })?;
            if *max_tokens == 0 {
                return Err("max_tokens must be positive".into());
            }
            Input::Sequence {
                vocab,
                token_features: token_features.clone(),
                max_tokens: *max_tokens,
            }
        }
    };
    let classes = match &entry.class_bins_mib {
        Some(bins) => Some(MemoryClasses::new(bins.clone()).map_err(|e| e.to_string())?),
        None => None,
    };
    if !entry.requires.is_empty() && entry.kind != EstimatorKind::MemoryRegressor {
        return Err("only a memory regressor may require anything of a job".into());
    }
    let mut quantiles = None;
    match entry.kind {
        EstimatorKind::MemoryClassifier => {
            classes
                .as_ref()
                .ok_or("a memory classifier needs class_bins_mib")?;
        }
        EstimatorKind::MemoryRegressor => {
            let levels = entry
                .residual_quantiles
                .as_ref()
                .ok_or("a memory regressor needs residual_quantiles")?;
            let levels = levels.iter().map(|l| (l.confidence, l.log_ratio)).collect();
            quantiles = Some(ResidualQuantiles::new(levels).map_err(|e| e.to_string())?);
        }
        EstimatorKind::UtilizationRegressor => {
            entry
                .target
                .as_ref()
                .ok_or("a utilization regressor needs a target")?;
        }
    }
    Ok(Checked {
        family,
        input,
        classes,
        quantiles,
    })
}

fn check_specs(specs: &[FeatureSpec], known: impl Fn(&str) -> bool) -> Result<(), String> {
    for spec in specs {
        if !known(&spec.name) {
            return Err(format!("unknown feature '{}'", spec.name));
        }
        if !(spec.std.is_finite() && spec.std > 0.0 && spec.mean.is_finite()) {
            return Err(format!("feature '{}' has an invalid mean/std", spec.name));
        }
    }
    if specs.is_empty() {
        return Err("no input features".into());
    }
    Ok(())
}
