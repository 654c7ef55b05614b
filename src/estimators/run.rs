//! Running: the estimators of a job's family, each model called once per batch of jobs (per
//! distinct layer count for sequence models), their outputs handed to [`super::combine`].

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::combine::{self, FamilyModels, Partial};
use super::extrapolation::Extrapolation;
use super::manifest::{EstimatorEntry, EstimatorKind, Requirement};
use super::onnx::{InferenceError, Model, ModelInput};
use super::{Estimate, EstimateError, EstimatorRun, Estimators, Query};
use crate::domain::analytic::{self, AnalyticFigures};
use crate::domain::features::{AggregateFeatures, FeatureSpec, TokenFeatures};
use crate::domain::physics::REFERENCE_CAPACITY_MIB;
use crate::domain::{Family, Job, LayerKind, MemoryClasses, ResidualQuantiles};

pub(super) enum Input {
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
    pub(super) input: Input,
    pub(super) model: Box<dyn Model>,
    pub(super) classes: Option<MemoryClasses>,
    pub(super) quantiles: Option<ResidualQuantiles>,
}

impl Estimator {
    pub fn name(&self) -> &str {
        &self.entry.name
    }

    /// Why a sequence estimator cannot read this valid job (more layers than positions, or a
    /// layer kind without a token), said in the answer's warnings; `None` when it can. The
    /// family's other estimators answer such a job.
    pub fn cannot_read(&self, job: &Job) -> Option<String> {
        let Input::Sequence {
            vocab, max_tokens, ..
        } = &self.input
        else {
            return None;
        };
        let name = self.name();
        let layers = job.layers();
        if layers.len() > *max_tokens {
            return Some(format!(
                "estimator '{name}' left out: it reads at most {max_tokens} layers, the job has {}",
                layers.len()
            ));
        }
        let (index, layer) = layers
            .iter()
            .enumerate()
            .find(|(_, layer)| !vocab.contains(&layer.kind))?;
        Some(format!(
            "estimator '{name}' left out: it has no token for layer kind '{}' (layers[{index}])",
            layer.kind.as_str()
        ))
    }

    /// Whether this estimator answers a job's learned base ([`Job::learned_base`]) when the
    /// job's own setup is outside the learned ones: the memory regressors that read the
    /// layers (the simulation regressors read a simulation of the job's own setup).
    pub fn answers_bases(&self) -> bool {
        self.entry.kind == EstimatorKind::MemoryRegressor
            && !self.entry.requires.contains(&Requirement::Simulation)
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
                    // Attention costs rows x tokens^2 in ONNX Runtime's buffers (and its arena
                    // keeps the peak): bounded per call, so no batch can take the memory a
                    // pod has. Rows are independent, so chunking changes no answer.
                    let rows_per_call = (MAX_ATTENTION_CELLS / (n_tokens * n_tokens).max(1)).max(1);
                    for chunk in group.chunks(rows_per_call) {
                        let kind_ids: Vec<i64> = chunk
                            .iter()
                            .flat_map(|(_, t)| t.kind_ids.iter().copied())
                            .collect();
                        let features: Vec<f32> = chunk
                            .iter()
                            .flat_map(|(_, t)| t.features.iter().copied())
                            .collect();
                        let input = ModelInput::Sequence {
                            kind_ids: &kind_ids,
                            features: &features,
                            n_rows: chunk.len(),
                            n_tokens,
                            n_features: token_features.len(),
                        };
                        for ((i, _), answer) in chunk
                            .iter()
                            .zip(split_rows(self.model.infer(input), chunk.len()))
                        {
                            answers[*i] = answer;
                        }
                    }
                }
                answers
            }
        }
    }
}

/// Most rows x tokens^2 a sequence model is called with at once (2 jobs of 512 layers, 128 of
/// 64). Peak RSS of the debug server under 8 concurrent 2 MiB batches of 73 MLP jobs x 512
/// layers: 1.6 GB unchunked, 419 MB at 16 x 512^2, 263 MB at 4 x, 184 MB at 2 x.
const MAX_ATTENTION_CELLS: usize = 2 * 512 * 512;

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

