//! The domain: validated jobs, their features and memory classes. No HTTP and no ONNX here.

pub mod analytic;
pub mod features;
pub mod job;
pub mod memory;
pub mod perf;
pub mod physics;
pub mod saved;
pub mod setup;
pub mod step;
pub mod summary;
pub mod transformer;
pub mod uncertainty;
pub mod vocabulary;

pub use job::{
    Family, Job, JobError, Layer, LayerKind, Optimizer, Precision, SavedTensors,
    SimulatedCategories, Simulation, UncheckedLayer, UncheckedSimulation,
};
pub use memory::{Confidence, MemoryClass, MemoryClasses, MemoryFraction, ResidualQuantiles};
pub use setup::{Setup, SetupError, UncheckedSetup};
pub use step::LayerDetail;

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
