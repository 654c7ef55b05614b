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
use crate::job::names;
use crate::job::setup::{
    BaseWeights, Checkpointing, LoraTargets, Optimizer, OptimizerImplementation, Precision,
    Strategy, Trainable,
};
use crate::job::validated::{Family, Job, Layer, LayerKind};
use crate::job::LayerDetail;

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

/// A kernel takes at least this long on the GPU however little it does (launch latency,
/// ramp-up and tail of a grid): ~2-4 us for an empty kernel on A100/H100.
const KERNEL_MIN_US: f64 = 3.0;
/// cuBLAS/cuDNN output tiles: 128x128 with 8 warps (256 threads) where that fills the GPU,
/// else 64x64 tiles with 4 warps (what cuBLAS's heuristics pick for small problems).
const GEMM_TILE: f64 = 128.0;
const GEMM_SMALL_TILE: f64 = 64.0;
const GEMM_WARPS: f64 = 8.0;
const GEMM_SMALL_WARPS: f64 = 4.0;
/// The least reduction length one split-K block takes on.
const SPLIT_K_MIN: f64 = 256.0;
/// Register and shared-memory use let about two GEMM blocks reside per SM.
const GEMM_BLOCKS_PER_SM: f64 = 2.0;
/// PyTorch's elementwise kernels: 128 threads (4 warps) per block, 4 elements per thread
/// (`aten/src/ATen/native/cuda/Loops.cuh`); blocks per SM limited by warps (and at most 32).
const ELEMENTWISE_WARPS: f64 = 4.0;
const ELEMENTWISE_PER_BLOCK: f64 = 512.0;
/// `multi_tensor_apply` (foreach/fused optimizers): 512 threads per block, 65,536 elements
/// per chunk, at most 110 tensors per launch (depth 2; fewer with more lists: taken as 48).
const FOREACH_WARPS: f64 = 16.0;
const FOREACH_CHUNK: f64 = 65_536.0;
const FOREACH_TENSORS_PER_LAUNCH: f64 = 48.0;
/// Flash/memory-efficient attention: one block per 128 query rows per head, 4 warps; head
/// dimension taken as 64 when the head count is unknown.
const ATTENTION_ROWS_PER_BLOCK: f64 = 128.0;
const ATTENTION_HEAD_DIM: f64 = 64.0;
/// Host-to-device copies of a pinned batch: ~12 GB/s effective over PCIe 4.0 x16.
const PCIE_GB_S: f64 = 12.0;
/// Cross-entropy: log_softmax and nll forward, their two backward kernels, on fp32 logits.
const LOSS_KERNELS: usize = 4;

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

/// Which peak a kernel runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unit {
    /// Matrix products at the job's matmul dtype (tensor cores where it has them).
    Matmul,
    /// Convolutions: like matmuls, but cuDNN uses TF32 for fp32 by default
    /// (`torch.backends.cudnn.allow_tf32 = True`), cuBLAS does not (since PyTorch 1.12).
    Conv,
    /// Everything else: fp32 CUDA cores.
    Vector,
}

/// One kernel: work, and the grid that does it.
#[derive(Debug, Clone, Copy)]
struct Kernel {
    flops: f64,
    bytes: f64,
    unit: Unit,
    blocks: f64,
    warps_per_block: f64,
    /// Blocks one SM holds at once.
    blocks_per_sm: f64,
}

fn gemm(m: f64, n: f64, k: f64, element: f64, unit: Unit, sms: f64) -> Kernel {
    let tiles = |t: f64| (m / t).ceil().max(1.0) * (n / t).ceil().max(1.0);
    let (tiles, warps) = if tiles(GEMM_TILE) >= sms {
        (tiles(GEMM_TILE), GEMM_WARPS)
    } else {
        (tiles(GEMM_SMALL_TILE), GEMM_SMALL_WARPS)
    };
    // Split-K: when the output's tiles alone would leave SMs idle, cuBLAS and cuDNN split the
    // reduction across blocks (a weight gradient reduces over every position of the batch),
    // each split writing an fp32 partial product that a reduction reads back.
    let splits = if tiles < sms {
        (sms / tiles).ceil().min((k / SPLIT_K_MIN).floor()).max(1.0)
    } else {
        1.0
    };
    let partials = if splits > 1.0 {
        2.0 * m * n * 4.0 * splits
    } else {
        0.0
    };
    Kernel {
        flops: 2.0 * m * n * k,
        bytes: (m * k + k * n + m * n) * element + partials,
        unit,
        blocks: tiles * splits,
        warps_per_block: warps,
        blocks_per_sm: GEMM_BLOCKS_PER_SM,
    }
}

