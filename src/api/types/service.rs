//! Batches, problems, the loaded estimators, health and the GPU catalogue.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::*;

/// Many jobs in one call.
#[derive(Debug, Deserialize, ToSchema)]
#[schema(example = json!({"items": [
    {"batch_size": 64, "layers": [{"kind": "linear", "output_size": 512, "params": 401920}, {"kind": "relu", "output_size": 512, "params": 0}, {"kind": "linear", "output_size": 10, "params": 5130}]},
    {"batch_size": 8, "layers": [{"kind": "warp_drive", "output_size": 1, "params": 0}]}
]}))]
#[serde(deny_unknown_fields)]
pub struct BatchRequest {
    /// The jobs (1 to 256), each an `EstimateRequest`. Each is validated on its own: a bad item
    /// gets its own error in the answer and does not fail the batch, so any JSON is accepted here.
    // Kept as raw JSON until each item is parsed on its own: far less memory than a tree.
    #[schema(value_type = Vec<Value>, min_items = 1, max_items = 256)]
    pub items: Vec<Box<serde_json::value::RawValue>>,
}

/// One batch item's outcome: `estimate` when `status` is 200, `error` otherwise.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct BatchItemResponse {
    pub index: usize,
    pub status: u16,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimate: Option<EstimateResponse>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<Problem>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct BatchResponse {
    /// One entry per request item, in request order.
    pub items: Vec<BatchItemResponse>,
}

/// An error, problem-details style (RFC 9457).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct Problem {
    #[schema(example = "Invalid request")]
    pub title: String,
    /// The HTTP status, repeated.
    #[schema(example = 422)]
    pub status: u16,
    /// What went wrong, naming the offending field.
    #[schema(example = "batch_size: must be between 1 and 1048576, got 0")]
    pub detail: String,
}

