//! Wire types: what clients send and receive. Kept apart from the domain types so the API can
//! stay stable while the internals change; field names here are a contract with schedulers.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::job::Family;

/// A training job to estimate.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({
    "family": "mlp",
    "batch_size": 996,
    "optimizer": "adam",
    "precision": "fp32",
    "layers": [
        {"kind": "linear", "output_size": 1173, "params": 2753031},
        {"kind": "batch_norm", "output_size": 1173, "params": 2346},
        {"kind": "relu", "output_size": 1173, "params": 0},
        {"kind": "dropout", "output_size": 1173, "params": 0},
        {"kind": "linear", "output_size": 586, "params": 687964},
        {"kind": "batch_norm", "output_size": 586, "params": 1172},
        {"kind": "relu", "output_size": 586, "params": 0},
        {"kind": "dropout", "output_size": 586, "params": 0},
        {"kind": "linear", "output_size": 197, "params": 115639},
        {"kind": "softmax", "output_size": 197, "params": 0}
    ]
}))]
pub struct EstimateRequest {
    /// `mlp`, `cnn` or `transformer`; inferred from the layers when absent (attention makes a
    /// transformer, convolutions a CNN).
    #[serde(default)]
    #[schema(value_type = Option<FamilyName>)]
    pub family: Option<String>,
    /// Samples per training step. Required, unless `training_arguments` state
    /// `per_device_train_batch_size`: it is then that x `gradient_accumulation_steps` (the
    /// samples a GPU takes per step).
    #[schema(minimum = 1, maximum = 1048576)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub batch_size: Option<u64>,
    /// The model's layers in execution order (1 to 4096). Give either `layers` or `summary`.
    #[serde(default, deserialize_with = "layer_objects")]
    #[schema(min_items = 1, max_items = 4096)]
    pub layers: Option<Vec<LayerRequest>>,
    /// The model as printed text instead of a layer list: a `torchsummary` or `torchinfo` table,
    /// `print(model)` (plain, or annotated with `, N params` per module), or a Keras
    /// `model.summary()` (Keras 2 or 3). `format` may be left out: it is then detected.
    /// What was assumed to read it (derived parameters, sizes, shared weights) is answered in
    /// `warnings`.
    #[serde(default, deserialize_with = "object_only::optional")]
    pub summary: Option<SummaryRequest>,
    /// Sequence length (tokens per sample); required with a `module_print` summary that has
    /// token layers (embeddings, attention) and no `input_shape`.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1_000_000)]
    pub seq_len: Option<u64>,
    /// `sgd`, `momentum`, `adam` (default), `adamw`, `adafactor`, `adam_8bit`, `adamw_8bit`
    /// (bitsandbytes), `paged_adamw` or `paged_adamw_8bit` (state outside PyTorch's allocator).
    #[serde(default)]
    pub optimizer: Option<String>,
    /// `fp32` (default), `tf32`, `amp_fp16` / `amp_bf16` (autocast, fp32 master weights;
    /// `mixed16` = `amp_fp16`), `bf16` / `fp16` (pure 16-bit weights, gradients and state).
    /// Lightning's strings are read too: `bf16-mixed` (`amp_bf16`), `16-mixed` (`amp_fp16`),
    /// `bf16-true` (`bf16`), `16-true` (`fp16`), `32-true` (`fp32`).
    #[serde(default)]
    pub precision: Option<String>,
    /// How the optimizer steps: `foreach` (default, PyTorch's GPU default), `fused`, `for_loop`.
    #[serde(default)]
    pub optimizer_implementation: Option<String>,
    /// `none` (default), `full` (every repeated block, found from the layer names) or a list
    /// of module names (layer-name prefixes) that recompute their forward in backward.
    #[serde(default)]
    pub activation_checkpointing: Option<NamesRequest>,
    /// Samples per GPU per forward/backward (the peak follows it). Default: `batch_size /
    /// gradient_accumulation_steps`.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub micro_batch_size: Option<u64>,
    /// Micro-batches per optimizer step (default 1); gradients persist between them.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub gradient_accumulation_steps: Option<u64>,
    /// Only these parameters train, the rest are frozen (no gradients, no optimizer state).
    #[serde(default, deserialize_with = "object_only::optional")]
    pub trainable: Option<TrainableRequest>,
    /// LoRA adapters on a frozen base (QLoRA with `base_weights: nf4`).
    #[serde(default, deserialize_with = "object_only::optional")]
    pub lora: Option<LoraRequest>,
    /// The GPU layout: data parallelism (DDP, FSDP, ZeRO), tensor, pipeline and context
    /// parallel degrees. The answer is for the most loaded GPU.
    #[serde(default, deserialize_with = "object_only::optional")]
    pub parallelism: Option<ParallelismRequest>,
    /// What lives in CPU memory instead (DeepSpeed ZeRO-Offload, FSDP `CPUOffload`, torchao's
    /// `CPUOffloadOptimizer`).
    #[serde(default, deserialize_with = "object_only::optional")]
    pub offload: Option<OffloadRequest>,
    /// With `precision` bf16 or fp16: `fp32` keeps an fp32 master copy of what trains with the
    /// optimizer state (sharded with it by ZeRO), the step run on it in fp32, as DeepSpeed's
    /// bf16/fp16 modes do; `none` (default) steps the 16-bit weights themselves.
    #[serde(default)]
    pub master_weights: Option<String>,
    /// Preference training's reference model (TRL's DPO and kin): `copy` (a frozen copy of the
    /// weights beside the trained ones), `adapters_disabled` (with `lora`: the base without its
    /// adapters, no second copy) or `none` (default). Give `batch_size` in sequences (a
    /// chosen/rejected pair is two).
    #[serde(default)]
    pub reference_model: Option<String>,
    /// Per-sample input shape, e.g. `[3, 224, 224]`: sizes the layers of a `module_print` summary
    /// with convolutions (otherwise informational for most estimators).
    #[serde(default, deserialize_with = "whole_number::optional_list")]
    #[schema(value_type = Option<Vec<Dimension>>, min_items = 1, max_items = 5)]
    pub input_shape: Option<Vec<u64>>,
    /// What autograd keeps for backward, as `gpucast_describe` traces it on the meta device:
    /// when present, the MiB figure comes from the regressors that use it (more accurate).
    #[serde(default, deserialize_with = "object_only::optional")]
    pub saved_tensors: Option<SavedTensorsRequest>,
    /// `gpucast_describe`'s simulation of a whole training step at this batch size: when
    /// present, the MiB figure comes from it (the `simulated` estimator, or a regressor that
    /// requires it), and `fit` from its minimum capacity and reserved peak.
    #[serde(default, deserialize_with = "object_only::optional")]
    pub simulation: Option<SimulationRequest>,
    /// The share of the card's memory the job caps its caching allocator at
    /// (`torch.cuda.set_per_process_memory_fraction`), greater than 0 and at most 1: the job
    /// must run within the cap, and each copy then occupies the cap plus the CUDA context.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    pub memory_fraction: Option<f64>,
    /// Where the description came from, e.g. `timm:resnet50` (informational).
    #[serde(default)]
    pub model: Option<String>,
    /// A Hugging Face `config.json` (Llama, Mistral, Qwen2, Gemma, Phi-3, Mixtral-style MoE,
    /// GPT-2, GPT-NeoX, BERT, T5, ChatGLM) instead of `layers`: the model's layers, parameters and
    /// activations are built from it at `seq_len` tokens (required with it). Unknown keys are
    /// ignored; missing essentials are a 422 naming them. The analytic training step answers.
    #[serde(default, deserialize_with = "crate::api::unique_keys::object")]
    #[schema(value_type = Option<Object>, example = json!({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}))]
    pub transformer_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// Hugging Face `TrainingArguments.to_dict()`, as the Trainer saves it
    /// (`training_args.json`): `per_device_train_batch_size` is the micro-batch,
    /// `gradient_accumulation_steps`, `gradient_checkpointing` (`full`), `bf16` / `fp16`
    /// autocast (`amp_bf16` / `amp_fp16`), `tf32`, `optim` (`adamw_torch`,
    /// `adamw_torch_fused`, `adamw_hf`, `adafactor`, `sgd`, `adamw_bnb_8bit`, `adamw_8bit`,
    /// `paged_adamw_8bit`, `paged_adamw_32bit`, ...), `fsdp`, and `deepspeed` when it is the
    /// config itself. Other keys are ignored. What is read is echoed in `setup.from_files`; a
    /// value the request states otherwise is a 422 naming both.
    #[serde(default, deserialize_with = "crate::api::unique_keys::object")]
    #[schema(value_type = Option<Object>, example = json!({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "gradient_checkpointing": true, "bf16": true, "optim": "paged_adamw_8bit"}))]
    pub training_arguments: Option<serde_json::Map<String, serde_json::Value>>,
    /// PEFT's `adapter_config.json` (`peft_type` LORA): the `lora` block from `r`,
    /// `lora_alpha`, `lora_dropout`, `target_modules` and `modules_to_save`.
    #[serde(default, deserialize_with = "crate::api::unique_keys::object")]
    #[schema(value_type = Option<Object>, example = json!({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"], "bias": "none"}))]
    pub adapter_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// A DeepSpeed config: `zero_optimization.stage` (0: ddp, 1-3: zero1-zero3),
    /// `offload_optimizer` / `offload_param` devices, `bf16` / `fp16` (16-bit weights with fp32
    /// master weights), its `optimizer`; `"auto"` resolved from `training_arguments` as the
    /// Trainer does. `parallelism.world_size` still says how many GPUs.
    #[serde(default, deserialize_with = "crate::api::unique_keys::object")]
    #[schema(value_type = Option<Object>, example = json!({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto"}))]
    pub deepspeed: Option<serde_json::Map<String, serde_json::Value>>,
    /// accelerate's FSDP options, as JSON: its config (`distributed_type: FSDP`,
    /// `fsdp_config`, `mixed_precision` as autocast, `num_processes` as
    /// `parallelism.world_size`) or the `fsdp_config` mapping alone. `sharding_strategy`
    /// (`FULL_SHARD`: fsdp, `SHARD_GRAD_OP`: zero2, `NO_SHARD`: ddp; accelerate's default
    /// FULL_SHARD) or FSDP2's `reshard_after_forward`, `offload_params` and
    /// `activation_checkpointing` are read, with or without their `fsdp_` prefix.
    #[serde(default, deserialize_with = "crate::api::unique_keys::object")]
    #[schema(value_type = Option<Object>, example = json!({"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 8, "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": false, "fsdp_activation_checkpointing": true}}))]
    pub fsdp: Option<serde_json::Map<String, serde_json::Value>>,
    /// How `from_pretrained` loaded the model: `torch_dtype` (`bfloat16`, `float16`, `float32`
    /// or `auto`: the config's; not given: fp32, or fp16 when quantised, as transformers 4)
    /// and `quantization_config` (bitsandbytes `load_in_4bit` / `load_in_8bit`, GPTQ or AWQ
    /// 4-bit) as `lora.base_weights`; `attn_implementation` as `attention`. 16-bit weights
    /// train as pure `bf16` / `fp16`.
    #[serde(default, deserialize_with = "crate::api::unique_keys::object")]
    #[schema(value_type = Option<Object>, example = json!({"torch_dtype": "bfloat16", "quantization_config": {"load_in_4bit": true, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true}}))]
    pub load: Option<serde_json::Map<String, serde_json::Value>>,
    /// With `transformer_config`: how the loss over the vocabulary is taken. `upcast_fp32`
    /// (default: Hugging Face transformers' loss, the whole logits in fp32), `chunked`
    /// (litgpt's `chunked_cross_entropy`, torchtune's `CEWithChunkedOutputLoss`), `fused`
    /// (Liger's fused linear cross-entropy, Cut Cross-Entropy: no logits kept) or `native`
    /// (`F.cross_entropy` on the logits in their own dtype: 16-bit under pure bf16/fp16).
    #[serde(default)]
    pub loss_implementation: Option<String>,
    /// With `transformer_config`: the attention kernel, `sdpa` (default: flash or
    /// memory-efficient attention, no N x N tensors, as a GPU picks) or `eager` (the N x N
    /// probabilities kept).
    #[serde(default)]
    pub attention: Option<String>,
    /// Confidence of `memory.upper_bound_mib`: the share of jobs whose true peak stays at or
    /// below it (0.5 to 0.99, default 0.95).
    #[serde(default)]
    pub confidence: Option<f64>,
    /// Which estimators run: `figures` (default: those the answer's figures come from: the
    /// memory and utilization regressors, the simulation, the analytic models and physics) or
    /// `all` (the memory classifiers too: their opinions under `memory.estimators`, and 40 % of
    /// `memory.class.probabilities` from their mean; the class itself is always the figure's).
    /// The classifiers cost most of a layer job's time.
    #[serde(default)]
    #[schema(value_type = Option<String>, example = "all")]
    pub estimators: Option<String>,
    /// The GPU to estimate for: a catalogue GPU (`h100-80gb`, `A100 80GB`, `rtx 4090`, ...;
    /// `GET /v1/gpus` lists them), `attached` (this host's first GPU), or a card described by
    /// its name and memory. Default: the A100 40 GB the estimators were trained on. A list of
    /// up to 16 cards ranks them (`gpu_ranking`) and answers for the best-ranked one.
    #[serde(default)]
    pub gpu: Option<GpuChoice>,
    /// The software environment the job runs in (e.g. `torch2.5-cu124`: 1 to 64 letters,
    /// digits, `.`, `_`, `+`, `-`): the GPU's calibration profile in that environment is used
    /// when there is one, else the GPU's own; `calibration.environment` says which.
    #[serde(default)]
    #[schema(
        max_length = 64,
        pattern = "^[A-Za-z0-9._+-]{1,64}$",
        example = "torch2.5-cu124"
    )]
    pub environment: Option<String>,
}

