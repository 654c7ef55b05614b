//! `models/manifest.json`: what each estimator is, what it was trained on, how to feed it.

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::estimators::features::FeatureSpec;

pub const MANIFEST_FILE: &str = "manifest.json";
pub const SUPPORTED_SCHEMA_VERSION: u32 = 1;

#[derive(Debug, Clone, Deserialize)]
pub struct Manifest {
    pub schema_version: u32,
    #[serde(default)]
    pub generated_at: Option<String>,
    /// Provenance of the training data (file, sha256, rows), passed through to clients.
    #[serde(default)]
    pub training_data: serde_json::Value,
    /// The split protocol, passed through to clients.
    #[serde(default)]
    pub split: serde_json::Value,
    pub estimators: Vec<EstimatorEntry>,
    /// How the mlp family's classifiers combine (kept at the top level for compatibility).
    #[serde(default)]
    pub combined: Option<CombinedEntry>,
    /// How the other families' classifiers combine, by family.
    #[serde(default)]
    pub combined_by_family: BTreeMap<String, CombinedEntry>,
    /// The `simulated` estimator (physics from the job's whole-step simulation), for every
    /// family; absent in older manifests, and then simulations serve only as features.
    #[serde(default)]
    pub simulated: Option<SimulatedEntry>,
}

/// The constants of the `simulated` estimator: what every process pays outside the caching
/// allocator, and how far measured peaks fall from the simulated figure.
#[derive(Debug, Clone, Deserialize)]
pub struct SimulatedEntry {
    /// CUDA context and cuBLAS/cuDNN handles, MiB.
    pub cuda_context_mib: f64,
    /// Conformal quantiles of log(measured / simulated figure).
    pub residual_quantiles: Vec<ResidualQuantile>,
    pub version: String,
    /// Where the regressors that correct the simulated figure were trained (their training
    /// jobs' normalised feature vectors); absent: no domain, the correction applies everywhere.
    #[serde(default)]
    pub domain: Option<FileRef>,
}

/// A file of the models directory and its checksum.
#[derive(Debug, Clone, Deserialize)]
pub struct FileRef {
    pub file: String,
    pub sha256: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EstimatorKind {
    MemoryClassifier,
    MemoryRegressor,
    UtilizationRegressor,
}

impl EstimatorKind {
    pub fn as_str(self) -> &'static str {
        match self {
            EstimatorKind::MemoryClassifier => "memory_classifier",
            EstimatorKind::MemoryRegressor => "memory_regressor",
            EstimatorKind::UtilizationRegressor => "utilization_regressor",
        }
    }
}

#[derive(Debug, Clone, Deserialize)]
pub struct EstimatorEntry {
    pub name: String,
    pub version: String,
    pub family: String,
    pub kind: EstimatorKind,
    /// What the runtime loads: a weights file (`*.weights.json`) in process, an ONNX graph on
    /// ONNX Runtime.
    pub file: String,
    pub sha256: String,
    /// The ONNX graph training exported and scored, which an in-process entry's weights were
    /// written from: never loaded by the service (the tests check the weights against ONNX
    /// Runtime's run of it).
    #[serde(default)]
    pub graph: Option<FileRef>,
    pub input: InputSpec,
    pub output: String,
    /// What evaluates the model: `in_process` or `onnxruntime` ([`Runtime`]); absent in older
    /// manifests, where [`Runtime::default_for`] decides. Kept as text so that a name this
    /// build does not know is refused with the estimator's name, not serde's line and column.
    #[serde(default)]
    pub runtime: Option<String>,
    #[serde(default)]
    pub class_bins_mib: Option<Vec<u64>>,
    /// What a regressor predicts (`smact`, `smocc`, `drama`).
    #[serde(default)]
    pub target: Option<String>,
    /// A memory regressor's conformal quantiles of log(measured / predicted).
    #[serde(default)]
    pub residual_quantiles: Option<Vec<ResidualQuantile>>,
    /// Capacity of the card the training data was measured on (fit checks default to it).
    #[serde(default)]
    pub capacity_mib: Option<u64>,
    /// Held-out jobs this estimator's `test_*` figures were measured on (default: the split's).
    #[serde(default)]
    pub test_file: Option<String>,
    #[serde(default)]
    pub validation: BTreeMap<String, serde_json::Value>,
    /// What a job must carry for this estimator to run on it; jobs without it get the family's
    /// other estimators. Only memory regressors may require anything.
    #[serde(default)]
    pub requires: Vec<Requirement>,
}

/// What evaluates an estimator's graph, fixed by its manifest entry: the one runtime it is
/// loaded on, with no second copy of it and no fallback to another.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Runtime {
    /// gpucast's own evaluator of the aggregate MLP ensembles, read from their weight arrays
    /// ([`super::feedforward`]).
    InProcess,
    /// ONNX Runtime's sessions.
    OnnxRuntime,
}

impl Runtime {
    pub const NAMES: [&'static str; 2] = ["in_process", "onnxruntime"];

    pub fn parse(name: &str) -> Option<Runtime> {
        match name {
            "in_process" => Some(Runtime::InProcess),
            "onnxruntime" => Some(Runtime::OnnxRuntime),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Runtime::InProcess => "in_process",
            Runtime::OnnxRuntime => "onnxruntime",
        }
    }

    /// The runtime of an entry that names none (manifests written before the field): what
    /// served such entries before, in process for aggregate graphs and ONNX Runtime for
    /// sequence ones. An aggregate model whose file the evaluator cannot read then fails the
    /// load.
    pub fn default_for(input: &InputSpec) -> Runtime {
        match input {
            InputSpec::Aggregate { .. } => Runtime::InProcess,
            InputSpec::Sequence { .. } => Runtime::OnnxRuntime,
        }
    }
}

/// Something a job may carry besides its layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Requirement {
    /// `saved_tensors`, as `gpucast_describe` traces them.
    SavedTensors,
    /// `simulation`, `gpucast_describe`'s whole-training-step simulation.
    Simulation,
}

impl Requirement {
    pub fn as_str(self) -> &'static str {
        match self {
            Requirement::SavedTensors => "saved_tensors",
            Requirement::Simulation => "simulation",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
pub struct ResidualQuantile {
    pub confidence: f64,
    pub log_ratio: f64,
}

#[derive(Debug, Clone, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum InputSpec {
    Aggregate {
        features: Vec<FeatureSpec>,
    },
    Sequence {
        kind_vocab: Vec<String>,
        token_features: Vec<FeatureSpec>,
        max_tokens: usize,
    },
}

#[derive(Debug, Clone, Deserialize)]
pub struct CombinedEntry {
    pub members: Vec<String>,
    pub rule: String,
    #[serde(default)]
    pub validation: BTreeMap<String, serde_json::Value>,
}
