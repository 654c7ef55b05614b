//! The analytic training step: what one GPU holds at the step's peak, by category, for any
//! [`Setup`], from the layer list (names, parameters, linear shapes) and the activations kept
//! for backward (traced saved tensors, or every layer output). It answers jobs that carry no
//! simulation of their setup, and it is where sharding and model parallelism are applied to
//! a one-GPU simulation ([`shard_simulated`]).
//!
//! The peak is the larger of two moments of a step: the start of backward (weights, optimizer
//! state, every activation kept, the first gradients and the gradient of the largest output)
//! and the optimizer's step (weights, optimizer state, every gradient and the optimizer's
//! temporaries). Gradients from earlier micro-batches are alive in both when the step
//! accumulates. docs/user/setups.md states the rules; each constant says where it comes from.
//!
//! Its stages: `state` each layer's plan and the model's state (one and two), `kept` what
//! backward keeps (three), this file what lands on the GPU (four) and the shards of a
//! simulation; `host` what an offloading rank holds in host memory.

use crate::job::matched::{self, NamedLayers};
use crate::job::setup::{Setup, Strategy};
use crate::job::validated::{Job, Layer, SimulatedCategories};
use crate::job::KnownActivations;

mod host;
mod kept;
mod state;

pub use host::{host_memory, HostMemory};
use kept::{kept_for_backward, tensor_share, KeptForBackward};
use state::{
    layer_state_bytes, layer_sums, model_state, plan_layers, LayerPlan, LayerSums, ModelState,
};

/// LoRA adapters train in fp32 whatever the base (PEFT's `autocast_adapter_dtype`).
const ADAPTER_BYTES: f64 = 4.0;
/// What the caching allocator reserves beyond the allocated peak: the median reserved /
/// allocated of the 3,155 simulated timm steps (data/timm/simulations.jsonl.gz) is 1.080.
pub const ALLOCATOR_CACHE_SHARE: f64 = 0.08;

/// One GPU's bytes at the step's peak.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct StepMemory {
    pub parameters: f64,
    pub gradients: f64,
    pub optimizer_state: f64,
    pub activations: f64,
    pub temporaries: f64,
    /// DDP's gradient buckets, FSDP/ZeRO's gather and reduce buffers.
    pub collective_buffers: f64,
    /// The layout's collective buffers whichever moment peaks (DDP's exist all along,
    /// FSDP's gathers during forward and backward).
    pub layout_buffers: f64,
    /// A paged optimizer's state: in CUDA unified memory, outside the allocator's figures.
    pub paged_optimizer_state: f64,
    /// Parameters that train (adapters included), and of them the adapters, whole model.
    pub trainable_params: f64,
    pub lora_params: f64,
    /// True when the peak is the optimizer's step rather than the start of backward.
    pub at_optimizer_step: bool,
    /// What the allocator holds at the optimizer's step (weights, every gradient, the state
    /// and the step's temporaries), whichever moment peaks: no step needs less.
    pub optimizer_step_bytes: f64,
    /// The moment that does not peak, by the categories that differ between the two (weights,
    /// state and paged state are the same at both): its doubt may still pass the peak's.
    pub other_moment: MomentBytes,
}

/// The categories of one moment of the step that differ between the start of backward and the
/// optimizer's step, bytes.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct MomentBytes {
    pub gradients: f64,
    pub activations: f64,
    pub temporaries: f64,
    pub collective_buffers: f64,
}

impl StepMemory {
    /// What PyTorch's allocator holds at the peak (`max_memory_allocated`).
    pub fn allocated(&self) -> f64 {
        self.parameters
            + self.gradients
            + self.optimizer_state
            + self.activations
            + self.temporaries
            + self.collective_buffers
    }
}

/// The analytic step of `job` on its most loaded GPU.
pub fn analytic_step(job: &Job) -> StepMemory {
    analytic_step_as(job, job.setup(), job.known_activations())
}

