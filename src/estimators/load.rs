//! Loading: the manifest read and checked, every model file verified against its checksum and
//! its contract (features known, graph inputs and outputs), the `simulated` block and its
//! training domain.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::estimator::{Estimator, Input};
use super::extrapolation::TrainingDomain;
use super::feedforward::FeedForward;
use super::manifest::{
    EstimatorEntry, EstimatorKind, FileRef, InputSpec, Manifest, SimulatedEntry, MANIFEST_FILE,
    SUPPORTED_SCHEMA_VERSION,
};
use super::onnx::{self, Model, ModelInput, OnnxModel};
use super::Estimators;
use crate::estimators::features::{
    check_specs, raw_token_feature, AggregateFeatures, TOKEN_FEATURES,
};
use crate::job::{Family, Job, LayerKind, MemoryClasses, ResidualQuantiles};

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

/// The `simulated` estimator as loaded from the manifest.
pub(super) struct SimulatedModel {
    pub(super) cuda_context_mib: f64,
    pub(super) quantiles: ResidualQuantiles,
    pub(super) version: String,
    /// Where the regressors that correct the simulated figure were trained; `None`: no domain
    /// was given, and the correction applies to every simulated job.
    pub(super) domain: Option<TrainingDomain>,
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
            let model: Box<dyn Model> = match &input {
                Input::Aggregate(specs) => {
                    in_process(&entry.name, &bytes, &entry.output, specs.len(), model)
                }
                Input::Sequence { .. } => Box::new(model),
            };
            estimators.push(Estimator {
                entry: entry.clone(),
                family,
                input,
                model,
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
}

/// An aggregate model evaluated in process when its graph is one [`FeedForward`] knows and
/// both agree on probe rows; ONNX Runtime's sessions otherwise (and the log says why).
fn in_process(
    name: &str,
    bytes: &[u8],
    output: &str,
    width: usize,
    runtime: OnnxModel,
) -> Box<dyn Model> {
    let checked = checked_feedforward(bytes, output, width, &runtime);
    match checked {
        Ok(graph) => {
            tracing::debug!(estimator = name, "evaluated in process");
            Box::new(graph)
        }
        Err(why) => {
            tracing::warn!(estimator = name, %why, "left to ONNX Runtime");
            Box::new(runtime)
        }
    }
}

/// The graph read in process, if it agrees with ONNX Runtime's run of it on probe rows.
fn checked_feedforward(
    bytes: &[u8],
    output: &str,
    width: usize,
    runtime: &OnnxModel,
) -> Result<FeedForward, String> {
    let graph = FeedForward::from_onnx(bytes, output)?;
    let rows = probe_rows(width);
    let input = ModelInput::Aggregate {
        rows: &rows,
        n_rows: PROBE_ROWS,
    };
    let expected = runtime.infer(input).map_err(|e| e.to_string())?;
    let got = graph.infer(input).map_err(|e| e.to_string())?;
    match disagreement(&expected, &got) {
        None => Ok(graph),
        Some(why) => Err(format!("disagrees with ONNX Runtime on probe rows: {why}")),
    }
}

const PROBE_ROWS: usize = 64;

/// `PROBE_ROWS` rows of normalised features spread over -3..3, and one of zeros: the
/// range the estimators are fed.
fn probe_rows(width: usize) -> Vec<f32> {
    let mut state: u32 = 0x9E37_79B9;
    (0..PROBE_ROWS * width)
        .map(|i| {
            if i < width {
                return 0.0;
            }
            state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (state >> 8) as f32 / (1u32 << 24) as f32 * 6.0 - 3.0
        })
        .collect()
}

/// Where two runs of one model part by more than float rounding of different summation
/// orders and approximated functions can: 1e-4 relative, 1e-6 absolute.
fn disagreement(expected: &[f32], got: &[f32]) -> Option<String> {
    if expected.len() != got.len() {
        return Some(format!("{} values against {}", got.len(), expected.len()));
    }
    expected
        .iter()
        .zip(got)
        .position(|(&e, &g)| {
            let same = (e.is_nan() && g.is_nan())
                || e == g
                || (e - g).abs() <= 1e-6 + 1e-4 * e.abs().max(g.abs());
            !same
        })
        .map(|i| format!("value {i}: {} against {}", got[i], expected[i]))
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
        std::iter::once(crate::job::UncheckedLayer {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn committed() -> (PathBuf, Manifest, &'static ort::environment::Environment) {
        let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
        let dylib = std::env::var("ORT_DYLIB_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|_| root.join(".cache/onnxruntime/libonnxruntime.so"));
        let models = root.join("models");
        let manifest = std::fs::read(models.join(MANIFEST_FILE)).unwrap();
        let environment = onnx::environment(&dylib).unwrap();
        (
            models,
            serde_json::from_slice(&manifest).unwrap(),
            environment,
        )
    }

    fn aggregate_width(entry: &EstimatorEntry) -> Option<usize> {
        match &entry.input {
            InputSpec::Aggregate { features } => Some(features.len()),
            InputSpec::Sequence { .. } => None,
        }
    }

    #[test]
    fn every_committed_aggregate_model_is_evaluated_in_process_and_agrees_with_onnx_runtime() {
        let (models, manifest, environment) = committed();
        let mut checked = 0;
        for entry in &manifest.estimators {
            let Some(width) = aggregate_width(entry) else {
                continue;
            };
            let bytes = std::fs::read(models.join(&entry.file)).unwrap();
            let runtime =
                OnnxModel::load(environment, &bytes, &["features"], &entry.output, 1).unwrap();
            if let Err(why) = checked_feedforward(&bytes, &entry.output, width, &runtime) {
                panic!("{}: {why}", entry.name);
            }
            checked += 1;
        }
        assert!(
            checked >= 8,
            "only {checked} aggregate models in the manifest"
        );
    }

    #[test]
    fn a_graph_that_disagrees_with_onnx_runtime_is_left_to_it() {
        let (models, manifest, environment) = committed();
        let entry = |name: &str| {
            manifest
                .estimators
                .iter()
                .find(|e| e.name == name)
                .unwrap()
                .clone()
        };
        // The same inputs and output, other weights: SMOCC's graph against SMACT's runtime.
        let (smact, smocc) = (entry("smact"), entry("smocc"));
        let runtime_bytes = std::fs::read(models.join(&smact.file)).unwrap();
        let runtime =
            OnnxModel::load(environment, &runtime_bytes, &["features"], &smact.output, 1).unwrap();
        let graph_bytes = std::fs::read(models.join(&smocc.file)).unwrap();
        let width = aggregate_width(&smact).unwrap();
        let why = checked_feedforward(&graph_bytes, &smocc.output, width, &runtime).unwrap_err();
        assert!(why.contains("disagrees with ONNX Runtime"), "{why}");
    }

    #[test]
    fn disagreement_tolerates_rounding_only() {
        assert_eq!(disagreement(&[1.0, f32::NAN], &[1.000_01, f32::NAN]), None);
        assert!(disagreement(&[1.0], &[1.001]).is_some());
        assert!(disagreement(&[0.0], &[1e-5]).is_some());
        assert!(disagreement(&[1.0], &[1.0, 2.0]).is_some());
    }
}
