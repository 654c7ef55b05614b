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

use crate::job::matched::{self, NamedLayers};
use crate::job::setup::{
    BaseWeights, Checkpointing, ExpertLayout, LoraTargets, Optimizer, OptimizerImplementation,
    Reference, Setup, Strategy, Trainable,
};
use crate::job::validated::{Job, Layer, LayerKind, SimulatedCategories};
use crate::job::KnownActivations;
use crate::job::LayerDetail;
use crate::physics::{saved, shapes};

/// bitsandbytes keeps 32-bit state for parameters below this size (`min_8bit_size`).
const MIN_8BIT_SIZE: u64 = 4096;
/// 8-bit Adam: two uint8 states and an fp32 absmax per 256-element block of each.
const ADAM_8BIT_BYTES: f64 = 2.0 + 2.0 * 4.0 / 256.0;
/// NF4 with double quantisation: 4 bits, an 8-bit absmax per 64 weights, an fp32 scale per
/// 256 of those (QLoRA, Dettmers et al. 2023: 4.127 bits per weight).
const NF4_BYTES: f64 = 0.5 + 1.0 / 64.0 + 4.0 / (64.0 * 256.0);
/// LoRA adapters train in fp32 whatever the base (PEFT's `autocast_adapter_dtype`).
const ADAPTER_BYTES: f64 = 4.0;
/// The share of the traced fp32 saved bytes a step keeps under autocast: matmuls and
/// convolutions save 16-bit inputs, norms, softmax and losses fp32 ones. The median, over five
/// models, of describe's simulated autocast activations at the peak over the traced fp32 bytes
/// (describe/scripts/autocast_kept_share.py: a Llama 0.646, GPT-2 0.856, ViT-B 0.757,
/// ResNet-50 0.532, ConvNeXt-T 0.585).
const AUTOCAST_KEPT_SHARE: f64 = 0.65;
/// The same share under pure bf16/fp16.
const PURE_16BIT_KEPT_SHARE: f64 = 0.5;

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

fn is_matmul(kind: LayerKind) -> bool {
    kind == LayerKind::Linear || kind == LayerKind::Attention || kind.is_convolution()
}

/// A linear layer's (in, out), as [`shapes::linear_shape`] reads it for the step's time too.
fn linear_shape(layer: &Layer, detail: Option<&LayerDetail>) -> (f64, f64) {
    let shape = shapes::linear_shape(layer, detail, None);
    (shape.inputs, shape.outputs)
}

/// An embedding table's two factors for Adafactor: its (vocabulary, width) where given, else a
/// square guess (the vocabulary is not in a layer list).
fn embedding_factors(layer: &Layer, detail: Option<&LayerDetail>) -> (f64, f64) {
    match detail.map(|d| (d.in_features, d.out_features)) {
        Some((Some(i), Some(o))) => (i as f64, o as f64),
        _ => {
            let side = (layer.params as f64).sqrt();
            (side, side)
        }
    }
}

/// Per-layer facts the step model reads.
#[derive(Clone)]
struct LayerPlan {
    /// Base parameters that train.
    trainable: f64,
    /// Whether the layer's own weight trains (a tied head's: the embedding's).
    weight_trains: bool,
    /// LoRA adapter parameters on this layer.
    adapters: f64,
    /// Bytes of the base weights as stored.
    weight_bytes: f64,
    /// Bytes of a frozen reference copy of this layer (DPO's `ref_model`).
    reference_bytes: f64,
    /// Bytes of the optimizer state of this layer's trainable base parameters (non-adapter).
    state_elements_bytes: f64,
    /// The (in, out) factors of the layer's matrix (Adafactor's), for a linear layer or an
    /// embedding table.
    shape: Option<(f64, f64)>,
    /// Bytes of this layer's quantised weight dequantised for its matmul (compute dtype).
    dequantised_bytes: f64,
}

