//! The estimators: loaded once from `models/` as the manifest describes them, checked, then
//! run for every job of their family.

pub mod manifest;
pub mod onnx;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use sha2::{Digest, Sha256};

use crate::domain::features::{raw_token_feature, AggregateFeatures, FeatureSpec, TokenFeatures, TOKEN_FEATURES};
use crate::domain::{Family, Job, LayerKind, MemoryClass, MemoryClasses};
use manifest::{EstimatorEntry, EstimatorKind, InputSpec, Manifest, MANIFEST_FILE, SUPPORTED_SCHEMA_VERSION};
use onnx::{InferenceError, Model, ModelInput, OnnxModel};

/// Why the models could not be loaded. Each message names the file at fault, on one line.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("{path}: cannot read: {source}")]
    Read { path: PathBuf, source: std::io::Error },
    #[error("{path}: invalid manifest: {reason}")]
    Manifest { path: PathBuf, reason: String },
    #[error("{path}: sha256 is {actual}, the manifest says {expected}")]
    Checksum { path: PathBuf, expected: String, actual: String },
    #[error("{path}: {reason}")]
    Model { path: PathBuf, reason: String },
    #[error("ONNX Runtime: {0}")]
    Runtime(String),
}

/// Why a valid job could not be estimated.
#[derive(Debug, thiserror::Error)]
pub enum EstimateError {
    #[error("family: no memory estimator is loaded for family '{0}'")]
    UnsupportedFamily(Family),
    #[error("layers[{index}].kind: '{kind}' is not in the vocabulary of estimator '{estimator}'")]
    KindNotInVocabulary { index: usize, kind: LayerKind, estimator: String },
    #[error("layers: estimator '{estimator}' accepts at most {max} layers, got {got}")]
    TooManyTokens { estimator: String, max: usize, got: usize },
    #[error(transparent)]
    Inference(#[from] InferenceError),
}

enum Input {
    Aggregate(Vec<FeatureSpec>),
    Sequence { vocab: Vec<LayerKind>, token_features: Vec<FeatureSpec>, max_tokens: usize },
}

/// One loaded estimator.
pub struct Estimator {
    pub entry: EstimatorEntry,
    pub family: Family,
    input: Input,
    model: Box<dyn Model>,
    classes: Option<MemoryClasses>,
}

impl Estimator {
    pub fn name(&self) -> &str {
        &self.entry.name
    }

