//! Validated training-job descriptions. Untrusted input becomes a [`Job`] here, at the edge;
//! nothing downstream can see an invalid one.

use std::fmt;

/// Largest layer list accepted. Real models stay far below (timm's largest ~2,000 modules);
/// beyond this a request is absurd and would only burn CPU.
pub const MAX_LAYERS: usize = 4096;
/// Largest batch size accepted.
pub const MAX_BATCH_SIZE: u64 = 1 << 20;
/// Largest per-layer parameter count or output size accepted (10^13: far beyond any model).
pub const MAX_LAYER_QUANTITY: u64 = 10_000_000_000_000;
/// Largest traced saved-tensor byte count accepted (16 TiB), so that sums stay exact in f64.
pub const MAX_SAVED_BYTES: u64 = 1 << 44;

/// What a layer does, in the canonical vocabulary shared with the training pipeline and the
/// `describe` tool (see docs/models.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum LayerKind {
    Linear,
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose2d,
    BatchNorm,
    LayerNorm,
    GroupNorm,
    InstanceNorm,
    RmsNorm,
    Dropout,
    DropPath,
    Relu,
    Relu6,
    LeakyRelu,
    Prelu,
    Elu,
    Selu,
    Gelu,
    Silu,
    Mish,
    Softplus,
    Tanh,
    Sigmoid,
    Hardswish,
    Hardsigmoid,
    Softmax,
    Identity,
    MaxPool,
    AvgPool,
    AdaptiveAvgPool,
    AdaptiveMaxPool,
    Embedding,
    Attention,
    Flatten,
    Upsample,
    Other,
}

impl LayerKind {
    pub const ALL: [LayerKind; 37] = [
        LayerKind::Linear,
        LayerKind::Conv1d,
        LayerKind::Conv2d,
        LayerKind::Conv3d,
        LayerKind::ConvTranspose2d,
        LayerKind::BatchNorm,
        LayerKind::LayerNorm,
        LayerKind::GroupNorm,
        LayerKind::InstanceNorm,
        LayerKind::RmsNorm,
        LayerKind::Dropout,
        LayerKind::DropPath,
        LayerKind::Relu,
        LayerKind::Relu6,
        LayerKind::LeakyRelu,
        LayerKind::Prelu,
        LayerKind::Elu,
        LayerKind::Selu,
        LayerKind::Gelu,
        LayerKind::Silu,
        LayerKind::Mish,
        LayerKind::Softplus,
        LayerKind::Tanh,
        LayerKind::Sigmoid,
        LayerKind::Hardswish,
        LayerKind::Hardsigmoid,
        LayerKind::Softmax,
        LayerKind::Identity,
        LayerKind::MaxPool,
        LayerKind::AvgPool,
        LayerKind::AdaptiveAvgPool,
        LayerKind::AdaptiveMaxPool,
        LayerKind::Embedding,
        LayerKind::Attention,
        LayerKind::Flatten,
        LayerKind::Upsample,
        LayerKind::Other,
    ];