/// [`analytic_step`] of `job`'s layers with `setup` and `known` activations in place of its
/// own: what another value of a field the request left unsaid would give
/// (`physics::assumed`), without copying the job.
pub fn analytic_step_as(job: &Job, setup: &Setup, known: Option<KnownActivations>) -> StepMemory {
    StepStages::of(job, setup, known).memory
}

/// One analytic step kept stage by stage, so that a step of the same layers with another value
/// of one field (`physics::assumed`) runs again only the stages that field reaches: an
/// optimizer implementation only the model state's temporaries, an optimizer or a master copy
/// the plan's optimizer state and the model state, a loss, an attention kernel or
/// checkpointing only what backward keeps. Each stage is reused only when every input it reads
/// is the same, so a step beside it is the step run whole, bit for bit.
pub struct StepStages<'a> {
    setup: &'a Setup,
    known: Option<KnownActivations>,
    named: std::borrow::Cow<'a, NamedLayers>,
    plans: Vec<LayerPlan>,
    sums: LayerSums,
    model: ModelState,
    kept: KeptForBackward,
    /// The step itself.
    pub memory: StepMemory,
}

impl<'a> StepStages<'a> {
    /// The step of `job`'s layers with `setup` and `known` activations, stage by stage.
    pub fn of(job: &'a Job, setup: &'a Setup, known: Option<KnownActivations>) -> StepStages<'a> {
        // The layers the setup's module lists name, matched once per job (not per card or step).
        let named = job.named_layers(setup);
        let plans = plan_layers(job, setup, known, &named);
        let model = model_state(&plans, setup);
        let sums = layer_sums(job, &plans);
        let kept = kept_for_backward(job, setup, known, &named, &plans, &sums);
        let memory = on_the_gpu(job, setup, &model, &kept);
        StepStages {
            setup,
            known,
            named,
            plans,
            sums,
            model,
            kept,
            memory,
        }
    }

    /// [`analytic_step_as`] of the same job with `setup` and `known`, reusing the stages whose
    /// inputs are this step's.
    pub fn beside(&self, job: &Job, setup: &Setup, known: Option<KnownActivations>) -> StepMemory {
        let base = self.setup;
        // The module lists name the same layers, and every field the plan reads is the same
        // (the stored weights read only whether the activations are known) but the
        // optimizer and the master copy, which only its state reads.
        let same_plans = matched::same_lists(setup, base)
            && known.is_some() == self.known.is_some()
            && setup.precision == base.precision
            && setup.reference == base.reference
            && setup.parallelism == base.parallelism
            && setup.trainable == base.trainable
            && setup.lora == base.lora;
        if !same_plans {
            return analytic_step_as(job, setup, known);
        }
        let same_state = setup.optimizer == base.optimizer && setup.fp32_master == base.fp32_master;
        let restated;
        let plans = if same_state {
            &self.plans
        } else {
            restated = self
                .plans
                .iter()
                .zip(job.layers())
                .map(|(plan, layer)| LayerPlan {
                    state_elements_bytes: layer_state_bytes(
                        setup,
                        plan.trainable,
                        layer,
                        plan.shape,
                    ),
                    ..plan.clone()
                })
                .collect::<Vec<_>>();
            &restated
        };
        // The model state reads the plans and, beyond them, the optimizer, its implementation
        // and the master copy.
        let model = if same_state && setup.implementation == base.implementation {
            self.model
        } else {
            model_state(plans, setup)
        };
        // What backward keeps reads the plans, the activations, checkpointing and the
        // micro-batch.
        let kept = if known == self.known
            && setup.checkpointing == base.checkpointing
            && setup.micro_batch_size == base.micro_batch_size
        {
            self.kept
        } else {
            kept_for_backward(job, setup, known, &self.named, plans, &self.sums)
        };
        on_the_gpu(job, setup, &model, &kept)
    }
}

