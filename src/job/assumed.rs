//! What a request leaves unsaid: the fields its answer assumes, each with the values it could
//! have taken instead, so that the answer can say how far each moves the figure and the bound
//! can widen with that doubt (`physics::assumed`).

use super::activations::KnownActivations;
use super::setup::{ExpertLayout, LossImplementation, OptimizerImplementation};

/// Another value an assumed field could have taken, as the job would hold it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Alternative {
    /// The model's activations counted with another loss over the vocabulary.
    Loss(LossImplementation, KnownActivations),
    OptimizerImplementation(OptimizerImplementation),
    /// A mixture of experts' experts held in another layout (whether a quantised base
    /// quantises them).
    ExpertLayout(ExpertLayout),
}

/// One field the request did not state: the value assumed and the others worth running (the
/// defaults assumed keep the most, so the value that keeps the least bounds the range).
#[derive(Debug, Clone, PartialEq)]
pub struct Assumption {
    pub field: &'static str,
    pub assumed: &'static str,
    pub alternatives: Vec<Alternative>,
}