impl Estimators {
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
        let Some(classes) = members.iter().find_map(|e| e.classes.as_ref()) else {
            return jobs
                .iter()
                .map(|_| Err(EstimateError::UnsupportedFamily(family)))
                .collect();
        };
        let job_refs: Vec<&Job> = jobs.iter().map(|query| query.job).collect();
        // The analytic figures once per job: the features read them, and they are answers too.
        let analytic: Vec<AnalyticRun> = job_refs.iter().map(|job| AnalyticRun::of(job)).collect();
        let aggregates: Vec<AggregateFeatures> = job_refs
            .iter()
            .zip(&analytic)
            .map(|(job, run)| AggregateFeatures::with_analytic(job, &run.figures))
            .collect();
        // A job of a setup the learned models were not trained on: its memory regressors
        // answer the same layers in the nearest setup they know, and the training step carries
        // that answer to the job's setup (`combine`, `Partial::finish`).
        let bases: Vec<Option<Job>> = job_refs.iter().map(|job| job.learned_base()).collect();
        let base_aggregates: Vec<Option<AggregateFeatures>> = bases
            .iter()
            .map(|base| {
                base.as_ref()
                    .map(|base| AggregateFeatures::with_analytic(base, &AnalyticFigures::of(base)))
            })
            .collect();
        // What an estimator reads of a job: the job, or for a memory regressor its base.
        let view = |i: usize, estimator: &Estimator| -> (&Job, &AggregateFeatures) {
            match (&bases[i], &base_aggregates[i]) {
                (Some(base), Some(features)) if estimator.answers_bases() => (base, features),
                _ => (job_refs[i], &aggregates[i]),
            }
        };
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
            .map(|_| Ok(Partial::new(members.len())))
            .collect();
        for estimator in &members {
            let applicable: Vec<usize> = (0..jobs.len())
                .filter(|&i| estimator.applies_to(view(i, estimator).0))
                // A sequence model that cannot read a job is left out of it, and the answer
                // says so; the family's other estimators answer.
                // Trained on plain one-GPU jobs: another setup is physics', corrected by the
                // memory regressors' answer of its base.
                .filter(|&i| {
                    let reason = if job_refs[i].learned_estimators_apply() {
                        estimator.cannot_read(job_refs[i])
                    } else if bases[i].is_some() && estimator.answers_bases() {
                        None
                    } else if job_refs[i].known_activations().is_some() {
                        Some(combine::BUILT_FROM_CONFIG.to_string())
                    } else {
                        Some(combine::OUTSIDE_LEARNED_SETUPS.to_string())
                    };
                    let Some(reason) = reason else { return true };
                    if let Ok(partial) = &mut partials[i] {
                        if !partial.left_out.contains(&reason) {
                            partial.left_out.push(reason);
                        }
                    }
                    false
                })
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
            let own_jobs = applicable.len() == jobs.len()
                && (!estimator.answers_bases() || bases.iter().all(Option::is_none));
            let outputs = if own_jobs {
                estimator.run_many(&job_refs, &aggregates)
            } else {
                let some_jobs: Vec<&Job> =
                    applicable.iter().map(|&i| view(i, estimator).0).collect();
                let some_aggregates: Vec<AggregateFeatures> = applicable
                    .iter()
                    .map(|&i| view(i, estimator).1.clone())
                    .collect();
                estimator.run_many(&some_jobs, &some_aggregates)
            };
            let latency = started.elapsed() / applicable.len() as u32;
            for (&i, output) in applicable.iter().zip(outputs) {
                let (partial, confidence) = (&mut partials[i], jobs[i].confidence);
                let Ok(state) = partial else { continue };
                let applied =
                    output.and_then(|output| state.apply(estimator, classes, output, confidence));
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
        let models = FamilyModels {
            family,
            classes,
            simulated: self.simulated.as_ref(),
        };
        partials
            .into_iter()
            .zip(jobs)
            .zip(reaches)
            .zip(analytic)
            .zip(bases)
            .map(|((((partial, query), reach), analytic), base)| {
                partial
                    .and_then(|state| state.finish(&models, query, analytic, reach, base.as_ref()))
            })
            .collect()
    }
}

/// A job's analytic figures, each formula timed as the estimator it answers for.
pub(super) struct AnalyticRun {
    pub(super) figures: AnalyticFigures,
    /// First principles, traced first principles, Horus.
    pub(super) latencies: [Duration; 3],
}

impl AnalyticRun {
    fn of(job: &Job) -> AnalyticRun {
        let started = Instant::now();
        let first_principles_mib = analytic::first_principles_mib(job);
        let first = started.elapsed();
        let traced_first_principles_mib = analytic::traced_first_principles_mib(job);
        let traced = started.elapsed() - first;
        let horus_mib = analytic::horus_mib(job);
        let horus = started.elapsed() - first - traced;
        AnalyticRun {
            figures: AnalyticFigures {
                first_principles_mib,
                traced_first_principles_mib,
                horus_mib,
            },
            latencies: [first, traced, horus],
        }
    }
}
