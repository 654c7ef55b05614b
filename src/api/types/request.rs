//! A training job to estimate: the model, its setup and the GPU(s) it is for.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::*;
use crate::job::setup::{
    UncheckedLora, UncheckedNames, UncheckedOffload, UncheckedParallelism, UncheckedZero,
};
use crate::job::{Family, UncheckedSetup};

// Its setup fields are the command line's flags too (`gpucast estimate --optimizer adamw`),
// declared here once: `#[arg(long)]` makes a field a flag of the same name, its documentation
// the help; `#[arg(skip)]` leaves a field to the job file (or to a flag of another form, in
// `JobFlags` of config.rs).
/// A training job to estimate.
#[derive(Debug, Clone, Default, Deserialize, Serialize, ToSchema, clap::Args)]
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
    #[arg(long)]
    pub family: Option<String>,
    /// Samples per training step. Required, unless `training_arguments` state
    /// `per_device_train_batch_size`: it is then that x `gradient_accumulation_steps` (the
    /// samples a GPU takes per step).
    #[schema(minimum = 1, maximum = 1048576)]
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[arg(long)]
    pub batch_size: Option<u64>,
    /// The model's layers in execution order (1 to 4096). Give either `layers` or `summary`.
    #[serde(default, deserialize_with = "layer_objects")]
    #[schema(min_items = 1, max_items = 4096)]
    #[arg(skip)]
    pub layers: Option<Vec<LayerRequest>>,
    /// The model as printed text instead of a layer list: a `torchsummary` or `torchinfo` table,
    /// `print(model)` (plain, or annotated with `, N params` per module), or a Keras
    /// `model.summary()` (Keras 2 or 3). `format` may be left out: it is then detected.
    /// What was assumed to read it (derived parameters, sizes, shared weights) is answered in
    /// `warnings`.
    #[serde(default, deserialize_with = "object_only::optional")]
    #[arg(skip)]
    pub summary: Option<SummaryRequest>,
    /// Sequence length (tokens per sample); required with a `module_print` summary that has
    /// token layers (embeddings, attention) and no `input_shape`.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1_000_000)]
    #[arg(long)]
    pub seq_len: Option<u64>,
    /// `sgd`, `momentum`, `adam` (default), `adamw`, `adafactor`, `adam_8bit`, `adamw_8bit`
    /// (bitsandbytes), `paged_adamw` or `paged_adamw_8bit` (state outside PyTorch's allocator).
    #[serde(default)]
    #[arg(long)]
    pub optimizer: Option<String>,
    /// `fp32` (default), `tf32`, `amp_fp16` / `amp_bf16` (autocast, fp32 master weights;
    /// `mixed16` = `amp_fp16`), `bf16` / `fp16` (pure 16-bit weights, gradients and state).
    /// Lightning's strings are read too: `bf16-mixed` (`amp_bf16`), `16-mixed` (`amp_fp16`),
    /// `bf16-true` (`bf16`), `16-true` (`fp16`), `32-true` (`fp32`).
    #[serde(default)]
    #[arg(long)]
    pub precision: Option<String>,
    /// How the optimizer steps: `foreach` (default, PyTorch's GPU default), `fused`, `for_loop`.
    #[serde(default)]
    #[arg(long)]
    pub optimizer_implementation: Option<String>,
    /// `none` (default), `full` (every repeated block, found from the layer names) or a list
    /// of module names (layer-name prefixes) that recompute their forward in backward.
    #[serde(default)]
    #[arg(long, value_parser = NamesRequest::from_flag)]
    pub activation_checkpointing: Option<NamesRequest>,
    /// Samples per GPU per forward/backward (the peak follows it). Default: `batch_size /
    /// gradient_accumulation_steps`.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    #[arg(long)]
    pub micro_batch_size: Option<u64>,
    /// Micro-batches per optimizer step (default 1); gradients persist between them.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    #[arg(long)]
    pub gradient_accumulation_steps: Option<u64>,
    /// Only these parameters train, the rest are frozen (no gradients, no optimizer state).
    #[serde(default, deserialize_with = "object_only::optional")]
    #[arg(skip)]
    pub trainable: Option<TrainableRequest>,
    /// LoRA adapters on a frozen base (QLoRA with `base_weights: nf4`).
    #[serde(default, deserialize_with = "object_only::optional")]
    #[arg(skip)]
    pub lora: Option<LoraRequest>,
    /// The GPU layout: data parallelism (DDP, FSDP, ZeRO), tensor, pipeline and context
    /// parallel degrees. The answer is for the most loaded GPU.
    #[serde(default, deserialize_with = "object_only::optional")]
    #[command(flatten)]
    pub parallelism: Option<ParallelismRequest>,
    /// What lives in CPU memory instead (DeepSpeed ZeRO-Offload, FSDP `CPUOffload`, torchao's
    /// `CPUOffloadOptimizer`).
    #[serde(default, deserialize_with = "object_only::optional")]
    #[arg(skip)]
    pub offload: Option<OffloadRequest>,
    /// With `precision` bf16 or fp16: `fp32` keeps an fp32 master copy of what trains with the
    /// optimizer state (sharded with it by ZeRO), the step run on it in fp32, as DeepSpeed's
    /// bf16/fp16 modes do; `none` (default) steps the 16-bit weights themselves.
    #[serde(default)]
    #[arg(long)]
    pub master_weights: Option<String>,
    /// Preference training's reference model (TRL's DPO and kin): `copy` (a frozen copy of the
    /// weights beside the trained ones), `adapters_disabled` (with `lora`: the base without its
    /// adapters, no second copy) or `none` (default). Give `batch_size` in sequences (a
    /// chosen/rejected pair is two).
    #[serde(default)]
    #[arg(long)]
    pub reference_model: Option<String>,
    /// DeepSpeed ZeRO's buffer sizes (its `zero_optimization` settings, in elements), with
    /// `parallelism.strategy` zero1-zero3; each unsaid one is DeepSpeed's default. A
    /// `deepspeed` config fills them in.
    #[serde(default, deserialize_with = "object_only::optional")]
    #[arg(skip)]
    pub zero: Option<ZeroRequest>,
    /// Per-sample input shape, e.g. `[3, 224, 224]`: sizes the layers of a `module_print` summary
    /// with convolutions (otherwise informational for most estimators).
    #[serde(default, deserialize_with = "whole_number::optional_list")]
    #[schema(value_type = Option<Vec<Dimension>>, min_items = 1, max_items = 5)]
    #[arg(skip)]
    pub input_shape: Option<Vec<u64>>,
    /// What autograd keeps for backward, as `gpucast_describe` traces it on the meta device:
    /// when present, the MiB figure comes from the regressors that use it (more accurate).
    #[serde(default, deserialize_with = "object_only::optional")]
    #[arg(skip)]
    pub saved_tensors: Option<SavedTensorsRequest>,
    /// `gpucast_describe`'s simulation of a whole training step at this batch size: when
    /// present, the MiB figure comes from it (the `simulated` estimator, or a regressor that
    /// requires it), and `fit` from its minimum capacity and reserved peak.
    #[serde(default, deserialize_with = "object_only::optional")]
    #[arg(skip)]
    pub simulation: Option<SimulationRequest>,
    /// The share of the card's memory the job caps its caching allocator at
    /// (`torch.cuda.set_per_process_memory_fraction`), greater than 0 and at most 1: the job
    /// must run within the cap, and each copy then occupies the cap plus the CUDA context.
    #[serde(default)]
    #[schema(exclusive_minimum = 0.0, maximum = 1.0)]
    #[arg(long)]
    pub memory_fraction: Option<f64>,
    /// Where the description came from, e.g. `timm:resnet50` (informational).
    #[serde(default)]
    #[arg(long)]
    pub model: Option<String>,
    /// A Hugging Face `config.json` (Llama, Mistral, Qwen2, Gemma, Phi-3, Mixtral-style MoE,
    /// GPT-2, GPT-NeoX, BERT, T5, ChatGLM) instead of `layers`: the model's layers, parameters and
    /// activations are built from it at `seq_len` tokens (required with it). Unknown keys are
    /// ignored; missing essentials are a 422 naming them. The analytic training step answers.
    #[serde(default, deserialize_with = "crate::api::unique_keys::object")]
    #[schema(value_type = Option<Object>, example = json!({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000}))]
    #[arg(skip)]
    pub transformer_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// Hugging Face `TrainingArguments.to_dict()`, as the Trainer saves it
    /// (`training_args.json`): `per_device_train_batch_size` is the micro-batch,
    /// `gradient_accumulation_steps`, `gradient_checkpointing` (`full`), `bf16` / `fp16`
    /// autocast (`amp_bf16` / `amp_fp16`), `tf32`, `optim` (`adamw_torch`,
    /// `adamw_torch_fused`, `adamw_hf`, `adafactor`, `sgd`, `adamw_bnb_8bit`, `adamw_8bit`,
    /// `paged_adamw_8bit`, `paged_adamw_32bit`, ...), `fsdp`, and `deepspeed` when it is the
    /// config itself. Other keys are ignored. What is read is echoed in `setup.from_files`; a
    /// value the request states otherwise is a 422 naming both.
    #[serde(default, deserialize_with = "crate::api::unique_keys::file_object")]
    #[schema(value_type = Option<FileObject>, example = json!({"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "gradient_checkpointing": true, "bf16": true, "optim": "paged_adamw_8bit"}))]
    #[arg(skip)]
    pub training_arguments: Option<serde_json::Map<String, serde_json::Value>>,
    /// PEFT's `adapter_config.json` (`peft_type` LORA): the `lora` block from `r`,
    /// `lora_alpha`, `lora_dropout`, `target_modules` and `modules_to_save`.
    #[serde(default, deserialize_with = "crate::api::unique_keys::file_object")]
    #[schema(value_type = Option<FileObject>, example = json!({"peft_type": "LORA", "r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "target_modules": ["q_proj", "v_proj"], "bias": "none"}))]
    #[arg(skip)]
    pub adapter_config: Option<serde_json::Map<String, serde_json::Value>>,
    /// A DeepSpeed config (an object, or its text as JSON or YAML): `zero_optimization.stage` (0: ddp, 1-3: zero1-zero3),
    /// `offload_optimizer` / `offload_param` devices, `bf16` / `fp16` (16-bit weights with fp32
    /// master weights), its `optimizer`; `"auto"` resolved from `training_arguments` as the
    /// Trainer does. `parallelism.world_size` still says how many GPUs.
    #[serde(default, deserialize_with = "crate::api::unique_keys::file_object")]
    #[schema(value_type = Option<FileObject>, example = json!({"zero_optimization": {"stage": 3}, "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto"}))]
    #[arg(skip)]
    pub deepspeed: Option<serde_json::Map<String, serde_json::Value>>,
    /// accelerate's FSDP options, as JSON or as the YAML text accelerate writes: its config (`distributed_type: FSDP`,
    /// `fsdp_config`, `mixed_precision` as autocast, `num_processes` as
    /// `parallelism.world_size`) or the `fsdp_config` mapping alone. `sharding_strategy`
    /// (`FULL_SHARD`: fsdp, `SHARD_GRAD_OP`: zero2, `NO_SHARD`: ddp; accelerate's default
    /// FULL_SHARD) or FSDP2's `reshard_after_forward`, `offload_params` and
    /// `activation_checkpointing` are read, with or without their `fsdp_` prefix.
    #[serde(default, deserialize_with = "crate::api::unique_keys::file_object")]
    #[schema(value_type = Option<FileObject>, example = json!({"distributed_type": "FSDP", "mixed_precision": "bf16", "num_processes": 8, "fsdp_config": {"fsdp_sharding_strategy": "FULL_SHARD", "fsdp_offload_params": false, "fsdp_activation_checkpointing": true}}))]
    #[arg(skip)]
    pub fsdp: Option<serde_json::Map<String, serde_json::Value>>,
    /// How `from_pretrained` loaded the model: `torch_dtype` (`bfloat16`, `float16`, `float32`
    /// or `auto`: the config's; not given: the config's 16-bit `torch_dtype` as transformers 5
    /// loads by default, listed in `memory.uncertainty.assumed` against transformers 4's fp32,
    /// unless the request states `precision`; without one, fp32, or fp16 when quantised)
    /// and `quantization_config` (bitsandbytes `load_in_4bit` / `load_in_8bit`, GPTQ or AWQ
    /// 4-bit) as `lora.base_weights`; `attn_implementation` as `attention`. 16-bit weights
    /// train as pure `bf16` / `fp16`.
    #[serde(default, deserialize_with = "crate::api::unique_keys::file_object")]
    #[schema(value_type = Option<FileObject>, example = json!({"torch_dtype": "bfloat16", "quantization_config": {"load_in_4bit": true, "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": true}}))]
    #[arg(skip)]
    pub load: Option<serde_json::Map<String, serde_json::Value>>,
    /// With `transformer_config`: how the loss over the vocabulary is taken. `upcast_fp32`
    /// (default: Hugging Face transformers' loss, the whole logits in fp32), `chunked`
    /// (litgpt's `chunked_cross_entropy`, torchtune's `CEWithChunkedOutputLoss`), `fused`
    /// (Liger's fused linear cross-entropy, Cut Cross-Entropy: no logits kept) or `native`
    /// (`F.cross_entropy` on the logits in their own dtype: 16-bit under pure bf16/fp16).
    #[serde(default)]
    #[arg(long)]
    pub loss_implementation: Option<String>,
    /// With `transformer_config`: the attention kernel, `sdpa` (default: flash or
    /// memory-efficient attention, no N x N tensors, as a GPU picks) or `eager` (the N x N
    /// probabilities kept).
    #[serde(default)]
    #[arg(long)]
    pub attention: Option<String>,
    /// Confidence of `memory.upper_bound_mib`: the share of jobs whose true peak stays at or
    /// below it (0.5 to 0.99, default 0.95).
    #[serde(default)]
    #[arg(long)]
    pub confidence: Option<f64>,
    /// Which estimators run: `figures` (default: those the answer's figures come from: the
    /// memory and utilization regressors, the simulation, the analytic models and physics) or
    /// `all` (the memory classifiers too: their opinions under `memory.estimators`, and 40 % of
    /// `memory.class.probabilities` from their mean; the class itself is always the figure's).
    /// The classifiers cost most of a layer job's time.
    #[serde(default)]
    #[schema(value_type = Option<String>, example = "all")]
    #[arg(long)]
    pub estimators: Option<String>,
    /// The GPU to estimate for: a catalogue GPU (`h100-80gb`, `A100 80GB`, `rtx 4090`, ...;
    /// `GET /v1/gpus` lists them), `attached` (this host's first GPU), or a card described by
    /// its name and memory. Default: the A100 40 GB the estimators were trained on. A list of
    /// up to 16 cards ranks them (`gpu_ranking`) and answers for the best-ranked one.
    #[serde(default)]
    #[arg(skip)]
    pub gpu: Option<GpuChoice>,
    /// The node the job's GPUs sit in (its host memory and how many of the job's GPUs it
    /// holds): with offload, `fit.host` checks what the ranks keep on the CPU against it, and
    /// `fit.fits` is false when it does not fit.
    #[serde(default, deserialize_with = "object_only::optional")]
    #[arg(skip)]
    pub node: Option<NodeRequest>,
    /// The software environment the job runs in (e.g. `torch2.5-cu124`: 1 to 64 letters,
    /// digits, `.`, `_`, `+`, `-`): the GPU's calibration profile in that environment is used
    /// when there is one, else the GPU's own; `calibration.environment` says which.
    #[serde(default)]
    #[schema(
        max_length = 64,
        pattern = "^[A-Za-z0-9._+-]{1,64}$",
        example = "torch2.5-cu124"
    )]
    #[arg(long)]
    pub environment: Option<String>,
    /// The training stack the job runs on: `transformers` (default: Hugging Face transformers
    /// and PEFT on PyTorch, Trainer, TRL or a custom loop), `accelerate`, `deepspeed` (the
    /// stacks the physics follows and the bound was measured on), `megatron`, `litgpt`,
    /// `torchtitan`, `torchtune` or `other` (a framework with its own engine). Without an
    /// `environment` that has observations, another stack's bound holds the spread between
    /// stacks (`memory.uncertainty.basis`: `between_stacks`).
    #[serde(default)]
    #[schema(example = "litgpt")]
    #[arg(long)]
    pub stack: Option<String>,
}