/// Most cards a `gpu` list may name: enough for any cluster's kinds, bounded for the CPU.
pub const MAX_GPU_CHOICES: usize = 16;

/// One card, or a list of cards to rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum GpuChoice {
    One(GpuRequest),
    Many(Vec<GpuRequest>),
}

// By hand: the derive cannot bound the list's length, which the parser does.
impl utoipa::PartialSchema for GpuChoice {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, OneOfBuilder};
        let card = utoipa::openapi::Ref::from_schema_name("GpuRequest");
        OneOfBuilder::new()
            .item(card.clone())
            .item(
                ArrayBuilder::new()
                    .items(card)
                    .min_items(Some(1))
                    .max_items(Some(MAX_GPU_CHOICES)),
            )
            .description(Some("One card, or a list of cards to rank."))
            .into()
    }
}

impl ToSchema for GpuChoice {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        schemas.push((
            "GpuRequest".into(),
            <GpuRequest as utoipa::PartialSchema>::schema(),
        ));
        <GpuRequest as ToSchema>::schemas(schemas);
    }
}

impl GpuChoice {
    /// The cards asked about, in the caller's order.
    pub fn cards(&self) -> &[GpuRequest] {
        match self {
            GpuChoice::One(card) => std::slice::from_ref(card),
            GpuChoice::Many(cards) => cards,
        }
    }
}

