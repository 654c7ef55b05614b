//! Validated training-job descriptions. Untrusted input becomes a [`Job`] here, at the edge;
//! nothing downstream can see an invalid one.

use std::ops::Range;

use super::activations::KnownActivations;
use super::assumed::Assumption;
use super::detail::{Detail, Group};
use super::echo;
use super::matched::{self, NamedLayers};
use super::names::{self, LayerDetail};
use super::setup::{
    Checkpointing, LoraTargets, OptimizerImplementation, Setup, SetupError, Trainable,
    UncheckedSetup,
};
pub use super::setup::{Optimizer, Precision};

/// Largest layer list accepted. Real models stay far below (timm's largest ~2,000 modules);
/// beyond this a request is absurd and would only burn CPU.
pub const MAX_LAYERS: usize = 4096;
/// Largest batch size accepted.
pub const MAX_BATCH_SIZE: u64 = 1 << 20;
/// Largest per-layer parameter count or output size accepted (10^13: far beyond any model).
pub const MAX_LAYER_QUANTITY: u64 = 10_000_000_000_000;
/// Largest per-layer forward FLOPs per sample accepted (10^18: a 10^13-parameter layer over
/// 50,000 positions).
pub const MAX_LAYER_FLOPS: u64 = 1_000_000_000_000_000_000;
/// Largest traced saved-tensor byte count accepted (16 TiB), so that sums stay exact in f64.
pub const MAX_SAVED_BYTES: u64 = 1 << 44;

/// A simulation whose `trainable_params` reach this share of the layers' parameters trained
/// them all (tied weights are counted once by describe, twice in a layer list).
const ALL_TRAINED_SHARE: f64 = 0.5;

/// A validated job description.
#[derive(Debug, Clone, PartialEq)]
pub struct Job {
    family: Family,
    batch_size: u64,
    layers: Vec<Layer>,
    /// Names and linear shapes, index for index with `layers`; empty when none were given.
    details: Vec<LayerDetail>,
    /// The repeated blocks the names show ([`names::blocks`]), found once when the names are
    /// set: the setup's check, the step and the roofline all read them.
    blocks: Vec<Range<usize>>,
    setup: Setup,
    /// The layers the setup's module lists name ([`NamedLayers`]), matched once when the
    /// setup is set: the step and the roofline read them for every card.
    named: NamedLayers,
    input_shape: Option<Vec<u64>>,
    saved_tensors: Option<SavedTensors>,
    simulation: Option<Simulation>,
    /// The activations of a model built from its configuration (no learned estimator reads
    /// such a job: the analytic step answers it).
    known_activations: Option<KnownActivations>,
    /// The fields the request left unsaid that the step's figure depends on.
    assumptions: Vec<Assumption>,
    /// Read from a printed summary (layers and shapes from text, saved tensors derived).
    printed: bool,
}