impl EstimateRequest {
    /// The setup fields, borrowed for the domain's parser: a field it reads is mapped here,
    /// beside its declaration.
    pub fn unchecked_setup(&self) -> UncheckedSetup<'_> {
        fn names(n: &NamesRequest) -> UncheckedNames<'_> {
            match n {
                NamesRequest::Keyword(word) => UncheckedNames::Keyword(word),
                NamesRequest::Names(list) => UncheckedNames::Names(list),
            }
        }
        UncheckedSetup {
            precision: self.precision.as_deref(),
            optimizer: self.optimizer.as_deref(),
            optimizer_implementation: self.optimizer_implementation.as_deref(),
            activation_checkpointing: self.activation_checkpointing.as_ref().map(names),
            micro_batch_size: self.micro_batch_size,
            gradient_accumulation_steps: self.gradient_accumulation_steps,
            trainable_params: self.trainable.as_ref().and_then(|t| t.params),
            trainable_modules: self.trainable.as_ref().and_then(|t| t.modules.as_deref()),
            lora: self.lora.as_ref().map(|l| UncheckedLora {
                rank: l.rank,
                alpha: l.alpha,
                dropout: l.dropout,
                target_modules: names(&l.target_modules),
                base_weights: l.base_weights.as_deref(),
                modules_to_save: l.modules_to_save.as_deref(),
                group_size: l.group_size,
                expert_layout: l.expert_layout.as_deref(),
            }),
            parallelism: self.parallelism.as_ref().map(|p| UncheckedParallelism {
                strategy: p.strategy.as_deref(),
                world_size: p.world_size,
                tensor_parallel: p.tensor_parallel,
                pipeline_parallel: p.pipeline_parallel,
                context_parallel: p.context_parallel,
                sequence_parallel: p.sequence_parallel,
            }),
            master_weights: self.master_weights.as_deref(),
            reference_model: self.reference_model.as_deref(),
            offload: self.offload.as_ref().map(|o| UncheckedOffload {
                optimizer_state: o.optimizer_state,
                gradients: o.gradients,
                parameters: o.parameters,
            }),
            zero: self.zero.as_ref().map(|z| UncheckedZero {
                reduce_bucket_size: z.reduce_bucket_size,
                prefetch_bucket_size: z.prefetch_bucket_size,
                max_live_parameters: z.max_live_parameters,
                max_reuse_distance: z.max_reuse_distance,
                param_persistence_threshold: z.param_persistence_threshold,
                sub_group_size: z.sub_group_size,
            }),
        }
    }
}

