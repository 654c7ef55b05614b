//! A layer of a job: its kind, the model family, and the checks on what a caller sends.

use super::*;
use std::fmt;

/// What a layer does, in the canonical vocabulary shared with the training pipeline and the
/// `describe` tool (see docs/design/models.md).
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

    /// Every accepted spelling after normalisation (lower case, without `_`, `-` and spaces),
    /// with its kind: the GPUMemNet data's (`batchnormalization`), PyTorch class names'
    /// (`batchnorm2d`) and the canonical names'.
    pub const ALIASES: [(&'static str, LayerKind); 51] = [
        ("linear", LayerKind::Linear),
        ("dense", LayerKind::Linear),
        ("conv1d", LayerKind::Conv1d),
        ("conv2d", LayerKind::Conv2d),
        ("conv", LayerKind::Conv2d),
        ("conv3d", LayerKind::Conv3d),
        ("convtranspose2d", LayerKind::ConvTranspose2d),
        ("batchnorm", LayerKind::BatchNorm),
        ("batchnormalization", LayerKind::BatchNorm),
        ("batchnorm1d", LayerKind::BatchNorm),
        ("batchnorm2d", LayerKind::BatchNorm),
        ("batchnorm3d", LayerKind::BatchNorm),
        ("bn", LayerKind::BatchNorm),
        ("layernorm", LayerKind::LayerNorm),
        ("groupnorm", LayerKind::GroupNorm),
        ("instancenorm", LayerKind::InstanceNorm),
        ("instancenorm2d", LayerKind::InstanceNorm),
        ("rmsnorm", LayerKind::RmsNorm),
        ("dropout", LayerKind::Dropout),
        ("droppath", LayerKind::DropPath),
        ("relu", LayerKind::Relu),
        ("relu6", LayerKind::Relu6),
        ("leakyrelu", LayerKind::LeakyRelu),
        ("prelu", LayerKind::Prelu),
        ("elu", LayerKind::Elu),
        ("selu", LayerKind::Selu),
        ("gelu", LayerKind::Gelu),
        ("silu", LayerKind::Silu),
        ("swish", LayerKind::Silu),
        ("mish", LayerKind::Mish),
        ("softplus", LayerKind::Softplus),
        ("tanh", LayerKind::Tanh),
        ("sigmoid", LayerKind::Sigmoid),
        ("hardswish", LayerKind::Hardswish),
        ("hardsigmoid", LayerKind::Hardsigmoid),
        ("softmax", LayerKind::Softmax),
        ("identity", LayerKind::Identity),
        ("maxpool", LayerKind::MaxPool),
        ("maxpool2d", LayerKind::MaxPool),
        ("avgpool", LayerKind::AvgPool),
        ("avgpool2d", LayerKind::AvgPool),
        ("adaptiveavgpool", LayerKind::AdaptiveAvgPool),
        ("adaptiveavgpool2d", LayerKind::AdaptiveAvgPool),
        ("adaptivemaxpool", LayerKind::AdaptiveMaxPool),
        ("adaptivemaxpool2d", LayerKind::AdaptiveMaxPool),
        ("embedding", LayerKind::Embedding),
        ("attention", LayerKind::Attention),
        ("multiheadattention", LayerKind::Attention),
        ("flatten", LayerKind::Flatten),
        ("upsample", LayerKind::Upsample),
        ("other", LayerKind::Other),
    ];

    /// Parses a kind leniently: case-insensitive, ignoring `_`, `-` and spaces, so that the
    /// spellings of the GPUMemNet data (`batch_normalization`, `LeakyReLU`) and of PyTorch class
    /// names (`BatchNorm1d`, `Conv2d`) are accepted ([`LayerKind::ALIASES`]).
    pub fn parse(raw: &str) -> Option<LayerKind> {
        // The service's own names (what describe writes) need no normalising: a describe job
        // names hundreds of layers, twice each.
        if let Some(&kind) = LayerKind::ALL.iter().find(|k| k.as_str() == raw) {
            return Some(kind);
        }
        let key: String = raw
            .chars()
            .filter(|c| !matches!(c, '_' | '-' | ' '))
            .flat_map(char::to_lowercase)
            .collect();
        LayerKind::ALIASES
            .iter()
            .find(|(alias, _)| *alias == key)
            .map(|&(_, kind)| kind)
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
            LayerKind::BatchNorm
                | LayerKind::LayerNorm
                | LayerKind::GroupNorm
                | LayerKind::InstanceNorm
                | LayerKind::RmsNorm
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

pub(super) fn check_quantities(
    index: usize,
    output_size: u64,
    params: u64,
) -> Result<(), JobError> {
    for (field, value) in [("output_size", output_size), ("params", params)] {
        if value > MAX_LAYER_QUANTITY {
            return Err(JobError::QuantityTooLarge {
                index,
                field,
                value,
            });
        }
    }
    Ok(())
}

pub(super) fn parse_layer(index: usize, raw: UncheckedLayer<'_>) -> Result<Layer, JobError> {
    let kind = LayerKind::parse(raw.kind).ok_or_else(|| JobError::UnknownKind {
        index,
        kind: echo(raw.kind),
        known: LayerKind::ALL.map(LayerKind::as_str).join(", "),
    })?;
    check_quantities(index, raw.output_size, raw.params)?;
    Ok(Layer {
        kind,
        output_size: raw.output_size,
        params: raw.params,
    })
}
