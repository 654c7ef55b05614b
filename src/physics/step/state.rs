//! Stages one and two of the analytic step: each layer's plan (what trains, the weights as
//! stored, the reference copy, the optimizer state, the dequantised weight), the whole model's
//! state from the plans, and the sums over layers that what backward keeps reads.

use crate::job::matched::NamedLayers;
use crate::job::setup::{
    BaseWeights, ExpertLayout, LoraTargets, Optimizer, OptimizerImplementation, Reference, Setup,
    Trainable,
};
use crate::job::validated::{Job, Layer, LayerKind};
use crate::job::KnownActivations;
use crate::job::LayerDetail;
use crate::physics::shapes;

use super::ADAPTER_BYTES;

/// bitsandbytes keeps 32-bit state for parameters below this size (`min_8bit_size`).
pub(super) const MIN_8BIT_SIZE: u64 = 4096;
/// 8-bit Adam: two uint8 states and an fp32 absmax per 256-element block of each.
pub(super) const ADAM_8BIT_BYTES: f64 = 2.0 + 2.0 * 4.0 / 256.0;
/// NF4 with double quantisation: 4 bits, an 8-bit absmax per 64 weights, an fp32 scale per
/// 256 of those (QLoRA, Dettmers et al. 2023: 4.127 bits per weight).
pub(super) const NF4_BYTES: f64 = 0.5 + 1.0 / 64.0 + 4.0 / (64.0 * 256.0);

pub(super) fn is_matmul(kind: LayerKind) -> bool {
    kind == LayerKind::Linear || kind == LayerKind::Attention || kind.is_convolution()
}

/// A linear layer's (in, out), as [`shapes::linear_shape`] reads it for the step's time too.
pub(super) fn linear_shape(layer: &Layer, detail: Option<&LayerDetail>) -> (f64, f64) {
    let shape = shapes::linear_shape(layer, detail, None);
    (shape.inputs, shape.outputs)
}

/// An embedding table's two factors for Adafactor: its (vocabulary, width) where given, else a
/// square guess (the vocabulary is not in a layer list).
pub(super) fn embedding_factors(layer: &Layer, detail: Option<&LayerDetail>) -> (f64, f64) {
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
pub(super) struct LayerPlan {
    /// Base parameters that train.
    pub(super) trainable: f64,
    /// Whether the layer's own weight trains (a tied head's: the embedding's).
    pub(super) weight_trains: bool,
    /// LoRA adapter parameters on this layer.
    pub(super) adapters: f64,
    /// Bytes of the base weights as stored.
    pub(super) weight_bytes: f64,
    /// Bytes of a frozen reference copy of this layer (DPO's `ref_model`).
    pub(super) reference_bytes: f64,
    /// Bytes of the optimizer state of this layer's trainable base parameters (non-adapter).
    pub(super) state_elements_bytes: f64,
    /// The (in, out) factors of the layer's matrix (Adafactor's), for a linear layer or an
    /// embedding table.
    pub(super) shape: Option<(f64, f64)>,
    /// Bytes of this layer's quantised weight dequantised for its matmul (compute dtype).
    pub(super) dequantised_bytes: f64,
}

/// The optimizer state bytes of `elements` trainable parameters of one layer stored in
/// `storage` bytes each (Adafactor factors a linear weight into its row and column).
pub(super) fn state_bytes(
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

/// Stage one: each layer's trainable parameters, adapters, stored weights, reference copy,
/// optimizer state and dequantised weight, whole model.
pub(super) fn plan_layers(
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
pub(super) fn layer_state_bytes(
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
pub(super) fn stored_weight_bytes(
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
pub(super) struct ModelState {
    pub(super) weights: f64,
    pub(super) gradients: f64,
    pub(super) state: f64,
    /// Of which the fp32 copy of the gradients a step on an fp32 master takes.
    pub(super) fp32_gradient_copy: f64,
    pub(super) optimizer_temporaries: f64,
    pub(super) largest_gradient: f64,
    pub(super) adapter_params: f64,
    pub(super) base_trainable: f64,
}

/// Stage two: the model state of the planned layers.
pub(super) fn model_state(plans: &[LayerPlan], setup: &Setup) -> ModelState {
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
pub(super) struct LayerSums {
    /// Each layer's output elements per sample.
    pub(super) outputs: Vec<f64>,
    /// Their sum (at least 1).
    pub(super) output_total: f64,
    pub(super) largest_output: f64,
    /// The largest quantised weight dequantised for its matmul, bytes.
    pub(super) dequantised: f64,
    /// Each adapted layer's input elements per sample (its positions times its inputs),
    /// in layer order: what LoRA's adapters keep of it.
    pub(super) adapter_inputs: Vec<(usize, f64)>,
}

pub(super) fn layer_sums(job: &Job, plans: &[LayerPlan]) -> LayerSums {
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
