//! The estimate as a client reads it.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::*;

/// A MiB range with the probability of each class.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct MemoryClassResponse {
    /// Class index (0 is the smallest).
    pub index: usize,
    /// Exclusive lower bound, MiB.
    pub lower_mib: u64,
    /// Inclusive upper bound, MiB; null for the open top class.
    pub upper_mib: Option<u64>,
    /// Probability of each class, by index.
    pub probabilities: Vec<f32>,
}

/// One estimator's own answer: a class (classifiers) or a MiB figure (regressors, formulas).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EstimatorAnswer {
    pub version: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub class: Option<MemoryClassResponse>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub estimate_mib: Option<f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct MemoryResponse {
    /// Expected peak GPU memory, MiB (as nvidia-smi reports it: CUDA context included); null
    /// for a job without a simulation of a family without a memory regressor. Never below the
    /// physics floor: parameters + gradients + optimizer state (+ the simulated activations at
    /// the peak) + CUDA context.
    pub estimate_mib: Option<f64>,
    /// A peak the job stays at or below with probability `confidence`: `memory.uncertainty`'s
    /// distribution read at that confidence (a calibration profile's bound where one applies),
    /// at least `estimate_mib`; null with `estimate_mib`.
    pub upper_bound_mib: Option<f64>,
    /// Confidence of `upper_bound_mib`.
    pub confidence: f64,
    /// True when an estimator answered less than the physics floor and the figure was raised
    /// to it.
    #[serde(default)]
    pub floored: bool,
    /// The class containing `estimate_mib` (its probabilities: 60 % on that class, 40 % the
    /// classifiers' mean); without a figure, the classifiers' combined answer.
    pub class: MemoryClassResponse,
    /// `estimate_mib` by category, MiB; null without a figure.
    pub breakdown: Option<BreakdownResponse>,
    /// Where the breakdown comes from; null without a figure.
    pub breakdown_source: Option<BreakdownSourceName>,
    /// The simulation's allocated peak, MiB; null without a simulation.
    pub allocated_peak_mib: Option<f64>,
    /// The simulation's reserved peak with unlimited memory, MiB; null without a simulation.
    pub reserved_peak_mib: Option<f64>,
    /// The smallest allocator capacity the step runs on, MiB; null without a simulation.
    pub min_capacity_mib: Option<f64>,
    /// Each memory estimator's own answer, by estimator name.
    pub estimators: BTreeMap<String, EstimatorAnswer>,
    /// How far a simulated job is from the jobs the simulation regressors were trained on, and
    /// what that changed; null for a job without a simulation, or when no training domain is
    /// loaded (`GET /v1/estimators`, `simulated.domain`).
    #[serde(default)]
    pub extrapolation: Option<ExtrapolationResponse>,
    /// The distribution the bound and `fit.oom_probability` are read from; null with
    /// `estimate_mib`.
    #[serde(default)]
    pub uncertainty: Option<UncertaintyResponse>,
    /// When in the step the peak falls; null with `estimate_mib`.
    #[serde(default)]
    pub peak_moment: Option<PeakMomentName>,
    /// For a job counted from its layers: the factor (0.5 to 2) on the training step's
    /// activations, temporaries and allocator cache that makes the step of the same layers in
    /// the nearest learned setup (fp32 or fp16 autocast, every parameter trained, one GPU)
    /// answer what the memory regressor answers there. Every setup of the same layers shares
    /// it. Null for a simulated or configured job, or when the regressor's answer lies beyond
    /// that range (the step answers alone).
    #[serde(default)]
    pub base_correction: Option<f64>,
}

/// A simulated job against the training domain of the regressors that correct the simulated
/// figure. Up to `far` x the typical distance the correction leads; beyond it, or for an
/// optimizer or precision the regressors were not trained on, the `simulated` figure leads.
/// The bound's log ratio is multiplied by `bound_widened_by` = clamp(ratio / near, 1,
/// max_widen) either way. Figures rounded to 0.001.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"distance": 0.412, "typical_distance": 1.7, "ratio": 0.242, "outside_setup": false,
    "correction_applied": true, "bound_widened_by": 1.0}))]
