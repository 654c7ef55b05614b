//! A first-principles performance model of one training step on one GPU: the kernels a PyTorch
//! eager step launches (forward, backward, recomputation, loss, optimizer), each timed on a
//! roofline (FLOPs at the dtype's achievable peak, or bytes at the achievable DRAM bandwidth,
//! over the share of the SMs its thread blocks occupy), and issued by a host that needs
//! [`Constants::host_us_per_op`] per op: when kernels are shorter than their dispatch, the GPU
//! waits. From that timeline come the step time, samples/s, and the utilization DCGM would
//! report: SMACT (time-weighted share of SMs with work), SMOCC (resident warps over the SM's
//! maximum, time-weighted) and DRAMA (bytes moved over the bytes the DRAM could have moved).
//!
//! docs/design/roofline.md describes the model, its constants and how it was evaluated.

use crate::devices::performance::GpuPerformance;
use crate::job::setup::{Checkpointing, LoraTargets, Strategy, Trainable};
use crate::job::validated::{Family, Job, LayerKind};
use crate::physics::step;

mod collectives;
mod kernels;
mod shapes;
mod timeline;

use collectives::*;
use kernels::*;
use shapes::*;
use timeline::*;

/// The model's tunable constants. Two were fitted ([`CALIBRATED`]); the efficiencies are
/// the commonly achieved shares of the data-sheet peaks and were left fixed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Constants {
    /// Host time to dispatch one op in eager PyTorch (Python, the dispatcher, autograd, the
    /// launch itself): ~10-30 us measured on typical servers.
    pub host_us_per_op: f64,
    /// Host time per optimizer step outside the ops modelled: the training loop's Python,
    /// the input batch, `zero_grad`, the loss's `.item()` synchronisation. The GPU is idle.
    pub step_host_us: f64,
    /// Host time per element of an MLP step's input batch, ns: making the batch and copying
    /// it to the GPU while the GPU waits (GPUMemNet's loop draws random inputs on the host
    /// every step). Other families pay the copy alone ([`PCIE_GB_S`]).
    pub input_host_ns_per_element: f64,
    /// Share of the dense tensor/CUDA-core peak large GEMMs reach (cuBLAS: 70-80 %).
    pub compute_efficiency: f64,
    /// Share of the DRAM bandwidth streaming kernels reach (~80-90 % in STREAM-like tests).
    pub memory_efficiency: f64,
}

/// The constants the service answers with. `host_us_per_op` and `step_host_us` were fitted on
/// the MLP training rows' measured SMACT and SMOCC (data/mlp/train_utilization.jsonl.gz) with
/// leave-one-shape-out folds: `cargo run --release --example fit_roofline` prints the grid,
/// the folds and the choice.
pub const CALIBRATED: Constants = Constants {
    host_us_per_op: 15.0,
    step_host_us: 1000.0,
    input_host_ns_per_element: 3.0,
    compute_efficiency: 0.7,
    memory_efficiency: 0.8,
};

/// What the model says of one training step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Roofline {
    /// One optimizer step: every micro-batch's forward and backward, the optimizer, the
    /// host's fixed cost.
    pub step_time_ms: f64,
    pub samples_per_s: f64,
    /// Summed over the step's micro-batches (recomputation is in backward).
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub optimizer_ms: f64,
    pub bound: Bound,
    pub smact: f64,
    pub smocc: f64,
    pub drama: f64,
    /// FLOPs and DRAM bytes of one step.
    pub flops: f64,
    pub bytes: f64,
    /// The step's data-parallel collectives on the interconnect, overlapped with compute or
    /// not ([`collectives`]); only the part compute does not hide is in `step_time_ms`.
    pub collectives_ms: f64,
}

/// What bounds the step: the GPU's arithmetic, its memory, or the host's dispatch (the GPU
/// waiting for work).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bound {
    Compute,
    Memory,
    Overhead,
    /// Data-parallel collectives that compute does not hide.
    Communication,
}

impl Bound {
    pub fn as_str(self) -> &'static str {
        match self {
            Bound::Compute => "compute",
            Bound::Memory => "memory",
            Bound::Overhead => "overhead",
            Bound::Communication => "communication",
        }
    }
}

/// The roofline of `job` on `gpu` with the calibrated constants.
pub fn roofline(job: &Job, gpu: &GpuPerformance) -> Roofline {
    roofline_with(job, gpu, &CALIBRATED)
}