impl From<GpuRequest> for GpuChoice {
    fn from(card: GpuRequest) -> GpuChoice {
        GpuChoice::One(card)
    }
}

// By hand, like `GpuRequest`: a list is bounded before its items are read.
impl<'de> Deserialize<'de> for GpuChoice {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::Array(items) => {
                if items.is_empty() || items.len() > MAX_GPU_CHOICES {
                    return Err(D::Error::custom(format!(
                        "a list of GPUs holds 1 to {MAX_GPU_CHOICES} cards, got {}",
                        items.len()
                    )));
                }
                items
                    .into_iter()
                    .enumerate()
                    .map(|(i, item)| {
                        serde_json::from_value(item)
                            .map_err(|e| D::Error::custom(format!("gpu[{i}]: {e}")))
                    })
                    .collect::<Result<_, _>>()
                    .map(GpuChoice::Many)
            }
            one => serde_json::from_value(one)
                .map(GpuChoice::One)
                .map_err(D::Error::custom),
        }
    }
}

/// A keyword (`none`, `full`, `all-linear`) or a list of module names.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum NamesRequest {
    Keyword(String),
    Names(Vec<String>),
}

/// Which parameters train: a count, or module names (layer-name prefixes).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainableRequest {
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(maximum = 10_000_000_000_000_u64)]
    pub params: Option<u64>,
    #[serde(default)]
    #[schema(min_items = 1, max_items = 256)]
    pub modules: Option<Vec<String>>,
}