    /// The canonical name, as used in the manifest's vocabularies.
    pub fn as_str(self) -> &'static str {
        match self {
            LayerKind::Linear => "linear",
            LayerKind::Conv1d => "conv1d",
            LayerKind::Conv2d => "conv2d",
            LayerKind::Conv3d => "conv3d",
            LayerKind::ConvTranspose2d => "conv_transpose2d",
            LayerKind::BatchNorm => "batch_norm",
            LayerKind::LayerNorm => "layer_norm",
            LayerKind::GroupNorm => "group_norm",
            LayerKind::InstanceNorm => "instance_norm",
            LayerKind::RmsNorm => "rms_norm",
            LayerKind::Dropout => "dropout",
            LayerKind::DropPath => "drop_path",
            LayerKind::Relu => "relu",
            LayerKind::Relu6 => "relu6",
            LayerKind::LeakyRelu => "leaky_relu",
            LayerKind::Prelu => "prelu",
            LayerKind::Elu => "elu",
            LayerKind::Selu => "selu",
            LayerKind::Gelu => "gelu",
            LayerKind::Silu => "silu",
            LayerKind::Mish => "mish",
            LayerKind::Softplus => "softplus",
            LayerKind::Tanh => "tanh",
            LayerKind::Sigmoid => "sigmoid",
            LayerKind::Hardswish => "hardswish",
            LayerKind::Hardsigmoid => "hardsigmoid",
            LayerKind::Softmax => "softmax",
            LayerKind::Identity => "identity",
            LayerKind::MaxPool => "max_pool",
            LayerKind::AvgPool => "avg_pool",
            LayerKind::AdaptiveAvgPool => "adaptive_avg_pool",
            LayerKind::AdaptiveMaxPool => "adaptive_max_pool",
            LayerKind::Embedding => "embedding",
            LayerKind::Attention => "attention",
            LayerKind::Flatten => "flatten",
            LayerKind::Upsample => "upsample",
            LayerKind::Other => "other",
        }
    }

    /// Parses a kind leniently: case-insensitive, ignoring `_`, `-` and spaces, so that the
    /// spellings of the GPUMemNet data (`batch_normalization`, `LeakyReLU`) and of PyTorch class
    /// names (`BatchNorm1d`, `Conv2d`) are accepted.
    pub fn parse(raw: &str) -> Option<LayerKind> {
        let key: String = raw
            .chars()
            .filter(|c| !matches!(c, '_' | '-' | ' '))
            .flat_map(char::to_lowercase)
            .collect();
        let kind = match key.as_str() {
            "linear" | "dense" => LayerKind::Linear,
            "conv1d" => LayerKind::Conv1d,
            "conv2d" | "conv" => LayerKind::Conv2d,
            "conv3d" => LayerKind::Conv3d,
            "convtranspose2d" => LayerKind::ConvTranspose2d,
            "batchnorm" | "batchnormalization" | "batchnorm1d" | "batchnorm2d" | "batchnorm3d"
            | "bn" => LayerKind::BatchNorm,
            "layernorm" => LayerKind::LayerNorm,
            "groupnorm" => LayerKind::GroupNorm,
            "instancenorm" | "instancenorm2d" => LayerKind::InstanceNorm,
            "rmsnorm" => LayerKind::RmsNorm,
            "dropout" => LayerKind::Dropout,
            "droppath" => LayerKind::DropPath,
            "relu" => LayerKind::Relu,
            "relu6" => LayerKind::Relu6,
            "leakyrelu" => LayerKind::LeakyRelu,
            "prelu" => LayerKind::Prelu,
            "elu" => LayerKind::Elu,
            "selu" => LayerKind::Selu,
            "gelu" => LayerKind::Gelu,
            "silu" | "swish" => LayerKind::Silu,
            "mish" => LayerKind::Mish,
            "softplus" => LayerKind::Softplus,
            "tanh" => LayerKind::Tanh,
            "sigmoid" => LayerKind::Sigmoid,
            "hardswish" => LayerKind::Hardswish,
            "hardsigmoid" => LayerKind::Hardsigmoid,
            "softmax" => LayerKind::Softmax,
            "identity" => LayerKind::Identity,
            "maxpool" | "maxpool2d" => LayerKind::MaxPool,
            "avgpool" | "avgpool2d" => LayerKind::AvgPool,
            "adaptiveavgpool" | "adaptiveavgpool2d" => LayerKind::AdaptiveAvgPool,
            "adaptivemaxpool" | "adaptivemaxpool2d" => LayerKind::AdaptiveMaxPool,
            "embedding" => LayerKind::Embedding,
            "attention" | "multiheadattention" => LayerKind::Attention,
            "flatten" => LayerKind::Flatten,
            "upsample" => LayerKind::Upsample,
            "other" => LayerKind::Other,
            _ => return None,
        };
        Some(kind)
    }

    /// Element-wise nonlinearities (the GPUMemNet notion of "activation layer").
    pub fn is_activation(self) -> bool {
        matches!(
            self,
            LayerKind::Relu
                | LayerKind::Relu6
                | LayerKind::LeakyRelu
                | LayerKind::Prelu
                | LayerKind::Elu
                | LayerKind::Selu
                | LayerKind::Gelu
                | LayerKind::Silu
                | LayerKind::Mish
                | LayerKind::Softplus
                | LayerKind::Tanh
                | LayerKind::Sigmoid
                | LayerKind::Hardswish
                | LayerKind::Hardsigmoid
                | LayerKind::Softmax
                | LayerKind::Identity
        )
    }

    pub fn is_normalisation(self) -> bool {
        matches!(
            self,
            LayerKind::BatchNorm | LayerKind::LayerNorm | LayerKind::GroupNorm | LayerKind::InstanceNorm | LayerKind::RmsNorm
        )
    }

    pub fn is_convolution(self) -> bool {
        matches!(
            self,
            LayerKind::Conv1d | LayerKind::Conv2d | LayerKind::Conv3d | LayerKind::ConvTranspose2d
        )
    }
}