/// The step of `job` on `gpu` with `constants`.
pub fn roofline_with(job: &Job, gpu: &GpuPerformance, constants: &Constants) -> Roofline {
    let setup = job.setup();
    let layers = job.layers();
    let precision = setup.precision;
    let storage = precision.storage_bytes();
    let max_warps = f64::from(gpu.max_warps_per_sm);
    let p = setup.parallelism;
    // Tensor parallelism gives each GPU 1/t of every layer's outputs, context parallelism 1/c
    // of the positions, pipeline parallelism the first 1/p of the layers (the first stage,
    // which also holds the most activations). Collectives are not modelled.
    let stage = layers.len().div_ceil(p.pipeline.max(1) as usize);
    let inferred = inferred_linear_shapes(job);
    let attention: Vec<Option<AttentionRead>> = (0..layers.len())
        .map(|i| {
            (layers[i].kind == LayerKind::Attention).then(|| attention_read(job, i, &inferred))
        })
        .collect();
    let roles = LayerRoles::of(job);
    // One micro-batch from a synchronised start; the step repeats it `accumulation` times.
    let step = Step {
        job,
        micro: setup.micro_batch_size as f64,
        split: (p.tensor * p.context) as f64,
        seq: job
            .input_shape()
            .filter(|s| s.len() == 1)
            .map(|s| s[0] as f64),
        element: activation_bytes(precision),
        inferred: &inferred,
        attention: &attention,
    };
    let mut timeline = Timeline::new(gpu, constants, precision);
    let (mut forward_us, mut backward_us) = micro_batch(&mut timeline, &step, &roles, stage);
    let (shares, adapters) = (&roles.shares, &roles.adapters);
    let trains_share = |i: usize| shares[i];
    let adapted = |i: usize| adapters[i];
    let accumulation = setup.accumulation.max(1) as f64;
    let micro_us = timeline.done;
    let collectives = collectives(
        job,
        gpu,
        shares,
        adapters,
        stage,
        Phases {
            forward_us,
            backward_us,
            accumulation,
        },
    );
    // Scale the micro-batch's sums to the step.
    let mut scaled = Sums::of(&timeline).times(accumulation);
    forward_us *= accumulation;
    backward_us *= accumulation;

    // The optimizer step, from a synchronised start: on the GPU, unless its state is offloaded
    // (then the CPU steps, in `offload_us`).
    let mut optimizer = Timeline::new(gpu, constants, precision);
    if !setup.offload.optimizer_state {
        optimizer_kernels(
            &mut optimizer,
            job,
            &trains_share,
            &adapted,
            storage,
            max_warps,
        );
    }
    let optimizer_us = optimizer.sync();
    scaled = scaled.plus(Sums::of(&optimizer));

    // The fitted host cost per input element is GPUMemNet's loop's (MLPs on random batches
    // drawn on the host each step); CNN and transformer jobs normally load through a
    // DataLoader whose workers prepare batches ahead, leaving the copy to the GPU.
    let input_ns = if job.family() == Family::Mlp {
        constants.input_host_ns_per_element
    } else {
        4.0 / PCIE_GB_S
    };
    let input_us =
        input_elements(job) * setup.micro_batch_size as f64 * accumulation * input_ns * 1e-3;
    let offload_us = match setup.offload.any() {
        true => step::host_memory(job).map_or(0.0, |host| {
            offload_us(job, &host, forward_us, backward_us, accumulation)
        }),
        false => 0.0,
    };
    let step_us = micro_us * accumulation
        + optimizer_us
        + constants.step_host_us
        + input_us
        + collectives.exposed_us
        + offload_us;
    let busy = scaled.compute_us + scaled.memory_us;
    let idle = (step_us - busy - collectives.exposed_us).max(0.0);
    let exposed = collectives.exposed_us;
    let bound = if exposed >= idle && exposed >= scaled.compute_us && exposed >= scaled.memory_us {
        Bound::Communication
    } else if idle >= scaled.compute_us && idle >= scaled.memory_us {
        Bound::Overhead
    } else if scaled.compute_us >= scaled.memory_us {
        Bound::Compute
    } else {
        Bound::Memory
    };
    let seconds = step_us * 1e-6;
    Roofline {
        step_time_ms: step_us * 1e-3,
        samples_per_s: setup.micro_batch_size as f64 * accumulation / seconds,
        forward_ms: forward_us * 1e-3,
        backward_ms: backward_us * 1e-3,
        optimizer_ms: optimizer_us * 1e-3,
        bound,
        smact: (scaled.sm_busy / step_us).clamp(0.0, 1.0),
        smocc: (scaled.warps / step_us).clamp(0.0, 1.0),
        drama: (scaled.bytes / (seconds * gpu.memory_bandwidth_gb_s * 1e9)).clamp(0.0, 1.0),
        flops: scaled.flops,
        bytes: scaled.bytes,
        collectives_ms: collectives.total_us * 1e-3,
    }
}