pub struct ExtrapolationResponse {
    /// Euclidean distance from the job's normalised feature vector to the nearest training
    /// job's; null when the job is outside the trained setups.
    pub distance: Option<f64>,
    /// The distance typical of a model family the regressors had not seen.
    pub typical_distance: f64,
    /// `distance / typical_distance`; null when outside the trained setups (infinitely far).
    pub ratio: Option<f64>,
    /// The job's optimizer or precision is not one the regressors were trained on.
    pub outside_setup: bool,
    /// A simulation regressor's figure leads (`memory.estimate_mib`, before the floor).
    pub correction_applied: bool,
    /// Factor on the log ratio of `upper_bound_mib` over `estimate_mib` (1: not widened).
    pub bound_widened_by: f64,
}

/// A MiB figure by category, each rounded to 0.1 MiB; they sum to the figure (rounded the
/// same way).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct BreakdownResponse {
    /// Weights (both copies in mixed precision).
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer_state: f64,
    /// Tensors kept for backward: the simulation's at the peak, the traced saved tensors, or
    /// every layer output.
    pub activations: f64,
    /// Workspaces and intermediates live at the peak, and whatever part of the figure the
    /// categories of physics do not explain (a learned correction).
    pub temporaries: f64,
    /// DDP's gradient buckets, FSDP/ZeRO's gathered weights and reduce buffers (0 on one GPU).
    pub collective_buffers: f64,
    /// A paged optimizer's state (bitsandbytes' paged optimizers): CUDA unified memory on the
    /// device, outside PyTorch's allocator (so not in `allocated_peak_mib`/`reserved_peak_mib`).
    pub paged_optimizer_state: f64,
    /// Segments the caching allocator holds beyond the allocated bytes (a simulated job's
    /// reserved peak on the card minus its allocated peak; for `training_step` 8 % of the
    /// allocated bytes, the simulations' median; 0 for an analytic breakdown).
    pub allocator_cache: f64,
    /// CUDA context and cuBLAS/cuDNN handles, outside the allocator.
    pub cuda_context: f64,
}

/// `simulation`: the job's whole-step simulation (on the most loaded GPU of its layout);
/// `analytic`: per-parameter bytes of the optimizer and precision, activations from the traced
/// saved tensors or the layer outputs; `training_step`: the analytic training step of a setup
/// the learned models do not know (docs/user/setups.md), per GPU.
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum BreakdownSourceName {
    Simulation,
    Analytic,
    TrainingStep,
}

/// Mean utilization while the job trains alone on the GPU, as fractions 0..1 (DCGM profiling
/// metrics). A metric without a figure is null, and `null_reasons` says why.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct UtilizationResponse {
    /// SM active (DCGM_FI_PROF_SM_ACTIVE).
    pub smact: Option<f32>,
    /// SM occupancy (DCGM_FI_PROF_SM_OCCUPANCY).
    pub smocc: Option<f32>,
    /// DRAM active (DCGM_FI_PROF_DRAM_ACTIVE).
    pub drama: Option<f32>,
    /// Where each figure comes from, by metric name: `learned` (a regressor trained on
    /// measured utilization) or `roofline` (the performance model on the target GPU); a null
    /// metric has no entry.
    pub sources: BTreeMap<String, UtilizationSourceName>,
    /// Why each null metric is null, by metric name (`smact`, `smocc`, `drama`); a metric
    /// with a figure has no entry.
    pub null_reasons: BTreeMap<String, String>,
}

/// What a utilization figure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum UtilizationSourceName {
    Learned,
    Roofline,
}

/// One card of a `gpu` list, in rank order: the cards the job fits first, fastest predicted
/// step first, then the smaller card; then the cards it does not fit, nearest first.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct GpuRankResponse {
    /// 1 for the card the rest of the answer is for.
    pub rank: u32,
    /// The card's profile key, as `fit.gpu` names it.
    pub gpu: String,
    pub capacity_mib: u64,
    pub fits: bool,
    pub max_colocated: u64,
    /// The estimate on this card (calibrated by its profile when it has one), MiB.
    pub estimate_mib: Option<f64>,
    pub upper_bound_mib: Option<f64>,
    /// The roofline's step time; null on a card known only by its memory.
    pub step_time_ms: Option<f64>,
    pub samples_per_s: Option<f64>,
}