impl fmt::Display for LayerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The model family, which selects the estimators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Family {
    Mlp,
    Cnn,
    Transformer,
}

impl Family {
    pub fn as_str(self) -> &'static str {
        match self {
            Family::Mlp => "mlp",
            Family::Cnn => "cnn",
            Family::Transformer => "transformer",
        }
    }

    pub fn parse(raw: &str) -> Option<Family> {
        match raw {
            "mlp" => Some(Family::Mlp),
            "cnn" => Some(Family::Cnn),
            "transformer" => Some(Family::Transformer),
            _ => None,
        }
    }

    /// Attention blocks make a transformer; otherwise convolutions make a CNN.
    pub fn infer(layers: &[Layer]) -> Family {
        if layers.iter().any(|l| l.kind == LayerKind::Attention) {
            Family::Transformer
        } else if layers.iter().any(|l| l.kind.is_convolution()) {
            Family::Cnn
        } else {
            Family::Mlp
        }
    }
}

impl fmt::Display for Family {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layer {
    pub kind: LayerKind,
    /// Elements of the layer's output for one sample.
    pub output_size: u64,
    /// Parameters the layer owns.
    pub params: u64,
}

/// A layer as it arrives, before validation.
#[derive(Debug, Clone)]
pub struct UncheckedLayer<'a> {
    pub kind: &'a str,
    pub output_size: u64,
    pub params: u64,
}

/// The optimizer, which decides how much state is kept per parameter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Optimizer {
    Sgd,
    Momentum,
    #[default]
    Adam,
    AdamW,
}

impl Optimizer {
    pub fn parse(raw: &str) -> Option<Optimizer> {
        match raw.to_ascii_lowercase().as_str() {
            "sgd" => Some(Optimizer::Sgd),
            "momentum" | "sgd_momentum" | "nesterov" => Some(Optimizer::Momentum),
            "adam" => Some(Optimizer::Adam),
            "adamw" => Some(Optimizer::AdamW),
            _ => None,
        }
    }

    /// Bytes of optimizer state per (fp32) parameter.
    pub fn state_bytes_per_param(self) -> f64 {
        match self {
            Optimizer::Sgd => 0.0,
            Optimizer::Momentum => 4.0,
            Optimizer::Adam | Optimizer::AdamW => 8.0,
        }
    }
}

/// Numeric precision of training.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Precision {
    #[default]
    Fp32,
    /// fp16 or bf16 autocast with fp32 master weights.
    Mixed16,
}

impl Precision {
    pub fn parse(raw: &str) -> Option<Precision> {
        match raw.to_ascii_lowercase().as_str() {
            "fp32" | "float32" => Some(Precision::Fp32),
            "mixed16" | "fp16" | "bf16" | "float16" | "bfloat16" | "amp" => Some(Precision::Mixed16),
            _ => None,
        }
    }
}

/// The tensors autograd keeps for backward in one training forward pass, as `describe` traces
/// them on the meta device: `per_sample_bytes x batch + fixed_bytes`. Where a job has them they
/// are the best single predictor of its activation memory (docs/models.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedTensors {
    pub per_sample_bytes: u64,
    pub fixed_bytes: u64,
}

impl SavedTensors {
    /// Bytes kept for backward at `batch_size`.
    pub fn bytes_at(self, batch_size: u64) -> f64 {
        self.per_sample_bytes as f64 * batch_size as f64 + self.fixed_bytes as f64
    }
}

/// A validated job description.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    family: Family,
    batch_size: u64,
    layers: Vec<Layer>,
    optimizer: Optimizer,
    precision: Precision,
    input_shape: Option<Vec<u64>>,
    saved_tensors: Option<SavedTensors>,
}