/// Host memory one GPU's process streams per second in a CPU optimizer step (DeepSpeed's
/// CPU-Adam, AVX on the few cores each GPU's process gets): an assumption of this model, not
/// fitted on measured offload runs.
const HOST_OPTIMIZER_GB_S: f64 = 10.0;

/// What offload adds to a step, us, beyond what the GPU's work hides (ZeRO-Offload, FSDP's
/// `CPUOffload`): the gradients copied down as backward makes them (hidden behind backward;
/// ZeRO-1/2 copy every micro-batch's, accumulated on the CPU), the CPU optimizer's step over
/// the state, master weights and gradients it holds (the GPU waits), the updated weights copied
/// back up before the next forward, and offloaded weights brought in for each micro-batch's
/// forward and backward (prefetched: hidden behind both).
fn offload_us(
    job: &Job,
    host: &step::HostMemory,
    forward_us: f64,
    backward_us: f64,
    accumulation: f64,
) -> f64 {
    let setup = job.setup();
    let storage = setup.precision.storage_bytes();
    let pcie_us = |bytes: f64| bytes / (PCIE_GB_S * 1e3);
    let copies = match setup.parallelism.strategy {
        Strategy::Zero1 | Strategy::Zero2 => accumulation,
        _ => 1.0,
    };
    let down = pcie_us(host.stepped_params * storage * copies);
    let cpu_step = (2.0 * host.optimizer_state + host.gradients) / (HOST_OPTIMIZER_GB_S * 1e3);
    let up = pcie_us(host.stepped_params * storage);
    let fetch = pcie_us(2.0 * host.parameters * accumulation);
    (down - backward_us).max(0.0) + cpu_step + up + (fetch - forward_us - backward_us).max(0.0)
}

/// What each layer does in the step: the share of its weights that trains, whether it carries
/// LoRA adapters, whether backward computes its input's gradient, whether it is recomputed.
struct LayerRoles {
    shares: Vec<f64>,
    adapters: Vec<bool>,
    input_grad: Vec<bool>,
    recomputed: Vec<bool>,
}

impl LayerRoles {
    /// Read as the memory step reads them, from the module lists matched once per job.
    fn of(job: &Job) -> LayerRoles {
        let setup = job.setup();
        let layers = job.layers();
        let head = layers.iter().rposition(|l| l.kind == LayerKind::Linear);
        let total_params: f64 = layers.iter().map(|l| l.params as f64).sum();

        // Which layers train their weights, which carry LoRA adapters (as the memory step reads
        // them, from the module lists matched once per job).
        let lora = setup.lora.as_ref();
        let named = job.named_layers(setup);
        let trains_share = |i: usize| -> f64 {
            if layers[i].params == 0 {
                return 0.0;
            }
            match (&setup.trainable, lora) {
                (Trainable::Modules(_), _) => f64::from(u8::from(named.trainable(i))),
                (_, Some(_)) => 0.0,
                (Trainable::Params(n), None) if total_params > 0.0 => {
                    (*n as f64 / total_params).min(1.0)
                }
                _ => 1.0,
            }
        };
        let adapted = |i: usize| -> bool {
            let Some(lora) = lora else { return false };
            layers[i].kind == LayerKind::Linear
                && match &lora.targets {
                    LoraTargets::AllLinear => Some(i) != head,
                    LoraTargets::Names(_) => named.targeted(i),
                }
        };
        // Backward computes a layer's input gradient only when something before it trains.
        let first_trained = (0..layers.len()).find(|&i| trains_share(i) > 0.0 || adapted(i));
        let needs_input_grad = |i: usize| first_trained.is_some_and(|f| i > f);
        let recomputed: &[std::ops::Range<usize>] = match &setup.checkpointing {
            Checkpointing::None => &[],
            Checkpointing::Full => job.blocks(),
            Checkpointing::Modules(_) => named.checkpointed(),
        };
        let mut is_recomputed = vec![false; layers.len()];
        for range in recomputed {
            is_recomputed[range.clone()]
                .iter_mut()
                .for_each(|r| *r = true);
        }
        let shares: Vec<f64> = (0..layers.len()).map(trains_share).collect();
        let adapters: Vec<bool> = (0..layers.len()).map(adapted).collect();
        let input_grad = (0..layers.len()).map(needs_input_grad).collect();
        LayerRoles {
            shares,
            adapters,
            input_grad,
            recomputed: is_recomputed,
        }
    }