/// One training step on the target GPU, from the roofline performance model
/// (docs/design/roofline.md): the kernels of forward, backward (with recomputation) and the
/// optimizer, each at the dtype's achievable peak or the DRAM bandwidth, dispatched by an
/// eager host. One GPU of the layout: its compute, and the data-parallel collectives compute
/// does not hide (`collectives_ms`).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PerformanceResponse {
    /// One optimizer step (every micro-batch of it), milliseconds.
    pub step_time_ms: f64,
    /// Samples this GPU trains per second.
    pub samples_per_s: f64,
    /// Forward of every micro-batch of the step, ms.
    pub forward_ms: f64,
    /// Backward (recomputation included) of every micro-batch of the step, ms.
    pub backward_ms: f64,
    /// The optimizer's step, ms.
    pub optimizer_ms: f64,
    /// The step's data-parallel collectives (DDP all-reduce, ZeRO/FSDP gathers and
    /// reduce-scatters) on the card's interconnect, ms; compute hides some or all of them, and
    /// only the rest lengthens the step. 0 on one GPU.
    pub collectives_ms: f64,
    /// What bounds the step: the GPU's arithmetic, its memory bandwidth, the host's dispatch
    /// (the GPU waiting for work), or collectives compute does not hide.
    pub bound: PerformanceBoundName,
    pub source: PerformanceSourceName,
    /// The host's time to dispatch one op that the step was timed with, microseconds: fitted
    /// to the step times observed on this GPU in this environment (else in any) when there are
    /// some, else the model's default (15).
    pub host_us_per_op: f64,
    /// Observed step times the host cost rests on; 0 for the default.
    pub host_cost_observations: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PerformanceBoundName {
    Compute,
    Memory,
    Overhead,
    Communication,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum PerformanceSourceName {
    Roofline,
}

/// Time spent on this estimate, microseconds: `total` and one entry per estimator name. An
/// answer given again without estimating (the same body answered before, while the
/// calibration profiles it read are current, or a batch item repeating another) has a `total`
/// of its own and the estimators' times of the run that computed it.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LatencyResponse {
    /// From the request's arrival to its answer, all estimators included.
    pub total: f64,
    #[serde(flatten)]
    #[schema(additional_properties)]
    pub estimators: BTreeMap<String, f64>,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct EstimateResponse {
    /// The family whose estimators answered.
    pub family: String,
    pub memory: MemoryResponse,
    pub utilization: UtilizationResponse,
    pub latency_us: LatencyResponse,
    /// Version of each estimator used, by name.
    pub estimator_versions: BTreeMap<String, String>,
    /// Whether the job fits the GPU (by its upper bound); null without a MiB figure.
    pub fit: Option<FitResponse>,
    /// Which GPU's calibration was applied to the MiB figures.
    pub calibration: Option<CalibrationResponse>,
    /// The training setup as understood; the MiB figures are for one GPU of its layout (the
    /// most loaded one).
    pub setup: SetupResponse,
    /// What the answer left out or assumed, e.g. a sequence estimator that reads fewer layers
    /// than the job has (the family's other estimators answer); empty when nothing was.
    pub warnings: Vec<String>,
    /// Step time and throughput on the target GPU; null when the target's peak throughput is
    /// unknown (`performance_null_reason` says why).
    pub performance: Option<PerformanceResponse>,
    /// Why `performance` is null; absent when it has figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub performance_null_reason: Option<String>,
    /// The cards of a `gpu` list, ranked; absent when one card was asked about.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub gpu_ranking: Vec<GpuRankResponse>,
}

/// The training setup an answer is for.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct SetupResponse {
    pub precision: String,
    pub optimizer: String,
    pub optimizer_implementation: String,
    /// `none`, `full` or `modules`.
    pub activation_checkpointing: String,
    pub micro_batch_size: u64,
    pub gradient_accumulation_steps: u64,
    /// Parameters that get gradients and optimizer state (LoRA adapters included).
    pub trainable_params: u64,
    /// Of them, LoRA adapter parameters.
    pub lora_params: u64,
    pub parallelism: ParallelismResponse,
    pub offload: OffloadResponse,
    /// `fp32` when an fp32 master copy goes with the optimizer state, else `none`.
    pub master_weights: String,
    /// `none`, `copy` or `adapters_disabled`.
    pub reference_model: String,
    /// For a job built from its config: how the loss over the vocabulary was counted.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_implementation: Option<String>,
    /// The setup values read from the request's files (`training_arguments`,
    /// `adapter_config`, `deepspeed`, `load`), each with where it was read; absent when none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub from_files: Vec<FromFileResponse>,
    /// True when the learned estimators know this setup (one GPU, every parameter trained,
    /// fp32/tf32 or fp16 autocast, sgd/momentum/adam/adamw, no checkpointing or
    /// accumulation); otherwise physics answers alone.
    pub learned_estimators_apply: bool,
}