/// Why a job description was rejected. Each variant names the offending field.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum JobError {
    #[error("batch_size: must be between 1 and {MAX_BATCH_SIZE}, got {0}")]
    BatchSize(u64),
    #[error("layers: must not be empty")]
    NoLayers,
    #[error("layers: at most {MAX_LAYERS} layers are accepted, got {0}")]
    TooManyLayers(usize),
    #[error("layers[{index}].kind: unknown layer kind '{kind}' (known kinds: {known})")]
    UnknownKind { index: usize, kind: String, known: String },
    #[error("layers[{index}].{field}: must be at most {MAX_LAYER_QUANTITY}, got {value}")]
    QuantityTooLarge { index: usize, field: &'static str, value: u64 },
    #[error("family: unknown family '{0}' (known: mlp, cnn, transformer)")]
    UnknownFamily(String),
    #[error("optimizer: unknown optimizer '{0}' (known: sgd, momentum, adam, adamw)")]
    UnknownOptimizer(String),
    #[error("precision: unknown precision '{0}' (known: fp32, mixed16, fp16, bf16)")]
    UnknownPrecision(String),
    #[error("input_shape: must hold 1 to 5 positive dimensions of at most 1,000,000")]
    InputShape,
    #[error("saved_tensors.{field}: must be at most {MAX_SAVED_BYTES}, got {value}")]
    SavedBytesTooLarge { field: &'static str, value: u64 },
}

impl Job {
    /// Validates an untrusted description. `family` is inferred from the layers when absent.
    pub fn parse<'a>(
        family: Option<&str>,
        batch_size: u64,
        layers: impl ExactSizeIterator<Item = UncheckedLayer<'a>>,
    ) -> Result<Job, JobError> {
        if batch_size == 0 || batch_size > MAX_BATCH_SIZE {
            return Err(JobError::BatchSize(batch_size));
        }
        if layers.len() == 0 {
            return Err(JobError::NoLayers);
        }
        if layers.len() > MAX_LAYERS {
            return Err(JobError::TooManyLayers(layers.len()));
        }
        let layers = layers
            .enumerate()
            .map(|(index, raw)| parse_layer(index, raw))
            .collect::<Result<Vec<_>, _>>()?;
        let family = match family {
            Some(name) => Family::parse(name).ok_or_else(|| JobError::UnknownFamily(name.into()))?,
            None => Family::infer(&layers),
        };
        Ok(Job {
            family,
            batch_size,
            layers,
            optimizer: Optimizer::default(),
            precision: Precision::default(),
            input_shape: None,
            saved_tensors: None,
        })
    }

    /// Sets how the job trains; `None` keeps the defaults (Adam, fp32).
    pub fn with_training(mut self, optimizer: Option<&str>, precision: Option<&str>) -> Result<Job, JobError> {
        if let Some(raw) = optimizer {
            self.optimizer = Optimizer::parse(raw).ok_or_else(|| JobError::UnknownOptimizer(raw.chars().take(64).collect()))?;
        }
        if let Some(raw) = precision {
            self.precision = Precision::parse(raw).ok_or_else(|| JobError::UnknownPrecision(raw.chars().take(64).collect()))?;
        }
        Ok(self)
    }

    /// Sets the per-sample input shape (e.g. `[3, 224, 224]`).
    pub fn with_input_shape(mut self, shape: Option<&[u64]>) -> Result<Job, JobError> {
        if let Some(shape) = shape {
            if shape.is_empty() || shape.len() > 5 || shape.iter().any(|&d| d == 0 || d > 1_000_000) {
                return Err(JobError::InputShape);
            }
            self.input_shape = Some(shape.to_vec());
        }
        Ok(self)
    }

    /// Sets the traced saved tensors; each count at most `MAX_SAVED_BYTES` (16 TiB).
    pub fn with_saved_tensors(mut self, saved: Option<SavedTensors>) -> Result<Job, JobError> {
        if let Some(saved) = saved {
            for (field, value) in [("per_sample_bytes", saved.per_sample_bytes), ("fixed_bytes", saved.fixed_bytes)] {
                if value > MAX_SAVED_BYTES {
                    return Err(JobError::SavedBytesTooLarge { field, value });
                }
            }
            self.saved_tensors = Some(saved);
        }
        Ok(self)
    }

    pub fn saved_tensors(&self) -> Option<SavedTensors> {
        self.saved_tensors
    }

    pub fn optimizer(&self) -> Optimizer {
        self.optimizer
    }

    pub fn precision(&self) -> Precision {
        self.precision
    }

    pub fn input_shape(&self) -> Option<&[u64]> {
        self.input_shape.as_deref()
    }

    pub fn family(&self) -> Family {
        self.family
    }

    pub fn batch_size(&self) -> u64 {
        self.batch_size
    }

    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }
}

