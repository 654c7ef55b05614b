//! Loading: the manifest read and checked, every model file verified against its checksum and
//! its contract (features known, graph inputs and outputs) and loaded on the runtime its entry
//! names, the `simulated` block and its training domain.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};

use super::estimator::{Estimator, Input};
use super::extrapolation::TrainingDomain;
use super::feedforward::FeedForward;
use super::manifest::{
    EstimatorEntry, EstimatorKind, FileRef, InputSpec, Manifest, Runtime, SimulatedEntry,
    MANIFEST_FILE, SUPPORTED_SCHEMA_VERSION,
};
use super::onnx::{self, Model, OnnxModel};
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
    /// features known, graph inputs and outputs as the contract says, each model on the one
    /// runtime its entry names (a model that cannot run there fails the load).
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
        let mut estimators = Vec::with_capacity(manifest.estimators.len());
        for entry in &manifest.estimators {
            let path = dir.join(&entry.file);
            let Checked {
                family,
                input,
                runtime,
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
            let model = load_model(
                entry,
                runtime,
                &input,
                &bytes,
                ort_dylib,
                sessions_per_model,
            )
            .map_err(|reason| match reason {
                ModelRefused::Runtime(reason) => LoadError::Runtime(reason),
                ModelRefused::Model(reason) => LoadError::Model {
                    path: path.clone(),
                    reason: format!(
                        "estimator '{}' cannot run on {}: {reason}",
                        entry.name,
                        runtime.as_str()
                    ),
                },
            })?;
            estimators.push(Estimator {
                entry: entry.clone(),
                family,
                input,
                model,
                runtime,
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

/// Why a model was not loaded on its runtime.
enum ModelRefused {
    /// ONNX Runtime itself could not start.
    Runtime(String),
    /// The model cannot run there.
    Model(String),
}

/// Loads a model on the one runtime its entry names: in process, a weights file the evaluator
/// reads whose rows are as wide as the entry's features; on ONNX Runtime, a pool of `sessions`
/// sessions whose graph has the inputs and the output the service uses.
fn load_model(
    entry: &EstimatorEntry,
    runtime: Runtime,
    input: &Input,
    bytes: &[u8],
    ort_dylib: &Path,
    sessions: usize,
) -> Result<Box<dyn Model>, ModelRefused> {
    match (runtime, input) {
        (Runtime::InProcess, Input::Aggregate(specs)) => {
            let model = FeedForward::from_weights(bytes).map_err(ModelRefused::Model)?;
            if model.inputs() != specs.len() {
                return Err(ModelRefused::Model(format!(
                    "its rows hold {} features, the entry lists {}",
                    model.inputs(),
                    specs.len()
                )));
            }
            Ok(Box::new(model))
        }
        (Runtime::InProcess, Input::Sequence { .. }) => Err(ModelRefused::Model(
            "the in-process evaluator reads aggregate features only".into(),
        )),
        (Runtime::OnnxRuntime, _) => {
            // Started on the first model that needs it: a manifest of in-process models only
            // never loads the library.
            let environment = onnx::environment(ort_dylib).map_err(ModelRefused::Runtime)?;
            let input_names: &[&str] = match input {
                Input::Aggregate(_) => &["features"],
                Input::Sequence { .. } => &["kind_ids", "token_features", "mask"],
            };
            let model = OnnxModel::load(environment, bytes, input_names, &entry.output, sessions)
                .map_err(ModelRefused::Model)?;
            Ok(Box::new(model))
        }
    }
}

struct Checked {
    family: Family,
    input: Input,
    runtime: Runtime,
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
    let runtime = match entry.runtime.as_deref() {
        None => Runtime::default_for(&entry.input),
        Some(name) => Runtime::parse(name).ok_or_else(|| {
            format!(
                "unknown runtime '{name}' (this build runs {})",
                Runtime::NAMES.join(" or ")
            )
        })?,
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
        runtime,
        classes,
        quantiles,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::estimators::onnx::ModelInput;

    fn root() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR"))
    }

    fn dylib() -> PathBuf {
        std::env::var("ORT_DYLIB_PATH")
            .map(PathBuf::from)
            .unwrap_or_else(|_| root().join(".cache/onnxruntime/libonnxruntime.so"))
    }

    fn committed_manifest() -> serde_json::Value {
        serde_json::from_slice(&std::fs::read(root().join("models").join(MANIFEST_FILE)).unwrap())
            .unwrap()
    }

    /// Loads a copy of the committed models whose manifest `edit` changed (it may also write
    /// files into the copy, given its path).
    fn load_edited(
        edit: impl FnOnce(&mut serde_json::Value, &Path),
    ) -> Result<Estimators, LoadError> {
        let dir = tempfile::tempdir().unwrap();
        for file in std::fs::read_dir(root().join("models")).unwrap() {
            let file = file.unwrap().path();
            std::fs::copy(&file, dir.path().join(file.file_name().unwrap())).unwrap();
        }
        let mut manifest = committed_manifest();
        edit(&mut manifest, dir.path());
        std::fs::write(
            dir.path().join(MANIFEST_FILE),
            serde_json::to_vec(&manifest).unwrap(),
        )
        .unwrap();
        Estimators::load(dir.path(), &dylib(), 1)
    }

    fn entry_named<'a>(
        manifest: &'a mut serde_json::Value,
        name: &str,
    ) -> &'a mut serde_json::Value {
        manifest["estimators"]
            .as_array_mut()
            .unwrap()
            .iter_mut()
            .find(|e| e["name"] == name)
            .unwrap()
    }

    fn committed() -> (PathBuf, Manifest) {
        let manifest = serde_json::from_value(committed_manifest()).unwrap();
        (root().join("models"), manifest)
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

    /// Where the in-process run of `weights_file` parts from ONNX Runtime's run of
    /// `graph_file` on the probe rows.
    fn disagreement_with_onnx_runtime(
        weights_file: &Path,
        graph_file: &Path,
        output: &str,
        width: usize,
    ) -> Option<String> {
        let environment = onnx::environment(&dylib()).unwrap();
        let graph_bytes = std::fs::read(graph_file).unwrap();
        let runtime = OnnxModel::load(environment, &graph_bytes, &["features"], output, 1).unwrap();
        let weights = FeedForward::from_weights(&std::fs::read(weights_file).unwrap()).unwrap();
        let rows = probe_rows(width);
        let input = ModelInput::Aggregate {
            rows: &rows,
            n_rows: PROBE_ROWS,
        };
        disagreement(
            &runtime.infer(input).unwrap(),
            &weights.infer(input).unwrap(),
        )
    }

    fn aggregate_width(entry: &EstimatorEntry) -> Option<usize> {
        match &entry.input {
            InputSpec::Aggregate { features } => Some(features.len()),
            InputSpec::Sequence { .. } => None,
        }
    }

    // The load never reads the graphs of the in-process models; this test runs each against
    // its weights, for every committed in-process model, so the weights and the evaluator
    // stay right.
    #[test]
    fn every_committed_aggregate_model_is_evaluated_in_process_and_agrees_with_onnx_runtime() {
        let (models, manifest) = committed();
        let mut checked = 0;
        for entry in &manifest.estimators {
            let Some(width) = aggregate_width(entry) else {
                continue;
            };
            assert_eq!(
                entry.runtime.as_deref(),
                Some("in_process"),
                "{}",
                entry.name
            );
            let graph = entry
                .graph
                .as_ref()
                .expect("an in-process entry names its graph");
            let graph_path = models.join(&graph.file);
            let actual = hex::encode(Sha256::digest(std::fs::read(&graph_path).unwrap()));
            assert_eq!(actual, graph.sha256, "{}: the graph's sha256", entry.name);
            let weights = models.join(&entry.file);
            if let Some(why) =
                disagreement_with_onnx_runtime(&weights, &graph_path, &entry.output, width)
            {
                panic!(
                    "{}: disagrees with ONNX Runtime on probe rows: {why}",
                    entry.name
                );
            }
            checked += 1;
        }
        assert!(
            checked >= 8,
            "only {checked} aggregate models in the manifest"
        );
    }

    #[test]
    fn the_agreement_check_sees_other_weights() {
        let (models, manifest) = committed();
        let entry = |name: &str| manifest.estimators.iter().find(|e| e.name == name).unwrap();
        // The same inputs and output, other weights: SMOCC's weights against SMACT's graph.
        let (smact, smocc) = (entry("smact"), entry("smocc"));
        let why = disagreement_with_onnx_runtime(
            &models.join(&smocc.file),
            &models.join(&smact.graph.as_ref().unwrap().file),
            &smact.output,
            aggregate_width(smact).unwrap(),
        );
        assert!(why.is_some());
    }

    #[test]
    fn disagreement_tolerates_rounding_only() {
        assert_eq!(disagreement(&[1.0, f32::NAN], &[1.000_01, f32::NAN]), None);
        assert!(disagreement(&[1.0], &[1.001]).is_some());
        assert!(disagreement(&[0.0], &[1e-5]).is_some());
        assert!(disagreement(&[1.0], &[1.0, 2.0]).is_some());
    }

    #[test]
    fn every_committed_model_runs_on_the_runtime_its_entry_names() {
        let estimators = Estimators::load(&root().join("models"), &dylib(), 1).unwrap();
        for estimator in estimators.all() {
            let named = estimator.entry.runtime.as_deref();
            assert_eq!(named, Some(estimator.runtime()), "{}", estimator.name());
            let expected = match estimator.entry.input {
                InputSpec::Aggregate { .. } => "in_process",
                InputSpec::Sequence { .. } => "onnxruntime",
            };
            assert_eq!(estimator.runtime(), expected, "{}", estimator.name());
        }
    }

    #[test]
    fn an_unknown_runtime_fails_the_load_naming_the_model() {
        let error = load_edited(|manifest, _| {
            entry_named(manifest, "smocc")["runtime"] = "tract".into();
        })
        .err()
        .expect("an unknown runtime is refused");
        let message = error.to_string();
        assert!(matches!(error, LoadError::Manifest { .. }), "{message}");
        assert!(
            message.contains("estimator 'smocc'") && message.contains("unknown runtime 'tract'"),
            "{message}"
        );
    }

    /// Writes `edit` of smact's weights as its file, with their checksum.
    fn edited_weights(
        manifest: &mut serde_json::Value,
        dir: &Path,
        edit: impl FnOnce(&mut serde_json::Value),
    ) {
        let entry = entry_named(manifest, "smact");
        let file = entry["file"].as_str().unwrap().to_string();
        let mut weights: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(&file)).unwrap()).unwrap();
        edit(&mut weights);
        let bytes = serde_json::to_vec(&weights).unwrap();
        std::fs::write(dir.join("smact_patched.weights.json"), &bytes).unwrap();
        entry["file"] = "smact_patched.weights.json".into();
        entry["sha256"] = hex::encode(Sha256::digest(&bytes)).into();
    }

    #[test]
    fn an_in_process_model_the_evaluator_cannot_run_fails_the_load() {
        let error = load_edited(|manifest, dir| {
            edited_weights(manifest, dir, |weights| {
                weights["head"]["type"] = "softsign".into();
            });
        })
        .err()
        .expect("weights with an unknown head are refused in process");
        let message = error.to_string();
        assert!(matches!(error, LoadError::Model { .. }), "{message}");
        assert!(
            message.contains("estimator 'smact' cannot run on in_process")
                && message.contains("softsign"),
            "{message}"
        );
        // Its graph is no weights file: the evaluator never reads ONNX.
        let error = load_edited(|manifest, _| {
            let entry = entry_named(manifest, "smact");
            let graph = entry["graph"].clone();
            entry["file"] = graph["file"].clone();
            entry["sha256"] = graph["sha256"].clone();
        })
        .err()
        .expect("a graph is refused in process");
        let message = error.to_string();
        assert!(
            message.contains("estimator 'smact' cannot run on in_process")
                && message.contains("not a weights file"),
            "{message}"
        );
    }

    #[test]
    fn an_in_process_model_fed_fewer_features_than_it_reads_fails_the_load() {
        let error = load_edited(|manifest, _| {
            let features = &mut entry_named(manifest, "smact")["input"]["features"];
            features.as_array_mut().unwrap().pop();
        })
        .err()
        .expect("a row of the wrong width is refused at load, not on the first request");
        let message = error.to_string();
        assert!(
            message.contains("estimator 'smact' cannot run on in_process")
                && message.contains("its rows hold 22 features, the entry lists 21"),
            "{message}"
        );
    }

    #[test]
    fn a_sequence_model_named_in_process_fails_the_load() {
        let error = load_edited(|manifest, _| {
            entry_named(manifest, "sequence_transformer")["runtime"] = "in_process".into();
        })
        .err()
        .expect("the evaluator reads aggregate graphs only");
        let message = error.to_string();
        assert!(
            message.contains("estimator 'sequence_transformer' cannot run on in_process"),
            "{message}"
        );
    }

    #[test]
    fn an_aggregate_model_may_be_named_onnx_runtime_with_its_graph() {
        let estimators = load_edited(|manifest, _| {
            let entry = entry_named(manifest, "smact");
            entry["runtime"] = "onnxruntime".into();
            let graph = entry["graph"].clone();
            entry["file"] = graph["file"].clone();
            entry["sha256"] = graph["sha256"].clone();
        })
        .unwrap();
        let smact = estimators
            .all()
            .iter()
            .find(|e| e.name() == "smact")
            .unwrap();
        assert_eq!(smact.runtime(), "onnxruntime");
        // Its weights file is no graph: ONNX Runtime refuses it.
        let error = load_edited(|manifest, _| {
            entry_named(manifest, "smact")["runtime"] = "onnxruntime".into();
        })
        .err()
        .expect("weights are refused on ONNX Runtime");
        assert!(
            error
                .to_string()
                .contains("estimator 'smact' cannot run on onnxruntime"),
            "{error}"
        );
    }

    #[test]
    fn a_manifest_without_runtimes_runs_aggregate_graphs_in_process_and_sequences_on_onnx_runtime()
    {
        let estimators = load_edited(|manifest, _| {
            for entry in manifest["estimators"].as_array_mut().unwrap() {
                entry.as_object_mut().unwrap().remove("runtime");
            }
        })
        .unwrap();
        for estimator in estimators.all() {
            assert_eq!(estimator.entry.runtime, None);
            let expected = match estimator.entry.input {
                InputSpec::Aggregate { .. } => "in_process",
                InputSpec::Sequence { .. } => "onnxruntime",
            };
            assert_eq!(estimator.runtime(), expected, "{}", estimator.name());
        }
    }
}