/// One setup value read from a file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"field": "precision", "value": "amp_bf16", "from": "training_arguments.bf16"}))]
pub struct FromFileResponse {
    /// The request field it sets (`precision`, `lora.rank`, `parallelism.strategy`, ...).
    pub field: String,
    /// Its value, in the request's vocabulary.
    pub value: String,
    /// Where it was read (`deepspeed.zero_optimization.stage`; `(auto: ...)` when resolved).
    pub from: String,
}

/// The GPU layout an answer is for.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct ParallelismResponse {
    pub strategy: String,
    pub world_size: u64,
    pub data_parallel: u64,
    pub tensor_parallel: u64,
    pub pipeline_parallel: u64,
    pub context_parallel: u64,
    pub sequence_parallel: bool,
}

/// Whether the job fits one GPU, and how many copies fit side by side.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct FitResponse {
    /// The GPU checked: the requested one, or the reference `a100-40gb`.
    pub gpu: String,
    pub capacity_mib: u64,
    /// Without a simulation: true when `memory.upper_bound_mib` is at most `capacity_mib`.
    /// With one: true when `memory.min_capacity_mib` plus the CUDA context is (the allocator
    /// frees its cache before it fails). With `memory_fraction` f the job must also run within
    /// f x capacity.
    pub fits: bool,
    /// The probability that the job runs out of memory on this GPU (within f x capacity with
    /// `memory_fraction` f): the distribution of `memory.uncertainty` read at the capacity,
    /// the allocator's reclaimable cache freed first. `fits` is true when it is at most
    /// 1 - `confidence`.
    pub oom_probability: f64,
    /// The confidence `fits` was decided at (the request's).
    pub confidence: f64,
    /// Copies of the job that fit on one such GPU: floor(capacity / what a copy occupies),
    /// which is the upper bound, or with a simulation its reserved peak plus the CUDA context,
    /// or with `memory_fraction` f the cap f x capacity plus the context; 1 for a job that fits
    /// only alone, 0 for one that does not fit.
    pub max_colocated: u64,
    /// What `fits` and `max_colocated` rest on.
    #[serde(default)]
    pub basis: FitBasisName,
    /// With `node` and offload: whether the node's host memory holds what the job's ranks on
    /// it keep on the CPU (`fits` is false when it does not); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<HostFitResponse>,
}

/// The node's host memory against what the job's ranks on it offload.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HostFitResponse {
    /// `setup.offload.host_memory_mib` x `gpus`, MiB.
    pub needed_mib: f64,
    /// The node's host memory (`node.memory_mib`).
    pub capacity_mib: u64,
    /// The job's GPUs on the node.
    pub gpus: u64,
    pub fits: bool,
}

