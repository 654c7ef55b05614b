//! Observed peaks and step times, the profiles derived from them, the watch, the devices.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::*;

/// One measured peak of a job on a GPU.
///
/// Rules across fields that no schema states, refused with 422 naming the field: the job's
/// own `gpu`, when given, names the same one card as `gpu` (not another, not a list); its own
/// `environment`, when given, is `environment`; `observed_peak_mib` lies between the job's
/// physical floor and the card's memory; `step_time_ms` needs a card with performance figures
/// (not a custom card known only by its memory).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"gpu": "h100-80gb", "observed_peak_mib": 2310, "job": {
    "batch_size": 512,
    "layers": [
        {"kind": "linear", "output_size": 1024, "params": 803840},
        {"kind": "relu", "output_size": 1024, "params": 0},
        {"kind": "linear", "output_size": 10, "params": 10250},
        {"kind": "softmax", "output_size": 10, "params": 0}
    ]
}}))]
pub struct ObservationRequest {
    /// A catalogue GPU, `attached`, or a custom card (`{"name", "capacity_mib"}`).
    pub gpu: GpuRequest,
    /// The job, as `POST /v1/estimate` takes it.
    #[serde(deserialize_with = "object_only::one")]
    pub job: EstimateRequest,
    /// Peak GPU memory the job reached, MiB, as nvidia-smi reports it: at least the job's
    /// physical floor (model state and CUDA context) and at most the GPU's capacity; a peak
    /// outside is refused (422), being no reading of this job on this GPU.
    #[schema(minimum = 1)]
    pub observed_peak_mib: f64,
    /// The software environment the job ran in (e.g. `torch2.5-cu124`: 1 to 64 letters,
    /// digits, `.`, `_`, `+`, `-`): the observation then also teaches the GPU's profile in
    /// that environment. The job's own `environment`, if given, must agree.
    #[serde(default)]
    #[schema(
        max_length = 64,
        pattern = "^[A-Za-z0-9._+-]{1,64}$",
        example = "torch2.5-cu124"
    )]
    pub environment: Option<String>,
    /// The job's measured time of one optimizer step on this GPU, ms (the median of steady
    /// steps): the observation then also teaches the environment's host cost per op, the
    /// performance model's one environment-bound constant (`step_time_fit` in the profiles).
    /// At most an hour; refused for a custom card known only by its memory.
    #[serde(default)]
    #[schema(exclusive_minimum = 0, maximum = 3600000, example = 215.0)]
    pub step_time_ms: Option<f64>,
}

/// One observation or a list of them.
// Documents the body only: the handler parses the items one by one, so that an error names
// the item and field.
#[derive(Debug, ToSchema)]
#[serde(untagged)]
#[allow(clippy::large_enum_variant)] // never built at run time
pub enum ObservationsRequest {
    One(ObservationRequest),
    Many(Vec<ObservationRequest>),
}

/// What the service has learned about one GPU.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ProfileResponse {
    pub gpu: String,
    /// The environment this profile is learned from; null for the GPU's own profile (every
    /// observation of the GPU, whatever its environment).
    pub environment: Option<String>,
    /// Calibrated figure = offset_mib + scale x the reference figure.
    pub offset_mib: f64,
    pub scale: f64,
    /// Quantiles of observed / calibrated - 1, by level ("0.5", "0.95", ...).
    pub residual_quantiles: BTreeMap<String, f64>,
    pub observations: u64,
    /// RFC 3339.
    pub updated_at: String,
    /// What this environment changes in the breakdown, fitted to its observations that carry
    /// a predicted breakdown; estimates in the environment apply it instead of the line
    /// (held within a step of it). Absent for a GPU's own profile and for an environment
    /// without such observations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub environment_fit: Option<EnvironmentFitResponse>,
    /// The host's cost per dispatched op fitted to this profile's observations that carry a
    /// `step_time_ms`; estimates on this GPU (in this environment) time their steps with it.
    /// Absent without such observations.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub step_time_fit: Option<StepTimeFitResponse>,
}

/// The performance model's host cost fitted to observed step times.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"host_us_per_op": 41.7, "observations": 3, "median_error": 0.06}))]
pub struct StepTimeFitResponse {
    /// Host time to dispatch one op (Python, dispatcher, autograd, launch), microseconds;
    /// the model's default is 15.
    pub host_us_per_op: f64,
    /// Observations with a step time the fit rests on.
    pub observations: usize,
    /// Median of |fitted step time / observed - 1| over them.
    pub median_error: f64,
}