    fn role(&self, i: usize) -> LayerRole {
        LayerRole {
            adapted: self.adapters[i],
            trains: self.shares[i],
            input_grad: self.input_grad[i],
        }
    }
}

/// Stage two: one micro-batch's forward, loss and backward (recomputation included) on
/// `timeline` from a synchronised start, repeated blocks timed once; its forward and backward
/// times, us.
fn micro_batch(
    timeline: &mut Timeline,
    step: &Step,
    roles: &LayerRoles,
    stage: usize,
) -> (f64, f64) {
    let job = step.job;
    let layers = job.layers();
    let details = job.layer_details();
    let detail = |i: usize| details.get(i);
    let micro = step.micro;
    let max_warps = f64::from(timeline.gpu.max_warps_per_sm);
    let is_recomputed = &roles.recomputed;
    let (inferred, attention) = (step.inferred, step.attention);
    let mut forward_us = 0.0;
    let mut backward_us = 0.0;
    let forward = |t: &mut Timeline, i: usize| {
        layer_kernels(
            t,
            step,
            i,
            Pass::Forward,
            LayerRole {
                adapted: roles.adapters[i],
                trains: 0.0,
                input_grad: false,
            },
        )
    };
    // Repeated blocks that launch the same kernels are timed once and applied as many times.
    let role = |i: usize| roles.role(i);
    let key = |i: usize| LayerKey {
        layer: layers[i],
        in_features: detail(i).and_then(|d| d.in_features),
        out_features: detail(i).and_then(|d| d.out_features),
        flops: detail(i).and_then(|d| d.flops),
        inferred: inferred[i],
        attention: attention[i],
        role: role(i),
        recomputed: is_recomputed[i],
    };
    // Each layer's key once: comparing every block's layers with the first's reads them all.
    let keys: Vec<LayerKey> = (0..stage).map(key).collect();
    let repeats = repeats(job.blocks(), stage, |a, b| keys[a] == keys[b]);
    let mut next = repeats.iter().peekable();
    let mut i = 0;
    while i < stage {
        match next.next_if(|(first, _)| first.start == i) {
            Some((first, count)) => {
                let mut block = timeline.recording();
                first.clone().for_each(|j| forward(&mut block, j));
                timeline.repeat(&block.span(), *count);
                i += first.len() * count;
            }
            None => {
                forward(timeline, i);
                i += 1;
            }
        }
    }
    let out = layers.last().map_or(1.0, |l| l.output_size as f64) * micro;
    timeline.run(
        elementwise(out, 3.0 * out * 4.0, max_warps),
        LOSS_KERNELS / 2,
    );
    forward_us += timeline.done;
    let started = timeline.done;
    timeline.run(
        elementwise(out, 3.0 * out * 4.0, max_warps),
        LOSS_KERNELS / 2,
    );
    let backward = |t: &mut Timeline, i: usize| {
        if is_recomputed[i] {
            forward(t, i);
        }
        layer_kernels(t, step, i, Pass::Backward, role(i));
    };
    let mut next = repeats.iter().rev().peekable();
    let mut i = stage;
    while i > 0 {
        match next.next_if(|(first, count)| first.start + first.len() * count == i) {
            Some((first, count)) => {
                let mut block = timeline.recording();
                first.clone().rev().for_each(|j| backward(&mut block, j));
                timeline.repeat(&block.span(), *count);
                i -= first.len() * count;
            }
            None => {
                i -= 1;
                backward(timeline, i);
            }
        }
    }
    backward_us += timeline.sync() - started;
    (forward_us, backward_us)
}

