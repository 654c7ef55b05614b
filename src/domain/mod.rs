//! The domain: validated jobs, their features and memory classes. No HTTP and no ONNX here.

pub mod analytic;
pub mod features;
pub mod job;
pub mod memory;
pub mod summary;

pub use job::{Family, Job, JobError, Layer, LayerKind, Optimizer, Precision, SavedTensors, UncheckedLayer};
pub use memory::{Confidence, MemoryClass, MemoryClasses, ResidualQuantiles};