/// Stage four: the model state and what backward keeps on the most loaded GPU (sharding,
/// model parallelism, offload, the layout's buffers), at the larger of the step's two moments.
fn on_the_gpu(job: &Job, setup: &Setup, model: &ModelState, kept: &KeptForBackward) -> StepMemory {
    let layers = job.layers();
    let total_params: f64 = layers.iter().map(|l| l.params as f64).sum();
    let precision = setup.precision;
    let storage = precision.storage_bytes();
    let ModelState {
        weights,
        gradients,
        state,
        fp32_gradient_copy,
        optimizer_temporaries,
        largest_gradient,
        adapter_params,
        base_trainable,
    } = *model;
    let KeptForBackward {
        activations,
        backward_temporaries,
        whole_under_tensor_parallel,
    } = *kept;
    // Sharding and model parallelism.
    let p = setup.parallelism;
    let model_parallel = (p.tensor * p.pipeline) as f64;
    let data = p.data() as f64;
    let (shard_state, shard_gradients, shard_weights) = p.strategy.shards();
    let by = |shard: bool| if shard { data } else { 1.0 };
    let weights_gpu = weights / model_parallel / by(shard_weights);
    let gradients_gpu = gradients / model_parallel / by(shard_gradients);
    let (state_gpu, paged_gpu) = {
        let per_gpu = state / model_parallel / by(shard_state);
        if setup.optimizer.is_paged() {
            (0.0, per_gpu)
        } else {
            (per_gpu, 0.0)
        }
    };
    let zero3 = p.strategy == Strategy::Zero3;
    let optimizer_temporaries = if zero3 {
        // ZeRO-3 steps its partition sub-group by sub-group, each sub-group's gradients
        // flattened into a new fp32 tensor first (stage3.py, `_prepare_fp32_grad_for_sub_group`):
        // `sub_group_size` elements at most, whatever the weights' dtype.
        let partition = (base_trainable + adapter_params) / model_parallel / by(shard_gradients);
        (optimizer_temporaries - fp32_gradient_copy) / model_parallel / by(shard_state)
            + partition.min(setup.zero.sub_group as f64) * 4.0
    } else {
        optimizer_temporaries / model_parallel / by(shard_state)
    };
    // Offloaded to the CPU: the optimizer's state and its step (nothing of either stays);
    // the gradients, copied out as backward makes them (one tensor on the GPU at a time);
    // the weights, of which the GPU holds only the units gathered (the collective buffers).
    let offload = setup.offload;
    let (state_gpu, paged_gpu, optimizer_temporaries) = if offload.optimizer_state {
        (0.0, 0.0, 0.0)
    } else {
        (state_gpu, paged_gpu, optimizer_temporaries)
    };
    // ZeRO-3 keeps its gradient partitions with the optimizer: on the CPU when that is
    // offloaded (stage3.py's `grad_partitions_flat_buffer` lives on the optimizer's device).
    let gradients_offloaded = offload.gradients || (zero3 && offload.optimizer_state);
    let gradients_gpu = if gradients_offloaded {
        (largest_gradient / model_parallel).min(gradients_gpu)
    } else {
        gradients_gpu
    };
    // ZeRO-3 never partitions a parameter of at most `stage3_param_persistence_threshold`
    // elements: every rank holds it whole on the GPU, offloaded or not.
    let persistent = if zero3 {
        let small: f64 = layers
            .iter()
            .map(|l| l.params)
            .filter(|&n| n > 0 && n <= setup.zero.persistence_threshold)
            .sum::<u64>() as f64;
        small * weights / total_params.max(1.0) / model_parallel
    } else {
        0.0
    };
    let weights_gpu = if offload.parameters {
        persistent
    } else {
        weights_gpu + persistent * (1.0 - 1.0 / by(shard_weights))
    };
    // Tensor and context parallelism split the activations (tensor parallelism not all of
    // them); the first pipeline stage keeps up to `pipeline` micro-batches of its 1/pipeline
    // of the layers in flight (1F1B).
    let in_flight = (p.pipeline.min(setup.accumulation.max(1))) as f64 / p.pipeline as f64;
    let whole = if p.sequence_parallel {
        0.0
    } else {
        whole_under_tensor_parallel
    };
    let activations_gpu =
        (whole + (activations - whole) / p.tensor as f64) / p.context as f64 * in_flight;
    let backward_temporaries = backward_temporaries / (p.tensor * p.context) as f64;
    let unsharded_gradients = gradients / model_parallel;
    let compute_bytes = precision.compute_bytes();
    let reduce_bucket = setup.zero.reduce_bucket as f64;
    let collective = match p.strategy {
        // ZeRO-3 allocates its contiguous gradient bucket at start-up whatever the layout
        // (`reduce_bucket_size` elements of the weights' dtype); with one rank and the weights
        // on the GPU nothing is gathered.
        Strategy::Zero3 if p.data() <= 1 && !offload.parameters => reduce_bucket * storage,
        _ if p.data() <= 1 && !offload.parameters => 0.0,
        Strategy::None => 0.0,
        // DDP's buckets hold a flat copy of every gradient.
        Strategy::Ddp => unsharded_gradients,
        Strategy::Zero1 | Strategy::Zero2 => {
            unsharded_gradients.min(reduce_bucket * storage.min(4.0))
        }
        // FSDP: the gathered weights of the unit running and of the one prefetched, and one
        // unit's gradients before their reduce-scatter.
        // ZeRO-3 (DeepSpeed's defaults, stage3.py and partitioned_param_coordinator.py): the
        // parameters kept gathered for their reuse and those prefetched, never fewer than two
        // units, and the contiguous gradient bucket, allocated whole at start-up
        // (`reduce_bucket_size` elements of the parameters' dtype).
        Strategy::Fsdp | Strategy::Zero3 => {
            let units = job.blocks();
            let unit_params = if units.is_empty() {
                total_params
            } else {
                units
                    .iter()
                    .map(|r| {
                        layers[r.clone()]
                            .iter()
                            .map(|l| l.params as f64)
                            .sum::<f64>()
                    })
                    .fold(0.0, f64::max)
            } / model_parallel;
            let unit_trainable = unit_params * (gradients / weights.max(1.0)).min(1.0);
            if p.strategy == Strategy::Zero3 {
                zero3_gathered(layers, setup) / model_parallel * compute_bytes
                    + reduce_bucket * storage
            } else {
                2.0 * unit_params * compute_bytes + unit_trainable * 4.0
            }
        }
    };
    let ddp_buckets = if p.strategy == Strategy::Ddp {
        collective
    } else {
        0.0
    };
    // Accumulated gradients stay on the GPU between micro-batches, unless offloaded.
    let accumulating = setup.accumulation > 1 && !gradients_offloaded;
    let first_gradients = if accumulating {
        gradients_gpu
    } else {
        (largest_gradient / model_parallel).min(gradients_gpu)
    };
    let backward = weights_gpu
        + state_gpu
        + activations_gpu
        + first_gradients
        + backward_temporaries
        + collective;
    let optimizer_step =
        weights_gpu + state_gpu + gradients_gpu + optimizer_temporaries + ddp_buckets;
    let at_optimizer_step = optimizer_step > backward;
    let at_step = MomentBytes {
        gradients: gradients_gpu,
        activations: 0.0,
        temporaries: optimizer_temporaries,
        collective_buffers: ddp_buckets,
    };
    let at_backward = MomentBytes {
        gradients: first_gradients,
        activations: activations_gpu,
        temporaries: backward_temporaries,
        collective_buffers: collective,
    };
    let (peak, other_moment) = if at_optimizer_step {
        (at_step, at_backward)
    } else {
        (at_backward, at_step)
    };
    StepMemory {
        parameters: weights_gpu,
        gradients: peak.gradients,
        optimizer_state: state_gpu,
        activations: peak.activations,
        temporaries: peak.temporaries,
        collective_buffers: peak.collective_buffers,
        paged_optimizer_state: paged_gpu,
        trainable_params: base_trainable + adapter_params,
        lora_params: adapter_params,
        layout_buffers: collective,
        at_optimizer_step,
        optimizer_step_bytes: optimizer_step,
        other_moment,
    }
}