/// An environment's effect on the breakdown: observed ≈ model state and buffers +
/// activation_scale x activations + cache_scale x allocator cache + allocator_fixed_mib +
/// context_mib.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({
    "context_mib": 812.5,
    "allocator_fixed_mib": 0.0,
    "activation_scale": 0.97,
    "cache_scale": 1.0,
    "observations": 3,
    "log_residual_quantiles": {"0.5": 0.0, "0.9": 0.01, "0.95": 0.01, "0.99": 0.01},
    "stack_factor": 1.31,
    "log_margin_95": 0.21
}))]
pub struct EnvironmentFitResponse {
    /// The environment's cost outside the allocator (CUDA context, loaded modules, library
    /// handles), MiB; null when no observation counted it (physics' own stays).
    pub context_mib: Option<f64>,
    /// Fixed cost inside the allocator beyond physics' categories, MiB.
    pub allocator_fixed_mib: f64,
    pub activation_scale: f64,
    pub cache_scale: f64,
    /// The observations the fit rests on.
    pub observations: usize,
    /// Quantiles of log(observed / fitted), by level ("0.5", "0.95", ...).
    pub log_residual_quantiles: BTreeMap<String, f64>,
    /// The stack's factor on everything the allocator holds (1: physics as it is), within
    /// 0.5-2: the most any observations may move this environment's answers.
    pub stack_factor: f64,
    /// ln(upper bound / figure) of the part the stack scales at confidence 0.95: the
    /// environment's own doubt, narrowing as consistent observations come.
    pub log_margin_95: f64,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ObservationsResponse {
    /// Observations recorded by this call.
    pub recorded: usize,
    /// The refitted profiles, one per GPU touched.
    pub profiles: Vec<ProfileResponse>,
    /// GPUs whose profile moved less than this call's observations asked: one update moves a
    /// profile's figure (at the median prediction of its observations) and its scale by at
    /// most a factor of 1.25 either way. The observations are kept; later updates move on.
    pub limited: Vec<String>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct ProfilesResponse {
    pub profiles: Vec<ProfileResponse>,
}

/// Watch a training process on this host's GPU until it exits and learn from its peak.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct WatchRequest {
    /// The process to watch (it may not have touched the GPU yet).
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 4294967295_u64)]
    pub pid: u64,
    /// The job the process runs, as `POST /v1/estimate` takes it.
    #[serde(deserialize_with = "object_only::one")]
    pub job: EstimateRequest,
    /// Longest watch, seconds (default 86,400, at most 30 days); a watch cut short records nothing.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 2_592_000)]
    pub max_seconds: Option<u64>,
    /// Milliseconds between two readings (default 200, 10 to 60,000).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 10, maximum = 60_000)]
    pub interval_ms: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct WatchResponse {
    pub pid: u32,
    pub gpu: String,
    /// `watching`: the peak is recorded as an observation when the process exits.
    pub status: String,
}

/// One GPU of this host.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct DeviceResponse {
    pub index: u32,
    pub uuid: String,
    pub name: String,
    /// Catalogue id when known (`a100-40gb`), else null.
    pub sku: Option<String>,
    pub memory_total_mib: u64,
    pub memory_used_mib: u64,
    pub memory_free_mib: u64,
    pub compute_capability: Option<String>,
    pub driver_version: String,
    /// Streaming multiprocessors, as NVML reports them (null when it cannot say).
    #[serde(default)]
    pub multiprocessor_count: Option<u32>,
    /// Highest SM clock, MHz.
    #[serde(default)]
    pub max_sm_clock_mhz: Option<u32>,
    /// Highest memory clock, MHz (data moves on both edges).
    #[serde(default)]
    pub max_memory_clock_mhz: Option<u32>,
    #[serde(default)]
    pub memory_bus_width_bits: Option<u32>,
    /// Peaks derived from the figures above and the architecture (null for a catalogue card,
    /// whose data-sheet figures `GET /v1/gpus` gives, or when NVML does not say enough).
    #[serde(default)]
    pub derived_peaks: Option<PeaksResponse>,
}

#[derive(Debug, Serialize, Deserialize, ToSchema)]
pub struct DevicesResponse {
    /// False when there is no NVIDIA driver (or NVML is disabled); `reason` says why.
    pub nvml: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    pub devices: Vec<DeviceResponse>,
}