/// A memory-bound kernel over `elements`, moving `bytes`.
fn elementwise(elements: f64, bytes: f64, max_warps: f64) -> Kernel {
    Kernel {
        flops: elements,
        bytes,
        unit: Unit::Vector,
        blocks: (elements / ELEMENTWISE_PER_BLOCK).ceil().max(1.0),
        warps_per_block: ELEMENTWISE_WARPS,
        blocks_per_sm: (max_warps / ELEMENTWISE_WARPS).min(32.0),
    }
}

/// (host, done) after issuing `n` kernels of `duration` us, each `host_op` us of host work
/// after the last: the closed form of `host += host_op; done = max(done, host) + duration`
/// repeated `n` times, so that a job's cost follows its layers, not its parameter count (a
/// foreach optimizer over 10^16 elements is 10^10 launches). Unrolled, the last kernel ends at
/// `max(done + n d, max over j of host + j h + (n - j + 1) d)`, linear in j, so the inner
/// maximum sits at j = 1 or j = n.
fn issue(host: f64, done: f64, host_op: f64, duration: f64, n: f64) -> (f64, f64) {
    if n < 1.0 {
        return (host, done);
    }
    let done = (done + n * duration)
        .max(host + host_op + n * duration)
        .max(host + n * host_op + duration);
    (host + n * host_op, done)
}

/// The step's timeline: the host issues ops one after another; the GPU runs each as soon as
/// it is issued and the previous one is done.
struct Timeline<'a> {
    gpu: &'a GpuPerformance,
    constants: &'a Constants,
    precision: Precision,
    /// When the host has issued the last op, and when the GPU finishes it (us).
    host: f64,
    done: f64,
    /// Kernel time bound by compute, by memory; SM-time share busy; warp-time share.
    compute_us: f64,
    memory_us: f64,
    sm_busy: f64,
    warps: f64,
    flops: f64,
    bytes: f64,
    /// Per kernel, precomputed once: SMs and their warps, the achievable FLOP rate per
    /// [`Unit`] (FLOP/us) and byte rate (B/us). A large model runs thousands of kernels.
    sms: f64,
    max_warps: f64,
    compute_rate: [f64; 3],
    memory_rate: f64,
}

impl<'a> Timeline<'a> {
    fn new(gpu: &'a GpuPerformance, constants: &'a Constants, precision: Precision) -> Self {
        let rate = |unit| peak_tflops(gpu, precision, unit) * 1e6 * constants.compute_efficiency;
        Timeline {
            gpu,
            constants,
            precision,
            sms: f64::from(gpu.sm_count),
            max_warps: f64::from(gpu.max_warps_per_sm),
            compute_rate: [rate(Unit::Matmul), rate(Unit::Conv), rate(Unit::Vector)],
            memory_rate: gpu.memory_bandwidth_gb_s * 1e3 * constants.memory_efficiency,
            host: 0.0,
            done: 0.0,
            compute_us: 0.0,
            memory_us: 0.0,
            sm_busy: 0.0,
            warps: 0.0,
            flops: 0.0,
            bytes: 0.0,
        }
    }

    /// Peak FLOP/s (10^12) of a unit at the job's precision.
    /// Issues `count` copies of `kernel`.
    fn run(&mut self, kernel: Kernel, count: usize) {
        let sms = self.sms;
        let active = (kernel.blocks / sms).min(1.0);
        let compute = kernel.flops / (self.compute_rate[kernel.unit as usize] * active);
        let memory = kernel.bytes / (self.memory_rate * active);
        let duration = compute.max(memory).max(KERNEL_MIN_US);
        // Warps resident on an active SM, over the most it holds.
        let per_sm = (kernel.blocks / (active * sms)).min(kernel.blocks_per_sm);
        let occupancy = (per_sm * kernel.warps_per_block / self.max_warps).min(1.0);
        let n = count as f64;
        (self.host, self.done) = issue(
            self.host,
            self.done,
            self.constants.host_us_per_op,
            duration,
            n,
        );
        if compute >= memory {
            self.compute_us += n * duration;
        } else {
            self.memory_us += n * duration;
        }
        self.sm_busy += n * duration * active;
        self.warps += n * duration * active * occupancy;
        self.flops += n * kernel.flops;
        self.bytes += n * kernel.bytes;
    }

    /// Waits for the GPU (a phase boundary the host synchronises on); returns the time.
    fn sync(&mut self) -> f64 {
        self.host = self.done;
        self.done
    }

