//! How much of a job a figure rests on: each level of detail has its own spread of the
//! uncertain terms ([`crate::bound`]).

use serde::{Deserialize, Serialize};

use super::{Family, SetupFamily};

/// What a figure's held-out errors are grouped by: how much of the job it rests on, its
/// setup's family and its model's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub detail: Detail,
    pub family: SetupFamily,
    pub model: Family,
}

/// How much of the job a figure rests on: each has its own spread of the uncertain terms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Detail {
    /// describe's whole-step simulation (the allocator replayed).
    Simulation,
    /// A simulation of a setup the learned corrections were not trained on (adapters,
    /// checkpointing, 16-bit, sharding...): physics alone, on published runs' spreads.
    SimulatedSetup,
    /// A model built from its Hugging Face configuration: activations counted tensor by tensor.
    Config,
    /// A layer list (traced, printed or bare) of such a setup: the analytic training step.
    SetupStep,
    /// A layer list with describe's traced saved tensors.
    Traced,
    /// A printed summary: layers and output shapes read from text, saved tensors derived.
    Printout,
    /// A layer list alone.
    Layers,
}

impl Detail {
    pub const ALL: [Detail; 7] = [
        Detail::Simulation,
        Detail::SimulatedSetup,
        Detail::Config,
        Detail::SetupStep,
        Detail::Traced,
        Detail::Printout,
        Detail::Layers,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Detail::Simulation => "simulation",
            Detail::SimulatedSetup => "simulated_setup",
            Detail::Config => "config",
            Detail::SetupStep => "setup_step",
            Detail::Traced => "traced",
            Detail::Printout => "printout",
            Detail::Layers => "layers",
        }
    }
}