/// LoRA adapters, as PEFT builds them.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"rank": 16, "alpha": 32, "target_modules": ["q_proj", "v_proj"], "base_weights": "nf4"}))]
pub struct LoraRequest {
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(minimum = 1, maximum = 65536)]
    pub rank: u64,
    /// Scaling numerator (default: 8, PEFT's); does not change memory.
    #[serde(default)]
    pub alpha: Option<f64>,
    /// PEFT's `lora_dropout` (0 to below 1, default 0): above 0 every adapted layer keeps its
    /// dropped input and mask for backward.
    #[serde(default)]
    pub dropout: Option<f64>,
    /// Layer names (PEFT's rule: the whole name or its last dotted components, e.g. `q_proj`)
    /// or `all-linear` (every linear layer but the output head).
    pub target_modules: NamesRequest,
    /// The frozen base: `same` (the job's precision, default), `int8`, `nf4` (QLoRA),
    /// `gptq_int4` or `awq_int4` (4-bit checkpoints with group-wise scales and zeros).
    #[serde(default)]
    pub base_weights: Option<String>,
    /// With `gptq_int4` or `awq_int4`: inputs per quantisation group (default 128).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 65536)]
    pub group_size: Option<u64>,
    /// PEFT's `modules_to_save` (e.g. `["embed_tokens", "lm_head"]`, a classifier `score`):
    /// each gets a trained copy beside the frozen original, with its gradients and optimizer
    /// state.
    #[serde(default)]
    pub modules_to_save: Option<Vec<String>>,
}

