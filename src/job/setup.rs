//! How a job is trained: precision, optimizer, activation checkpointing, accumulation, frozen
//! weights and adapters, and the GPU layout. Parsed from untrusted input into a [`Setup`] here;
//! what each choice does to memory lives in [`super::step`]. docs/user/setups.md is the contract.

use std::fmt;

use super::echo;

/// Most names a list field (`target_modules`, `trainable.modules`, checkpointed modules) holds.
pub const MAX_NAMES: usize = 256;
/// Longest name accepted in such a list.
pub const MAX_NAME_CHARS: usize = 256;
/// Largest GPU count of any degree or world size (far beyond any cluster).
pub const MAX_WORLD_SIZE: u64 = 1 << 20;
/// Largest accumulation accepted.
pub const MAX_ACCUMULATION: u64 = 1 << 20;
/// Largest LoRA rank accepted (any real adapter is far below).
pub const MAX_LORA_RANK: u64 = 1 << 16;
/// LoRA's alpha when none is given: PEFT's `LoraConfig` default (a scale; no memory of its own).
pub const PEFT_DEFAULT_ALPHA: f64 = 8.0;

/// A setup field that cannot be read, or a combination that cannot run: `field: message`.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct SetupError {
    pub field: String,
    pub message: String,
}

impl SetupError {
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> SetupError {
        SetupError {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// The numeric format of weights, gradients and activations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Precision {
    #[default]
    Fp32,
    /// fp32 storage, TF32 matmuls: memory as fp32.
    Tf32,
    /// CUDA autocast to fp16: fp32 master weights, 16-bit casts and activations.
    AmpFp16,
    AmpBf16,
    /// Pure 16-bit: weights, gradients and optimizer state in bf16.
    Bf16,
    /// Pure fp16 with a loss scaler.
    Fp16,
}

impl Precision {
    pub const NAMES: &'static str = "fp32, tf32, amp_fp16, amp_bf16, bf16, fp16";

    pub fn parse(raw: &str) -> Option<Precision> {
        match raw.to_ascii_lowercase().as_str() {
            "fp32" | "float32" => Some(Precision::Fp32),
            "tf32" => Some(Precision::Tf32),
            // `mixed16` and `amp` are the names this service used before the six modes.
            "amp_fp16" | "mixed16" | "amp" => Some(Precision::AmpFp16),
            "amp_bf16" => Some(Precision::AmpBf16),
            "bf16" | "bfloat16" => Some(Precision::Bf16),
            "fp16" | "float16" => Some(Precision::Fp16),
            // Lightning's precision strings: `-mixed` is autocast, `-true` the weights' dtype.
            "bf16-mixed" => Some(Precision::AmpBf16),
            "16-mixed" => Some(Precision::AmpFp16),
            "bf16-true" => Some(Precision::Bf16),
            "16-true" => Some(Precision::Fp16),
            "32-true" => Some(Precision::Fp32),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Tf32 => "tf32",
            Precision::AmpFp16 => "amp_fp16",
            Precision::AmpBf16 => "amp_bf16",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }

    pub fn is_autocast(self) -> bool {
        matches!(self, Precision::AmpFp16 | Precision::AmpBf16)
    }

    pub fn is_pure_16bit(self) -> bool {
        matches!(self, Precision::Bf16 | Precision::Fp16)
    }

    /// Bytes of one element a kernel computes in (activations, gathered weights): fp32
    /// unless 16-bit (autocast or pure).
    pub fn compute_bytes(self) -> f64 {
        match self {
            Precision::Fp32 | Precision::Tf32 => 4.0,
            _ => 2.0,
        }
    }

    /// Bytes of one stored weight, gradient or optimizer-state element.
    pub fn storage_bytes(self) -> f64 {
        if self.is_pure_16bit() {
            2.0
        } else {
            4.0
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Optimizer {
    Sgd,
    Momentum,
    #[default]
    Adam,
    AdamW,
    Adafactor,
    /// bitsandbytes' blockwise 8-bit Adam.
    Adam8bit,
    AdamW8bit,
    /// AdamW with its state in CUDA unified memory, outside PyTorch's caching allocator.
    PagedAdamW,
    PagedAdamW8bit,
}

impl Optimizer {
    pub const NAMES: &'static str = "sgd, momentum, adam, adamw, adafactor, adam_8bit, \
                                     adamw_8bit, paged_adamw, paged_adamw_8bit";

    pub fn parse(raw: &str) -> Option<Optimizer> {
        match raw.to_ascii_lowercase().replace('-', "_").as_str() {
            "sgd" => Some(Optimizer::Sgd),
            "momentum" | "sgd_momentum" | "nesterov" => Some(Optimizer::Momentum),
            "adam" => Some(Optimizer::Adam),
            "adamw" => Some(Optimizer::AdamW),
            "adafactor" => Some(Optimizer::Adafactor),
            "adam_8bit" | "adam8bit" => Some(Optimizer::Adam8bit),
            "adamw_8bit" | "adamw8bit" => Some(Optimizer::AdamW8bit),
            "paged_adamw" | "paged_adamw_32bit" => Some(Optimizer::PagedAdamW),
            "paged_adamw_8bit" => Some(Optimizer::PagedAdamW8bit),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Optimizer::Sgd => "sgd",
            Optimizer::Momentum => "momentum",
            Optimizer::Adam => "adam",
            Optimizer::AdamW => "adamw",
            Optimizer::Adafactor => "adafactor",
            Optimizer::Adam8bit => "adam_8bit",
            Optimizer::AdamW8bit => "adamw_8bit",
            Optimizer::PagedAdamW => "paged_adamw",
            Optimizer::PagedAdamW8bit => "paged_adamw_8bit",
        }
    }

    /// fp32 state bytes per parameter of the four optimizers the learned models were trained
    /// on (the features' formula): 0, 4, 8, 8. The other optimizers' state is sized per layer
    /// by [`super::step`].
    pub fn state_bytes_per_param(self) -> f64 {
        match self {
            Optimizer::Sgd => 0.0,
            Optimizer::Momentum => 4.0,
            _ => 8.0,
        }
    }

    /// State outside PyTorch's allocator (bitsandbytes' paged optimizers).
    pub fn is_paged(self) -> bool {
        matches!(self, Optimizer::PagedAdamW | Optimizer::PagedAdamW8bit)
    }

    pub fn is_8bit(self) -> bool {
        matches!(
            self,
            Optimizer::Adam8bit | Optimizer::AdamW8bit | Optimizer::PagedAdamW8bit
        )
    }

    /// Whether the optimizer has `implementation`: bitsandbytes' optimizers run their own
    /// fused kernels (no for-loop), torch's Adafactor has no fused kernel.
    pub fn runs_as(self, implementation: OptimizerImplementation) -> bool {
        match implementation {
            OptimizerImplementation::Foreach => true,
            OptimizerImplementation::Fused => self != Optimizer::Adafactor,
            OptimizerImplementation::ForLoop => self.is_classic() || self == Optimizer::Adafactor,
        }
    }

    /// One of sgd, momentum, adam, adamw: what the learned models were trained on.
    pub fn is_classic(self) -> bool {
        matches!(
            self,
            Optimizer::Sgd | Optimizer::Momentum | Optimizer::Adam | Optimizer::AdamW
        )
    }
}

/// How the optimizer's step runs: PyTorch's GPU default is `foreach` (one temporary copy of
/// the state per step), `fused` allocates next to nothing, `for_loop` one parameter's worth.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OptimizerImplementation {
    #[default]
    Foreach,
    Fused,
    ForLoop,
}

impl OptimizerImplementation {
    pub fn parse(raw: &str) -> Option<OptimizerImplementation> {
        match raw.to_ascii_lowercase().as_str() {
            "foreach" => Some(OptimizerImplementation::Foreach),
            "fused" => Some(OptimizerImplementation::Fused),
            "for_loop" | "forloop" => Some(OptimizerImplementation::ForLoop),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            OptimizerImplementation::Foreach => "foreach",
            OptimizerImplementation::Fused => "fused",
            OptimizerImplementation::ForLoop => "for_loop",
        }
    }
}

/// Which modules recompute their forward in backward instead of keeping activations.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Checkpointing {
    #[default]
    None,
    /// Every block of the model's repeated block stack.
    Full,
    /// These modules (layer-name prefixes).
    Modules(Vec<String>),
}

impl Checkpointing {
    pub fn as_str(&self) -> &'static str {
        match self {
            Checkpointing::None => "none",
            Checkpointing::Full => "full",
            Checkpointing::Modules(_) => "modules",
        }
    }
}

/// Which parameters train; the rest are frozen (no gradient, no optimizer state).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Trainable {
    #[default]
    All,
    Params(u64),
    Modules(Vec<String>),
}

/// The frozen base weights of a LoRA job.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BaseWeights {
    /// In the job's precision.
    #[default]
    Same,
    /// bitsandbytes LLM.int8: 1 byte per weight and fp32 row scales.
    Int8,
    /// QLoRA's NF4: 4 bits per weight, 8-bit block scales (64) with fp32 scales of those (256).
    Nf4,
    /// GPTQ 4-bit (AutoGPTQ/optimum): packed int4 weights, an fp16 scale and a packed 4-bit zero
    /// per group of inputs and output, and an int32 group index per input (`g_idx`).
    Gptq { group_size: u64 },
    /// AWQ 4-bit (AutoAWQ's GEMM layout): packed int4 weights, an fp16 scale and a packed 4-bit
    /// zero per group of inputs and output.
    Awq { group_size: u64 },
}

/// The group size of GPTQ and AWQ checkpoints unless told (both libraries' default).
pub const DEFAULT_GROUP_SIZE: u64 = 128;
/// The largest group: a group the size of a layer's inputs is per-channel quantisation.
const MAX_GROUP_SIZE: u64 = 65_536;

impl BaseWeights {
    pub fn parse(raw: &str) -> Option<BaseWeights> {
        match raw.to_ascii_lowercase().as_str() {
            "same" | "none" => Some(BaseWeights::Same),
            "int8" | "8bit" => Some(BaseWeights::Int8),
            "nf4" | "4bit" | "fp4" => Some(BaseWeights::Nf4),
            "gptq_int4" | "gptq" => Some(BaseWeights::Gptq {
                group_size: DEFAULT_GROUP_SIZE,
            }),
            "awq_int4" | "awq" => Some(BaseWeights::Awq {
                group_size: DEFAULT_GROUP_SIZE,
            }),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            BaseWeights::Same => "same",
            BaseWeights::Int8 => "int8",
            BaseWeights::Nf4 => "nf4",
            BaseWeights::Gptq { .. } => "gptq_int4",
            BaseWeights::Awq { .. } => "awq_int4",
        }
    }