/// The distribution of the peak that `upper_bound_mib` and `fit.oom_probability` are read
/// from: the held-out errors of figures like this one. A measured peak's score against a
/// figure F is `log(measured / F) / share`, with `share` the uncertain terms' part of F
/// (activations, temporaries, allocator cache), at least the calibration's least share; the
/// peak at score s is `F exp(scale assumed_factor s share)`. `score_quantiles` are split-conformal quantiles
/// of the scores of `scores_group`'s measured rows (data/uncertainty.json, docs/reports/accuracy.md).
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct UncertaintyResponse {
    /// What the figure rests on: `simulation`, `simulated_setup`, `config`, `setup_step`,
    /// `traced`, `printout` or `layers`.
    pub detail: String,
    /// The setup's family: `full`, `lora`, `qlora`, `sharded` or `offload`.
    pub setup_family: String,
    /// What the bound rests on: `held_out_groups` (the held-out errors of the job's group,
    /// measured on transformers and PEFT on PyTorch, DeepSpeed ZeRO-2 and FSDP: another stack
    /// may lie outside; post three of its runs as observations of an `environment` to
    /// narrow it), `gpu_profile` (the GPU's calibration profile), `environment` (the named
    /// environment's own observations: its stack's factor and their scatter) or
    /// `between_stacks` (a `stack` the physics does not follow, never observed: the spread
    /// between stacks).
    pub basis: String,
    /// The group whose errors bound the figure: `detail/setup_family/model_family`, else
    /// `detail/setup_family`, `detail` or `all` where a group has too few measured rows.
    pub scores_group: String,
    /// Measured rows behind `score_quantiles`.
    pub rows: u64,
    pub known_mib: f64,
    pub cuda_context_mib: f64,
    pub uncertain_mib: f64,
    /// Of the uncertain terms, the cache the allocator frees before it fails.
    pub reclaimable_mib: f64,
    /// What a score is multiplied by: the uncertain share of the figure, at least the least
    /// share.
    pub share: f64,
    /// The factor on every score: 1, more for a job far from the measured data, or what a
    /// calibration profile's bound implies.
    pub scale: f64,
    /// The group's score at confidences 0.5, 0.8, 0.9, 0.95 and 0.99, before `scale`.
    pub score_quantiles: BTreeMap<String, f64>,
    /// The fields the request left unsaid that move the figure, widest first, each with the
    /// figure's range over the values it could take: state the first to narrow the bound
    /// most. Empty when the request states them all, or when a learned or simulated figure
    /// answers (its measured errors hold what its jobs left unsaid). An unsaid `stack` comes
    /// last: what the other stacks would answer, within the spread between stacks; it is not
    /// in the bound (the held-out errors were measured over many stacks), and stating it
    /// narrows nothing, but a stack the physics does not follow gets that spread as its bound.
    pub assumed: Vec<AssumedResponse>,
    /// `ln(highest / lowest)` of the figures the unstated fields allow together (their moves
    /// added; the `stack` entry aside): 0 when nothing is assumed.
    pub assumed_log_range: f64,
    /// What the scores are multiplied by for that range: `1 + w assumed_log_range`, `w` the
    /// calibration's weight, fitted with the quantiles on held-out rows (docs/reports/accuracy.md).
    pub assumed_factor: f64,
}

/// One field the request did not state, and how far it moves the figure.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AssumedResponse {
    /// The request field, e.g. `precision`, `optimizer`, `activation_checkpointing`,
    /// `attention`, `master_weights`, `load.torch_dtype`, `loss_implementation`,
    /// `optimizer_implementation`, `zero` (DeepSpeed's defaults against Hugging Face's
    /// `"auto"` buffer sizes) or `stack`.
    pub field: String,
    /// The value the answer assumed.
    pub assumed: String,
    /// The lowest figure over the field's values, MiB.
    pub low_mib: f64,
    /// The highest figure over the field's values, MiB.
    pub high_mib: f64,
}

/// When in the training step the peak falls: `backward_start` (every activation kept, the
/// first gradients) or `optimizer_step` (every gradient and the optimizer's temporaries, no
/// activation: why such a breakdown shows 0 MiB of activations).
#[derive(Debug, Clone, Copy, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum PeakMomentName {
    BackwardStart,
    OptimizerStep,
}

/// `upper_bound`: the upper bound; `simulation`: the simulation's minimum capacity and
/// reserved peak.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, ToSchema, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum FitBasisName {
    #[default]
    UpperBound,
    Simulation,
}

#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct CalibrationResponse {
    pub gpu: String,
    /// True when a profile learned from observed jobs on this GPU moved the figures.
    pub profile_used: bool,
    /// Observations the profile rests on (0 without a profile).
    pub observations: u64,
    /// The environment whose profile was used; null when it was the GPU's own profile (or
    /// none was used).
    pub environment: Option<String>,
    /// Present (true) while the calibration store cannot be read: the profiles are the ones
    /// last derived, and observations since are not in them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub profiles_stale: bool,
}
