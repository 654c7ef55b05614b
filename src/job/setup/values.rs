//! The values a setup field takes: precision, optimizer and its implementation, checkpointing,
//! the loss over the vocabulary.

use std::fmt;

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

/// The name of each of `values`.
pub(crate) fn value_names<T: Copy>(values: &[T], name: fn(T) -> &'static str) -> Vec<&'static str> {
    values.iter().map(|&v| name(v)).collect()
}

/// Each name of `values`, separated by commas: what an error lists as known.
pub(crate) fn known<T: Copy>(values: &[T], name: fn(T) -> &'static str) -> String {
    value_names(values, name).join(", ")
}

impl Precision {
    /// Every precision, in the order the docs and the vocabulary list them.
    pub const ALL: [Precision; 6] = [
        Precision::Fp32,
        Precision::Tf32,
        Precision::AmpFp16,
        Precision::AmpBf16,
        Precision::Bf16,
        Precision::Fp16,
    ];

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
    /// Every optimizer, in the order the docs and the vocabulary list them.
    pub const ALL: [Optimizer; 9] = [
        Optimizer::Sgd,
        Optimizer::Momentum,
        Optimizer::Adam,
        Optimizer::AdamW,
        Optimizer::Adafactor,
        Optimizer::Adam8bit,
        Optimizer::AdamW8bit,
        Optimizer::PagedAdamW,
        Optimizer::PagedAdamW8bit,
    ];

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
    pub const ALL: [OptimizerImplementation; 3] = [
        OptimizerImplementation::Foreach,
        OptimizerImplementation::Fused,
        OptimizerImplementation::ForLoop,
    ];

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
    /// The keywords it takes beside module names.
    pub const KEYWORDS: [&'static str; 2] = ["none", "full"];

    pub fn as_str(&self) -> &'static str {
        match self {
            Checkpointing::None => "none",
            Checkpointing::Full => "full",
            Checkpointing::Modules(_) => "modules",
        }
    }
}

impl fmt::Display for Precision {
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
    pub const ALL: [LossImplementation; 4] = [
        LossImplementation::UpcastFp32,
        LossImplementation::Chunked,
        LossImplementation::Fused,
        LossImplementation::Native,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            LossImplementation::UpcastFp32 => "upcast_fp32",
            LossImplementation::Chunked => "chunked",
            LossImplementation::Fused => "fused",
            LossImplementation::Native => "native",
        }
    }
}