/// The optimizer state bytes of `elements` trainable parameters of one layer stored in
/// `storage` bytes each (Adafactor factors a linear weight into its row and column).
fn state_bytes(
    optimizer: Optimizer,
    elements: f64,
    storage: f64,
    layer: &Layer,
    shape: Option<(f64, f64)>,
) -> f64 {
    if elements <= 0.0 {
        return 0.0;
    }
    match optimizer {
        Optimizer::Sgd => 0.0,
        Optimizer::Momentum => elements * storage,
        Optimizer::Adam | Optimizer::AdamW | Optimizer::PagedAdamW => 2.0 * elements * storage,
        Optimizer::Adam8bit | Optimizer::AdamW8bit | Optimizer::PagedAdamW8bit => {
            if layer.params >= MIN_8BIT_SIZE {
                elements * ADAM_8BIT_BYTES
            } else {
                2.0 * elements * 4.0
            }
        }
        Optimizer::Adafactor => match shape {
            // Row and column second moments instead of one per weight.
            Some((i, o)) if i * o > 0.0 => {
                let share = (elements / layer.params.max(1) as f64).min(1.0);
                share * (i + o + (layer.params as f64 - i * o).max(0.0)) * storage
            }
            _ => elements * storage,
        },
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

/// What one rank of an offloading job holds in host (CPU) memory, bytes: the state and tensors
/// its offload moves off the GPU, as DeepSpeed's ZeRO-Offload and FSDP's `CPUOffload` keep them.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HostMemory {
    /// The optimizer's state on the CPU (with an fp32 master copy where the setup keeps one),
    /// the rank's shard of it: what the GPU no longer holds.
    pub optimizer_state: f64,
    /// The gradients the CPU optimizer steps on: DeepSpeed copies each rank's partition into an
    /// fp32 buffer beside its master weights (ZeRO-1/2 `single_partition_of_fp32_groups`' grads,
    /// ZeRO-3 `grad_partitions_flat_buffer`, pinned with `pin_memory`), and ZeRO-1/2 keep a
    /// second fp32 partition to accumulate micro-batches in (`accumulated_grads_in_cpu`);
    /// FSDP's `CPUOffload` and gradients offloaded on their own (torchao) keep their dtype.
    pub gradients: f64,
    /// The weights' shard on the CPU (FSDP `CPUOffload(offload_params=True)`, ZeRO-3
    /// `offload_param`), in their dtype.
    pub parameters: f64,
    /// The trained parameters the CPU optimizer steps on this rank (its shard): what crosses
    /// PCIe each step as gradients down and updated weights up. Zero without optimizer offload.
    pub stepped_params: f64,
}

impl HostMemory {
    pub fn total(&self) -> f64 {
        self.optimizer_state + self.gradients + self.parameters
    }
}

/// The host memory one rank of `job` holds for what it offloads; `None` without offload.
/// Counted from the same model state as the GPU's figure (the state, gradients and weights the
/// offload takes off the GPU land here), sharded as the strategy shards them. Not counted: the
/// model as loaded before it is sharded (DeepSpeed's estimator adds 4 bytes a parameter per
/// process without `zero.Init`), the host's own data loading, and NVMe swap (ZeRO-Infinity).
pub fn host_memory(job: &Job) -> Option<HostMemory> {
    let setup = job.setup();
    let offload = setup.offload;
    if !offload.any() {
        return None;
    }
    let named = job.named_layers(setup);
    let plans = plan_layers(job, setup, job.known_activations(), &named);
    let model = model_state(&plans, setup);
    let p = setup.parallelism;
    let model_parallel = (p.tensor * p.pipeline) as f64;
    let data = p.data() as f64;
    let (shard_state, shard_gradients, shard_weights) = p.strategy.shards();
    let by = |shard: bool| if shard { data } else { 1.0 };
    let optimizer_state = if offload.optimizer_state {
        model.state / model_parallel / by(shard_state)
    } else {
        0.0
    };
    let trained = model.base_trainable + model.adapter_params;
    // ZeRO's CPU optimizer steps on an fp32 copy of the rank's gradient partition; ZeRO-1/2
    // accumulate micro-batches in another (ZeRO-3 accumulates in the first). FSDP's
    // `CPUOffload` (and torchao's) moves the gradients' shard in their own dtype.
    let cpu_step_gradients = match p.strategy {
        _ if !offload.optimizer_state => 0.0,
        Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3 => {
            let partitions = if p.strategy != Strategy::Zero3 && setup.accumulation > 1 {
                2.0
            } else {
                1.0
            };
            trained * 4.0 / model_parallel / by(shard_state) * partitions
        }
        _ => model.gradients / model_parallel / by(shard_gradients),
    };
    let own_gradients = if offload.gradients {
        model.gradients / model_parallel / by(shard_gradients)
    } else {
        0.0
    };
    let parameters = if offload.parameters {
        model.weights / model_parallel / by(shard_weights)
    } else {
        0.0
    };
    let stepped_params = if offload.optimizer_state {
        trained / model_parallel / by(shard_state)
    } else {
        0.0
    };
    Some(HostMemory {
        optimizer_state,
        gradients: cpu_step_gradients.max(own_gradients),
        parameters,
        stepped_params,
    })
}

/// Stage one: each layer's trainable parameters, adapters, stored weights, reference copy,
/// optimizer state and dequantised weight, whole model.
fn plan_layers(
    job: &Job,
    setup: &Setup,
    known: Option<KnownActivations>,
    named: &NamedLayers,
) -> Vec<LayerPlan> {
    let layers = job.layers();
    let details = job.layer_details();
    let detail = |i: usize| details.get(i);
    let precision = setup.precision;
    let storage = precision.storage_bytes();
    let head = layers.iter().rposition(|l| l.kind == LayerKind::Linear);
    let total_params: f64 = layers.iter().map(|l| l.params as f64).sum();
    // Which layers LoRA adapts, and which base weights are quantised (bitsandbytes quantises
    // every linear layer but the output head, whatever the adapters' targets).
    let lora = setup.lora.as_ref();
    let adapted = |i: usize| -> bool {
        let Some(lora) = lora else { return false };
        if layers[i].kind != LayerKind::Linear {
            return false;
        }
        match &lora.targets {
            LoraTargets::AllLinear => Some(i) != head,
            LoraTargets::Names(_) => named.targeted(i),
        }
    };
    // Inside one of `trainable.modules`.
    let in_modules = |i: usize| named.trainable(i);
    let trainable_share = match setup.trainable {
        Trainable::Params(n) if total_params > 0.0 => (n as f64 / total_params).min(1.0),
        _ => 1.0,
    };
    // PEFT's modules_to_save: a trained copy beside each frozen original.
    let saved = |i: usize| lora.is_some() && named.saved(i);
    // A head tied to the embeddings shares their weight: naming it trainable trains that
    // weight (its gradient and state counted at the token embedding of the same size).
    let tied_head_trains = match &setup.trainable {
        Trainable::Modules(_) => (0..layers.len())
            .find(|&i| {
                layers[i].kind == LayerKind::Linear && layers[i].params == 0 && in_modules(i)
            })
            .map(|i| {
                let (inputs, outputs) = linear_shape(&layers[i], detail(i));
                inputs * outputs
            }),
        _ => None,
    };
    layers
        .iter()
        .enumerate()
        .map(|(i, layer)| {
            // A head tied to the embeddings has no parameters of its own, but PEFT's
            // modules_to_save gives it a trained copy of its whole weight (its default
            // `ensure_weight_tying=False`).
            let params = if saved(i) && layer.params == 0 && layer.kind == LayerKind::Linear {
                let (inputs, outputs) = linear_shape(layer, detail(i));
                inputs * outputs
            } else {
                layer.params as f64
            };
            let base_trains = saved(i)
                || tied_head_trains.is_some_and(|weight| {
                    layer.kind == LayerKind::Embedding && layer.params as f64 == weight
                })
                || match (&setup.trainable, lora) {
                    (Trainable::Modules(_), _) => in_modules(i),
                    (_, Some(_)) => false,
                    (Trainable::Params(_), None) => true,
                    (Trainable::All, None) => true,
                };
            let trainable = if base_trains {
                params * trainable_share
            } else {
                0.0
            };
            let adapters = if adapted(i) {
                let (inputs, outputs) = linear_shape(layer, detail(i));
                lora.map_or(0.0, |l| l.rank as f64 * (inputs + outputs))
            } else {
                0.0
            };
            // A mixture of experts' experts are quantised where each expert projection is an
            // `nn.Linear` (transformers 4); fused into 3D parameters (transformers 5), the
            // libraries leave them as loaded.
            let experts = detail(i)
                .and_then(|d| d.experts)
                .filter(|_| lora.is_some_and(|l| l.expert_layout == ExpertLayout::PerExpertLinear));
            let quantised = lora.map(|l| l.base_weights).filter(|_| {
                (layer.kind == LayerKind::Linear && Some(i) != head || experts.is_some())
                    && !base_trains
            });
            let weight_bytes =
                stored_weight_bytes(layer, detail(i), params, quantised, setup, known.is_some())
                    + if saved(i) { params * storage } else { 0.0 };
            // Adafactor factors every matrix: linear weights by their shape, embedding tables
            // by a square guess (their vocabulary is not in the layer list).
            let shape = match layer.kind {
                LayerKind::Linear => Some(linear_shape(layer, detail(i))),
                LayerKind::Embedding => Some(embedding_factors(layer, detail(i))),
                _ => None,
            };
            // A reference copy holds the weights as the model loaded them (not a saved
            // module's trained copy, nor autocast's casts).
            let reference_bytes = if setup.reference == Reference::Copy {
                match quantised {
                    Some(BaseWeights::Same) | None => layer.params as f64 * storage,
                    Some(_) => weight_bytes - if saved(i) { params * storage } else { 0.0 },
                }
            } else {
                0.0
            };
            // A quantised base is dequantised whole for each matmul, forward and backward
            // (bitsandbytes' MatMul4Bit and int8 backward, the GPTQ/AWQ training kernels),
            // and freed after it: one layer's at a time.
            let dequantised_bytes = match (quantised, experts) {
                (Some(BaseWeights::Same) | None, _) => 0.0,
                // Each expert's linears run one at a time.
                (Some(_), Some(e)) => {
                    e.linears()
                        .iter()
                        .map(|&(i, o)| (i * o) as f64)
                        .fold(0.0, f64::max)
                        * precision.compute_bytes()
                }
                (Some(_), None) => params * precision.compute_bytes(),
            };
            LayerPlan {
                trainable,
                weight_trains: base_trains,
                adapters,
                weight_bytes,
                reference_bytes,
                dequantised_bytes,
                state_elements_bytes: layer_state_bytes(setup, trainable, layer, shape),
                shape,
            }
        })
        .collect()
}

/// The optimizer state of one layer's `trainable` base parameters, with the fp32 master copy
/// of them that goes with it; `shape`: the factors Adafactor keeps.
fn layer_state_bytes(
    setup: &Setup,
    trainable: f64,
    layer: &Layer,
    shape: Option<(f64, f64)>,
) -> f64 {
    // The optimizer's elements: the weights' dtype, or fp32 beside an fp32 master copy.
    let state_storage = if setup.fp32_master {
        4.0
    } else {
        setup.precision.storage_bytes()
    };
    state_bytes(setup.optimizer, trainable, state_storage, layer, shape)
        + if setup.fp32_master {
            trainable * 4.0
        } else {
            0.0
        }
}

/// Bytes of one layer's base weights as the GPU stores them: quantised, or in the weights'
/// dtype with autocast's 16-bit copy of a matmul's weight beside it.
fn stored_weight_bytes(
    layer: &Layer,
    detail: Option<&LayerDetail>,
    params: f64,
    quantised: Option<BaseWeights>,
    setup: &Setup,
    activations_known: bool,
) -> f64 {
    let precision = setup.precision;
    let storage = precision.storage_bytes();
    // The inputs and outputs of the linear layers quantised: an experts layer's, summed over
    // its experts' linears.
    let in_out = || match detail.and_then(|d| d.experts) {
        Some(e) => e.linears().iter().fold((0.0, 0.0), |(i, o), &(li, lo)| {
            (i + (e.count * li) as f64, o + (e.count * lo) as f64)
        }),
        None => linear_shape(layer, detail),
    };
    match quantised {
        Some(BaseWeights::Nf4) => params * NF4_BYTES,
        // Packed int4, an fp16 scale and a packed 4-bit zero per group and output; GPTQ
        // adds an int32 group index per input.
        Some(BaseWeights::Gptq { group_size }) => {
            params * (0.5 + 2.5 / group_size as f64) + in_out().0 * 4.0
        }
        Some(BaseWeights::Awq { group_size }) => params * (0.5 + 2.5 / group_size as f64),
        Some(BaseWeights::Int8) => params * 1.0 + in_out().1 * 4.0,
        _ => {
            // Autocast keeps a 16-bit copy of each weight a matmul saved for backward
            // (FSDP gathers 16-bit weights instead: see the collective buffers).
            // (A model built from its configuration counts them with its activations,
            // as describe's simulation does.)
            let cast = if precision.is_autocast()
                && is_matmul(layer.kind)
                && !setup.parallelism.strategy.shards().2
                && !activations_known
            {
                2.0
            } else {
                0.0
            };
            layer.params as f64 * (storage + cast)
        }
    }
}

/// What the model's weights, gradients and optimizer hold, whole model, before sharding.
#[derive(Clone, Copy)]
struct ModelState {
    weights: f64,
    gradients: f64,
    state: f64,
    /// Of which the fp32 copy of the gradients a step on an fp32 master takes.
    fp32_gradient_copy: f64,
    optimizer_temporaries: f64,
    largest_gradient: f64,
    adapter_params: f64,
    base_trainable: f64,
}

/// Stage two: the model state of the planned layers.
fn model_state(plans: &[LayerPlan], setup: &Setup) -> ModelState {
    let storage = setup.precision.storage_bytes();
    let state_storage = if setup.fp32_master { 4.0 } else { storage };
    let state_element_bytes =
        |p: &LayerPlan| p.trainable * state_storage + p.adapters * ADAPTER_BYTES;
    let gradient_bytes = |p: &LayerPlan| p.trainable * storage + p.adapters * ADAPTER_BYTES;
    // One pass over the plans: each sum taken in layer order from -0.0, as `Iterator::sum`
    // takes it, each largest from 0.
    let (mut adapter_params, mut base_trainable, mut stored, mut layer_state) =
        (-0.0, -0.0, -0.0, -0.0);
    let (mut all_state_elements, mut most_state_elements) = (-0.0, 0.0);
    let (mut trainable_fp32, mut largest_gradient) = (-0.0, 0.0);
    for p in plans {
        adapter_params += p.adapters;
        base_trainable += p.trainable;
        stored += p.weight_bytes + p.reference_bytes;
        layer_state += p.state_elements_bytes;
        let elements = state_element_bytes(p);
        all_state_elements += elements;
        most_state_elements = f64::max(most_state_elements, elements);
        trainable_fp32 += p.trainable * 4.0;
        largest_gradient = f64::max(largest_gradient, gradient_bytes(p));
    }
    let weights: f64 = stored + adapter_params * ADAPTER_BYTES;
    let gradients = base_trainable * storage + adapter_params * ADAPTER_BYTES;
    let adapter_state = if adapter_params > 0.0 {
        let one = Layer {
            kind: LayerKind::Linear,
            output_size: 0,
            params: MIN_8BIT_SIZE,
        };
        state_bytes(setup.optimizer, adapter_params, ADAPTER_BYTES, &one, None)
    } else {
        0.0
    };
    let state: f64 = layer_state + adapter_state;
    // The optimizer's temporaries: foreach Adam/Adafactor take one copy of the state's size
    // (the sqrt of the second moments, for all parameters at once); the for-loop one
    // parameter's; fused kernels and bitsandbytes' none to speak of.
    let optimizer_temporaries = match (setup.optimizer, setup.implementation) {
        (Optimizer::Sgd | Optimizer::Momentum, _) => 0.0,
        (o, _) if o.is_8bit() || o.is_paged() => 0.0,
        (_, OptimizerImplementation::Fused) => 0.0,
        (_, OptimizerImplementation::Foreach) => all_state_elements,
        (_, OptimizerImplementation::ForLoop) => most_state_elements,
    };
    // With an fp32 master the step also takes an fp32 copy of the gradients it applies.
    let fp32_gradient_copy = if setup.fp32_master {
        trainable_fp32
    } else {
        0.0
    };
    let optimizer_temporaries = optimizer_temporaries + fp32_gradient_copy;

    ModelState {
        weights,
        gradients,
        state,
        fp32_gradient_copy,
        optimizer_temporaries,
        largest_gradient,
        adapter_params,
        base_trainable,
    }
}

/// What backward's figures read of the layers and their plans whatever the activations,
/// checkpointing and micro-batch: summed once per plan, not once per alternative.
struct LayerSums {
    /// Each layer's output elements per sample.
    outputs: Vec<f64>,
    /// Their sum (at least 1).
    output_total: f64,
    largest_output: f64,
    /// The largest quantised weight dequantised for its matmul, bytes.
    dequantised: f64,
    /// Each adapted layer's input elements per sample (its positions times its inputs),
    /// in layer order: what LoRA's adapters keep of it.
    adapter_inputs: Vec<(usize, f64)>,
}

fn layer_sums(job: &Job, plans: &[LayerPlan]) -> LayerSums {
    let layers = job.layers();
    let details = job.layer_details();
    let outputs: Vec<f64> = layers.iter().map(|l| l.output_size as f64).collect();
    let output_total: f64 = outputs.iter().sum::<f64>().max(1.0);
    let largest_output = outputs.iter().copied().fold(0.0, f64::max);
    let dequantised = plans
        .iter()
        .map(|p| p.dequantised_bytes)
        .fold(0.0, f64::max);
    let adapter_inputs = (0..layers.len())
        .filter(|&i| plans[i].adapters > 0.0)
        .map(|i| {
            let (inputs, outputs) = linear_shape(&layers[i], details.get(i));
            let positions = outputs.max(1.0).recip() * layers[i].output_size as f64;
            (i, positions * inputs)
        })
        .collect();
    LayerSums {
        outputs,
        output_total,
        largest_output,
        dequantised,
        adapter_inputs,
    }
}

/// What backward needs at the step's start, bytes: the activations kept and the temporaries
/// it begins with.
#[derive(Clone, Copy)]
struct KeptForBackward {
    activations: f64,
    backward_temporaries: f64,
    /// Of `activations`, what every tensor-parallel rank keeps whole without sequence
    /// parallelism ([`BLOCK_WHOLE_BYTES`]; the blocks' checkpointed inputs; the embeddings'
    /// output and the final norm's, not the vocabulary-parallel loss).
    whole_under_tensor_parallel: f64,
}

/// Stage three: the activations kept for backward at the micro-batch (checkpointing, freeze
/// tuning, LoRA's inputs) and what backward starts with.
fn kept_for_backward(
    job: &Job,
    setup: &Setup,
    known: Option<KnownActivations>,
    named: &NamedLayers,
    plans: &[LayerPlan],
    sums: &LayerSums,
) -> KeptForBackward {
    let layers = job.layers();
    let details = job.layer_details();
    let precision = setup.precision;
    let storage = precision.storage_bytes();
    let lora = setup.lora.as_ref();
    // Activations kept for backward at the micro-batch, by layer in proportion to its output.
    let micro = setup.micro_batch_size as f64;
    let compute_activation_bytes = precision.compute_bytes();
    let kept_share = if precision.is_autocast() {
        AUTOCAST_KEPT_SHARE
    } else if precision.is_pure_16bit() {
        PURE_16BIT_KEPT_SHARE
    } else {
        1.0
    };
    // A block's input is the residual stream: fp32 under autocast, 16-bit when pure.
    let stream_bytes = storage;
    let (outputs, output_total) = (&sums.outputs, sums.output_total);
    let share =
        |range: &std::ops::Range<usize>| outputs[range.clone()].iter().sum::<f64>() / output_total;
    // Freeze tuning: autograd records nothing before the first layer that trains (no input
    // there requires a gradient), so the frozen layers before it keep no activations. (Not
    // under LoRA, whose adapters start in the first block, nor with a tied head trained: the
    // embeddings' weight then trains, and everything after it records.)
    let frozen_prefix = match (&setup.trainable, lora) {
        (Trainable::Modules(_), None) => plans.iter().position(|p| p.trainable > 0.0).unwrap_or(0),
        _ => 0,
    };
    // What each adapted layer's adapters keep beside the base layer's own input, outside
    // checkpointed blocks (inside, backward recomputes them). PEFT casts the input to the
    // adapters' dtype (fp32, kept so by `autocast_adapter_dtype`) and lora_A keeps what it
    // reads: under pure 16 bits a new fp32 copy, under autocast lora_A's own 16-bit cast, in
    // fp32 the base layer's input itself. Dropout keeps its mask, and its output (fp32, or
    // its 16-bit cast under autocast) is what lora_A keeps.
    let adapter_input_bytes = match lora {
        Some(l) if l.dropout > 0.0 => {
            1.0 + if precision.is_autocast() {
                compute_activation_bytes
            } else {
                ADAPTER_BYTES
            }
        }
        Some(_) if precision.is_pure_16bit() => ADAPTER_BYTES,
        Some(_) if precision.is_autocast() => compute_activation_bytes,
        _ => 0.0,
    };
    // A frozen linear keeps nothing of its input (LoRA's base, freeze tuning's frozen
    // layers); an adapted one's input is lora_A's own where the adapters keep a copy (above).
    let frozen = |i: usize| {
        !plans[i].weight_trains && (plans[i].adapters == 0.0 || adapter_input_bytes > 0.0)
    };
    // (A model built from its configuration counts its activations tensor by tensor.)
    let frozen_inputs = if known.is_some() || plans.iter().all(|p| p.weight_trains) {
        0.0
    } else {
        saved::frozen_linear_inputs(layers, details, frozen_prefix, frozen) as f64
            * micro
            * compute_activation_bytes
    };
    let kept = match (known, job.saved_tensors()) {
        (Some(k), _) => {
            let frozen_blocks = job
                .blocks()
                .iter()
                .filter(|r| r.end <= frozen_prefix)
                .count()
                .min(k.blocks as usize) as f64;
            (k.outside + k.per_block * (k.blocks as f64 - frozen_blocks)) * micro + k.fixed
        }
        (None, Some(saved)) => (saved.bytes_at(setup.micro_batch_size)
            * kept_share
            * (1.0 - share(&(0..frozen_prefix)))
            - frozen_inputs)
            .max(0.0),
        (None, None) => {
            (output_total * micro * 4.0 * kept_share * (1.0 - share(&(0..frozen_prefix)))
                - frozen_inputs)
                .max(0.0)
        }
    };
    let checkpointed: &[std::ops::Range<usize>] = match &setup.checkpointing {
        Checkpointing::None => &[],
        Checkpointing::Full => job.blocks(),
        Checkpointing::Modules(_) => named.checkpointed(),
    };
    let whole_share = BLOCK_WHOLE_BYTES / BLOCK_BYTES;
    let mut whole = kept * whole_share;
    let activations = if checkpointed.is_empty() {
        if let Some(k) = known {
            whole = (k.outside - k.loss + whole_share * k.per_block * k.blocks as f64) * micro;
        }
        kept
    } else if let (Some(k), Checkpointing::Full) = (known, &setup.checkpointing) {
        // Every block keeps its input. Backward starts with the loss's tensors and gradients;
        // the first block it recomputes comes once they are freed: the larger of the two.
        let inputs = k.outside + k.blocks as f64 * k.block_input;
        let recomputing = inputs - k.loss + k.per_block;
        let whole_inputs = inputs - k.loss;
        if recomputing > inputs + k.backward_temporaries {
            whole = (whole_inputs + whole_share * k.per_block) * micro;
            k.fixed + recomputing * micro
        } else {
            whole = whole_inputs * micro;
            k.fixed + inputs * micro
        }
    } else {
        // Each checkpointed block keeps only its input; backward recomputes one at a time.
        let inside: f64 = checkpointed.iter().map(share).sum::<f64>().min(1.0);
        let inputs: f64 = checkpointed
            .iter()
            .map(|r| {
                let before = r
                    .start
                    .checked_sub(1)
                    .map_or(outputs[r.start], |i| outputs[i]);
                before * micro * stream_bytes
            })
            .sum();
        let largest = checkpointed.iter().map(share).fold(0.0, f64::max);
        kept * (1.0 - inside) + inputs + kept * largest
    };
    let adapter_inputs = if adapter_input_bytes > 0.0 {
        // Which layers a checkpointed block holds, marked once (not each block asked per layer).
        let mut inside = vec![
            false;
            if checkpointed.is_empty() {
                0
            } else {
                layers.len()
            }
        ];
        for range in checkpointed {
            for i in range.clone().take_while(|&i| i < layers.len()) {
                inside[i] = true;
            }
        }
        sums.adapter_inputs
            .iter()
            .filter(|&&(i, _)| !inside.get(i).copied().unwrap_or(false))
            .map(|&(_, per_sample)| per_sample * micro * adapter_input_bytes)
            .sum::<f64>()
    } else {
        0.0
    };
    let activations = activations + adapter_inputs;
    // Backward starts with the gradient of the loss's input (the logits, in fp32 for a
    // language model's loss) beside what it keeps.
    let (largest_output, dequantised) = (sums.largest_output, sums.dequantised);
    let backward_temporaries = dequantised
        + match known {
            Some(k) => k.backward_temporaries * micro,
            None => largest_output * micro * 4.0,
        };

    KeptForBackward {
        activations,
        backward_temporaries,
        whole_under_tensor_parallel: whole.clamp(0.0, activations),
    }
}

/// A block's activations per token and hidden unit, bytes in 16 bits, and what of them every
/// tensor-parallel rank reads whole without sequence parallelism: the two norms' inputs and
/// the inputs of attention's and the MLP's first linears. Korthikanti et al. (2022) count 10
/// of GPT's 34 (with dropout's masks); a Llama-style block (SwiGLU at 3.5x, no dropout)
/// keeps about 44, 8 of them whole.
const BLOCK_BYTES: f64 = 44.0;
const BLOCK_WHOLE_BYTES: f64 = 8.0;
/// What a checkpointed block keeps: its input, per token and hidden unit in 16 bits.
const BLOCK_INPUT_BYTES: f64 = 2.0;

/// The share of the activations one tensor-parallel rank holds. Sequence parallelism splits
/// them all; without it (Megatron's default) each rank keeps a block's norm and linear inputs
/// whole, and under full checkpointing the blocks' inputs too (one block is recomputed at a
/// time). The loss's logits stay split: vocabulary-parallel.
fn tensor_share(job: &Job, setup: &Setup) -> f64 {
    let p = setup.parallelism;
    let t = p.tensor as f64;
    if p.tensor <= 1 || p.sequence_parallel {
        return 1.0 / t;
    }
    let blocks = job.blocks().len() as f64;
    let whole = match setup.checkpointing {
        Checkpointing::Full if blocks > 0.0 => {
            let inputs = BLOCK_INPUT_BYTES * blocks;
            (inputs + BLOCK_WHOLE_BYTES) / (inputs + BLOCK_BYTES)
        }
        _ => BLOCK_WHOLE_BYTES / BLOCK_BYTES,
    };
    whole + (1.0 - whole) / t
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
