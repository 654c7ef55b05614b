//! LoRA and its quantised base: the adapters, the base weights' format, a mixture of experts'
//! layout; parsed from the request.

use super::*;

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
    /// Every format (the 4-bit checkpoints at their default group size).
    pub const ALL: [BaseWeights; 5] = [
        BaseWeights::Same,
        BaseWeights::Int8,
        BaseWeights::Nf4,
        BaseWeights::Gptq {
            group_size: DEFAULT_GROUP_SIZE,
        },
        BaseWeights::Awq {
            group_size: DEFAULT_GROUP_SIZE,
        },
    ];

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
    pub const ALL: [ExpertLayout; 2] = [ExpertLayout::PerExpertLinear, ExpertLayout::Fused];

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

pub(super) fn lora(raw: Option<UncheckedLora<'_>>) -> Result<Option<Lora>, SetupError> {
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
                    "unknown '{}' (known: {})",
                    echo(name),
                    known(&BaseWeights::ALL, BaseWeights::as_str)
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