/// CPU offload. `parameters` (FSDP `CPUOffload(offload_params=True)`, ZeRO-3
/// `offload_param`; needs `parallelism.strategy` fsdp or zero3) takes the gradients and the
/// optimizer state with them.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"optimizer_state": true}))]
pub struct OffloadRequest {
    /// The optimizer's state and step on the CPU (ZeRO-Offload, torchao CPUOffloadOptimizer).
    #[serde(default)]
    pub optimizer_state: Option<bool>,
    /// Each gradient copied to the CPU as backward makes it (torchao `offload_gradients`).
    #[serde(default)]
    pub gradients: Option<bool>,
    /// The weights on the CPU, each unit brought in for its forward and backward.
    #[serde(default)]
    pub parameters: Option<bool>,
}

/// What is offloaded, as understood.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OffloadResponse {
    pub optimizer_state: bool,
    pub gradients: bool,
    pub parameters: bool,
}

/// The GPU layout. `world_size` = data x `tensor_parallel` x `pipeline_parallel` x
/// `context_parallel`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"strategy": "fsdp", "world_size": 8}))]
pub struct ParallelismRequest {
    /// `none` (default), `ddp`, `fsdp` (full shard), `zero1`, `zero2`, `zero3`.
    #[serde(default)]
    pub strategy: Option<String>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub world_size: Option<u64>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub tensor_parallel: Option<u64>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub pipeline_parallel: Option<u64>,
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub context_parallel: Option<u64>,
}

/// A GPU a request names: a catalogue id, name or alias (`h100-80gb`, `A100 80GB`,
/// `NVIDIA GeForce RTX 4090`; matched case-insensitively, `GET /v1/gpus` lists them) or
/// `attached` (this host's first GPU); or a card the catalogue lacks, described by its name and
/// memory.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum GpuRequest {
    #[schema(example = "h100-80gb")]
    Name(String),
    Custom(CustomGpuRequest),
}

/// A card known by its memory only. Its calibration profile is `custom-`, a slug of its name
/// and its capacity (`custom-lab-card-2-24000mib`: even a name the catalogue knows is not a
/// catalogue card, and another capacity is another card); it has no
/// peak figures, so answers give no utilization for it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "lab-card-2", "capacity_mib": 24000}))]
pub struct CustomGpuRequest {
    /// 1 to 64 letters, digits, spaces, `-`, `_` or `.`.
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9 ._-]{1,64}$")]
    pub name: String,
    /// Usable memory, MiB, as nvidia-smi reports it (`memory.total`).
    #[schema(minimum = 1, maximum = 1048576)]
    pub capacity_mib: u64,
}

impl GpuRequest {
    /// What the request asks for, for [`crate::calibration::placement::Target::resolve`].
    pub fn ask(&self) -> crate::calibration::placement::GpuAsk<'_> {
        use crate::calibration::placement::GpuAsk;
        match self {
            GpuRequest::Name(name) => GpuAsk::Name(name),
            GpuRequest::Custom(custom) => GpuAsk::Custom {
                name: &custom.name,
                capacity_mib: custom.capacity_mib,
            },
        }
    }
}

// By hand rather than `untagged`, so that a wrong value says what is expected.
impl<'de> Deserialize<'de> for GpuRequest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::String(name) => Ok(GpuRequest::Name(name)),
            object @ serde_json::Value::Object(_) => serde_json::from_value(object)
                .map(GpuRequest::Custom)
                .map_err(|e| D::Error::custom(format!("a custom GPU: {e}"))),
            _ => Err(D::Error::custom(
                "expected a GPU name or an object {\"name\": ..., \"capacity_mib\": ...}",
            )),
        }
    }
}

/// Model families. Documents the schema only.
pub struct FamilyName;