/// A file a user's tool wrote: its JSON object, or its text as a string, JSON or YAML
/// (accelerate's config, a DeepSpeed config kept as YAML), read with each key once.
pub struct FileObject;

impl utoipa::PartialSchema for FileObject {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ObjectBuilder, OneOfBuilder, Type};
        OneOfBuilder::new()
            .item(ObjectBuilder::new().schema_type(Type::Object))
            .item(
                ObjectBuilder::new()
                    .schema_type(Type::String)
                    .description(Some("The file's text: JSON or YAML holding one mapping")),
            )
            .description(Some(
                "The file as a JSON object, or its text (JSON or YAML) as a string.",
            ))
            .into()
    }
}

impl ToSchema for FileObject {}

/// A keyword (`none`, `full`, `all-linear`) or a list of module names.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(untagged)]
pub enum NamesRequest {
    Keyword(String),
    Names(Vec<String>),
}

impl NamesRequest {
    /// A flag's value (`--activation-checkpointing`): `none` or `full` the keyword, anything
    /// else module names separated by commas.
    pub fn from_flag(raw: &str) -> Result<NamesRequest, std::convert::Infallible> {
        Ok(match raw {
            "none" | "full" => NamesRequest::Keyword(raw.to_string()),
            modules => {
                NamesRequest::Names(modules.split(',').map(|m| m.trim().to_string()).collect())
            }
        })
    }
}

