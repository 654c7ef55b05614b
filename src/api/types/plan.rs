//! The reverse question as a client asks it: for a job and a card (or a list, or the
//! catalogue), the largest micro-batch and the longest sequence that fit, the setups that make
//! it fit, and the smallest card it fits.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::*;

/// Most precisions one plan sweeps.
pub const MAX_PLAN_PRECISIONS: usize = 8;

/// A plan: the job (the body of `POST /v1/estimate`, its `gpu` the cards planned for) and
/// what to search.
#[derive(Debug, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({
    "job": {
        "transformer_config": {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128256},
        "seq_len": 2048, "batch_size": 1, "precision": "bf16", "activation_checkpointing": "full",
        "lora": {"rank": 16, "target_modules": "all-linear", "base_weights": "nf4"},
        "gpu": "rtx-4090"
    },
    "max_seq_len": 32768
}))]
pub struct PlanRequest {
    /// The job, as `POST /v1/estimate` takes it. Its `gpu` (one card or a list) is what the
    /// plan searches on, its `confidence` what `fits` is decided at; its micro-batch is where
    /// the search starts, the setups and the sequence are searched at.
    #[schema(value_type = EstimateRequest)]
    pub job: Box<serde_json::value::RawValue>,
    /// Plan on every card of the catalogue (`GET /v1/gpus`) instead of the job's `gpu`.
    #[serde(default)]
    pub catalogue: bool,
    /// A dtype sweep: the search on each card at each of these `precision`s (1 to 8), one
    /// row each; absent, the job's own.
    #[serde(default)]
    #[schema(min_items = 1, max_items = 8, example = json!(["fp32", "amp_bf16", "bf16"]))]
    pub precisions: Option<Vec<String>>,
    /// The largest micro-batch tried (default 4096): a plan whose micro-batch reaches it says
    /// `limited_by_max`.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub max_micro_batch: Option<u64>,
    /// Sequence length free: the longest `seq_len` up to this that fits the first row's card
    /// at the job's micro-batch. Absent: the sequence is the job's; with a job that has no
    /// `seq_len`, left out with a warning.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1_000_000)]
    pub max_seq_len: Option<u64>,
    /// Whether to rank the setups that make the job fit (default true): activation
    /// checkpointing, LoRA, an 8-bit optimizer, ZeRO-3, optimizer offload, each on its own
    /// over the job, on the first row's card at the job's micro-batch.
    #[serde(default)]
    pub setups: Option<bool>,
}

/// An answer at one point of a search: the estimate's figures there.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PlanPointResponse {
    pub micro_batch_size: u64,
    /// The sequence length answered at; null for a job without one.
    pub seq_len: Option<u64>,
    /// `memory.estimate_mib` of the estimate there.
    pub estimate_mib: Option<f64>,
    /// `memory.upper_bound_mib` there.
    pub upper_bound_mib: Option<f64>,
    /// `fit.oom_probability` there.
    pub oom_probability: Option<f64>,
    /// `performance.step_time_ms` there; null on a card known only by its memory.
    pub step_time_ms: Option<f64>,
    /// `performance.samples_per_s` there.
    pub samples_per_s: Option<f64>,
}

/// One card at one precision: the job's fit there and the largest micro-batch that fits.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PlanCardResponse {
    /// The card's id, as `fit.gpu` names it.
    pub gpu: String,
    pub capacity_mib: u64,
    /// The precision planned at (the job's, or one of `precisions`).
    pub precision: String,
    /// Whether the job fits as given (at its own micro-batch).
    pub fits: bool,
    /// The job as given there.
    pub job: PlanPointResponse,
    /// The largest micro-batch that fits at the confidence; null when not even 1 does.
    pub largest_micro_batch: Option<u64>,
    /// The estimate at `largest_micro_batch`.
    pub at_largest: Option<PlanPointResponse>,
    /// True when `largest_micro_batch` is `max_micro_batch`: a larger one may fit too.
    pub limited_by_max: bool,
}

/// The longest sequence that fits, at the job's micro-batch on the first row's card.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PlanSeqLenResponse {
    pub gpu: String,
    pub micro_batch_size: u64,
    /// Null when not even 1 token fits.
    pub longest_seq_len: Option<u64>,
    pub at_longest: Option<PlanPointResponse>,
    /// True when `longest_seq_len` is `max_seq_len`.
    pub limited_by_max: bool,
}

/// One setup over the job, at its micro-batch on the first row's card.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
#[schema(example = json!({"rank": 1, "setup": "activation_checkpointing", "changes": ["activation_checkpointing: full"],
    "fits": true, "estimate_mib": 12377.7, "upper_bound_mib": 15675.0, "step_time_ms": 8852.0, "ms_per_sample": 1106.5}))]
pub struct PlanSetupResponse {
    /// 1 is the best: the setups that fit first, least time per sample first; then those
    /// that do not, the least bound first.
    pub rank: u32,
    /// `as_given`, `activation_checkpointing`, `lora`, `optimizer_8bit`, `zero3` or
    /// `offload_optimizer`.
    pub setup: String,
    /// The request fields it sets over the job.
    pub changes: Vec<String>,
    pub fits: bool,
    pub estimate_mib: Option<f64>,
    pub upper_bound_mib: Option<f64>,
    /// Host memory one GPU's process holds for the setup's offload
    /// (`setup.offload.host_memory_mib`); absent without offload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory_mib: Option<f64>,
    pub step_time_ms: Option<f64>,
    /// `step_time_ms` over the samples of a step on this GPU.
    pub ms_per_sample: Option<f64>,
}

/// The plan.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct PlanResponse {
    /// The confidence `fits` was decided at everywhere (the job's).
    pub confidence: f64,
    /// The job's own micro-batch and accumulation steps.
    pub micro_batch_size: u64,
    pub gradient_accumulation_steps: u64,
    /// One row per card and precision, the cards in the order asked (the catalogue's order).
    pub cards: Vec<PlanCardResponse>,
    /// The card of least memory the job fits as given (ties: the faster step); null when it
    /// fits none.
    pub smallest_fitting_gpu: Option<String>,
    /// With `max_seq_len`: the longest sequence that fits.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq_len: Option<PlanSeqLenResponse>,
    /// The setups, ranked; empty with `setups: false`.
    pub setups: Vec<PlanSetupResponse>,
    /// Single estimates the plan made (each one the answer of `POST /v1/estimate` for its
    /// job), and their time, microseconds.
    pub estimates: u64,
    pub latency_us: f64,
    /// The job's warnings (as its estimate answers them), and setups left out with why.
    pub warnings: Vec<String>,
}