fn parse_layer(index: usize, raw: UncheckedLayer<'_>) -> Result<Layer, JobError> {
    let kind = LayerKind::parse(raw.kind).ok_or_else(|| JobError::UnknownKind {
        index,
        // Echo at most a short prefix: the kind is untrusted and may be huge.
        kind: raw.kind.chars().take(64).collect(),
        known: LayerKind::ALL.map(LayerKind::as_str).join(", "),
    })?;
    for (field, value) in [("output_size", raw.output_size), ("params", raw.params)] {
        if value > MAX_LAYER_QUANTITY {
            return Err(JobError::QuantityTooLarge { index, field, value });
        }
    }
    Ok(Layer { kind, output_size: raw.output_size, params: raw.params })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unchecked(kind: &str) -> UncheckedLayer<'_> {
        UncheckedLayer { kind, output_size: 10, params: 5 }
    }

    #[test]
    fn kinds_parse_from_gpumemnet_and_pytorch_spellings() {
        assert_eq!(LayerKind::parse("batch_normalization"), Some(LayerKind::BatchNorm));
        assert_eq!(LayerKind::parse("BatchNorm1d"), Some(LayerKind::BatchNorm));
        assert_eq!(LayerKind::parse("LeakyReLU"), Some(LayerKind::LeakyRelu));
        assert_eq!(LayerKind::parse("Softmax"), Some(LayerKind::Softmax));
        assert_eq!(LayerKind::parse("conv_transpose2d"), Some(LayerKind::ConvTranspose2d));
        assert_eq!(LayerKind::parse("lienar"), None);
    }

    #[test]
    fn every_canonical_name_parses_back_to_its_kind() {
        for kind in LayerKind::ALL {
            assert_eq!(LayerKind::parse(kind.as_str()), Some(kind), "{kind}");
        }
    }

    #[test]
    fn family_is_inferred_from_attention_then_convolution() {
        let job = |kinds: &[&str]| {
            Job::parse(None, 8, kinds.iter().map(|k| unchecked(k)).collect::<Vec<_>>().into_iter())
                .unwrap()
                .family()
        };
        assert_eq!(job(&["linear", "relu"]), Family::Mlp);
        assert_eq!(job(&["conv2d", "linear"]), Family::Cnn);
        assert_eq!(job(&["conv2d", "attention", "linear"]), Family::Transformer);
    }

    #[test]
    fn an_explicit_family_wins_over_inference() {
        let job = Job::parse(Some("cnn"), 8, vec![unchecked("linear")].into_iter()).unwrap();
        assert_eq!(job.family(), Family::Cnn);
    }

    #[test]
    fn invalid_jobs_are_rejected_with_the_offending_field() {
        let err = Job::parse(None, 0, vec![unchecked("linear")].into_iter()).unwrap_err();
        assert_eq!(err, JobError::BatchSize(0));
        let err = Job::parse(None, 8, Vec::new().into_iter()).unwrap_err();
        assert_eq!(err, JobError::NoLayers);
        let too_many = vec![unchecked("linear"); MAX_LAYERS + 1];
        assert_eq!(
            Job::parse(None, 8, too_many.into_iter()).unwrap_err(),
            JobError::TooManyLayers(MAX_LAYERS + 1)
        );
        let err = Job::parse(None, 8, vec![unchecked("linear"), unchecked("warp")].into_iter())
            .unwrap_err();
        assert!(err.to_string().starts_with("layers[1].kind: unknown layer kind 'warp'"), "{err}");
        let huge = UncheckedLayer { kind: "linear", output_size: 1, params: u64::MAX };
        let err = Job::parse(None, 8, vec![huge].into_iter()).unwrap_err();
        assert!(err.to_string().starts_with("layers[0].params"), "{err}");
        let err = Job::parse(Some("rnn"), 8, vec![unchecked("linear")].into_iter()).unwrap_err();
        assert_eq!(err, JobError::UnknownFamily("rnn".into()));
    }

    #[test]
    fn training_settings_default_to_adam_fp32_and_reject_unknown_names() {
        let job = Job::parse(None, 8, vec![unchecked("linear")].into_iter()).unwrap();
        assert_eq!((job.optimizer(), job.precision()), (Optimizer::Adam, Precision::Fp32));
        let job = job.with_training(Some("SGD"), Some("bf16")).unwrap();
        assert_eq!((job.optimizer(), job.precision()), (Optimizer::Sgd, Precision::Mixed16));
        assert_eq!(job.clone().with_training(Some("lion"), None).unwrap_err(), JobError::UnknownOptimizer("lion".into()));
        assert_eq!(job.clone().with_training(None, Some("int4")).unwrap_err(), JobError::UnknownPrecision("int4".into()));
        assert_eq!(job.clone().with_input_shape(Some(&[3, 0, 224])).unwrap_err(), JobError::InputShape);
        assert_eq!(job.with_input_shape(Some(&[3, 224, 224])).unwrap().input_shape(), Some(&[3, 224, 224][..]));
    }
}