    /// Whether the base is stored in 4 bits (dequantised for each matmul).
    pub fn is_4bit(self) -> bool {
        matches!(
            self,
            BaseWeights::Nf4 | BaseWeights::Gptq { .. } | BaseWeights::Awq { .. }
        )
    }
}

/// How a mixture of experts holds its experts' weights, which decides whether a quantised base
/// quantises them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ExpertLayout {
    /// One `nn.Linear` per expert projection (transformers 4): bitsandbytes, GPTQ and AWQ
    /// quantise each like any linear layer.
    #[default]
    PerExpertLinear,
    /// The experts fused into 3D parameters (transformers 5): bitsandbytes replaces only
    /// `nn.Linear` modules, so they stay in the weights' dtype.
    Fused,
}

impl ExpertLayout {
    pub fn parse(raw: &str) -> Option<ExpertLayout> {
        match raw.to_ascii_lowercase().as_str() {
            "per_expert_linear" => Some(ExpertLayout::PerExpertLinear),
            "fused" => Some(ExpertLayout::Fused),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            ExpertLayout::PerExpertLinear => "per_expert_linear",
            ExpertLayout::Fused => "fused",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoraTargets {
    /// PEFT's `all-linear`: every linear layer but the output head (the model's last linear).
    AllLinear,
    /// Layer names, matched as PEFT does: the whole name, or its last dotted components.
    Names(Vec<String>),
}

#[derive(Debug, Clone, PartialEq)]
pub struct Lora {
    pub rank: u64,
    pub alpha: f64,
    /// PEFT's `lora_dropout`: above 0 each adapted layer keeps its dropped input for backward.
    pub dropout: f64,
    pub targets: LoraTargets,
    pub base_weights: BaseWeights,
    /// How a mixture of experts holds its experts (whether a quantised base quantises them).
    pub expert_layout: ExpertLayout,
    /// PEFT's `modules_to_save`: a trained copy of each beside the frozen original.
    pub modules_to_save: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Strategy {
    #[default]
    None,
    Ddp,
    Fsdp,
    Zero1,
    Zero2,
    Zero3,
}

impl Strategy {
    pub fn parse(raw: &str) -> Option<Strategy> {
        match raw.to_ascii_lowercase().replace(['-', ' '], "_").as_str() {
            "none" | "single" => Some(Strategy::None),
            "ddp" => Some(Strategy::Ddp),
            "fsdp" | "fsdp2" | "full_shard" => Some(Strategy::Fsdp),
            "zero1" | "zero_1" => Some(Strategy::Zero1),
            "zero2" | "zero_2" => Some(Strategy::Zero2),
            "zero3" | "zero_3" => Some(Strategy::Zero3),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Strategy::None => "none",
            Strategy::Ddp => "ddp",
            Strategy::Fsdp => "fsdp",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Zero3 => "zero3",
        }
    }

    /// (optimizer state, gradients, weights) sharded across the data-parallel ranks.
    pub fn shards(self) -> (bool, bool, bool) {
        match self {
            Strategy::None | Strategy::Ddp => (false, false, false),
            Strategy::Zero1 => (true, false, false),
            Strategy::Zero2 => (true, true, false),
            Strategy::Fsdp | Strategy::Zero3 => (true, true, true),
        }
    }
}

/// The GPU layout: `world_size = data x tensor x pipeline x context` degrees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Parallelism {
    pub strategy: Strategy,
    pub world_size: u64,
    pub tensor: u64,
    pub pipeline: u64,
    pub context: u64,
    /// Tensor parallelism splits the norms' and first linears' inputs along the sequence too.
    pub sequence_parallel: bool,
}

impl Default for Parallelism {
    fn default() -> Parallelism {
        Parallelism {
            strategy: Strategy::None,
            world_size: 1,
            tensor: 1,
            pipeline: 1,
            context: 1,
            sequence_parallel: false,
        }
    }
}

impl Parallelism {
    /// The data-parallel degree: the ranks that hold the same layers.
    pub fn data(self) -> u64 {
        self.world_size / (self.tensor * self.pipeline * self.context)
    }

    pub fn is_single_gpu(self) -> bool {
        self.world_size == 1
    }
}

/// A validated training setup (without the checks that need the layers: see
/// [`super::Job::with_setup`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub implementation: OptimizerImplementation,
    pub checkpointing: Checkpointing,
    /// Samples per GPU per forward/backward.
    pub micro_batch_size: u64,
    pub accumulation: u64,
    pub trainable: Trainable,
    pub lora: Option<Lora>,
    pub parallelism: Parallelism,
    pub offload: Offload,
    /// With pure 16-bit weights: an fp32 master copy kept with the optimizer state (and
    /// sharded with it), the step run in fp32 on it (DeepSpeed's bf16/fp16 modes, and
    /// mixed-precision optimizers generally).
    pub fp32_master: bool,
    /// A frozen reference model beside the one that trains (DPO and its kin).
    pub reference: Reference,
    /// DeepSpeed ZeRO's buffer sizes (read under `zero1`-`zero3`).
    pub zero: ZeroBuffers,
}

/// Largest element count a ZeRO buffer setting may state (DeepSpeed's own defaults are at most
/// 1e12: `sub_group_size` in stage3.py's signature).
pub const MAX_ZERO_ELEMENTS: u64 = 1_000_000_000_000_000;

/// DeepSpeed ZeRO's buffer settings, in elements (`zero_optimization` of its config). Each
/// defaults to DeepSpeed's own (`DeepSpeedZeroConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ZeroBuffers {
    /// `reduce_bucket_size`: the contiguous gradient bucket, allocated whole at start-up.
    pub reduce_bucket: u64,
    /// `stage3_prefetch_bucket_size`: parameters gathered ahead of their use.
    pub prefetch_bucket: u64,
    /// `stage3_max_live_parameters`: no prefetch past this many gathered.
    pub max_live_parameters: u64,
    /// `stage3_max_reuse_distance`: a gathered parameter used again within this many
    /// elements of the trace stays gathered.
    pub max_reuse_distance: u64,
    /// `stage3_param_persistence_threshold`: parameters this small are never partitioned.
    pub persistence_threshold: u64,
    /// `sub_group_size`: the optimizer steps its partition in groups this large.
    pub sub_group: u64,
}

impl Default for ZeroBuffers {
    fn default() -> ZeroBuffers {
        ZeroBuffers {
            reduce_bucket: 500_000_000,
            prefetch_bucket: 50_000_000,
            max_live_parameters: 1_000_000_000,
            max_reuse_distance: 1_000_000_000,
            persistence_threshold: 100_000,
            sub_group: 1_000_000_000,
        }
    }
}

/// The reference model of preference training (TRL's DPO, KTO, ORPO-style trainers).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Reference {
    /// No reference model.
    #[default]
    None,
    /// A frozen copy of the model's weights (TRL's `ref_model` without PEFT).
    Copy,
    /// The LoRA model with its adapters disabled (TRL with PEFT): no second copy.
    AdaptersDisabled,
}