impl utoipa::PartialSchema for FamilyName {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let names = [Family::Mlp, Family::Cnn, Family::Transformer].map(Family::as_str);
        string_enum(
            names.into_iter(),
            "A model family: it selects the estimators.",
        )
    }
}

impl ToSchema for FamilyName {}

/// The canonical layer kinds. Other spellings (`BatchNorm2d`, `LeakyReLU`,
/// `batch_normalization`) are accepted too. Documents the schema only.
pub struct LayerKindName;

impl utoipa::PartialSchema for LayerKindName {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        let names = crate::job::LayerKind::ALL
            .into_iter()
            .map(crate::job::LayerKind::as_str);
        string_enum(
            names,
            "A layer kind; matched case-insensitively ignoring `_`, `-` and spaces.",
        )
    }
}

impl ToSchema for LayerKindName {}

/// One dimension of an input shape. Documents the schema only.
pub struct Dimension;

impl utoipa::PartialSchema for Dimension {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, Type};
        ObjectBuilder::new()
            .schema_type(Type::Integer)
            .minimum(Some(1))
            .maximum(Some(1_000_000))
            .into()
    }
}

impl ToSchema for Dimension {}

fn string_enum<'a>(
    values: impl Iterator<Item = &'a str>,
    description: &str,
) -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(values))
        .description(Some(description))
        .into()
}

/// A model summary as printed by a tool.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SummaryRequest {
    /// Which tool printed `text`; `auto` (the default) detects it.
    #[serde(default)]
    pub format: SummaryFormatRequest,
    /// The printed text (at most 1 MiB).
    #[schema(min_length = 1, max_length = 1048576)]
    pub text: String,
}

#[derive(Debug, Clone, Copy, Default, Deserialize, Serialize, ToSchema)]
#[serde(rename_all = "snake_case")]
pub enum SummaryFormatRequest {
    /// Detected from the text: a Keras table, a torchsummary/torchinfo table or a module print.
    #[default]
    Auto,
    /// The table of `torchsummary.summary` or `torchinfo.summary` (any depth).
    Torchsummary,
    /// `print(model)`: plain (parameters derived from the printed constructor arguments, sizes
    /// from `seq_len` or `input_shape`) or annotated with `, N params` per module.
    ModulePrint,
    /// Keras `model.summary()`: Keras 3's box-drawn table or Keras 2's columns.
    Keras,
}

/// The tensors autograd keeps for backward in one training forward pass (parameters excluded,
/// each storage once): `per_sample_bytes x batch_size + fixed_bytes`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SavedTensorsRequest {
    /// Bytes per sample.
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub per_sample_bytes: u64,
    /// Bytes that do not grow with the batch (e.g. standardised weights).
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub fixed_bytes: u64,
}

/// The allocator's figures for one training step as `gpucast_describe` simulates it (fake
/// tensors replayed through a model of PyTorch's CUDA caching allocator), bytes. Consistent:
/// allocated <= min capacity <= reserved, and the categories sum to the allocated peak.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({
    "batch_size": 64,
    "optimizer": "adam",
    "precision": "fp32",
    "allocated_peak_bytes": 9000000000_u64,
    "reserved_peak_bytes": 9400000000_u64,
    "min_capacity_bytes": 9100000000_u64,
    "breakdown_at_peak": {
        "parameters": 102228128, "gradients": 102228128, "optimizer_state": 204456256,
        "activations": 8300000000_u64, "temporaries": 291087488
    },
    "attention": "efficient",
    "interpolated": false
}))]
pub struct SimulationRequest {
    /// The batch size simulated: must be the job's micro-batch (its `batch_size` unless it
    /// accumulates).
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub batch_size: u64,
    /// The optimizer simulated; when given, it must be the job's (`adamw` is not `adam`).
    #[serde(default)]
    pub optimizer: Option<String>,
    /// The precision simulated; when given, it must be the job's (`bf16` is `mixed16`).
    #[serde(default)]
    pub precision: Option<String>,
    /// The allocator's allocated peak in the second (steady-state) training step.
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub allocated_peak_bytes: u64,
    /// Its reserved (segment) peak with unlimited memory; at least `allocated_peak_bytes`.
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub reserved_peak_bytes: u64,
    /// The smallest allocator capacity on which the step runs (the allocator frees its cache
    /// before it fails): from `allocated_peak_bytes` to `reserved_peak_bytes`.
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub min_capacity_bytes: u64,
    /// Allocated bytes by category at the allocated peak; they sum to `allocated_peak_bytes`.
    #[serde(deserialize_with = "object_only::one")]
    pub breakdown_at_peak: SimulatedBreakdownRequest,
    /// The attention kernel simulated (informational): `eager`, `math`, `efficient`, `flash`
    /// or `none`.
    #[serde(default)]
    pub attention: Option<String>,
    /// True when the figures were interpolated from two other batch sizes (default false).
    #[serde(default)]
    pub interpolated: Option<bool>,
    /// The checkpointing simulated (`none`, `full` or module names): must be the job's.
    #[serde(default)]
    pub activation_checkpointing: Option<NamesRequest>,
    /// Micro-batches per simulated step: must be the job's (default 1).
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub gradient_accumulation_steps: Option<u64>,
    /// The optimizer implementation simulated: must be the job's (default foreach).
    #[serde(default)]
    pub optimizer_implementation: Option<String>,
    /// Parameters that trained in the simulated step.
    #[serde(default, deserialize_with = "whole_number::optional")]
    pub trainable_params: Option<u64>,
    /// A paged optimizer's state (CUDA unified memory): not in the peaks above.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub paged_optimizer_state_bytes: Option<u64>,
}