/// A loaded estimator and its validation figures.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct EstimatorInfo {
    pub name: String,
    pub version: String,
    pub family: String,
    /// `memory_classifier`, `memory_regressor` or `utilization_regressor`.
    pub kind: String,
    /// `aggregate` (whole-job features) or `sequence` (one token per layer).
    pub input: String,
    /// What evaluates the model, as the manifest's `runtime` fixes it: `in_process` (gpucast's
    /// own evaluator of the small MLP ensembles, read from their weight arrays, `file`
    /// `*.weights.json`) or `onnxruntime` (`file` an ONNX graph).
    pub runtime: String,
    pub file: String,
    pub sha256: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub target: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub class_bins_mib: Option<Vec<u64>>,
    /// A memory regressor's calibrated quantiles of log(measured / predicted), by confidence.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub residual_quantiles: Option<Vec<ResidualQuantileInfo>>,
    /// What a job must carry for this estimator to answer it (`saved_tensors`); empty: any job
    /// of its family.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub requires: Vec<String>,
    #[schema(value_type = Object)]
    pub validation: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ResidualQuantileInfo {
    pub confidence: f64,
    pub log_ratio: f64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct CombinedInfo {
    pub members: Vec<String>,
    pub rule: String,
    #[schema(value_type = Object)]
    pub validation: BTreeMap<String, serde_json::Value>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct EstimatorsResponse {
    pub generated_at: Option<String>,
    /// Provenance of the training data: each file with its sha256.
    #[schema(value_type = Vec<Object>)]
    pub training_data: serde_json::Value,
    /// How the data was split for validation.
    #[schema(value_type = Object)]
    pub split: serde_json::Value,
    pub estimators: Vec<EstimatorInfo>,
    /// How the mlp family's classifiers combine into `memory.class`.
    pub combined: Option<CombinedInfo>,
    /// The same for the other families, by family.
    pub combined_by_family: BTreeMap<String, CombinedInfo>,
    /// The `simulated` estimator (every family's jobs that carry a simulation); null when the
    /// manifest has none.
    pub simulated: Option<SimulatedInfo>,
}

/// The `simulated` estimator's constants.
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct SimulatedInfo {
    pub version: String,
    /// CUDA context and cuBLAS/cuDNN handles every process pays outside the allocator, MiB.
    pub cuda_context_mib: f64,
    /// Quantiles of log(measured / simulated figure), by confidence.
    pub residual_quantiles: Vec<ResidualQuantileInfo>,
    /// The training domain of the regressors that correct the simulated figure; null when the
    /// manifest names none (the correction then applies to every simulated job).
    #[serde(default)]
    pub domain: Option<DomainInfo>,
}

/// What is loaded of a training domain (`simulated_domain.json`).
#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DomainInfo {
    pub file: String,
    pub sha256: String,
    /// Training jobs (points) a distance is measured to.
    pub points: usize,
    /// The normalised features of a point, in order.
    pub features: Vec<String>,
    /// The setups the regressors were trained on; other jobs are outside.
    pub optimizers: Vec<String>,
    pub precisions: Vec<String>,
    pub typical_distance: f64,
    /// The bound widens beyond `near` x the typical distance ...
    pub near: f64,
    /// ... and the correction is not applied beyond `far` x it ...
    pub far: f64,
    /// ... and the bound's log ratio is multiplied by at most this.
    pub max_widen: f64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct HealthResponse {
    /// `ok` while the process serves.
    pub status: String,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ReadyResponse {
    /// True once the models are loaded, false again while shutting down or while every
    /// request slot is taken (estimates would be refused).
    pub ready: bool,
    /// Whether estimates are answered now.
    pub estimates: bool,
    /// Whether the calibration store can be read and written. Estimates do not need it (they
    /// go on with the profiles last derived), so it does not make the service unready.
    pub store: bool,
    /// Why the store cannot be used, while it cannot.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store_error: Option<String>,
}

/// Peak throughput of a GPU model. Tensor figures are dense (no sparsity) with fp32 accumulate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
pub struct PeaksResponse {
    pub sm_count: u32,
    /// Resident warps one SM holds at most.
    pub max_warps_per_sm: u32,
    pub boost_clock_mhz: u32,
    /// DRAM bandwidth, 10^9 bytes/s.
    pub memory_bandwidth_gb_s: f64,
    /// fp32 on the CUDA cores, 10^12 FLOP/s.
    pub fp32_tflops: f64,
    /// TF32 on tensor cores; null before Ampere.
    pub tf32_tflops: Option<f64>,
    pub fp16_tflops: f64,
    /// Null before Ampere.
    pub bf16_tflops: Option<f64>,
    /// Null before Ada and Hopper.
    pub fp8_tflops: Option<f64>,
    /// GPU-to-GPU bandwidth each way within a node (NVLink, else PCIe), 10^9 bytes/s: what
    /// data-parallel collectives run on.
    pub interconnect_gb_s: f64,
}

impl From<&crate::devices::performance::GpuPerformance> for PeaksResponse {
    fn from(p: &crate::devices::performance::GpuPerformance) -> PeaksResponse {
        PeaksResponse {
            sm_count: p.sm_count,
            max_warps_per_sm: p.max_warps_per_sm,
            boost_clock_mhz: p.boost_clock_mhz,
            memory_bandwidth_gb_s: p.memory_bandwidth_gb_s,
            fp32_tflops: p.fp32_tflops,
            tf32_tflops: p.tf32_tflops,
            fp16_tflops: p.fp16_tflops,
            bf16_tflops: p.bf16_tflops,
            fp8_tflops: p.fp8_tflops,
            interconnect_gb_s: p.interconnect_gb_s,
        }
    }
}

/// A public document figures come from.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SourceResponse {
    pub title: String,
    pub url: String,
}

/// One GPU model of the catalogue.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({
    "id": "l4", "name": "NVIDIA L4", "aliases": ["NVIDIA L4", "L4", "L4 24GB"],
    "gfd_products": ["NVIDIA-L4"],
    "memory_mib": 23034, "memory_gb": 24, "compute_capability": "8.9",
    "peaks": {"sm_count": 58, "max_warps_per_sm": 48, "boost_clock_mhz": 2040,
        "memory_bandwidth_gb_s": 300.0, "fp32_tflops": 30.3, "tf32_tflops": 60.0,
        "fp16_tflops": 121.0, "bf16_tflops": 121.0, "fp8_tflops": 242.0,
        "interconnect_gb_s": 32.0},
    "source": {"title": "NVIDIA L4 Tensor Core GPU datasheet", "url": "https://www.nvidia.com/en-us/data-center/l4/"},
    "from_file": false
}))]
pub struct GpuResponse {
    /// What requests name it by, and its calibration profile's key.
    pub id: String,
    pub name: String,
    /// Other names it is matched by (what nvidia-smi prints, short forms).
    pub aliases: Vec<String>,
    /// What GPU Feature Discovery labels a node with this card (`nvidia.com/gpu.product`):
    /// the NVML names with spaces as dashes. Empty for a card it does not label.
    #[serde(default)]
    pub gfd_products: Vec<String>,
    /// Memory as nvidia-smi reports it (`memory.total`), MiB: the capacity fits are checked
    /// against.
    pub memory_mib: u64,
    /// The marketing size, GB.
    pub memory_gb: u32,
    /// `nvidia` or `amd`: utilization is modelled on NVIDIA cards only.
    pub vendor: String,
    /// `major.minor` (NVIDIA) or the gfx target (AMD).
    pub compute_capability: String,
    pub peaks: PeaksResponse,
    pub source: SourceResponse,
    /// What is nominal or approximate about the figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
    /// True when the entry comes from the file given by `--gpus` (added or replacing a
    /// built-in one).
    pub from_file: bool,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct GpusResponse {
    pub gpus: Vec<GpuResponse>,
}