impl Reference {
    pub fn as_str(self) -> &'static str {
        match self {
            Reference::None => "none",
            Reference::Copy => "copy",
            Reference::AdaptersDisabled => "adapters_disabled",
        }
    }
}

/// What lives in CPU memory instead of the GPU's (DeepSpeed ZeRO-Offload, FSDP's
/// `CPUOffload(offload_params=True)`, torchao's `CPUOffloadOptimizer`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Offload {
    /// The optimizer's state, and its step, run on the CPU.
    pub optimizer_state: bool,
    /// Each gradient is copied to the CPU as backward produces it (accumulated there).
    pub gradients: bool,
    /// The weights live on the CPU; each unit (a repeated block) is brought in for its
    /// forward and backward. Implies the gradients and the optimizer state (FSDP and ZeRO-3
    /// offload them with the parameters).
    pub parameters: bool,
}

impl Offload {
    pub fn any(self) -> bool {
        self.optimizer_state || self.gradients || self.parameters
    }
}

impl Setup {
    /// One GPU, fp32, Adam, every parameter trained, no checkpointing, no accumulation.
    pub fn plain(batch_size: u64) -> Setup {
        Setup {
            precision: Precision::default(),
            optimizer: Optimizer::default(),
            implementation: OptimizerImplementation::default(),
            checkpointing: Checkpointing::None,
            micro_batch_size: batch_size,
            accumulation: 1,
            trainable: Trainable::All,
            lora: None,
            parallelism: Parallelism::default(),
            offload: Offload::default(),
            fp32_master: false,
            reference: Reference::None,
            zero: ZeroBuffers::default(),
        }
    }