    /// Runs this estimator alone: class probabilities, or a one-element regression output.
    pub fn run(&self, job: &Job, aggregate: &AggregateFeatures) -> Result<Vec<f32>, EstimateError> {
        match &self.input {
            Input::Aggregate(specs) => {
                let features = aggregate.normalised(specs);
                Ok(self.model.infer(ModelInput::Aggregate(&features))?)
            }
            Input::Sequence { vocab, token_features, max_tokens } => {
                if job.layers().len() > *max_tokens {
                    return Err(EstimateError::TooManyTokens {
                        estimator: self.entry.name.clone(),
                        max: *max_tokens,
                        got: job.layers().len(),
                    });
                }
                let tokens = TokenFeatures::of(job, |k| vocab.iter().position(|v| *v == k), token_features)
                    .map_err(|(index, kind)| EstimateError::KindNotInVocabulary {
                        index,
                        kind,
                        estimator: self.entry.name.clone(),
                    })?;
                Ok(self.model.infer(ModelInput::Sequence(&tokens))?)
            }
        }
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

/// Everything the estimators said about one job.
#[derive(Debug, Clone)]
pub struct Estimate {
    pub family: Family,
    /// The combined memory class (mean of the classifiers' probabilities).
    pub class: ClassAnswer,
    /// Each classifier's own answer, by estimator name.
    pub classifiers: BTreeMap<String, ClassAnswer>,
    /// Utilization fractions by target (`smact`, `smocc`, ...); absent targets have no model.
    pub utilization: BTreeMap<String, f32>,
    pub runs: Vec<EstimatorRun>,
}

/// All loaded estimators, grouped by family.
pub struct Estimators {
    manifest: Manifest,
    estimators: Vec<Estimator>,
}

impl Estimators {
    /// Loads and checks every estimator of `dir/manifest.json`: file present, checksum equal,
    /// features known, graph inputs and outputs as the contract says.
    pub fn load(dir: &Path, ort_dylib: &Path, sessions_per_model: usize) -> Result<Estimators, LoadError> {
        let manifest_path = dir.join(MANIFEST_FILE);
        let manifest_bytes = std::fs::read(&manifest_path)
            .map_err(|source| LoadError::Read { path: manifest_path.clone(), source })?;
        let manifest: Manifest = serde_json::from_slice(&manifest_bytes)
            .map_err(|e| LoadError::Manifest { path: manifest_path.clone(), reason: e.to_string() })?;
        let invalid = |reason: String| LoadError::Manifest { path: manifest_path.clone(), reason };
        if manifest.schema_version != SUPPORTED_SCHEMA_VERSION {
            return Err(invalid(format!(
                "schema_version {} is not supported (expected {SUPPORTED_SCHEMA_VERSION})",
                manifest.schema_version
            )));
        }
        if manifest.estimators.is_empty() {
            return Err(invalid("no estimators listed".into()));
        }
        let environment = onnx::environment(ort_dylib).map_err(LoadError::Runtime)?;
        let mut estimators = Vec::with_capacity(manifest.estimators.len());
        for entry in &manifest.estimators {
            let path = dir.join(&entry.file);
            let (family, input, classes) = check_entry(entry).map_err(|reason| invalid(format!("estimator '{}': {reason}", entry.name)))?;
            let bytes = std::fs::read(&path).map_err(|source| LoadError::Read { path: path.clone(), source })?;
            let actual = hex::encode(Sha256::digest(&bytes));
            if !actual.eq_ignore_ascii_case(&entry.sha256) {
                return Err(LoadError::Checksum { path, expected: entry.sha256.clone(), actual });
            }
            let input_names: &[&str] = match input {
                Input::Aggregate(_) => &["features"],
                Input::Sequence { .. } => &["kind_ids", "token_features", "mask"],
            };
            let model = OnnxModel::load(environment, &bytes, input_names, &entry.output, sessions_per_model)
                .map_err(|reason| LoadError::Model { path: path.clone(), reason })?;
            estimators.push(Estimator { entry: entry.clone(), family, input, model: Box::new(model), classes });
        }
        for pair in estimators.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            if a.family == b.family && a.classes.is_some() && b.classes.is_some() && a.classes != b.classes {
                return Err(invalid(format!("estimators '{}' and '{}' classify family {} into different bins", a.name(), b.name(), a.family)));
            }
        }
        Ok(Estimators { manifest, estimators })
    }

    pub fn manifest(&self) -> &Manifest {
        &self.manifest
    }

    pub fn all(&self) -> &[Estimator] {
        &self.estimators
    }

    /// Runs every estimator of the job's family.
    pub fn estimate(&self, job: &Job) -> Result<Estimate, EstimateError> {
        let family = job.family();
        let members: Vec<&Estimator> = self.estimators.iter().filter(|e| e.family == family).collect();
        let classifiers: Vec<&Estimator> =
            members.iter().copied().filter(|e| e.entry.kind == EstimatorKind::MemoryClassifier).collect();
        let Some(classes) = classifiers.first().and_then(|e| e.classes.as_ref()) else {
            return Err(EstimateError::UnsupportedFamily(family));
        };
        let aggregate = AggregateFeatures::of(job);
        let mut runs = Vec::with_capacity(members.len());
        let mut answers = BTreeMap::new();
        let mut utilization = BTreeMap::new();
        let mut mean = vec![0.0f32; classes.len()];
        for estimator in &members {
            let started = Instant::now();
            let output = estimator.run(job, &aggregate)?;
            runs.push(EstimatorRun {
                name: estimator.entry.name.clone(),
                version: estimator.entry.version.clone(),
                latency: started.elapsed(),
            });
            match estimator.entry.kind {
                EstimatorKind::MemoryClassifier => {
                    for (m, p) in mean.iter_mut().zip(&output) {
                        *m += p / classifiers.len() as f32;
                    }
                    answers.insert(estimator.entry.name.clone(), class_answer(classes, output));
                }
                EstimatorKind::UtilizationRegressor => {
                    let target = estimator.entry.target.clone().unwrap_or_default();
                    let value = output.first().copied().unwrap_or(f32::NAN).clamp(0.0, 1.0);
                    utilization.insert(target, value);
                }
            }
        }
        Ok(Estimate { family, class: class_answer(classes, mean), classifiers: answers, utilization, runs })
    }
}

fn class_answer(classes: &MemoryClasses, probabilities: Vec<f32>) -> ClassAnswer {
    // First maximum wins, so a tie resolves to the smaller class deterministically.
    let index = probabilities
        .iter()
        .enumerate()
        .fold((0, f32::MIN), |best, (i, &p)| if p > best.1 { (i, p) } else { best })
        .0;
    ClassAnswer { class: classes.class(index), probabilities }
}

/// Checks a manifest entry against what this build can compute.
fn check_entry(entry: &EstimatorEntry) -> Result<(Family, Input, Option<MemoryClasses>), String> {
    let family = Family::parse(&entry.family).ok_or_else(|| format!("unknown family '{}'", entry.family))?;
    let probe_job = Job::parse(None, 1, std::iter::once(crate::domain::UncheckedLayer { kind: "linear", output_size: 1, params: 1 }))
        .expect("a one-layer job is valid");
    let input = match &entry.input {
        InputSpec::Aggregate { features } => {
            let aggregate = AggregateFeatures::of(&probe_job);
            check_specs(features, |name| aggregate.get(name).is_some())?;
            Input::Aggregate(features.clone())
        }
        InputSpec::Sequence { kind_vocab, token_features, max_tokens } => {
            let vocab = kind_vocab
                .iter()
                .map(|k| LayerKind::parse(k).ok_or_else(|| format!("unknown layer kind '{k}' in kind_vocab")))
                .collect::<Result<Vec<_>, _>>()?;
            check_specs(token_features, |name| {
                TOKEN_FEATURES.contains(&name) && raw_token_feature(&probe_job, 0, name).is_some()
            })?;
            if *max_tokens == 0 {
                return Err("max_tokens must be positive".into());
            }
            Input::Sequence { vocab, token_features: token_features.clone(), max_tokens: *max_tokens }
        }
    };
    let classes = match entry.kind {
        EstimatorKind::MemoryClassifier => {
            let bins = entry.class_bins_mib.clone().ok_or("a memory classifier needs class_bins_mib")?;
            Some(MemoryClasses::new(bins).map_err(|e| e.to_string())?)
        }
        EstimatorKind::UtilizationRegressor => {
            entry.target.as_ref().ok_or("a utilization regressor needs a target")?;
            None
        }
    };
    Ok((family, input, classes))
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