/// Why a job description was rejected. Each variant names the offending field.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum JobError {
    #[error("batch_size: must be between 1 and {MAX_BATCH_SIZE}, got {0}")]
    BatchSize(u64),
    #[error("layers: must not be empty")]
    NoLayers,
    #[error("layers: at most {MAX_LAYERS} layers are accepted, got {0}")]
    TooManyLayers(usize),
    #[error("layers[{index}].kind: unknown layer kind '{kind}' (known kinds: {known})")]
    UnknownKind {
        index: usize,
        kind: String,
        known: String,
    },
    #[error("layers[{index}].{field}: must be at most {MAX_LAYER_QUANTITY}, got {value}")]
    QuantityTooLarge {
        index: usize,
        field: &'static str,
        value: u64,
    },
    #[error("layers[{index}].flops: must be at most {MAX_LAYER_FLOPS}, got {value}")]
    FlopsTooLarge { index: usize, value: u64 },
    #[error("family: unknown family '{0}' (known: mlp, cnn, transformer)")]
    UnknownFamily(String),
    #[error(transparent)]
    Setup(#[from] SetupError),
    #[error("input_shape: must hold 1 to 5 positive dimensions of at most 1,000,000")]
    InputShape,
    #[error("saved_tensors.{field}: must be at most {MAX_SAVED_BYTES}, got {value}")]
    SavedBytesTooLarge { field: &'static str, value: u64 },
    #[error("simulation.{field}: must be at most {MAX_SAVED_BYTES}, got {value}")]
    SimulatedBytesTooLarge { field: String, value: u64 },
    #[error("simulation.batch_size: the simulation is of batch size {simulated}, the job's batch_size is {job}")]
    SimulatedBatchSize { simulated: u64, job: u64 },
    #[error("simulation.optimizer: '{simulated}' is not the job's optimizer ({job})")]
    SimulatedOptimizer { simulated: String, job: String },
    #[error("simulation.precision: '{simulated}' is not the job's precision ({job})")]
    SimulatedPrecision { simulated: String, job: String },
    #[error("simulation.reserved_peak_bytes: must be at least allocated_peak_bytes ({allocated}), got {reserved}")]
    SimulatedReservedBelowAllocated { allocated: u64, reserved: u64 },
    #[error(
        "simulation.min_capacity_bytes: must lie between allocated_peak_bytes ({allocated}) and reserved_peak_bytes ({reserved}), got {min_capacity}"
    )]
    SimulatedMinCapacity {
        allocated: u64,
        reserved: u64,
        min_capacity: u64,
    },
    #[error("simulation.breakdown_at_peak: the categories sum to {sum} bytes, allocated_peak_bytes is {allocated}")]
    SimulatedBreakdownSum { sum: u128, allocated: u64 },
}