    /// Whether the learned models were trained on jobs like this one: one GPU (or DDP, whose
    /// buckets are added to the physics), every parameter trained, no checkpointing, one
    /// micro-batch per step, fp32/TF32 or fp16 autocast, one of the four classic optimizers
    /// run as foreach. Outside, physics answers alone.
    pub fn within_learned(&self) -> bool {
        matches!(
            self.precision,
            Precision::Fp32 | Precision::Tf32 | Precision::AmpFp16
        ) && self.optimizer.is_classic()
            && self.implementation == OptimizerImplementation::Foreach
            && self.checkpointing == Checkpointing::None
            && !self.offload.any()
            && self.reference == Reference::None
            && self.accumulation == 1
            && self.trainable == Trainable::All
            && self.lora.is_none()
            && self.parallelism.is_single_gpu()
    }
}

/// A setup's family, by what its memory's doubt rests on: the held-out residuals of the
/// figure are grouped by it (and by the level of detail), since a frozen 4-bit base, sharded
/// state or offloaded state each leave different terms uncounted.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum SetupFamily {
    /// Every parameter (or a subset) trained in place on the GPUs that hold it.
    Full,
    /// Adapters on a base kept in its precision (or 8-bit).
    Lora,
    /// Adapters on a 4-bit base (NF4, GPTQ, AWQ).
    Qlora,
    /// State sharded across ranks (FSDP, ZeRO).
    Sharded,
    /// State or weights offloaded to the CPU.
    Offload,
}

impl SetupFamily {
    pub const ALL: [SetupFamily; 5] = [
        SetupFamily::Full,
        SetupFamily::Lora,
        SetupFamily::Qlora,
        SetupFamily::Sharded,
        SetupFamily::Offload,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SetupFamily::Full => "full",
            SetupFamily::Lora => "lora",
            SetupFamily::Qlora => "qlora",
            SetupFamily::Sharded => "sharded",
            SetupFamily::Offload => "offload",
        }
    }
}

impl Setup {
    /// The family, the first that applies: offload, then sharding, then adapters.
    pub fn family(&self) -> SetupFamily {
        let sharded = !self.parallelism.is_single_gpu()
            && self.parallelism.strategy.shards() != (false, false, false);
        match &self.lora {
            _ if self.offload.any() => SetupFamily::Offload,
            _ if sharded => SetupFamily::Sharded,
            Some(lora) if lora.base_weights.is_4bit() => SetupFamily::Qlora,
            Some(_) => SetupFamily::Lora,
            None => SetupFamily::Full,
        }
    }
}

