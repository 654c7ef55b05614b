//! What a simulation of the job's training step (describe's) says, as the job carries it.

/// The tensors autograd keeps for backward in one training forward pass, as `describe` traces
/// them on the meta device: `per_sample_bytes x batch + fixed_bytes`. Where a job has them they
/// are the best single predictor of its activation memory (docs/design/models.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SavedTensors {
    pub per_sample_bytes: u64,
    pub fixed_bytes: u64,
}

impl SavedTensors {
    /// Bytes kept for backward at `batch_size`.
    pub fn bytes_at(self, batch_size: u64) -> f64 {
        self.per_sample_bytes as f64 * batch_size as f64 + self.fixed_bytes as f64
    }
}

/// Allocated bytes by category at the allocated peak of a simulated training step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SimulatedCategories {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    /// Tensors kept for backward (and the live forward outputs) at the peak.
    pub activations: u64,
    /// Everything else live at the peak: workspaces, intermediate results of the step.
    pub temporaries: u64,
}

impl SimulatedCategories {
    /// The categories with their wire names, in the order of the contract.
    pub fn named(self) -> [(&'static str, u64); 5] {
        [
            ("parameters", self.parameters),
            ("gradients", self.gradients),
            ("optimizer_state", self.optimizer_state),
            ("activations", self.activations),
            ("temporaries", self.temporaries),
        ]
    }

    /// Their sum; u128 so that five counts of up to 2^44 cannot overflow.
    pub(super) fn total(self) -> u128 {
        self.named()
            .iter()
            .map(|&(_, bytes)| u128::from(bytes))
            .sum()
    }
}

/// What `gpucast_describe`'s whole-training-step simulation (fake tensors replayed through a
/// model of PyTorch's CUDA caching allocator) says of the job at its batch size. Validated:
/// allocated <= min_capacity <= reserved, and the categories sum exactly to the allocated peak.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Simulation {
    /// The allocator's allocated peak in the second (steady-state) training step.
    pub allocated_peak_bytes: u64,
    /// Its reserved (segment) peak with unlimited memory.
    pub reserved_peak_bytes: u64,
    /// The smallest allocator capacity on which the step runs: the allocator frees its cached
    /// segments and retries before it fails, so a card with this much usable memory suffices.
    pub min_capacity_bytes: u64,
    pub breakdown_at_peak: SimulatedCategories,
    /// The attention kernel the simulation assumed (informational).
    pub attention: Option<String>,
    /// True when the figures were interpolated from two other batch sizes.
    pub interpolated: bool,
    /// Parameters that trained in the simulated step, when it says.
    pub trainable_params: Option<u64>,
    /// A paged optimizer's state, outside the allocator's peaks.
    pub paged_optimizer_state_bytes: u64,
}

/// A simulation as it arrives, before validation against itself and its job.
#[derive(Debug, Clone, Default)]
pub struct UncheckedSimulation<'a> {
    pub batch_size: u64,
    pub optimizer: Option<&'a str>,
    pub precision: Option<&'a str>,
    pub allocated_peak_bytes: u64,
    pub reserved_peak_bytes: u64,
    pub min_capacity_bytes: u64,
    pub breakdown_at_peak: SimulatedCategories,
    pub attention: Option<&'a str>,
    pub interpolated: bool,
    /// `none`, `full` or `modules`: the checkpointing the simulation ran.
    pub activation_checkpointing: Option<&'a str>,
    pub gradient_accumulation_steps: Option<u64>,
    pub optimizer_implementation: Option<&'a str>,
    pub trainable_params: Option<u64>,
    pub paged_optimizer_state_bytes: Option<u64>,
}