impl Job {
    /// Validates an untrusted description. `family` is inferred from the layers when absent.
    pub fn parse<'a>(
        family: Option<&str>,
        batch_size: u64,
        layers: impl ExactSizeIterator<Item = UncheckedLayer<'a>>,
    ) -> Result<Job, JobError> {
        check_shape(batch_size, layers.len())?;
        let layers = layers
            .enumerate()
            .map(|(index, raw)| parse_layer(index, raw))
            .collect::<Result<Vec<_>, _>>()?;
        Job::from_layers(family, batch_size, layers)
    }

    /// A job from layers whose kinds are already known (a parsed summary's); their sizes and
    /// count are still checked against the limits.
    pub fn from_layers(
        family: Option<&str>,
        batch_size: u64,
        layers: Vec<Layer>,
    ) -> Result<Job, JobError> {
        check_shape(batch_size, layers.len())?;
        for (index, layer) in layers.iter().enumerate() {
            check_quantities(index, layer.output_size, layer.params)?;
        }
        let family = match family {
            Some(name) => Family::parse(name).ok_or_else(|| JobError::UnknownFamily(echo(name)))?,
            None => Family::infer(&layers),
        };
        Ok(Job {
            family,
            batch_size,
            layers,
            details: Vec::new(),
            blocks: Vec::new(),
            setup: Setup::plain(batch_size),
            named: NamedLayers::default(),
            input_shape: None,
            saved_tensors: None,
            simulation: None,
            known_activations: None,
            assumptions: Vec::new(),
            printed: false,
        })
    }

    /// Sets the optimizer and precision alone (the rest of the setup plain).
    pub fn with_training(
        self,
        optimizer: Option<&str>,
        precision: Option<&str>,
    ) -> Result<Job, JobError> {
        self.with_setup(&UncheckedSetup {
            optimizer,
            precision,
            ..Default::default()
        })
    }

    /// Sets the layers' names and linear shapes (index for index; call before
    /// [`Job::with_setup`], whose module names are matched against them).
    pub fn with_layer_details(mut self, details: Vec<LayerDetail>) -> Result<Job, JobError> {
        if details.len() != self.layers.len() {
            return Err(JobError::Setup(SetupError::new(
                "layers",
                "names and shapes must be given for every layer",
            )));
        }
        for (index, detail) in details.iter().enumerate() {
            for (field, value) in [
                ("in_features", detail.in_features),
                ("out_features", detail.out_features),
            ] {
                if let Some(value) = value {
                    if value == 0 || value > MAX_LAYER_QUANTITY {
                        return Err(JobError::QuantityTooLarge {
                            index,
                            field,
                            value,
                        });
                    }
                }
            }
            if let Some(value) = detail.flops.filter(|&f| f > MAX_LAYER_FLOPS) {
                return Err(JobError::FlopsTooLarge { index, value });
            }
        }
        self.details = if details.iter().all(|d| *d == LayerDetail::default()) {
            Vec::new()
        } else {
            details
        };
        self.blocks = names::blocks(&self.details);
        // (Set before the setup in every caller; matched again should one come after.)
        self.named = NamedLayers::of(&self.names(), &self.setup).0;
        Ok(self)
    }

    /// Sets how the job trains, checking what needs the layers: module names that must name
    /// layers, a LoRA rank within each target's dimensions, trainables within the model.
    pub fn with_setup(mut self, raw: &UncheckedSetup<'_>) -> Result<Job, JobError> {
        let setup = Setup::parse(self.batch_size, raw)?;
        self.named = self.check_against_layers(&setup)?;
        self.setup = setup;
        Ok(self)
    }

    /// Each layer's name, `None` where it has none.
    fn names(&self) -> Vec<Option<&str>> {
        (0..self.layers.len())
            .map(|i| self.details.get(i).and_then(|d| d.name.as_deref()))
            .collect()
    }

    /// Checks `setup` against the layers, and returns the layers its module lists name.
    fn check_against_layers(&self, setup: &Setup) -> Result<NamedLayers, SetupError> {
        let names = self.names();
        let named = names.iter().any(Option::is_some);
        // Every list matched in one pass over the names each; the checks below read which of
        // a list's names name a layer.
        let (layers_named, found) = NamedLayers::of(&names, setup);
        let no_names = |field: &str| {
            SetupError::new(
                field,
                "the layers carry no names to match (give each layer its module `name`)",
            )
        };
        let each_names_a_layer = |field: &str, list: &[String], found: &[bool]| {
            if !named {
                return Err(no_names(field));
            }
            if let Some(wanted) = list.iter().zip(found).find_map(|(w, &f)| (!f).then_some(w)) {
                return Err(SetupError::new(
                    field,
                    format!("'{}' names no layer", echo(wanted)),
                ));
            }
            Ok(())
        };
        match &setup.checkpointing {
            Checkpointing::None => {}
            Checkpointing::Full => {
                if self.blocks.is_empty() {
                    return Err(SetupError::new(
                        "activation_checkpointing",
                        "full checkpoints every repeated block, and no layer names show repeated \
                         blocks (`<prefix>.<index>.`, two or more indices): name the modules \
                         instead",
                    ));
                }
            }
            Checkpointing::Modules(list) => {
                each_names_a_layer("activation_checkpointing", list, &found.checkpointed)?
            }
        }
        let total: u64 = self.layers.iter().map(|l| l.params).sum();
        match &setup.trainable {
            Trainable::All => {}
            Trainable::Params(count) if *count > total => {
                return Err(SetupError::new(
                    "trainable.params",
                    format!("{count} is more than the model's {total} parameters"),
                ))
            }
            Trainable::Params(_) => {}
            Trainable::Modules(list) => {
                each_names_a_layer("trainable.modules", list, &found.trainable)?
            }
        }
        let Some(lora) = &setup.lora else {
            return Ok(layers_named);
        };
        if !lora.modules_to_save.is_empty() {
            each_names_a_layer("lora.modules_to_save", &lora.modules_to_save, &found.saved)?;
        }
        let targets: Vec<usize> = match &lora.targets {
            LoraTargets::AllLinear => {
                let linear: Vec<usize> = (0..self.layers.len())
                    .filter(|&i| self.layers[i].kind == LayerKind::Linear)
                    .collect();
                // The output head is not adapted.
                linear[..linear.len().saturating_sub(1)].to_vec()
            }
            LoraTargets::Names(list) => {
                each_names_a_layer("lora.target_modules", list, &found.targets)?;
                (0..self.layers.len())
                    .filter(|&i| layers_named.targeted(i))
                    .collect()
            }
        };
        if targets.is_empty() {
            return Err(SetupError::new(
                "lora.target_modules",
                "all-linear found no linear layer besides the output head",
            ));
        }
        for &i in &targets {
            if self.layers[i].kind != LayerKind::Linear {
                return Err(SetupError::new(
                    "lora.target_modules",
                    format!(
                        "'{}' is a {} layer: LoRA adapts linear layers",
                        echo(names[i].unwrap_or_default()),
                        self.layers[i].kind
                    ),
                ));
            }
            let detail = self.details.get(i);
            if let Some((Some(inputs), Some(outputs))) =
                detail.map(|d| (d.in_features, d.out_features))
            {
                if lora.rank > inputs.min(outputs) {
                    return Err(SetupError::new(
                        "lora.rank",
                        format!(
                            "{} is larger than '{}' ({inputs} x {outputs}) allows",
                            lora.rank,
                            echo(names[i].unwrap_or_default())
                        ),
                    ));
                }
            }
        }
        Ok(layers_named)
    }

    /// Sets the per-sample input shape (e.g. `[3, 224, 224]`).
    pub fn with_input_shape(mut self, shape: Option<&[u64]>) -> Result<Job, JobError> {
        if let Some(shape) = shape {
            if shape.is_empty() || shape.len() > 5 || shape.iter().any(|&d| d == 0 || d > 1_000_000)
            {
                return Err(JobError::InputShape);
            }
            self.input_shape = Some(shape.to_vec());
        }
        Ok(self)
    }

    /// Sets the traced saved tensors; each count at most `MAX_SAVED_BYTES` (16 TiB).
    pub fn with_saved_tensors(mut self, saved: Option<SavedTensors>) -> Result<Job, JobError> {
        if let Some(saved) = saved {
            for (field, value) in [
                ("per_sample_bytes", saved.per_sample_bytes),
                ("fixed_bytes", saved.fixed_bytes),
            ] {
                if value > MAX_SAVED_BYTES {
                    return Err(JobError::SavedBytesTooLarge { field, value });
                }
            }
            self.saved_tensors = Some(saved);
        }
        Ok(self)
    }

    /// Sets the whole-step simulation. Call it after [`Job::with_training`]: a simulation of
    /// another batch size, optimizer or precision describes another job and is refused.
    pub fn with_simulation(
        mut self,
        simulation: Option<UncheckedSimulation<'_>>,
    ) -> Result<Job, JobError> {
        let Some(raw) = simulation else {
            return Ok(self);
        };
        let counts = [
            ("allocated_peak_bytes", raw.allocated_peak_bytes),
            ("reserved_peak_bytes", raw.reserved_peak_bytes),
            ("min_capacity_bytes", raw.min_capacity_bytes),
        ];
        for (field, value) in counts {
            if value > MAX_SAVED_BYTES {
                return Err(JobError::SimulatedBytesTooLarge {
                    field: field.into(),
                    value,
                });
            }
        }
        for (category, value) in raw.breakdown_at_peak.named() {
            if value > MAX_SAVED_BYTES {
                return Err(JobError::SimulatedBytesTooLarge {
                    field: format!("breakdown_at_peak.{category}"),
                    value,
                });
            }
        }
        if raw.batch_size != self.setup.micro_batch_size {
            return Err(JobError::SimulatedBatchSize {
                simulated: raw.batch_size,
                job: self.setup.micro_batch_size,
            });
        }
        let setup_mismatch = |field: &str, simulated: String, job: String| {
            JobError::Setup(SetupError::new(
                format!("simulation.{field}"),
                format!("the simulation ran {simulated}, the job's is {job}"),
            ))
        };
        if self.setup.reference != super::setup::Reference::None {
            return Err(JobError::Setup(SetupError::new(
                "reference_model",
                "a simulation is of a step without a reference model; leave out the \
                 simulation (the analytic step adds the reference) or the reference",
            )));
        }
        // describe's simulated step keeps everything on the GPU.
        if self.setup.offload.any() {
            return Err(JobError::Setup(SetupError::new(
                "offload",
                "a simulation is of a step that keeps everything on the GPU; leave out the \
                 simulation (the analytic step models the offload) or the offload",
            )));
        }
        // A simulation that does not say ran none: describe simulates no checkpointing
        // unless asked, and says so when asked.
        let kind = raw.activation_checkpointing.unwrap_or("none");
        if kind != self.setup.checkpointing.as_str() {
            return Err(setup_mismatch(
                "activation_checkpointing",
                echo(kind),
                self.setup.checkpointing.as_str().into(),
            ));
        }
        // Adapters and frozen layers change the gradients, the optimizer state and what
        // backward keeps: a simulation that trained every parameter is not of such a job, nor
        // the other way round. describe states `trainable_params` whenever fewer train.
        let trains_all = self.setup.trainable == Trainable::All && self.setup.lora.is_none();
        let total_params: u64 = self.layers.iter().map(|l| l.params).sum();
        let simulated_all = raw
            .trainable_params
            .is_none_or(|n| n as f64 >= ALL_TRAINED_SHARE * total_params as f64);
        if trains_all != simulated_all {
            let said = |all: bool| {
                if all {
                    "every parameter trained".to_string()
                } else {
                    "a subset trained (LoRA, trainable or frozen layers)".to_string()
                }
            };
            return Err(setup_mismatch(
                "trainable_params",
                said(simulated_all),
                said(trains_all),
            ));
        }
        let accumulation = raw.gradient_accumulation_steps.unwrap_or(1);
        if accumulation != self.setup.accumulation {
            return Err(setup_mismatch(
                "gradient_accumulation_steps",
                accumulation.to_string(),
                self.setup.accumulation.to_string(),
            ));
        }
        let implementation = raw.optimizer_implementation.unwrap_or("foreach");
        if OptimizerImplementation::parse(implementation) != Some(self.setup.implementation) {
            return Err(setup_mismatch(
                "optimizer_implementation",
                echo(implementation),
                self.setup.implementation.as_str().into(),
            ));
        }
        let paged = raw.paged_optimizer_state_bytes.unwrap_or(0);
        if paged > MAX_SAVED_BYTES {
            return Err(JobError::SimulatedBytesTooLarge {
                field: "paged_optimizer_state_bytes".into(),
                value: paged,
            });
        }
        if let Some(name) = raw.optimizer {
            if Optimizer::parse(name) != Some(self.setup.optimizer) {
                return Err(JobError::SimulatedOptimizer {
                    simulated: echo(name),
                    job: self.setup.optimizer.as_str().into(),
                });
            }
        }
        if let Some(name) = raw.precision {
            if Precision::parse(name) != Some(self.setup.precision) {
                return Err(JobError::SimulatedPrecision {
                    simulated: echo(name),
                    job: self.setup.precision.as_str().into(),
                });
            }
        }
        let (allocated, reserved, min_capacity) = (
            raw.allocated_peak_bytes,
            raw.reserved_peak_bytes,
            raw.min_capacity_bytes,
        );
        if allocated > reserved {
            return Err(JobError::SimulatedReservedBelowAllocated {
                allocated,
                reserved,
            });
        }
        if min_capacity < allocated || min_capacity > reserved {
            return Err(JobError::SimulatedMinCapacity {
                allocated,
                reserved,
                min_capacity,
            });
        }
        let sum = raw.breakdown_at_peak.total();
        if sum != u128::from(allocated) {
            return Err(JobError::SimulatedBreakdownSum { sum, allocated });
        }
        self.simulation = Some(Simulation {
            allocated_peak_bytes: allocated,
            reserved_peak_bytes: reserved,
            min_capacity_bytes: min_capacity,
            breakdown_at_peak: raw.breakdown_at_peak,
            attention: raw.attention.map(echo),
            interpolated: raw.interpolated,
            trainable_params: raw.trainable_params,
            paged_optimizer_state_bytes: paged,
        });
        Ok(self)
    }

    /// Sets the activations of a model built from its configuration: the job is then
    /// answered by the analytic training step alone.
    pub fn with_known_activations(mut self, known: KnownActivations) -> Job {
        self.known_activations = Some(known);
        self
    }

    pub fn known_activations(&self) -> Option<KnownActivations> {
        self.known_activations
    }

    /// Whether the learned estimators may answer: a setup they were trained on, and a job
    /// described as they were (not built from a configuration).
    /// The same layers in the plain setup (fp32, Adam, every parameter trained, one GPU, no
    /// checkpointing or accumulation: [`Setup::plain`]), for a job outside the learned setups
    /// that physics counts from its layers (no simulation, not built from a configuration):
    /// the learned memory regressors answer the base, and the training step carries their
    /// correction to the job's setup. One base for every setup of the same layers, so they all
    /// share one correction. `None` for any other job.
    pub fn learned_base(&self) -> Option<Job> {
        if self.setup.within_learned() || !self.counted_from_layers() {
            return None;
        }
        let mut base = self.clone();
        base.setup = Setup::plain(self.batch_size);
        // The plain setup names no modules.
        base.named = NamedLayers::default();
        Some(base)
    }

    /// Whether physics counts the job from its layer list alone: no simulation, not built
    /// from a configuration.
    pub fn counted_from_layers(&self) -> bool {
        self.simulation.is_none() && self.known_activations.is_none()
    }

    /// Marks the job as read from a printed summary.
    pub fn printed(mut self) -> Job {
        self.printed = true;
        self
    }

    /// How much of the job its figure can rest on, most first: its simulation, its
    /// configuration, a trace, a printout, or the layers alone.
    pub fn detail(&self) -> Detail {
        let learned = self.setup.within_learned();
        if self.simulation.is_some() {
            if learned {
                Detail::Simulation
            } else {
                Detail::SimulatedSetup
            }
        } else if self.known_activations.is_some() {
            Detail::Config
        } else if !learned {
            Detail::SetupStep
        } else if self.printed {
            Detail::Printout
        } else if self.saved_tensors.is_some() {
            Detail::Traced
        } else {
            Detail::Layers
        }
    }

    /// The group whose held-out errors bound this job's figure.
    pub fn uncertainty_group(&self) -> Group {
        Group {
            detail: self.detail(),
            family: self.setup.family(),
            model: self.family(),
        }
    }

    pub fn learned_estimators_apply(&self) -> bool {
        self.setup.within_learned() && self.known_activations.is_none()
    }

    pub fn saved_tensors(&self) -> Option<SavedTensors> {
        self.saved_tensors
    }

    pub fn simulation(&self) -> Option<&Simulation> {
        self.simulation.as_ref()
    }

    pub fn optimizer(&self) -> Optimizer {
        self.setup.optimizer
    }

    pub fn precision(&self) -> Precision {
        self.setup.precision
    }

    pub fn setup(&self) -> &Setup {
        &self.setup
    }

    /// Adds a field the request left unsaid.
    pub fn with_assumption(mut self, assumption: Assumption) -> Job {
        self.assumptions.push(assumption);
        self
    }

    /// The fields the request left unsaid, with their alternatives.
    pub fn assumptions(&self) -> &[Assumption] {
        &self.assumptions
    }

    /// Names and linear shapes, index for index with [`Job::layers`]; empty when none given.
    pub fn layer_details(&self) -> &[LayerDetail] {
        &self.details
    }

    /// The layers `setup`'s module lists name: the job's own, matched when its setup was set,
    /// when `setup` names the same modules (an unstated field's alternative does), else
    /// matched now.
    pub fn named_layers(&self, setup: &Setup) -> std::borrow::Cow<'_, NamedLayers> {
        if matched::same_lists(setup, &self.setup) {
            std::borrow::Cow::Borrowed(&self.named)
        } else {
            std::borrow::Cow::Owned(NamedLayers::of(&self.names(), setup).0)
        }
    }

    /// The repeated blocks of the named layers ([`names::blocks`]): each the range of layer
    /// indices it spans, in order; empty without names.
    pub fn blocks(&self) -> &[Range<usize>] {
        &self.blocks
    }

    pub fn input_shape(&self) -> Option<&[u64]> {
        self.input_shape.as_deref()
    }

    pub fn family(&self) -> Family {
        self.family
    }

    pub fn batch_size(&self) -> u64 {
        self.batch_size
    }

    pub fn layers(&self) -> &[Layer] {
        &self.layers
    }
}

fn check_shape(batch_size: u64, layers: usize) -> Result<(), JobError> {
    if batch_size == 0 || batch_size > MAX_BATCH_SIZE {
        return Err(JobError::BatchSize(batch_size));
    }
    if layers == 0 {
        return Err(JobError::NoLayers);
    }
    if layers > MAX_LAYERS {
        return Err(JobError::TooManyLayers(layers));
    }
    Ok(())
}

mod layer;
mod simulation;

pub use layer::*;
pub use simulation::*;

#[cfg(test)]
mod tests;