/// The setup fields as a request gives them (borrowed, unchecked).
#[derive(Debug, Clone, Default)]
pub struct UncheckedSetup<'a> {
    pub precision: Option<&'a str>,
    pub optimizer: Option<&'a str>,
    pub optimizer_implementation: Option<&'a str>,
    pub activation_checkpointing: Option<UncheckedNames<'a>>,
    pub micro_batch_size: Option<u64>,
    pub gradient_accumulation_steps: Option<u64>,
    pub trainable_params: Option<u64>,
    pub trainable_modules: Option<&'a [String]>,
    pub lora: Option<UncheckedLora<'a>>,
    pub parallelism: Option<UncheckedParallelism<'a>>,
    pub offload: Option<UncheckedOffload>,
    pub master_weights: Option<&'a str>,
    pub reference_model: Option<&'a str>,
    pub zero: Option<UncheckedZero>,
}

/// DeepSpeed ZeRO's buffer settings as a request gives them (elements).
#[derive(Debug, Clone, Copy, Default)]
pub struct UncheckedZero {
    pub reduce_bucket_size: Option<u64>,
    pub prefetch_bucket_size: Option<u64>,
    pub max_live_parameters: Option<u64>,
    pub max_reuse_distance: Option<u64>,
    pub param_persistence_threshold: Option<u64>,
    pub sub_group_size: Option<u64>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct UncheckedOffload {
    pub optimizer_state: Option<bool>,
    pub gradients: Option<bool>,
    pub parameters: Option<bool>,
}

/// A keyword (`none`, `full`, `all-linear`) or a list of names.
#[derive(Debug, Clone, Copy)]
pub enum UncheckedNames<'a> {
    Keyword(&'a str),
    Names(&'a [String]),
}

#[derive(Debug, Clone, Copy)]
pub struct UncheckedLora<'a> {
    pub rank: u64,
    pub alpha: Option<f64>,
    pub dropout: Option<f64>,
    pub target_modules: UncheckedNames<'a>,
    pub base_weights: Option<&'a str>,
    pub modules_to_save: Option<&'a [String]>,
    pub group_size: Option<u64>,
    pub expert_layout: Option<&'a str>,
}

#[derive(Debug, Clone, Copy, Default)]
pub struct UncheckedParallelism<'a> {
    pub strategy: Option<&'a str>,
    pub world_size: Option<u64>,
    pub tensor_parallel: Option<u64>,
    pub pipeline_parallel: Option<u64>,
    pub context_parallel: Option<u64>,
    pub sequence_parallel: Option<bool>,
}

fn names(field: &str, raw: &[String]) -> Result<Vec<String>, SetupError> {
    if raw.is_empty() {
        return Err(SetupError::new(field, "must name at least one module"));
    }
    if raw.len() > MAX_NAMES {
        return Err(SetupError::new(
            field,
            format!("at most {MAX_NAMES} names, got {}", raw.len()),
        ));
    }
    raw.iter()
        .map(|name| {
            let name = name.trim();
            if name.is_empty() || name.chars().count() > MAX_NAME_CHARS {
                Err(SetupError::new(
                    field,
                    format!("each name must hold 1 to {MAX_NAME_CHARS} characters"),
                ))
            } else {
                Ok(name.to_string())
            }
        })
        .collect()
}

/// [`names`] with each name once (its first place kept): for the lists that ask only whether
/// some name of theirs names a layer (LoRA's targets and `modules_to_save`, trainable modules),
/// where naming one twice says nothing more. (Checkpointed modules keep their repeats: the step
/// counts each entry.)
fn distinct_names(field: &str, raw: &[String]) -> Result<Vec<String>, SetupError> {
    let mut list = names(field, raw)?;
    let mut seen: std::collections::HashSet<&str> = Default::default();
    let first: Vec<bool> = list.iter().map(|name| seen.insert(name)).collect();
    let mut first = first.into_iter();
    list.retain(|_| first.next().unwrap_or(false));
    Ok(list)
}

fn degree(field: &str, raw: Option<u64>) -> Result<u64, SetupError> {
    match raw {
        None => Ok(1),
        Some(d) if (1..=MAX_WORLD_SIZE).contains(&d) => Ok(d),
        Some(d) => Err(SetupError::new(
            field,
            format!("must be between 1 and {MAX_WORLD_SIZE}, got {d}"),
        )),
    }
}

fn parallelism(raw: Option<UncheckedParallelism<'_>>) -> Result<Parallelism, SetupError> {
    let Some(raw) = raw else {
        return Ok(Parallelism::default());
    };
    let strategy = match raw.strategy {
        None => Strategy::None,
        Some(name) => Strategy::parse(name).ok_or_else(|| {
            SetupError::new(
                "parallelism.strategy",
                format!(
                    "unknown strategy '{}' (known: none, ddp, fsdp, zero1, zero2, zero3)",
                    echo(name)
                ),
            )
        })?,
    };
    let tensor = degree("parallelism.tensor_parallel", raw.tensor_parallel)?;
    let pipeline = degree("parallelism.pipeline_parallel", raw.pipeline_parallel)?;
    let context = degree("parallelism.context_parallel", raw.context_parallel)?;
    let model_parallel = tensor * pipeline * context;
    let world_size = match raw.world_size {
        Some(0) => {
            return Err(SetupError::new(
                "parallelism.world_size",
                "must be at least 1, got 0",
            ))
        }
        Some(w) if w > MAX_WORLD_SIZE => {
            return Err(SetupError::new(
                "parallelism.world_size",
                format!("must be at most {MAX_WORLD_SIZE}, got {w}"),
            ))
        }
        Some(w) => w,
        None if matches!(strategy, Strategy::None | Strategy::Ddp) => model_parallel,
        None => {
            return Err(SetupError::new(
                "parallelism.world_size",
                format!(
                    "{} shards across the data-parallel ranks: give the world size",
                    strategy.as_str()
                ),
            ))
        }
    };
    if model_parallel > MAX_WORLD_SIZE || !world_size.is_multiple_of(model_parallel) {
        return Err(SetupError::new(
            "parallelism.world_size",
            format!(
                "{world_size} GPUs cannot be split into tensor x pipeline x context = \
                 {tensor} x {pipeline} x {context} groups"
            ),
        ));
    }
    if strategy == Strategy::None && world_size / model_parallel > 1 {
        return Err(SetupError::new(
            "parallelism.strategy",
            format!(
                "{} data-parallel ranks need a strategy (ddp, fsdp, zero1, zero2, zero3)",
                world_size / model_parallel
            ),
        ));
    }
    Ok(Parallelism {
        strategy,
        world_size,
        tensor,
        pipeline,
        context,
        sequence_parallel: raw.sequence_parallel.unwrap_or(false),
    })
}