/// Elements of one sample's input: the input shape's, else the first layer's inputs.
fn input_elements(job: &Job) -> f64 {
    if let Some(shape) = job.input_shape() {
        return shape.iter().map(|&d| d as f64).product();
    }
    let Some(first) = job.layers().first() else {
        return 0.0;
    };
    let detail = job.layer_details().first();
    match first.kind {
        LayerKind::Linear => {
            let s = linear_shape(first, detail, None);
            s.positions * s.inputs
        }
        k if k.is_convolution() => {
            let s = conv_shape(first, detail);
            s.positions * s.inputs
        }
        _ => first.output_size as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::sku::Catalogue;
    use crate::job::setup::{Precision, UncheckedLora, UncheckedNames, UncheckedSetup};
    use crate::job::validated::UncheckedLayer;
    use crate::job::LayerDetail;

    #[test]
    fn issuing_many_kernels_at_once_matches_issuing_them_one_by_one() {
        for (host_op, duration) in [(15.0, 3.0), (15.0, 15.0), (15.0, 40.0), (2.0, 0.5)] {
            for (host, done) in [(0.0, 0.0), (100.0, 20.0), (10.0, 500.0)] {
                for n in [0u32, 1, 2, 7, 300] {
                    let (mut h, mut d) = (host, done);
                    for _ in 0..n {
                        h += host_op;
                        d = f64::max(d, h) + duration;
                    }
                    let (ch, cd) = issue(host, done, host_op, duration, f64::from(n));
                    assert!((ch - h).abs() < 1e-6 * h.max(1.0), "host {ch} vs {h}");
                    assert!(
                        (cd - d).abs() < 1e-6 * d.max(1.0),
                        "done {cd} vs {d} ({host_op}, {duration}, {host}, {done}, {n})"
                    );
                }
            }
        }
    }

    fn a100() -> GpuPerformance {
        Catalogue::builtin().by_id("a100-40gb").unwrap().performance
    }

    /// Each pair equal to a billionth of the larger magnitude (one where both are tiny).
    fn assert_close(pairs: &[(f64, f64)], context: &str) {
        for &(a, b) in pairs {
            let scale = a.abs().max(b.abs()).max(1e-9);
            assert!((a - b).abs() <= 1e-9 * scale, "{a} vs {b} ({context})");
        }
    }

    #[test]
    fn a_recorded_span_repeated_matches_issuing_its_kernels_again_and_again() {
        let gpu = a100();
        // Host-bound (tiny), GPU-bound (large) and mixed runs of kernels.
        let kernels = [
            (elementwise(1e3, 8e3, 64.0), 1),
            (gemm(4096.0, 4096.0, 4096.0, 2.0, Unit::Matmul, 108.0), 1),
            (elementwise(1e5, 8e5, 64.0), 3),
            (gemm(64.0, 64.0, 64.0, 2.0, Unit::Matmul, 108.0), 2),
        ];
        for mix in [&kernels[..1], &kernels[1..2], &kernels[..]] {
            for (host, done) in [(0.0, 0.0), (500.0, 20.0), (10.0, 5000.0)] {
                for count in [1, 2, 7, 80] {
                    let start = |t: &mut Timeline| {
                        t.host = host;
                        t.done = done;
                    };
                    let mut direct = Timeline::new(&gpu, &CALIBRATED, Precision::AmpBf16);
                    start(&mut direct);
                    for _ in 0..count {
                        mix.iter().for_each(|&(k, n)| direct.run(k, n));
                    }
                    let mut repeated = Timeline::new(&gpu, &CALIBRATED, Precision::AmpBf16);
                    start(&mut repeated);
                    let mut block = repeated.recording();
                    mix.iter().for_each(|&(k, n)| block.run(k, n));
                    repeated.repeat(&block.span(), count);
                    let (d, r) = (Sums::of(&direct), Sums::of(&repeated));
                    assert_close(
                        &[
                            (direct.host, repeated.host),
                            (direct.done, repeated.done),
                            (d.compute_us, r.compute_us),
                            (d.memory_us, r.memory_us),
                            (d.sm_busy, r.sm_busy),
                            (d.warps, r.warps),
                            (d.flops, r.flops),
                            (d.bytes, r.bytes),
                        ],
                        &format!("from ({host}, {done}), x{count}"),
                    );
                }
            }
        }
    }

    #[test]
    fn repeated_blocks_timed_once_answer_as_the_layers_timed_one_by_one() {
        // The same layers with block names (`blocks.3.up`: timed once per run of equal blocks)
        // and without (`blocks_3_up`: no blocks, every layer timed).
        let unblocked = |job: &Job| {
            let details = job
                .layer_details()
                .iter()
                .map(|d| LayerDetail {
                    name: d.name.as_ref().map(|n| n.replace('.', "_")),
                    ..d.clone()
                })
                .collect();
            let job = job.clone().with_layer_details(details).unwrap();
            assert!(job.blocks().is_empty());
            job
        };
        let lora = UncheckedSetup {
            precision: Some("bf16"),
            lora: Some(UncheckedLora {
                rank: 8,
                alpha: None,
                dropout: None,
                target_modules: UncheckedNames::Keyword("all-linear"),
                base_weights: Some("nf4"),
                modules_to_save: None,
                group_size: None,
                expert_layout: None,
            }),
            ..plain()
        };
        for (width, tokens) in [(64, 16), (4096, 2048)] {
            for setup in [plain(), lora.clone()] {
                let job = stack(2, 12, width, tokens, setup);
                assert_eq!(job.blocks().len(), 12);
                let (a, b) = (roofline(&job, &a100()), roofline(&unblocked(&job), &a100()));
                assert_close(
                    &[
                        (a.step_time_ms, b.step_time_ms),
                        (a.forward_ms, b.forward_ms),
                        (a.backward_ms, b.backward_ms),
                        (a.smact, b.smact),
                        (a.smocc, b.smocc),
                        (a.drama, b.drama),
                        (a.flops, b.flops),
                        (a.bytes, b.bytes),
                    ],
                    &format!("width {width}"),
                );
            }
        }
    }

    /// `blocks` transformer-like blocks of two linears (width x 4 width) over `tokens`
    /// positions, named `blocks.<i>.up` / `.down`.
    fn stack(batch: u64, blocks: usize, width: u64, tokens: u64, setup: UncheckedSetup) -> Job {
        let mut layers = Vec::new();
        let mut details = Vec::new();
        for b in 0..blocks {
            for (name, i, o) in [("up", width, 4 * width), ("down", 4 * width, width)] {
                layers.push(UncheckedLayer {
                    kind: "linear",
                    output_size: tokens * o,
                    params: i * o + o,
                });
                details.push(LayerDetail {
                    name: Some(format!("blocks.{b}.{name}")),
                    in_features: Some(i),
                    out_features: Some(o),
                    flops: None,
                    experts: None,
                });
            }
        }
        Job::parse(Some("transformer"), batch, layers.into_iter())
            .unwrap()
            .with_layer_details(details)
            .unwrap()
            .with_setup(&setup)
            .unwrap()
    }

    fn plain() -> UncheckedSetup<'static> {
        UncheckedSetup::default()
    }

    #[test]
    fn linears_without_shapes_read_their_positions_from_their_neighbours() {
        // A ViT block as a bare layer list: 197 tokens of width 768, then the head.
        let (t, w) = (197u64, 768u64);
        let layer = |kind: &'static str, output_size: u64, params: u64| UncheckedLayer {
            kind,
            output_size,
            params,
        };
        let layers = vec![
            layer("layer_norm", t * w, 2 * w),
            layer("linear", t * 3 * w, w * 3 * w + 3 * w), // qkv: after the norm's width
            layer("attention", t * w, 0),
            layer("linear", t * w, w * w + w), // proj: the positions before it
            layer("layer_norm", t * w, 2 * w),
            layer("linear", t * 4 * w, w * 4 * w + 4 * w),
            layer("gelu", t * 4 * w, 0),
            layer("linear", t * w, 4 * w * w + w), // fc2: after fc1's width
            layer("linear", 1000, w * 1000 + 1000), // the head on the pooled token
        ];
        let job = Job::parse(Some("transformer"), 8, layers.into_iter()).unwrap();
        let shapes = inferred_linear_shapes(&job);
        let read: Vec<Option<(f64, f64, f64)>> = shapes
            .iter()
            .map(|s| s.map(|s| (s.positions, s.inputs, s.outputs)))
            .collect();
        let (tf, wf) = (t as f64, w as f64);
        assert_eq!(read[1], Some((tf, wf, 3.0 * wf)));
        assert_eq!(read[3], Some((tf, wf, wf)));
        assert_eq!(read[5], Some((tf, wf, 4.0 * wf)));
        assert_eq!(read[7], Some((tf, 4.0 * wf, wf)));
        assert_eq!(read[8], None, "the head reads as one position");
        // The FLOPs follow: 197 positions of every block GEMM, forward and backward.
        let block_flops = 2.0 * tf * (3.0 * wf * wf + wf * wf + 8.0 * wf * wf) * 8.0;
        let r = roofline(&job, &a100());
        assert!(r.flops > 2.5 * block_flops, "{r:?}");
        // An MLP's linears have no such reading: one position each, as before.
        let mlp = Job::parse(
            None,
            8,
            vec![
                layer("linear", 1173, 2346 * 1173 + 1173),
                layer("linear", 197, 1173 * 197 + 197),
            ]
            .into_iter(),
        )
        .unwrap();
        assert!(inferred_linear_shapes(&mlp).iter().all(Option::is_none));
    }

    #[test]
    fn a_long_reduction_over_few_output_tiles_is_split_across_the_sms() {
        // A convolution's weight gradient: 64 x 64 outputs reduced over a batch's 10^6
        // positions. Without split-K it would be one block on one SM.
        let sms = 108.0;
        let wgrad = gemm(64.0, 64.0, 1e6, 4.0, Unit::Conv, sms);
        assert!(wgrad.blocks >= sms, "{wgrad:?}");
        assert!(
            wgrad.bytes > (64.0 * 1e6 * 2.0 + 64.0 * 64.0) * 4.0,
            "partials read back"
        );
        // A short reduction is not split (each split takes at least SPLIT_K_MIN).
        assert_eq!(gemm(64.0, 64.0, 300.0, 4.0, Unit::Conv, sms).blocks, 1.0);
        // Enough output tiles: no split.
        let wide = gemm(4096.0, 4096.0, 1e6, 4.0, Unit::Matmul, sms);
        assert_eq!(wide.blocks, 32.0 * 32.0);
        assert_eq!(wide.bytes, (4096.0 * 1e6 * 2.0 + 4096.0 * 4096.0) * 4.0);
    }

    #[test]
    fn a_large_fp32_gemm_stack_is_compute_bound_at_the_achievable_cuda_core_peak() {
        let job = stack(64, 4, 4096, 512, plain());
        let r = roofline(&job, &a100());
        // 2 x params x tokens forward, twice that backward (the first layer skips its dgrad).
        let params = 4.0 * 2.0 * (4096.0 * 16384.0);
        let tokens = 64.0 * 512.0;
        let ideal_s = 6.0 * params * tokens / (19.5e12 * CALIBRATED.compute_efficiency);
        assert_eq!(r.bound, Bound::Compute);
        let ratio = r.step_time_ms * 1e-3 / ideal_s;
        assert!((0.85..1.05).contains(&ratio), "{ratio}");
        assert!(r.smact > 0.9 && r.smact <= 1.0, "{}", r.smact);
        for f in [r.smact, r.smocc, r.drama] {
            assert!((0.0..=1.0).contains(&f));
        }
    }

    #[test]
    fn autocast_runs_the_same_step_on_tensor_cores_faster() {
        let fp32 = roofline(&stack(64, 4, 4096, 512, plain()), &a100());
        let amp = roofline(
            &stack(
                64,
                4,
                4096,
                512,
                UncheckedSetup {
                    precision: Some("amp_bf16"),
                    ..plain()
                },
            ),
            &a100(),
        );
        assert!(
            amp.step_time_ms * 5.0 < fp32.step_time_ms,
            "{amp:?} {fp32:?}"
        );
    }

    #[test]
    fn a_tiny_job_waits_on_the_host_and_keeps_few_sms_busy() {
        let job = Job::parse(
            None,
            8,
            [
                UncheckedLayer {
                    kind: "linear",
                    output_size: 16,
                    params: 16 * 16 + 16,
                },
                UncheckedLayer {
                    kind: "relu",
                    output_size: 16,
                    params: 0,
                },
            ]
            .into_iter(),
        )
        .unwrap();
        let r = roofline(&job, &a100());
        assert_eq!(r.bound, Bound::Overhead);
        assert!(r.smact < 0.02, "{}", r.smact);
        assert!(r.smocc <= r.smact);
    }

    #[test]
    fn frozen_weights_skip_their_gradient_gemms_and_recomputation_repeats_the_forward() {
        let full = roofline(&stack(8, 4, 2048, 512, plain()), &a100());
        let targets = ["up".to_string()];
        let lora = roofline(
            &stack(
                8,
                4,
                2048,
                512,
                UncheckedSetup {
                    lora: Some(UncheckedLora {
                        rank: 8,
                        alpha: None,
                        dropout: None,
                        target_modules: UncheckedNames::Names(&targets),
                        base_weights: None,
                        modules_to_save: None,
                        group_size: None,
                        expert_layout: None,
                    }),
                    ..plain()
                },
            ),
            &a100(),
        );
        // About 3 x forward FLOPs fully trained, about 2 x with frozen bases.
        let ratio = lora.flops / full.flops;
        assert!((0.6..0.72).contains(&ratio), "{ratio}");
        let recomputed = roofline(
            &stack(
                8,
                4,
                2048,
                512,
                UncheckedSetup {
                    activation_checkpointing: Some(UncheckedNames::Keyword("full")),
                    ..plain()
                },
            ),
            &a100(),
        );
        let ratio = recomputed.flops / full.flops;
        assert!((1.3..1.36).contains(&ratio), "{ratio}");
    }

    #[test]
    fn tensor_and_pipeline_parallelism_split_each_gpus_work() {
        let one = roofline(&stack(8, 4, 4096, 512, plain()), &a100());
        let split = |tensor: u64, pipeline: u64| {
            roofline(
                &stack(
                    8,
                    4,
                    4096,
                    512,
                    UncheckedSetup {
                        parallelism: Some(crate::job::setup::UncheckedParallelism {
                            world_size: Some(tensor * pipeline),
                            tensor_parallel: Some(tensor),
                            pipeline_parallel: Some(pipeline),
                            ..Default::default()
                        }),
                        ..plain()
                    },
                ),
                &a100(),
            )
        };
        for (t, p) in [(2, 1), (1, 2), (2, 2)] {
            let ratio = split(t, p).flops / one.flops * (t * p) as f64;
            assert!((0.9..1.1).contains(&ratio), "t {t} p {p}: {ratio}");
        }
    }

    #[test]
    fn data_parallel_collectives_run_on_the_cards_link_and_only_what_compute_leaves_shows() {
        let parallel = |strategy: &'static str, world: u64| UncheckedSetup {
            parallelism: Some(crate::job::setup::UncheckedParallelism {
                strategy: Some(strategy),
                world_size: Some(world),
                ..Default::default()
            }),
            ..plain()
        };
        let card = |id: &str| Catalogue::builtin().by_id(id).unwrap().performance;
        // 8 blocks of 4096 x 16384: 1.07e9 fp32 parameters, 4.3 GB of gradients.
        let small_batch = |setup| stack(1, 8, 4096, 16, setup);
        let one = roofline(&small_batch(plain()), &card("a100-80gb"));
        assert_eq!(one.collectives_ms, 0.0);
        let gradients = one.flops / 6.0 / 16.0 * 4.0; // FLOPs = 6 x params x tokens
                                                      // DDP x8: an all-reduce of 2 x 7/8 of the gradients, at 75 % of NVLink 3's 300 GB/s.
        let nvlink = roofline(&small_batch(parallel("ddp", 8)), &card("a100-80gb"));
        let expected_ms = 2.0 * 7.0 / 8.0 * gradients / (300e9 * 0.75) * 1e3;
        assert!(
            (nvlink.collectives_ms / expected_ms - 1.0).abs() < 0.05,
            "{} vs {expected_ms}",
            nvlink.collectives_ms
        );
        // The same on PCIe 4.0: nearly 10x longer, and with so little compute to hide behind,
        // it bounds the step.
        let pcie = roofline(&small_batch(parallel("ddp", 8)), &card("a100-80gb-pcie"));
        assert!((pcie.collectives_ms / nvlink.collectives_ms - 300.0 / 32.0).abs() < 0.1);
        assert_eq!(pcie.bound, Bound::Communication);
        assert!(pcie.step_time_ms > one.step_time_ms + 0.9 * pcie.collectives_ms);
        // Across nodes the ring runs at the InfiniBand port's 25 GB/s.
        let nodes = roofline(&small_batch(parallel("ddp", 16)), &card("a100-80gb"));
        assert!(nodes.collectives_ms > 10.0 * nvlink.collectives_ms);
        // FSDP gathers weights for forward and backward and reduce-scatters gradients every
        // micro-batch: more traffic than DDP's one all-reduce; a large batch hides it.
        let fsdp = roofline(&small_batch(parallel("fsdp", 8)), &card("a100-80gb"));
        assert!(fsdp.collectives_ms > nvlink.collectives_ms);
        let big = |setup| stack(64, 8, 4096, 512, setup);
        let alone = roofline(&big(plain()), &card("a100-80gb"));
        let hidden = roofline(&big(parallel("fsdp", 8)), &card("a100-80gb"));
        assert!(hidden.collectives_ms > 0.0);
        assert!(hidden.step_time_ms < alone.step_time_ms * 1.02);
        assert_eq!(hidden.bound, Bound::Compute);
    }

    #[test]
    fn accumulation_repeats_the_micro_batch_and_given_flops_replace_the_derived_ones() {
        let one = roofline(&stack(16, 2, 2048, 256, plain()), &a100());
        let four = roofline(
            &stack(
                16,
                2,
                2048,
                256,
                UncheckedSetup {
                    micro_batch_size: Some(4),
                    gradient_accumulation_steps: Some(4),
                    ..plain()
                },
            ),
            &a100(),
        );
        assert!((four.flops / one.flops - 1.0).abs() < 0.01);
        assert!(four.step_time_ms > one.step_time_ms);

        let job = stack(16, 1, 2048, 256, plain());
        let mut details = job.layer_details().to_vec();
        let derived = 2.0 * 256.0 * 2048.0 * 8192.0;
        for d in &mut details {
            d.flops = Some((2.0 * derived) as u64);
        }
        let doubled = job.clone().with_layer_details(details).unwrap();
        let r = roofline(&doubled, &a100());
        let base = roofline(&job, &a100());
        // Forward and backward GEMMs scale with the given FLOPs (the loss and bias kernels don't).
        let ratio = r.flops / base.flops;
        assert!((1.9..2.0).contains(&ratio), "{ratio}");
    }
}
