//! How a job is trained: precision, optimizer, activation checkpointing, accumulation, frozen
//! weights and adapters, and the GPU layout. Parsed from untrusted input into a [`Setup`] here;
//! what each choice does to memory lives in [`super::step`]. docs/user/setups.md is the contract.

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

/// Which parameters train; the rest are frozen (no gradient, no optimizer state).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub enum Trainable {
    #[default]
    All,
    Params(u64),
    Modules(Vec<String>),
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
    pub const ALL: [Reference; 3] = [
        Reference::None,
        Reference::Copy,
        Reference::AdaptersDisabled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Reference::None => "none",
            Reference::Copy => "copy",
            Reference::AdaptersDisabled => "adapters_disabled",
        }
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
                        values::known(&Precision::ALL, Precision::as_str)
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
                        values::known(&Optimizer::ALL, Optimizer::as_str)
                    ),
                )
            })?,
        };
        let implementation = match raw.optimizer_implementation {
            None => OptimizerImplementation::default(),
            Some(name) => OptimizerImplementation::parse(name).ok_or_else(|| {
                SetupError::new(
                    "optimizer_implementation",
                    format!(
                        "unknown '{}' (known: {})",
                        echo(name),
                        values::known(
                            &OptimizerImplementation::ALL,
                            OptimizerImplementation::as_str
                        )
                    ),
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
                    format!(
                        "unknown '{}' (known: {})",
                        echo(other),
                        MASTER_WEIGHTS.join(", ")
                    ),
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

/// What `master_weights` takes: no copy beyond the weights, or an fp32 master copy of 16-bit
/// weights.
pub const MASTER_WEIGHTS: [&str; 2] = ["none", "fp32"];

/// Each setup field with named values (a dotted path for a nested one) -> its canonical names,
/// in the order the docs list them: the setup's part of `gpucast vocabulary`
/// (`crate::api::vocabulary`). A field with named values adds its line here, beside its parse.
pub fn named_values() -> Vec<(&'static str, Vec<&'static str>)> {
    vec![
        ("master_weights", MASTER_WEIGHTS.to_vec()),
        ("precision", value_names(&Precision::ALL, Precision::as_str)),
        ("optimizer", value_names(&Optimizer::ALL, Optimizer::as_str)),
        (
            "optimizer_implementation",
            value_names(
                &OptimizerImplementation::ALL,
                OptimizerImplementation::as_str,
            ),
        ),
        ("activation_checkpointing", Checkpointing::KEYWORDS.to_vec()),
        (
            "loss_implementation",
            value_names(&LossImplementation::ALL, LossImplementation::as_str),
        ),
        (
            "reference_model",
            value_names(&Reference::ALL, Reference::as_str),
        ),
        (
            "parallelism.strategy",
            value_names(&Strategy::ALL, Strategy::as_str),
        ),
        (
            "lora.base_weights",
            value_names(&BaseWeights::ALL, BaseWeights::as_str),
        ),
        (
            "lora.expert_layout",
            value_names(&ExpertLayout::ALL, ExpertLayout::as_str),
        ),
    ]
}

mod lora;
mod parallelism;
mod values;

pub use lora::*;
pub use parallelism::*;
pub use values::*;

#[cfg(test)]
mod tests;