fn lora(raw: Option<UncheckedLora<'_>>) -> Result<Option<Lora>, SetupError> {
    let Some(raw) = raw else {
        return Ok(None);
    };
    if raw.rank == 0 || raw.rank > MAX_LORA_RANK {
        return Err(SetupError::new(
            "lora.rank",
            format!("must be between 1 and {MAX_LORA_RANK}, got {}", raw.rank),
        ));
    }
    // PEFT's default, as an adapter_config.json without lora_alpha and describe read it.
    let alpha = raw.alpha.unwrap_or(PEFT_DEFAULT_ALPHA);
    if !alpha.is_finite() || alpha <= 0.0 || alpha > 1e6 {
        return Err(SetupError::new(
            "lora.alpha",
            "must be a positive number of at most 1e6",
        ));
    }
    let dropout = raw.dropout.unwrap_or(0.0);
    if !(0.0..1.0).contains(&dropout) {
        return Err(SetupError::new(
            "lora.dropout",
            format!("must be at least 0 and below 1, got {dropout}"),
        ));
    }
    let targets = match raw.target_modules {
        UncheckedNames::Keyword(word)
            if matches!(
                word.to_ascii_lowercase().as_str(),
                "all-linear" | "all_linear"
            ) =>
        {
            LoraTargets::AllLinear
        }
        UncheckedNames::Keyword(word) => {
            return Err(SetupError::new(
                "lora.target_modules",
                format!(
                    "'{}' is neither `all-linear` nor a list of module names",
                    echo(word)
                ),
            ))
        }
        UncheckedNames::Names(list) => {
            LoraTargets::Names(distinct_names("lora.target_modules", list)?)
        }
    };
    let base_weights = match raw.base_weights {
        None => BaseWeights::Same,
        Some(name) => BaseWeights::parse(name).ok_or_else(|| {
            SetupError::new(
                "lora.base_weights",
                format!(
                    "unknown '{}' (known: same, int8, nf4, gptq_int4, awq_int4)",
                    echo(name)
                ),
            )
        })?,
    };
    let base_weights = match (base_weights, raw.group_size) {
        (base, None) => base,
        (_, Some(g)) if !(1..=MAX_GROUP_SIZE).contains(&g) => {
            return Err(SetupError::new(
                "lora.group_size",
                format!("must be between 1 and {MAX_GROUP_SIZE}, got {g}"),
            ))
        }
        (BaseWeights::Gptq { .. }, Some(group_size)) => BaseWeights::Gptq { group_size },
        (BaseWeights::Awq { .. }, Some(group_size)) => BaseWeights::Awq { group_size },
        (base, Some(_)) => {
            return Err(SetupError::new(
                "lora.group_size",
                format!(
                    "applies to gptq_int4 and awq_int4 bases, not {}",
                    base.as_str()
                ),
            ))
        }
    };
    let modules_to_save = match raw.modules_to_save {
        None => Vec::new(),
        Some(list) => distinct_names("lora.modules_to_save", list)?,
    };
    let expert_layout = match raw.expert_layout {
        None => ExpertLayout::default(),
        Some(name) => ExpertLayout::parse(name).ok_or_else(|| {
            SetupError::new(
                "lora.expert_layout",
                format!("unknown '{}' (known: per_expert_linear, fused)", echo(name)),
            )
        })?,
    };
    Ok(Some(Lora {
        rank: raw.rank,
        alpha,
        dropout,
        targets,
        base_weights,
        expert_layout,
        modules_to_save,
    }))
}

