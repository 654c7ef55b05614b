//! The domain: validated jobs, their features and memory classes. No HTTP and no ONNX here.

pub mod analytic;
pub mod features;
pub mod job;
pub mod memory;
pub mod physics;
pub mod saved;
pub mod summary;
pub mod vocabulary;

pub use job::{
    Family, Job, JobError, Layer, LayerKind, Optimizer, Precision, SavedTensors,
    SimulatedCategories, Simulation, UncheckedLayer, UncheckedSimulation,
};
pub use memory::{Confidence, MemoryClass, MemoryClasses, MemoryFraction, ResidualQuantiles};
