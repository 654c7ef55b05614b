//! The job: what is trained (validated layers, a model's names and blocks, a simulation) and
//! how (the setup), how much of it a figure rests on, and what is asked of the answer
//! (confidence, memory classes). Parsed at the edge from untrusted input; no HTTP, no ONNX, no
//! physics here.

pub mod activations;
pub mod assumed;
pub mod detail;
pub mod matched;
pub mod memory;
pub mod names;
pub mod setup;
pub mod validated;

pub use activations::KnownActivations;
pub use assumed::{Alternative, Assumption};
pub use detail::{Detail, Group};
pub use memory::{Confidence, MemoryClass, MemoryClasses, MemoryFraction, ResidualQuantiles};
pub use names::LayerDetail;
pub use setup::LossImplementation;
pub use setup::{Setup, SetupError, SetupFamily, UncheckedSetup};
pub use validated::{
    Family, Job, JobError, Layer, LayerKind, Optimizer, Precision, SavedTensors,
    SimulatedCategories, Simulation, UncheckedLayer, UncheckedSimulation,
};

/// At most 64 characters of untrusted text (trimmed), for an error message, marked with `…`
/// when cut: a caller's name or path may be huge.
pub fn echo(untrusted: &str) -> String {
    const MAX_CHARS: usize = 64;
    let trimmed = untrusted.trim();
    let mut out: String = trimmed.chars().take(MAX_CHARS).collect();
    if trimmed.chars().nth(MAX_CHARS).is_some() {
        out.push('…');
    }
    out
}