/// A module name as a list of them holds it: 1 to 256 characters once trimmed, not all
/// whitespace (the schema of each name of `trainable.modules` and `lora.modules_to_save`;
/// the lists hold plain strings).
pub struct ModuleName;

impl utoipa::PartialSchema for ModuleName {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .min_length(Some(1))
            .max_length(Some(crate::job::setup::MAX_NAME_CHARS))
            .pattern(Some("\\S"))
            .description(Some(
                "A module name: 1 to 256 characters once trimmed, not all whitespace.",
            ))
            .into()
    }
}

impl ToSchema for ModuleName {}

/// Which parameters train: a count, or module names (layer-name prefixes).
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TrainableRequest {
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(maximum = 10_000_000_000_000_u64)]
    pub params: Option<u64>,
    #[serde(default)]
    #[schema(value_type = Option<Vec<ModuleName>>, min_items = 1, max_items = 256)]
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
    /// How a mixture of experts holds its experts, which decides whether a quantised base
    /// quantises them: `per_expert_linear` (default: transformers 4, an `nn.Linear` per expert
    /// projection, quantised like any linear) or `fused` (transformers 5's 3D expert
    /// parameters, which bitsandbytes leaves in the weights' dtype).
    #[serde(default)]
    #[schema(example = "per_expert_linear")]
    pub expert_layout: Option<String>,
    /// PEFT's `modules_to_save` (e.g. `["embed_tokens", "lm_head"]`, a classifier `score`):
    /// each gets a trained copy beside the frozen original, with its gradients and optimizer
    /// state.
    #[serde(default)]
    #[schema(value_type = Option<Vec<ModuleName>>, min_items = 1, max_items = 256)]
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

