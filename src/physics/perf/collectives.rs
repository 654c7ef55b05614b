//! Data-parallel collectives as ring algorithms move them, and how much of them compute hides.

use crate::devices::performance::GpuPerformance;
use crate::job::setup::{BaseWeights, Strategy};
use crate::job::validated::{Job, LayerKind};

use super::*;

/// GPUs of one node: rings of more ranks cross nodes, over [`INTER_NODE_GB_S`].
pub(super) const GPUS_PER_NODE: u64 = 8;
/// One 200 Gb/s InfiniBand (HDR) port per GPU, each way: a ring across nodes runs at it.
pub(super) const INTER_NODE_GB_S: f64 = 25.0;
/// Share of the link's bandwidth NCCL's ring collectives reach (bus bandwidth in nccl-tests:
/// ~230 of NVLink 3's 300 GB/s, ~75 % on PCIe).
pub(super) const COLLECTIVE_EFFICIENCY: f64 = 0.75;
/// A DDP bucket (25 MiB): the last one's all-reduce starts when backward ends.
pub(super) const DDP_BUCKET_BYTES: f64 = 25.0 * 1024.0 * 1024.0;

/// One micro-batch's forward and backward times (us) and the micro-batches of a step.
pub(super) struct Phases {
    pub(super) forward_us: f64,
    pub(super) backward_us: f64,
    pub(super) accumulation: f64,
}

/// The data-parallel collectives of one optimizer step (us): all of them, and the part that
/// compute does not hide.
pub(super) struct Collectives {
    pub(super) total_us: f64,
    pub(super) exposed_us: f64,
}

/// Data-parallel collectives over `d` ranks, as ring algorithms move them (each rank sends
/// (d-1)/d of the tensor per all-gather or reduce-scatter, twice that per all-reduce), on the
/// card's link ([`GpuPerformance::interconnect_gb_s`], or InfiniBand when the ranks span
/// nodes) at [`COLLECTIVE_EFFICIENCY`]:
///
/// - DDP: one all-reduce of the trained gradients per step (accumulation runs `no_sync`),
///   overlapped with the last micro-batch's backward but for its last bucket.
/// - ZeRO-1/2: the gradients reduce-scattered under the last backward, the updated weights
///   all-gathered after the optimizer (exposed).
/// - FSDP/ZeRO-3: every micro-batch gathers the weights for forward and again for backward
///   and reduce-scatters the gradients; prefetching hides them behind that pass's compute.
///
/// Tensor, pipeline and context parallelism's own traffic (activations) is not modelled.
pub(super) fn collectives(
    job: &Job,
    gpu: &GpuPerformance,
    shares: &[f64],
    adapters: &[bool],
    stage: usize,
    phases: Phases,
) -> Collectives {
    let setup = job.setup();
    let p = setup.parallelism;
    let d = p.data();
    if d <= 1 || p.strategy == Strategy::None {
        return Collectives {
            total_us: 0.0,
            exposed_us: 0.0,
        };
    }
    let layers = &job.layers()[..stage.min(job.layers().len())];
    let model_shard = p.tensor as f64;
    let rank = setup.lora.as_ref().map_or(0.0, |l| l.rank as f64);
    let quantised = setup.lora.as_ref().and_then(|l| match l.base_weights {
        b if b.is_4bit() => Some(0.5),
        BaseWeights::Int8 => Some(1.0),
        _ => None,
    });
    // Bytes of the weights one rank gathers and of the gradients it reduces (the latter in
    // the storage dtype: fp32 under autocast; adapters train in fp32).
    let storage = setup.precision.storage_bytes();
    let (mut weight_bytes, mut gradient_bytes) = (0.0, 0.0);
    for (i, layer) in layers.iter().enumerate() {
        let params = layer.params as f64 / model_shard;
        let per_weight = match quantised {
            Some(bytes) if layer.kind == LayerKind::Linear => bytes,
            _ => storage,
        };
        weight_bytes += params * per_weight;
        gradient_bytes += params * shares[i] * storage;
        if adapters[i] {
            let shape = linear_shape(layer, job.layer_details().get(i), None);
            let elements = rank * (shape.inputs + shape.outputs) / model_shard;
            weight_bytes += elements * 4.0;
            gradient_bytes += elements * 4.0;
        }
    }
    let link = if p.world_size > GPUS_PER_NODE {
        gpu.interconnect_gb_s.min(INTER_NODE_GB_S)
    } else {
        gpu.interconnect_gb_s
    };
    let bytes_per_us = link * 1e3 * COLLECTIVE_EFFICIENCY;
    let ring = (d - 1) as f64 / d as f64;
    let gather = |bytes: f64| ring * bytes / bytes_per_us;
    let Phases {
        forward_us,
        backward_us,
        accumulation,
    } = phases;
    match p.strategy {
        Strategy::None => unreachable!("returned above"),
        Strategy::Ddp => {
            let all_reduce = 2.0 * gather(gradient_bytes);
            let last_bucket = 2.0 * gather(gradient_bytes.min(DDP_BUCKET_BYTES));
            Collectives {
                total_us: all_reduce,
                exposed_us: (all_reduce - backward_us).max(last_bucket),
            }
        }
        Strategy::Zero1 | Strategy::Zero2 => {
            let reduce = gather(gradient_bytes);
            let weights = gather(weight_bytes);
            Collectives {
                total_us: reduce + weights,
                exposed_us: (reduce - backward_us).max(0.0) + weights,
            }
        }
        Strategy::Fsdp | Strategy::Zero3 => {
            let forward = gather(weight_bytes);
            let backward = gather(weight_bytes) + gather(gradient_bytes);
            // The first layer's gather waits for nothing to hide behind.
            let first = forward / layers.iter().filter(|l| l.params > 0).count().max(1) as f64;
            let exposed =
                (forward - forward_us).max(0.0) + first + (backward - backward_us).max(0.0);
            Collectives {
                total_us: (forward + backward) * accumulation,
                exposed_us: exposed * accumulation,
            }
        }
    }
}