/// Allocated bytes by category at the simulated allocated peak.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct SimulatedBreakdownRequest {
    /// Weights (both copies in mixed precision).
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub parameters: u64,
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub gradients: u64,
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub optimizer_state: u64,
    /// Tensors kept for backward.
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub activations: u64,
    /// Everything else live at the peak (workspaces, intermediates).
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 17_592_186_044_416_u64)]
    pub temporaries: u64,
}

/// Layers as JSON objects only: serde would also read a struct from an array by position
/// (`["linear", 10, 5]`), a second spelling of the same layer that no one documents.
fn layer_objects<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Option<Vec<LayerRequest>>, D::Error> {
    struct Object(LayerRequest);
    impl<'de> Deserialize<'de> for Object {
        fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            struct Visitor;
            impl<'de> serde::de::Visitor<'de> for Visitor {
                type Value = LayerRequest;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a layer object")
                }
                fn visit_map<A: serde::de::MapAccess<'de>>(
                    self,
                    map: A,
                ) -> Result<LayerRequest, A::Error> {
                    LayerRequest::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                }
            }
            deserializer.deserialize_map(Visitor).map(Object)
        }
    }
    let layers = Option::<Vec<Object>>::deserialize(deserializer)?;
    Ok(layers.map(|layers| layers.into_iter().map(|Object(layer)| layer).collect()))
}

/// One layer of the model.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LayerRequest {
    /// Layer kind, e.g. `linear`, `batch_norm`, `relu`, `dropout`, `conv2d`, `attention`;
    /// matched case-insensitively ignoring `_`, `-` and spaces (`BatchNorm1d`, `LeakyReLU` work).
    #[schema(value_type = LayerKindName)]
    pub kind: String,
    /// Elements of the layer's output for one sample.
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 10_000_000_000_000_u64)]
    pub output_size: u64,
    /// Parameters the layer owns.
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(maximum = 10_000_000_000_000_u64)]
    pub params: u64,
    /// Module path, e.g. `layer1.0.conv1`: what `lora.target_modules`, `trainable.modules` and
    /// a list of `activation_checkpointing` modules match.
    #[serde(default)]
    pub name: Option<String>,
    /// A linear layer's input features (with `out_features`: sizes LoRA adapters and bounds
    /// their rank; `describe` emits both).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 10_000_000_000_000_u64)]
    pub in_features: Option<u64>,
    /// A linear layer's output features.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 10_000_000_000_000_u64)]
    pub out_features: Option<u64>,
    /// Forward FLOPs of the layer for one sample, multiply-add counted as 2 (`describe` counts
    /// them with torch's FlopCounterMode). The performance model derives them when absent.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(maximum = 1_000_000_000_000_000_000_u64)]
    pub flops: Option<u64>,
}

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

/// Time spent on this estimate, microseconds: `total` and one entry per estimator name.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct LatencyResponse {
    /// From a validated request to the answer, all estimators included.
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
    /// answers (its measured errors hold what its jobs left unsaid).
    pub assumed: Vec<AssumedResponse>,
    /// `ln(highest / lowest)` of the figures the unstated fields allow together (their moves
    /// added): 0 when nothing is assumed.
    pub assumed_log_range: f64,
    /// What the scores are multiplied by for that range: `1 + w assumed_log_range`, `w` the
    /// calibration's weight, fitted with the quantiles on held-out rows (docs/reports/accuracy.md).
    pub assumed_factor: f64,
}

