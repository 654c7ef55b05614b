//! What a request leaves unsaid: the fields its answer assumes, each with the values it could
//! have taken instead, so that the answer can say how far each moves the figure and the bound
//! can widen with that doubt (`physics::assumed`).

use super::activations::KnownActivations;
use super::setup::{
    Checkpointing, ExpertLayout, LossImplementation, Optimizer, OptimizerImplementation, Precision,
    ZeroBuffers,
};

/// Another value an assumed field could have taken, as the job would hold it.
#[derive(Debug, Clone, PartialEq)]
pub enum Alternative {
    /// The model's activations counted with another loss over the vocabulary.
    Loss(LossImplementation, KnownActivations),
    OptimizerImplementation(OptimizerImplementation),
    /// A mixture of experts' experts held in another layout (whether a quantised base
    /// quantises them).
    ExpertLayout(ExpertLayout),
    /// The job trained in another precision (the weights loaded in another dtype), with the
    /// model's activations at it where they are known from its config (`None`: counted from
    /// the layers).
    Precision(Precision, Option<KnownActivations>),
    Optimizer(Optimizer),
    Checkpointing(Checkpointing),
    /// The model's activations under another attention kernel (the N x N probabilities kept).
    Attention(KnownActivations),
    /// An fp32 master copy of what trains, stepped in fp32 (DeepSpeed's 16-bit modes).
    MasterWeights,
    /// DeepSpeed ZeRO's buffers at other sizes (Hugging Face's `"auto"` values).
    Zero(ZeroBuffers),
}

/// One field the request did not state: the value assumed and the others worth running (the
/// defaults assumed keep the most, so the value that keeps the least bounds the range).
#[derive(Debug, Clone, PartialEq)]
pub struct Assumption {
    pub field: &'static str,
    pub assumed: &'static str,
    pub alternatives: Vec<Alternative>,
}