impl Setup {
    /// Reads the setup fields of a job of `batch_size` samples per step (per data-parallel
    /// replica, or for all of them: see docs/user/setups.md).
    pub fn parse(batch_size: u64, raw: &UncheckedSetup<'_>) -> Result<Setup, SetupError> {
        let precision = match raw.precision {
            None => Precision::default(),
            Some(name) => Precision::parse(name).ok_or_else(|| {
                SetupError::new(
                    "precision",
                    format!(
                        "unknown precision '{}' (known: {}; mixed16 = amp_fp16; Lightning's \
                         bf16-mixed, 16-mixed, bf16-true, 16-true, 32-true)",
                        echo(name),
                        Precision::NAMES
                    ),
                )
            })?,
        };
        let optimizer = match raw.optimizer {
            None => Optimizer::default(),
            Some(name) => Optimizer::parse(name).ok_or_else(|| {
                SetupError::new(
                    "optimizer",
                    format!(
                        "unknown optimizer '{}' (known: {})",
                        echo(name),
                        Optimizer::NAMES
                    ),
                )
            })?,
        };
        let implementation = match raw.optimizer_implementation {
            None => OptimizerImplementation::default(),
            Some(name) => OptimizerImplementation::parse(name).ok_or_else(|| {
                SetupError::new(
                    "optimizer_implementation",
                    format!("unknown '{}' (known: foreach, fused, for_loop)", echo(name)),
                )
            })?,
        };
        if precision == Precision::Fp16 && optimizer.is_8bit() {
            return Err(SetupError::new(
                "optimizer",
                format!(
                    "{} keeps 8-bit state of 32- or 16-bit (bf16) weights; pure fp16 weights \
                     need a loss-scaled fp32 master copy (amp_fp16)",
                    optimizer.as_str()
                ),
            ));
        }
        // bitsandbytes updates each tensor in one kernel of its own: fused, or left at the
        // default; it has no for-loop. torch's Adafactor has no fused kernel.
        if optimizer == Optimizer::Adafactor && implementation == OptimizerImplementation::Fused {
            return Err(SetupError::new(
                "optimizer_implementation",
                "torch.optim.Adafactor has no fused implementation (foreach or for_loop)",
            ));
        }
        if !optimizer.runs_as(implementation) {
            return Err(SetupError::new(
                "optimizer_implementation",
                format!(
                    "{} runs bitsandbytes' own fused kernels: give fused or leave it out",
                    optimizer.as_str()
                ),
            ));
        }
        let checkpointing = match raw.activation_checkpointing {
            None => Checkpointing::None,
            Some(UncheckedNames::Keyword(word)) => match word.to_ascii_lowercase().as_str() {
                "none" | "off" => Checkpointing::None,
                "full" | "on" => Checkpointing::Full,
                _ => {
                    return Err(SetupError::new(
                        "activation_checkpointing",
                        format!(
                            "'{}' is neither none, full nor a list of module names",
                            echo(word)
                        ),
                    ))
                }
            },
            Some(UncheckedNames::Names(list)) => {
                Checkpointing::Modules(names("activation_checkpointing", list)?)
            }
        };
        let parallelism = parallelism(raw.parallelism)?;
        let accumulation = match raw.gradient_accumulation_steps {
            None => 1,
            Some(k) if (1..=MAX_ACCUMULATION).contains(&k) => k,
            Some(k) => {
                return Err(SetupError::new(
                    "gradient_accumulation_steps",
                    format!("must be between 1 and {MAX_ACCUMULATION}, got {k}"),
                ))
            }
        };
        let micro_batch_size = micro_batch(
            batch_size,
            raw.micro_batch_size,
            accumulation,
            parallelism.data(),
        )?;
        let trainable = match (raw.trainable_params, raw.trainable_modules) {
            (None, None) => Trainable::All,
            (Some(count), None) => Trainable::Params(count),
            (None, Some(list)) => Trainable::Modules(distinct_names("trainable.modules", list)?),
            (Some(_), Some(_)) => {
                return Err(SetupError::new(
                    "trainable",
                    "give either params (a count) or modules (names), not both",
                ))
            }
        };
        let lora = lora(raw.lora)?;
        if lora.is_some() && matches!(trainable, Trainable::Params(_)) {
            return Err(SetupError::new(
                "trainable.params",
                "with lora the adapters train: name the other trainable modules \
                 (trainable.modules, e.g. a classifier head) instead of a count",
            ));
        }
        let offload = offload(raw.offload, parallelism)?;
        let fp32_master = match raw.master_weights.map(str::to_ascii_lowercase).as_deref() {
            None | Some("none") => false,
            Some("fp32") if precision.is_pure_16bit() => true,
            Some("fp32") => {
                return Err(SetupError::new(
                    "master_weights",
                    format!(
                        "an fp32 master copy goes with 16-bit weights (bf16 or fp16); {} keeps \
                         its weights in fp32 already",
                        precision.as_str()
                    ),
                ))
            }
            Some(other) => {
                return Err(SetupError::new(
                    "master_weights",
                    format!("unknown '{}' (known: none, fp32)", echo(other)),
                ))
            }
        };
        let reference = match raw.reference_model.map(str::to_ascii_lowercase).as_deref() {
            None | Some("none") => Reference::None,
            Some("copy") => Reference::Copy,
            Some("adapters_disabled") if lora.is_some() => Reference::AdaptersDisabled,
            Some("adapters_disabled") => {
                return Err(SetupError::new(
                    "reference_model",
                    "adapters_disabled needs lora (the reference is the base without them)",
                ))
            }
            Some(other) => {
                return Err(SetupError::new(
                    "reference_model",
                    format!(
                        "unknown '{}' (known: none, copy, adapters_disabled)",
                        echo(other)
                    ),
                ))
            }
        };
        let zero = zero(raw.zero, parallelism)?;
        Ok(Setup {
            precision,
            optimizer,
            implementation,
            checkpointing,
            micro_batch_size,
            accumulation,
            trainable,
            lora,
            parallelism,
            offload,
            fp32_master,
            reference,
            zero,
        })
    }
}

/// What is offloaded. Parameters go with their gradients and optimizer state (as FSDP's
/// `CPUOffload(offload_params=True)` and ZeRO-3's `offload_param` do), and only where the
/// weights are sharded by units (`fsdp`, `zero3`; one GPU may run ZeRO-3 alone).
fn offload(raw: Option<UncheckedOffload>, parallelism: Parallelism) -> Result<Offload, SetupError> {
    let Some(raw) = raw else {
        return Ok(Offload::default());
    };
    let parameters = raw.parameters.unwrap_or(false);
    if parameters {
        if raw.gradients == Some(false) || raw.optimizer_state == Some(false) {
            return Err(SetupError::new(
                "offload.parameters",
                "offloaded parameters take their gradients and optimizer state with them \
                 (FSDP CPUOffload, ZeRO-3 offload_param): leave those out or true",
            ));
        }
        if !matches!(parallelism.strategy, Strategy::Fsdp | Strategy::Zero3) {
            return Err(SetupError::new(
                "offload.parameters",
                "parameters are offloaded unit by unit by FSDP or ZeRO-3: set \
                 parallelism.strategy to fsdp or zero3 (world_size 1 is allowed)",
            ));
        }
    }
    Ok(Offload {
        optimizer_state: parameters || raw.optimizer_state.unwrap_or(false),
        gradients: parameters || raw.gradients.unwrap_or(false),
        parameters,
    })
}