/// One field the request did not state, and how far it moves the figure.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct AssumedResponse {
    /// The request field, e.g. `loss_implementation` or `optimizer_implementation`.
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
    "log_residual_quantiles": {"0.5": 0.0, "0.9": 0.01, "0.95": 0.01, "0.99": 0.01}
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
    /// own evaluator of the small feed-forward graphs, read from the `.onnx` file) or
    /// `onnxruntime`.
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

/// Non-negative whole numbers, also when a client's JSON writes them as `29440.0` (JSON Schema's
/// `integer` admits that; serde's `u64` alone would not).
/// Structs read from JSON objects only: serde's derive also reads a struct from an array of
/// its fields in order (`"trainable": [null, null]` was accepted), which the schema of an
/// object does not allow (found by schemathesis's negative_data_rejection).
mod object_only {
    use std::marker::PhantomData;

    use serde::de::{MapAccess, Visitor};
    use serde::{Deserialize, Deserializer};

    struct Object<T>(T);

    impl<'de, T: Deserialize<'de>> Deserialize<'de> for Object<T> {
        fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
            struct Only<T>(PhantomData<T>);
            impl<'de, T: Deserialize<'de>> Visitor<'de> for Only<T> {
                type Value = T;
                fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                    f.write_str("a JSON object")
                }
                fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<T, A::Error> {
                    T::deserialize(serde::de::value::MapAccessDeserializer::new(map))
                }
            }
            deserializer.deserialize_map(Only(PhantomData)).map(Object)
        }
    }

    pub fn one<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        deserializer: D,
    ) -> Result<T, D::Error> {
        Object::deserialize(deserializer).map(|Object(value)| value)
    }

    pub fn optional<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
        deserializer: D,
    ) -> Result<Option<T>, D::Error> {
        Option::<Object<T>>::deserialize(deserializer)
            .map(|object| object.map(|Object(value)| value))
    }
}

mod whole_number {
    use serde::de::{Deserializer, Error, Unexpected, Visitor};
    use serde::Deserialize;

    struct WholeNumber;

    /// Integral floats are exact up to 2^53; beyond that a float cannot name one integer.
    const MAX_EXACT: f64 = 9_007_199_254_740_992.0;

    impl Visitor<'_> for WholeNumber {
        type Value = u64;

        fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
            f.write_str("a non-negative whole number")
        }

        fn visit_u64<E: Error>(self, v: u64) -> Result<u64, E> {
            Ok(v)
        }

        fn visit_i64<E: Error>(self, v: i64) -> Result<u64, E> {
            u64::try_from(v).map_err(|_| E::invalid_value(Unexpected::Signed(v), &self))
        }

        fn visit_f64<E: Error>(self, v: f64) -> Result<u64, E> {
            if v.fract() == 0.0 && (0.0..=MAX_EXACT).contains(&v) {
                Ok(v as u64)
            } else {
                Err(E::invalid_value(Unexpected::Float(v), &self))
            }
        }
    }

    #[derive(Deserialize)]
    struct Whole(#[serde(deserialize_with = "one")] u64);

    pub fn one<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        d.deserialize_any(WholeNumber)
    }

    pub fn optional<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        Ok(Option::<Whole>::deserialize(d)?.map(|w| w.0))
    }

    pub fn optional_list<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u64>>, D::Error> {
        Ok(Option::<Vec<Whole>>::deserialize(d)?.map(|v| v.into_iter().map(|w| w.0).collect()))
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[derive(Deserialize)]
        struct Probe {
            #[serde(deserialize_with = "one")]
            n: u64,
        }

        fn parse(json: &str) -> Result<u64, String> {
            serde_json::from_str::<Probe>(json)
                .map(|p| p.n)
                .map_err(|e| e.to_string())
        }

        #[test]
        fn whole_numbers_are_accepted_in_either_notation_and_nothing_else() {
            assert_eq!(parse(r#"{"n": 29440}"#), Ok(29440));
            assert_eq!(parse(r#"{"n": 29440.0}"#), Ok(29440));
            assert!(parse(r#"{"n": 8.5}"#).is_err());
            assert!(parse(r#"{"n": -8}"#).is_err());
            assert!(parse(r#"{"n": 1e300}"#).is_err());
            assert!(parse(r#"{"n": "8"}"#)
                .unwrap_err()
                .contains("non-negative whole number"));
        }
    }
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
