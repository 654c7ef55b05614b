//! What one rank of an offloading job holds in host memory, from the same model state as the
//! GPU's figure.

use crate::job::setup::Strategy;
use crate::job::validated::Job;

use super::state::{model_state, plan_layers};

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
