//! One loaded estimator (its manifest entry, input and model) and how it is called on a batch of
//! jobs; the analytic figures timed as estimators. Shared by loading, running and combining.

use std::time::{Duration, Instant};

use super::manifest::{EstimatorEntry, EstimatorKind, Requirement, Runtime};
use super::onnx::{InferenceError, Model, ModelInput};
use super::EstimateError;
use crate::estimators::features::{AggregateFeatures, FeatureSpec, TokenFeatures};
use crate::job::{Family, Job, LayerKind, MemoryClasses, ResidualQuantiles};
use crate::physics::analytic::{self, AnalyticFigures};

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
    /// What `model` is, as the manifest fixed it.
    pub(super) runtime: Runtime,
    pub(super) classes: Option<MemoryClasses>,
    pub(super) quantiles: Option<ResidualQuantiles>,
}

impl Estimator {
    pub fn name(&self) -> &str {
        &self.entry.name
    }

    /// What evaluates its model, as the manifest fixed it: `in_process` or `onnxruntime`.
    pub fn runtime(&self) -> &'static str {
        self.runtime.as_str()
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

    /// Runs this estimator on many jobs, each job's output computed as if it came alone.
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
                // One job a call: ONNX Runtime's kernels split a batch's sums differently from
                // one job's (an oom_probability moved in its sixth digit inside a batch of 90),
                // and a job's answer must not depend on the jobs sent with it. One job a call
                // also needs no padding and bounds attention's buffers by one job's tokens^2.
                jobs.iter()
                    .map(|job| {
                        let n_layers = job.layers().len();
                        if n_layers > *max_tokens {
                            return Err(EstimateError::TooManyTokens {
                                estimator: self.entry.name.clone(),
                                max: *max_tokens,
                                got: n_layers,
                            });
                        }
                        let tokens = TokenFeatures::of(
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
                        })?;
                        let input = ModelInput::Sequence {
                            kind_ids: &tokens.kind_ids,
                            features: &tokens.features,
                            n_rows: 1,
                            n_tokens: n_layers,
                            n_features: token_features.len(),
                        };
                        split_rows(self.model.infer(input), 1)
                            .pop()
                            .expect("one row in, one row out")
                    })
                    .collect()
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

/// A job's analytic figures, each formula timed as the estimator it answers for.
pub(super) struct AnalyticRun {
    pub(super) figures: AnalyticFigures,
    /// First principles, traced first principles, Horus.
    pub(super) latencies: [Duration; 3],
}

impl AnalyticRun {
    pub(super) fn of(job: &Job) -> AnalyticRun {
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