/// DeepSpeed ZeRO's buffer settings, in elements (`zero_optimization`'s keys without the
/// `stage3_` prefix). Each unsaid one is DeepSpeed's default.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"reduce_bucket_size": 16777216, "prefetch_bucket_size": 15099494, "param_persistence_threshold": 40960}))]
pub struct ZeroRequest {
    /// `reduce_bucket_size`: the contiguous gradient bucket (default 5e8).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1000000000000000_u64)]
    pub reduce_bucket_size: Option<u64>,
    /// `stage3_prefetch_bucket_size`: parameters gathered ahead (default 5e7).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 0, maximum = 1000000000000000_u64)]
    pub prefetch_bucket_size: Option<u64>,
    /// `stage3_max_live_parameters`: no prefetch beyond this many gathered (default 1e9).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 0, maximum = 1000000000000000_u64)]
    pub max_live_parameters: Option<u64>,
    /// `stage3_max_reuse_distance`: a parameter used again within this many elements of the
    /// trace stays gathered (default 1e9).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 0, maximum = 1000000000000000_u64)]
    pub max_reuse_distance: Option<u64>,
    /// `stage3_param_persistence_threshold`: parameters this small are never partitioned
    /// (default 1e5).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 0, maximum = 1000000000000000_u64)]
    pub param_persistence_threshold: Option<u64>,
    /// `sub_group_size`: the optimizer steps its partition in groups this large (default 1e9).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1000000000000000_u64)]
    pub sub_group_size: Option<u64>,
}