    /// A timeline that records what a run of kernels does to any starting point ([`Span`]):
    /// its host starts at 0 and its GPU at minus infinity, so that `done` ends as the part
    /// the host's start bounds and `host` as the host's own advance.
    fn recording(&self) -> Timeline<'a> {
        Timeline {
            host: 0.0,
            done: f64::NEG_INFINITY,
            compute_us: 0.0,
            memory_us: 0.0,
            sm_busy: 0.0,
            warps: 0.0,
            flops: 0.0,
            bytes: 0.0,
            ..*self
        }
    }

    /// What this recording timeline's kernels do to a timeline they are issued on.
    fn span(&self) -> Span {
        Span {
            // Every kernel's duration is in one of the two sums: their total is how far the
            // GPU's end moves when it, not the host, bounds each kernel.
            after_done: self.compute_us + self.memory_us,
            after_host: self.done,
            host: self.host,
            sums: Sums::of(self),
        }
    }

    /// Issues `span`'s kernels `count` times over.
    fn repeat(&mut self, span: &Span, count: usize) {
        for _ in 0..count {
            self.done = (self.done + span.after_done).max(self.host + span.after_host);
            self.host += span.host;
        }
        let sums = Sums::of(self).plus(span.sums.times(count as f64));
        (self.compute_us, self.memory_us, self.sm_busy) =
            (sums.compute_us, sums.memory_us, sums.sm_busy);
        (self.warps, self.flops, self.bytes) = (sums.warps, sums.flops, sums.bytes);
    }
}

/// What issuing a run of kernels does to a timeline, whatever its start: [`issue`] is
/// `done' = max(done + a, host + b)`, `host' = host + c`, and a run of such steps is one of
/// the same form (max-plus algebra), so a block repeated 80 times is timed once and applied
/// 80 times: `done' = max(done + after_done, host + after_host)`, `host' = host + host`.
#[derive(Debug, Clone, Copy)]
struct Span {
    after_done: f64,
    after_host: f64,
    host: f64,
    sums: Sums,
}

/// The dense peak (TFLOP/s) a kernel of `unit` runs at on `gpu` at `precision`.
fn peak_tflops(gpu: &GpuPerformance, precision: Precision, unit: Unit) -> f64 {
    let tf32 = gpu.tf32_tflops.unwrap_or(gpu.fp32_tflops);
    let half = |bf16: bool| {
        if bf16 {
            // Before Ampere bf16 has no tensor cores: it runs at about fp32's rate.
            gpu.bf16_tflops.unwrap_or(gpu.fp32_tflops)
        } else {
            gpu.fp16_tflops
        }
    };
    match (unit, precision) {
        (Unit::Vector, _) => gpu.fp32_tflops,
        (Unit::Matmul, Precision::Fp32) => gpu.fp32_tflops,
        (Unit::Conv, Precision::Fp32) | (_, Precision::Tf32) => tf32,
        (_, Precision::AmpFp16 | Precision::Fp16) => half(false),
        (_, Precision::AmpBf16 | Precision::Bf16) => half(true),
    }
}

/// Bytes of an activation element at `precision`: fp32 unless 16-bit.
fn activation_bytes(precision: Precision) -> f64 {
    precision.compute_bytes()
}

/// What the step knows of one layer.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Shape {
    /// Rows of the layer's GEMM per sample (tokens, output positions).
    positions: f64,
    inputs: f64,
    outputs: f64,
}

/// A linear layer's positions and (in, out): `out_features` when given (positions =
/// output_size / out_features), else one position (an MLP: the output is the features).
fn linear_shape(layer: &Layer, detail: Option<&LayerDetail>, seq: Option<f64>) -> Shape {
    let output = layer.output_size.max(1) as f64;
    let params = layer.params.max(1) as f64;
    match detail.and_then(|d| d.out_features) {
        Some(out) => {
            let out = out as f64;
            let inputs = detail
                .and_then(|d| d.in_features)
                .map_or(params / out, |i| i as f64);
            Shape {
                positions: (output / out).max(1.0),
                inputs,
                outputs: out,
            }
        }
        None => {
            // A token model's linear without shapes: the sequence's positions when the output
            // holds them; otherwise the output is the features.
            let positions = seq.filter(|&s| output >= s * 2.0).unwrap_or(1.0);
            let outputs = (output / positions).max(1.0);
            Shape {
                positions,
                inputs: (params / outputs).max(1.0),
                outputs,
            }
        }
    }
}

/// A convolution's output positions and implicit-GEMM (in, out). Without a channel count the
/// kernel is taken as 3x3 with as many input as output channels, so that out_channels =
/// sqrt(params / 9) (a ResNet body's convolution); positions = output_size / out_channels.
fn conv_shape(layer: &Layer, detail: Option<&LayerDetail>) -> Shape {
    let params = layer.params.max(1) as f64;
    let outputs = detail
        .and_then(|d| d.out_features)
        .map_or((params / 9.0).sqrt().max(1.0), |o| o as f64);
    Shape {
        positions: (layer.output_size.max(1) as f64 / outputs).max(1.0),
        inputs: (params / outputs).max(1.0),
        outputs,
    }
}