/// The parameters ZeRO-3 holds gathered at the turn from forward to backward, elements
/// (partitioned_param_coordinator.py). A module's parameters are released after it runs unless
/// the trace uses them again within `stage3_max_reuse_distance` elements: at the turn, the last
/// layers of forward are used again first in backward, so each layer whose forward rest and
/// backward way back (twice the parameters after it) fall within the distance stays gathered,
/// the last one always. Prefetching gathers `stage3_prefetch_bucket_size` more ahead, as long
/// as fewer than `stage3_max_live_parameters` are gathered. Never less than the largest layer
/// (a module is gathered whole to run).
fn zero3_gathered(layers: &[Layer], setup: &Setup) -> f64 {
    let zero = setup.zero;
    let total: f64 = layers.iter().map(|l| l.params as f64).sum();
    let mut after = 0.0;
    let mut kept = 0.0;
    for layer in layers.iter().rev() {
        if 2.0 * after <= zero.max_reuse_distance as f64 {
            kept += layer.params as f64;
        }
        after += layer.params as f64;
    }
    let prefetch = (zero.max_live_parameters as f64 - kept)
        .max(0.0)
        .min(zero.prefetch_bucket as f64);
    let largest = layers.iter().map(|l| l.params as f64).fold(0.0, f64::max);
    (kept + prefetch).max(largest).min(total)
}