/// What is offloaded, as understood.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct OffloadResponse {
    pub optimizer_state: bool,
    pub gradients: bool,
    pub parameters: bool,
    /// Host (CPU) memory one GPU's process holds for what it offloads, MiB (the sum of
    /// `host_breakdown`); absent without offload.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_memory_mib: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host_breakdown: Option<HostMemoryResponse>,
}

/// What one GPU's process holds in host memory for its offload, MiB, as DeepSpeed's
/// ZeRO-Offload and FSDP's `CPUOffload` keep it; rounded to 0.1 MiB.
#[derive(Debug, Clone, Serialize, Deserialize, ToSchema)]
pub struct HostMemoryResponse {
    /// The optimizer's state (with an fp32 master copy where the setup keeps one), the rank's
    /// shard of it.
    pub optimizer_state: f64,
    /// The gradients the CPU optimizer steps on: the rank's partition in fp32 (ZeRO-1/2
    /// keep a second one to accumulate micro-batches in), pinned with DeepSpeed's
    /// `pin_memory`; offloaded on their own, in their dtype.
    pub gradients: f64,
    /// The weights' shard (FSDP `offload_params`, ZeRO-3 `offload_param`).
    pub parameters: f64,
}

/// The node a job's GPUs sit in, as a placement checks it: with offload, what its ranks hold
/// on the CPU must fit its host memory.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"memory_mib": 262144, "gpus": 8}))]
pub struct NodeRequest {
    /// The node's host memory (RAM) the job may use, MiB.
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(minimum = 1, maximum = 1000000000_u64)]
    pub memory_mib: u64,
    /// The job's GPUs on one node (default: the world size, at most 8).
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub gpus: Option<u64>,
}

