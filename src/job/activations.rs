//! What a training step keeps of a model whose structure is known, counted tensor by tensor:
//! the job carries it (`validated`), the assumed alternatives re-count it (`assumed`), physics
//! reads it.

use super::setup::LossImplementation;

/// The activations of a model whose structure is known (built from its configuration,
/// [`crate::parsers::transformer`]), per sample, bytes at the job's precision: what the step keeps
/// instead of the traced saved tensors scaled by a precision's share.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KnownActivations {
    /// Kept outside the repeated blocks (embeddings, final norm, head, loss).
    pub outside: f64,
    /// Kept by one repeated block (their mean).
    pub per_block: f64,
    pub blocks: u64,
    /// A block's input (what a checkpointed block keeps).
    pub block_input: f64,
    /// What backward starts with beside them (the loss's gradients).
    pub backward_temporaries: f64,
    /// Of `outside`, what the loss keeps (freed once backward has passed it).
    pub loss: f64,
    /// Bytes kept whatever the micro-batch (autocast's 16-bit weight copies).
    pub fixed: f64,
    /// How the loss over the vocabulary was counted.
    pub loss_implementation: LossImplementation,
}
