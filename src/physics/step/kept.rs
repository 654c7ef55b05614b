//! Stage three of the analytic step: the activations kept for backward at the micro-batch
//! (checkpointing, freeze tuning, LoRA's inputs), what backward starts with, and the share of
//! them one tensor-parallel rank holds.

use crate::job::matched::NamedLayers;
use crate::job::setup::{Checkpointing, Setup, Trainable};
use crate::job::validated::Job;
use crate::job::KnownActivations;
use crate::physics::saved;

use super::state::{LayerPlan, LayerSums};
use super::ADAPTER_BYTES;

/// The share of the traced fp32 saved bytes a step keeps under autocast: matmuls and
/// convolutions save 16-bit inputs, norms, softmax and losses fp32 ones. The median, over five
/// models, of describe's simulated autocast activations at the peak over the traced fp32 bytes
/// (describe/scripts/autocast_kept_share.py: a Llama 0.646, GPT-2 0.856, ViT-B 0.757,
/// ResNet-50 0.532, ConvNeXt-T 0.585).
pub(super) const AUTOCAST_KEPT_SHARE: f64 = 0.65;
/// The same share under pure bf16/fp16.
pub(super) const PURE_16BIT_KEPT_SHARE: f64 = 0.5;

/// What backward needs at the step's start, bytes: the activations kept and the temporaries
/// it begins with.
#[derive(Clone, Copy)]
pub(super) struct KeptForBackward {
    pub(super) activations: f64,
    pub(super) backward_temporaries: f64,
    /// Of `activations`, what every tensor-parallel rank keeps whole without sequence
    /// parallelism ([`BLOCK_WHOLE_BYTES`]; the blocks' checkpointed inputs; the embeddings'
    /// output and the final norm's, not the vocabulary-parallel loss).
    pub(super) whole_under_tensor_parallel: f64,
}

/// Stage three: the activations kept for backward at the micro-batch (checkpointing, freeze
/// tuning, LoRA's inputs) and what backward starts with.
pub(super) fn kept_for_backward(
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
pub(super) const BLOCK_BYTES: f64 = 44.0;
pub(super) const BLOCK_WHOLE_BYTES: f64 = 8.0;
/// What a checkpointed block keeps: its input, per token and hidden unit in 16 bits.
pub(super) const BLOCK_INPUT_BYTES: f64 = 2.0;

/// The share of the activations one tensor-parallel rank holds. Sequence parallelism splits
/// them all; without it (Megatron's default) each rank keeps a block's norm and linear inputs
/// whole, and under full checkpointing the blocks' inputs too (one block is recomputed at a
/// time). The loss's logits stay split: vocabulary-parallel.
pub(super) fn tensor_share(job: &Job, setup: &Setup) -> f64 {
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