/// The GPU layout. `world_size` = data x `tensor_parallel` x `pipeline_parallel` x
/// `context_parallel`.
#[derive(Debug, Clone, Deserialize, Serialize, ToSchema, clap::Args)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"strategy": "fsdp", "world_size": 8}))]
pub struct ParallelismRequest {
    /// `none` (default), `ddp`, `fsdp` (full shard), `zero1`, `zero2`, `zero3`.
    #[serde(default)]
    #[arg(long)]
    pub strategy: Option<String>,
    /// GPUs in all: data x `tensor_parallel` x `pipeline_parallel` x `context_parallel`.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    #[arg(long)]
    pub world_size: Option<u64>,
    /// Tensor-parallel degree.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    #[arg(long)]
    pub tensor_parallel: Option<u64>,
    /// Pipeline-parallel degree.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    #[arg(long)]
    pub pipeline_parallel: Option<u64>,
    /// Context-parallel degree.
    #[serde(default, deserialize_with = "whole_number::optional")]
    #[schema(minimum = 1, maximum = 1048576)]
    #[arg(long)]
    pub context_parallel: Option<u64>,
    /// Whether tensor parallelism also splits the norms and the first linears' inputs along
    /// the sequence (Megatron's `--sequence-parallel`, torchtitan's TP plan). Default false,
    /// Megatron's default: each tensor-parallel rank then holds those activations whole.
    #[serde(default)]
    #[arg(long, value_name = "BOOL")]
    pub sequence_parallel: Option<bool>,
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
    /// The per-sample input the printout was made for, e.g. `[3, 224, 224]`: the request's
    /// `input_shape`, given beside the text it sizes (either place; both given and different,
    /// the top-level one is used, with a warning).
    #[serde(default, deserialize_with = "whole_number::optional_list")]
    #[schema(value_type = Option<Vec<Dimension>>, min_items = 1, max_items = 5)]
    pub input_shape: Option<Vec<u64>>,
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