/// ZeRO's buffer settings: given ones in range, the rest DeepSpeed's defaults; only under a
/// ZeRO strategy (nothing else reads them).
fn zero(raw: Option<UncheckedZero>, parallelism: Parallelism) -> Result<ZeroBuffers, SetupError> {
    let defaults = ZeroBuffers::default();
    let Some(raw) = raw else {
        return Ok(defaults);
    };
    if !matches!(
        parallelism.strategy,
        Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3
    ) {
        return Err(SetupError::new(
            "zero",
            "DeepSpeed ZeRO's buffers go with parallelism.strategy zero1, zero2 or zero3",
        ));
    }
    // A bucket holds at least one element; the other settings may be 0 (no prefetch, no
    // reuse, nothing persistent).
    let read = |field: &str, given: Option<u64>, default: u64, least: u64| match given {
        None => Ok(default),
        Some(n) if (least..=MAX_ZERO_ELEMENTS).contains(&n) => Ok(n),
        Some(n) => Err(SetupError::new(
            format!("zero.{field}"),
            format!("must be between {least} and {MAX_ZERO_ELEMENTS} elements, got {n}"),
        )),
    };
    Ok(ZeroBuffers {
        reduce_bucket: read(
            "reduce_bucket_size",
            raw.reduce_bucket_size,
            defaults.reduce_bucket,
            1,
        )?,
        prefetch_bucket: read(
            "prefetch_bucket_size",
            raw.prefetch_bucket_size,
            defaults.prefetch_bucket,
            0,
        )?,
        max_live_parameters: read(
            "max_live_parameters",
            raw.max_live_parameters,
            defaults.max_live_parameters,
            0,
        )?,
        max_reuse_distance: read(
            "max_reuse_distance",
            raw.max_reuse_distance,
            defaults.max_reuse_distance,
            0,
        )?,
        persistence_threshold: read(
            "param_persistence_threshold",
            raw.param_persistence_threshold,
            defaults.persistence_threshold,
            0,
        )?,
        sub_group: read("sub_group_size", raw.sub_group_size, defaults.sub_group, 1)?,
    })
}

/// The micro-batch: given, or `batch_size / accumulation` (and divided by the data-parallel
/// degree when `batch_size` is the global batch). A given one must make up the batch.
fn micro_batch(
    batch_size: u64,
    given: Option<u64>,
    accumulation: u64,
    data: u64,
) -> Result<u64, SetupError> {
    match given {
        Some(0) => Err(SetupError::new(
            "micro_batch_size",
            "must be at least 1, got 0",
        )),
        Some(micro) if micro > batch_size => Err(SetupError::new(
            "micro_batch_size",
            format!("{micro} is larger than batch_size ({batch_size})"),
        )),
        Some(micro) => {
            let per_replica = micro.saturating_mul(accumulation);
            if batch_size == per_replica || batch_size == per_replica.saturating_mul(data) {
                Ok(micro)
            } else {
                Err(SetupError::new(
                    "micro_batch_size",
                    format!(
                        "batch_size {batch_size} is neither micro_batch_size x \
                         gradient_accumulation_steps ({micro} x {accumulation}) nor that x the \
                         {data} data-parallel ranks"
                    ),
                ))
            }
        }
        None if !batch_size.is_multiple_of(accumulation) => Err(SetupError::new(
            "gradient_accumulation_steps",
            format!("{accumulation} micro-batches do not divide batch_size {batch_size}"),
        )),
        None => Ok(batch_size / accumulation),
    }
}

impl fmt::Display for Precision {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl fmt::Display for Strategy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What the training loop does for the loss over the vocabulary: what it keeps for backward
/// and what backward starts with.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LossImplementation {
    /// Hugging Face transformers' causal-LM loss (`loss_utils`): the logits upcast to fp32,
    /// a shifted contiguous copy, cross-entropy over all of them at once; backward starts with
    /// the fp32 gradients of the whole logits.
    #[default]
    UpcastFp32,
    /// The cross-entropy taken chunk by chunk of tokens (litgpt's `chunked_cross_entropy`,
    /// torchtune's `CEWithChunkedOutputLoss`): each chunk's log-softmax is kept, but backward
    /// frees as it goes, so no whole-logits gradient is ever allocated.
    Chunked,
    /// The head and the loss fused (Liger's `FusedLinearCrossEntropy`, Apple's Cut
    /// Cross-Entropy): the logits never exist beyond one chunk.
    Fused,
    /// `F.cross_entropy` on the logits in their own dtype, not upcast (nanoGPT, a hand-written
    /// loop): under pure 16-bit precision the log-softmax and the gradients are 16-bit; under
    /// autocast or fp32 the op runs in fp32 anyway, as the upcast loss does.
    Native,
}

impl LossImplementation {
    pub const NAMES: &'static str = "upcast_fp32, chunked, fused, native";

    pub fn as_str(self) -> &'static str {
        match self {
            LossImplementation::UpcastFp32 => "upcast_fp32",
            LossImplementation::Chunked => "chunked",
            LossImplementation::Fused => "fused",
            LossImplementation::Native => "native",
        }
    }
}

#[cfg(test)]
mod tests;
