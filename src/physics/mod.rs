//! The one physical model of a training step's GPU memory and time: the training step by
//! category at its two moments (`step`), the per-parameter and traced first principles
//! (`analytic`), saved tensors (`saved`), a linear layer's shape (`shapes`), the figure and floor of a job on a card (`peak`), the answer's breakdown
//! (`breakdown`), what an unstated field moves (`assumed`) and the roofline (`perf`). The
//! figure's doubt, its bound and fit are `crate::bound`'s.
//! "Physics first, learning second": a learned figure may correct these, never contradict them.

pub mod analytic;
pub mod assumed;
pub mod breakdown;
pub mod peak;
pub mod perf;
pub mod saved;
pub mod shapes;
pub mod step;

pub use breakdown::{Breakdown, BreakdownSource};
pub use peak::{on_most_loaded_gpu, Physics, Settled, SimulatedPeaks, REFERENCE_CAPACITY_MIB};