/// A paged optimizer state of one GPU, split as the layout shards the optimizer state.
pub fn shard_paged(job: &Job, bytes: u64) -> u64 {
    let p = job.setup().parallelism;
    let sharded = if p.strategy.shards().0 { p.data() } else { 1 };
    bytes / (p.tensor * p.pipeline * sharded)
}

/// A one-GPU simulation's categories on the most loaded rank of the job's layout: weights,
/// gradients and optimizer state split as the strategy and the tensor/pipeline degrees say,
/// activations as tensor/context parallelism and the pipeline's in-flight micro-batches do.
/// Returns them with the layout's collective buffers, bytes.
pub fn shard_simulated(job: &Job, simulated: SimulatedCategories) -> (SimulatedCategories, u64) {
    let setup = job.setup();
    let p = setup.parallelism;
    if p.is_single_gpu() {
        return (simulated, 0);
    }
    let model_parallel = (p.tensor * p.pipeline) as f64;
    let data = p.data() as f64;
    let (shard_state, shard_gradients, shard_weights) = p.strategy.shards();
    let by = |shard: bool| if shard { data } else { 1.0 };
    let scale = |bytes: u64, factor: f64| (bytes as f64 * factor).round() as u64;
    let in_flight = (p.pipeline.min(setup.accumulation.max(1))) as f64 / p.pipeline as f64;
    let categories = SimulatedCategories {
        parameters: scale(
            simulated.parameters,
            1.0 / model_parallel / by(shard_weights),
        ),
        gradients: scale(
            simulated.gradients,
            1.0 / model_parallel / by(shard_gradients),
        ),
        optimizer_state: scale(
            simulated.optimizer_state,
            1.0 / model_parallel / by(shard_state),
        ),
        activations: scale(
            simulated.activations,
            in_flight * tensor_share(job, setup) / p.context as f64,
        ),
        temporaries: scale(simulated.temporaries, 1.0 / (p.tensor * p.context) as f64),
    };
    (categories, analytic_step(job).layout_buffers.round() as u64)
}

#[cfg(test)]
mod tests;