/// The step of `job` on `gpu` with `constants`.
pub fn roofline_with(job: &Job, gpu: &GpuPerformance, constants: &Constants) -> Roofline {
    let setup = job.setup();
    let layers = job.layers();
    let details = job.layer_details();
    let detail = |i: usize| details.get(i);
    let precision = setup.precision;
    let element = activation_bytes(precision);
    let storage = precision.storage_bytes();
    let max_warps = f64::from(gpu.max_warps_per_sm);
    let micro = setup.micro_batch_size as f64;
    let p = setup.parallelism;
    // Tensor parallelism gives each GPU 1/t of every layer's outputs, context parallelism 1/c
    // of the positions, pipeline parallelism the first 1/p of the layers (the first stage,
    // which also holds the most activations). Collectives are not modelled.
    let split = (p.tensor * p.context) as f64;
    let stage = layers.len().div_ceil(p.pipeline.max(1) as usize);
    let seq = job
        .input_shape()
        .filter(|s| s.len() == 1)
        .map(|s| s[0] as f64);
    let inferred = inferred_linear_shapes(job);
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
    let attention: Vec<Option<AttentionRead>> = (0..layers.len())
        .map(|i| {
            (layers[i].kind == LayerKind::Attention).then(|| attention_read(job, i, &inferred))
        })
        .collect();
    let adapters: Vec<bool> = (0..layers.len()).map(adapted).collect();
    let trains_share = |i: usize| shares[i];
    let adapted = |i: usize| adapters[i];

    let mut timeline = Timeline::new(gpu, constants, precision);
    let mut forward_us = 0.0;
    let mut backward_us = 0.0;
    // One micro-batch from a synchronised start; the step repeats it `accumulation` times.
    let step = Step {
        job,
        micro,
        split,
        seq,
        element,
        inferred: &inferred,
        attention: &attention,
    };
    let forward = |t: &mut Timeline, i: usize| {
        layer_kernels(
            t,
            &step,
            i,
            Pass::Forward,
            LayerRole {
                adapted: adapted(i),
                trains: 0.0,
                input_grad: false,
            },
        )
    };
    // Repeated blocks that launch the same kernels are timed once and applied as many times.
    let role = |i: usize| LayerRole {
        adapted: adapted(i),
        trains: trains_share(i),
        input_grad: needs_input_grad(i),
    };
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
                forward(&mut timeline, i);
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
        layer_kernels(t, &step, i, Pass::Backward, role(i));
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
                backward(&mut timeline, i);
            }
        }
    }
    backward_us += timeline.sync() - started;
    let accumulation = setup.accumulation.max(1) as f64;
    let micro_us = timeline.done;
    let collectives = collectives(
        job,
        gpu,
        &shares,
        &adapters,
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

    // The optimizer step, from a synchronised start.
    let mut optimizer = Timeline::new(gpu, constants, precision);
    optimizer_kernels(
        &mut optimizer,
        job,
        &trains_share,
        &adapted,
        storage,
        max_warps,
    );
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
    let step_us = micro_us * accumulation
        + optimizer_us
        + constants.step_host_us
        + input_us
        + collectives.exposed_us;
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

/// GPUs of one node: rings of more ranks cross nodes, over [`INTER_NODE_GB_S`].
const GPUS_PER_NODE: u64 = 8;
/// One 200 Gb/s InfiniBand (HDR) port per GPU, each way: a ring across nodes runs at it.
const INTER_NODE_GB_S: f64 = 25.0;
/// Share of the link's bandwidth NCCL's ring collectives reach (bus bandwidth in nccl-tests:
/// ~230 of NVLink 3's 300 GB/s, ~75 % on PCIe).
const COLLECTIVE_EFFICIENCY: f64 = 0.75;
/// A DDP bucket (25 MiB): the last one's all-reduce starts when backward ends.
const DDP_BUCKET_BYTES: f64 = 25.0 * 1024.0 * 1024.0;

/// One micro-batch's forward and backward times (us) and the micro-batches of a step.
struct Phases {
    forward_us: f64,
    backward_us: f64,
    accumulation: f64,
}

/// The data-parallel collectives of one optimizer step (us): all of them, and the part that
/// compute does not hide.
struct Collectives {
    total_us: f64,
    exposed_us: f64,
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
fn collectives(
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

/// A timeline's sums.
#[derive(Debug, Clone, Copy)]
struct Sums {
    compute_us: f64,
    memory_us: f64,
    sm_busy: f64,
    warps: f64,
    flops: f64,
    bytes: f64,
}

impl Sums {
    fn of(t: &Timeline) -> Sums {
        Sums {
            compute_us: t.compute_us,
            memory_us: t.memory_us,
            sm_busy: t.sm_busy,
            warps: t.warps,
            flops: t.flops,
            bytes: t.bytes,
        }
    }

    fn times(self, k: f64) -> Sums {
        Sums {
            compute_us: self.compute_us * k,
            memory_us: self.memory_us * k,
            sm_busy: self.sm_busy * k,
            warps: self.warps * k,
            flops: self.flops * k,
            bytes: self.bytes * k,
        }
    }

    fn plus(self, o: Sums) -> Sums {
        Sums {
            compute_us: self.compute_us + o.compute_us,
            memory_us: self.memory_us + o.memory_us,
            sm_busy: self.sm_busy + o.sm_busy,
            warps: self.warps + o.warps,
            flops: self.flops + o.flops,
            bytes: self.bytes + o.bytes,
        }
    }
}

/// What every layer's kernels share in one micro-batch.
#[derive(Clone, Copy)]
struct Step<'a> {
    job: &'a Job,
    /// Samples per micro-batch.
    micro: f64,
    /// Tensor x context parallel degrees: the share of each activation one GPU holds.
    split: f64,
    /// The sequence length of a token model (a 1-D `input_shape`).
    seq: Option<f64>,
    /// Bytes of an activation element.
    element: f64,
    /// Shapes read for the linear layers that come without them.
    inferred: &'a [Option<Shape>],
    /// What each attention layer runs, read from its neighbours.
    attention: &'a [Option<AttentionRead>],
}

/// What an attention layer runs, read from the layers around it.
#[derive(Debug, Clone, Copy, PartialEq)]
enum AttentionRead {
    /// A container holding the attention that follows it in the list: no kernel.
    Container,
    /// The attention over (tokens, width), or an elementwise pass when no shape is found.
    Shaped(Option<(f64, f64)>),
}

fn attention_read(job: &Job, i: usize, inferred: &[Option<Shape>]) -> AttentionRead {
    let details = job.layer_details();
    let container = details.get(i + 1).is_some_and(|next| {
        job.layers()[i + 1].kind == LayerKind::Attention
            && matches!((details.get(i).and_then(|d| d.name.as_deref()), next.name.as_deref()),
                (Some(a), Some(b)) if names::within(b, a))
    });
    if container {
        AttentionRead::Container
    } else {
        AttentionRead::Shaped(attention_shape(job, i, inferred))
    }
}

/// Everything [`layer_kernels`] reads of a layer in either pass (its neighbours' part in
/// [`AttentionRead`]): layers with equal keys launch the same kernels.
#[derive(PartialEq)]
struct LayerKey {
    layer: Layer,
    in_features: Option<u64>,
    out_features: Option<u64>,
    flops: Option<u64>,
    inferred: Option<Shape>,
    attention: Option<AttentionRead>,
    role: LayerRole,
    recomputed: bool,
}

/// The runs of adjacent repeated blocks within the first `stage` layers whose layers are
/// `same` pairwise, as (the first block, how many): each run is timed once.
fn repeats(
    blocks: &[std::ops::Range<usize>],
    stage: usize,
    same: impl Fn(usize, usize) -> bool,
) -> Vec<(std::ops::Range<usize>, usize)> {
    let mut runs: Vec<(std::ops::Range<usize>, usize)> = Vec::new();
    for block in blocks.iter().filter(|b| b.end <= stage) {
        if let Some((first, count)) = runs.last_mut() {
            let len = first.len();
            if block.start == first.start + *count * len
                && block.len() == len
                && first.clone().zip(block.clone()).all(|(a, b)| same(a, b))
            {
                *count += 1;
                continue;
            }
        }
        runs.push((block.clone(), 1));
    }
    runs.retain(|&(_, count)| count > 1);
    runs
}

/// What a layer does in backward.
#[derive(Clone, Copy, PartialEq)]
struct LayerRole {
    /// It carries LoRA adapters.
    adapted: bool,
    /// The share of its weights that train (their gradient GEMMs run).
    trains: f64,
    /// Its input's gradient is needed (something before it trains).
    input_grad: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Pass {
    Forward,
    Backward,
}

/// The width and tokens of the attention at layer `i`: from the nearest linear layer with
/// shapes after it (the query projection), else before it (the output projection).
fn attention_shape(job: &Job, i: usize, inferred: &[Option<Shape>]) -> Option<(f64, f64)> {
    let layers = job.layers();
    let details = job.layer_details();
    let near = (i + 1..layers.len().min(i + 8)).chain((i.saturating_sub(8)..i).rev());
    near.filter(|&j| layers[j].kind == LayerKind::Linear)
        .find_map(|j| {
            let out = details.get(j)?.out_features? as f64;
            Some((layers[j].output_size as f64 / out, out))
        })
        .or_else(|| {
            // No shapes: the positions read from the nearest linear before it (its query,
            // key and value projection), the attention's output over them as its width.
            let tokens = (i.saturating_sub(8)..i)
                .rev()
                .find_map(|j| inferred[j])?
                .positions;
            Some((tokens, layers[i].output_size as f64 / tokens))
        })
        .filter(|&(tokens, width)| tokens >= 1.0 && width >= 1.0)
}

/// Shapes of the linear layers that come without them (a layer list or a summary), read from
/// their neighbours: a linear after a normalisation of width w (LayerNorm/GroupNorm weight and
/// bias: 2w; RMSNorm: w) or after a linear of w outputs takes w inputs, and a linear after one
/// of T positions keeps T (a ViT's 197 tokens, a window's); the reading must be whole
/// (`params = in x out`, plus `out` with a bias; `output = positions x out`). `None` where no
/// reading is whole: the layer then reads as one position (an MLP, whose output is its
/// features).
fn inferred_linear_shapes(job: &Job) -> Vec<Option<Shape>> {
    let details = job.layer_details();
    let mut features: Option<u64> = None;
    let mut positions: Option<u64> = None;
    let whole = |output: u64, params: u64, inputs: u64| -> Option<(u64, u64)> {
        [inputs, inputs + 1].into_iter().find_map(|per_out| {
            let out = params / per_out;
            (out > 0 && params.is_multiple_of(per_out) && output.is_multiple_of(out))
                .then(|| (output / out, out))
        })
    };
    job.layers()
        .iter()
        .enumerate()
        .map(|(i, layer)| {
            let (output, params) = (layer.output_size, layer.params);
            match layer.kind {
                LayerKind::LayerNorm | LayerKind::GroupNorm if params > 0 => {
                    features = Some(params / 2)
                }
                LayerKind::RmsNorm if params > 0 => features = Some(params),
                LayerKind::Linear if details.get(i).and_then(|d| d.out_features).is_none() => {
                    // Inputs from the width before it; else the positions before it.
                    let by_width = features
                        .filter(|&w| w > 0)
                        .and_then(|w| whole(output, params, w).map(|(t, out)| (t, w, out)));
                    let by_positions = || {
                        let t = positions.filter(|&t| t > 1 && output % t == 0)?;
                        let out = output / t;
                        // Both readings are whole when one is: take the bias's (the
                        // other differs by one input).
                        let inputs = if params > out && (params - out) % out == 0 {
                            (params - out) / out
                        } else if params % out == 0 {
                            params / out
                        } else {
                            return None;
                        };
                        Some((t, inputs, out))
                    };
                    let reading = by_width.or_else(by_positions);
                    features = reading.map(|(_, _, out)| out);
                    positions = reading.map(|(t, _, _)| t);
                    return reading
                        .filter(|&(t, _, _)| t > 1)
                        .map(|(t, inputs, out)| Shape {
                            positions: t as f64,
                            inputs: inputs as f64,
                            outputs: out as f64,
                        });
                }
                _ => {}
            }
            None
        })
        .collect()
}

/// The kernels of layer `i` for one pass over `micro` samples.
fn layer_kernels(t: &mut Timeline, step: &Step, i: usize, pass: Pass, role: LayerRole) {
    let Step {
        job,
        micro,
        split,
        seq,
        element,
        ..
    } = *step;
    let LayerRole {
        adapted,
        trains,
        input_grad,
    } = role;
    let layer = &job.layers()[i];
    let detail = job.layer_details().get(i);
    let given_flops = detail.and_then(|d| d.flops).map(|f| f as f64);
    let sms = f64::from(t.gpu.sm_count);
    let max_warps = f64::from(t.gpu.max_warps_per_sm);
    let output = layer.output_size as f64 * micro / split;
    let weights = layer.params as f64 / job.setup().parallelism.tensor as f64;
    let forward = pass == Pass::Forward;
    // A layer's own given FLOPs replace the derived ones (same shape, scaled work).
    let scaled = |mut k: Kernel, derived_per_sample: f64| {
        if let Some(f) = given_flops.filter(|_| derived_per_sample > 0.0) {
            k.flops *= f / derived_per_sample;
        }
        k
    };
    let kind = layer.kind;
    match kind {
        LayerKind::Linear
        | LayerKind::Conv1d
        | LayerKind::Conv2d
        | LayerKind::Conv3d
        | LayerKind::ConvTranspose2d => {
            let (shape, unit) = if kind == LayerKind::Linear {
                let shape = match (detail.and_then(|d| d.out_features), step.inferred[i]) {
                    (None, Some(shape)) => shape,
                    _ => linear_shape(layer, detail, seq),
                };
                (shape, Unit::Matmul)
            } else {
                (conv_shape(layer, detail), Unit::Conv)
            };
            // Context parallelism splits the positions, tensor parallelism the outputs.
            let p = job.setup().parallelism;
            let m = shape.positions * micro / p.context as f64;
            let (n, k) = (shape.outputs / p.tensor as f64, shape.inputs);
            let per_sample = 2.0 * shape.positions * shape.outputs * shape.inputs;
            let base = job.setup().lora.as_ref().map(|l| l.base_weights);
            let quantised = adapted && base.is_some_and(|b| b.is_4bit() || b == BaseWeights::Int8);
            if forward {
                if quantised {
                    // Dequantise the base weight before its matmul (and again in backward).
                    t.run(elementwise(weights, weights * 2.5, max_warps), 1);
                } else if t.precision.is_autocast() {
                    // Autocast casts each fp32 weight to 16 bits before the matmul.
                    t.run(elementwise(weights, weights * 6.0, max_warps), 1);
                }
                t.run(scaled(gemm(m, n, k, element, unit, sms), per_sample), 1);
            } else {
                if quantised {
                    t.run(elementwise(weights, weights * 2.5, max_warps), 1);
                }
                if input_grad {
                    t.run(scaled(gemm(m, k, n, element, unit, sms), per_sample), 1);
                }
                if trains > 0.0 {
                    let mut wgrad = scaled(gemm(k, n, m, element, unit, sms), per_sample);
                    wgrad.flops *= trains;
                    t.run(wgrad, 1);
                    // The bias gradient: a reduction over the output.
                    t.run(elementwise(output, output * element, max_warps), 1);
                }
            }
            if adapted {
                // LoRA: x @ A, then @ B, scaled and added (forward); their gradients and the
                // input's through them (backward). Small GEMMs: dispatch-bound.
                let rank = job.setup().lora.as_ref().map_or(8.0, |l| l.rank as f64);
                let a = gemm(m, rank, k, element, unit, sms);
                let b = gemm(m, n, rank, element, unit, sms);
                let add = elementwise(m * n, 3.0 * m * n * element, max_warps);
                if forward {
                    t.run(a, 1);
                    t.run(b, 1);
                    t.run(add, 2);
                } else {
                    t.run(b, 2);
                    t.run(a, 2);
                    t.run(add, 1);
                }
            }
        }
        LayerKind::Attention => {
            let AttentionRead::Shaped(shape) =
                step.attention[i].unwrap_or(AttentionRead::Shaped(None))
            else {
                return;
            };
            match shape {
                Some((tokens, width)) => {
                    // Context parallelism splits the queries, tensor parallelism the heads.
                    let p = job.setup().parallelism;
                    let queries = tokens / p.context as f64;
                    let width = width / p.tensor as f64;
                    let per_sample = 4.0 * queries * tokens * width;
                    let tokens = queries;
                    let times = if forward { 1.0 } else { 2.5 };
                    let heads = (width / ATTENTION_HEAD_DIM).max(1.0);
                    let kernel = Kernel {
                        flops: per_sample * micro * times,
                        bytes: 4.0 * tokens * width * micro * element * times,
                        unit: Unit::Matmul,
                        blocks: micro * heads * (tokens / ATTENTION_ROWS_PER_BLOCK).ceil(),
                        warps_per_block: GEMM_SMALL_WARPS,
                        blocks_per_sm: GEMM_BLOCKS_PER_SM,
                    };
                    let eager = job
                        .simulation()
                        .and_then(|s| s.attention.as_deref())
                        .is_some_and(|a| a == "math" || a == "eager");
                    if eager {
                        // Unfused: two batched GEMMs around the materialised scores (heads x
                        // T x T), which scale, mask, softmax and dropout pass over in turn
                        // (forward ~4 kernels of 2-3 passes; backward as many, 3 passes).
                        let scores = heads * tokens * tokens * micro;
                        let mut gemms = kernel;
                        gemms.bytes = scores * element * times;
                        let mut gemms = scaled(gemms, per_sample * times);
                        gemms.flops /= 2.0;
                        t.run(gemms, 2);
                        let passes = if forward { 2.5 } else { 3.0 };
                        t.run(elementwise(scores, passes * scores * element, max_warps), 4);
                    } else {
                        t.run(scaled(kernel, per_sample * times), 1);
                    }
                }
                None => {
                    let passes = if forward { 2.0 } else { 3.0 };
                    t.run(elementwise(output, passes * output * element, max_warps), 1);
                }
            }
        }
        LayerKind::Embedding => {
            if forward {
                t.run(elementwise(output, 2.0 * output * element, max_warps), 1);
            } else if trains > 0.0 {
                // Zero the table's gradient, then scatter-add the rows (sorted indices).
                t.run(elementwise(weights, weights * element, max_warps), 1);
                t.run(elementwise(output, 3.0 * output * element, max_warps), 2);
            }
        }
        LayerKind::Identity | LayerKind::Flatten => {}
        _ => {
            // Memory-bound: read the input, write the output (backward: read the output's
            // gradient and what was saved, write the input's). Normalisations read twice
            // (statistics, then normalise) and reduce their weights' gradients; dropout
            // writes (reads back) a one-byte mask; pooling reads a window (2x2) per output.
            let (passes, kernels) = match (kind, forward) {
                (k, true) if k.is_normalisation() => {
                    (3.0, if k == LayerKind::BatchNorm { 2 } else { 1 })
                }
                (k, false) if k.is_normalisation() => (4.0, 2),
                (LayerKind::Dropout | LayerKind::DropPath, _) => (2.0 + 1.0 / element, 1),
                (
                    LayerKind::MaxPool
                    | LayerKind::AvgPool
                    | LayerKind::AdaptiveAvgPool
                    | LayerKind::AdaptiveMaxPool,
                    _,
                ) => (5.0, 1),
                (_, true) => (2.0, 1),
                (_, false) => (3.0, 1),
            };
            if !forward && !input_grad && trains == 0.0 {
                return;
            }
            let per = passes / kernels as f64;
            let mut kernel = elementwise(output, per * output * element, max_warps);
            if let Some(f) = given_flops {
                kernel.flops = f * micro / split / kernels as f64;
            }
            t.run(kernel, kernels);
        }
    }
}

/// The optimizer's kernels over the trainable parameters of one GPU.
fn optimizer_kernels(
    t: &mut Timeline,
    job: &Job,
    trains_share: &dyn Fn(usize) -> f64,
    adapted: &dyn Fn(usize) -> bool,
    storage: f64,
    max_warps: f64,
) {
    let setup = job.setup();
    let layers = job.layers();
    let p = setup.parallelism;
    let shard = (p.tensor * p.pipeline) as f64
        * if p.strategy.shards().0 {
            p.data() as f64
        } else {
            1.0
        };
    let rank = setup.lora.as_ref().map_or(0.0, |l| l.rank as f64);
    // (elements, tensors) of every trainable parameter tensor: a weight and a bias per layer
    // (an embedding table alone), two per LoRA adapter (trained in fp32).
    let mut base = (0.0, 0.0);
    let mut adapters = (0.0, 0.0);
    let mut per_tensor: Vec<f64> = Vec::new();
    let for_loop =
        setup.implementation == OptimizerImplementation::ForLoop || setup.optimizer.is_8bit();
    for (i, layer) in layers.iter().enumerate() {
        let share = trains_share(i);
        if share > 0.0 {
            let tensors = if layer.kind == LayerKind::Embedding {
                1.0
            } else {
                2.0
            };
            let elements = layer.params as f64 * share / shard;
            base.0 += elements;
            base.1 += tensors;
            if for_loop {
                per_tensor.push(elements / tensors);
                if tensors > 1.0 {
                    per_tensor.push(elements / tensors);
                }
            }
        }
        if adapted(i) {
            let shape = linear_shape(layer, job.layer_details().get(i), None);
            let elements = rank * (shape.inputs + shape.outputs) / shard;
            adapters.0 += elements;
            adapters.1 += 2.0;
            if for_loop {
                per_tensor.push(rank * shape.inputs / shard);
                per_tensor.push(rank * shape.outputs / shard);
            }
        }
    }
    // Ops per tensor, and element passes over storage-sized values (reads + writes), from
    // torch.optim's foreach implementations (_multi_tensor_adam: lerp, mul, addcmul, sqrt,
    // div, add, addcdiv; AdamW first scales the weights).
    let (ops, passes) = match setup.optimizer {
        Optimizer::Sgd => (1.0, 3.0),
        Optimizer::Momentum => (3.0, 8.0),
        Optimizer::Adam => (7.0, 18.0),
        Optimizer::AdamW | Optimizer::PagedAdamW => (8.0, 20.0),
        Optimizer::Adafactor => (10.0, 20.0),
        // bitsandbytes: one kernel per tensor: fp32 weight and gradient, two uint8 states.
        Optimizer::Adam8bit | Optimizer::AdamW8bit | Optimizer::PagedAdamW8bit => (1.0, 4.0),
    };
    let (ops, passes) = match (setup.implementation, setup.optimizer.is_8bit()) {
        (OptimizerImplementation::Fused, false) => (1.0, 7.0),
        _ => (ops, passes),
    };
    let elements = base.0 + adapters.0;
    if elements <= 0.0 {
        return;
    }
    // Bytes per element pass: the storage dtype (adapters and 8-bit keep fp32).
    let bytes_per = (base.0 * storage + adapters.0 * 4.0) / elements;
    if for_loop {
        for &n in &per_tensor {
            let per_op = elementwise(n, n * passes * bytes_per / ops, max_warps);
            t.run(per_op, ops as usize);
        }
        return;
    }
    let tensors = base.1 + adapters.1;
    let launches = (tensors / FOREACH_TENSORS_PER_LAUNCH)
        .max(elements / (320.0 * FOREACH_CHUNK))
        .ceil()
        .max(1.0);
    let n = elements / launches;
    let kernel = Kernel {
        flops: n,
        bytes: n * passes * bytes_per / ops,
        unit: Unit::Vector,
        // Every tensor is at least one chunk.
        blocks: (n / FOREACH_CHUNK)
            .max(tensors / launches)
            .ceil()
            .clamp(1.0, 320.0),
        warps_per_block: FOREACH_WARPS,
        blocks_per_sm: (max_warps / FOREACH_WARPS).max(1.0),
    };
    t.run(kernel, (ops * launches) as usize);
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::devices::sku::Catalogue;
    use crate::job::setup::{UncheckedLora, UncheckedNames, UncheckedSetup};
    use crate::job::validated::UncheckedLayer;

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
