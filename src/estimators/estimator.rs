//! One loaded estimator (its manifest entry, input and model) and how it is called on a batch of
//! jobs; the analytic figures timed as estimators. Shared by loading, running and combining.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::manifest::{EstimatorEntry, EstimatorKind, Requirement};
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
