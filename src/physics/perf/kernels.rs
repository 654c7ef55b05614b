//! The kernels a step launches, each timed on the roofline: GEMMs, elementwise passes,
//! attention, the loss and the optimizer's, with the grids that size their occupancy.

use crate::devices::performance::GpuPerformance;
use crate::job::setup::{BaseWeights, Optimizer, OptimizerImplementation, Precision};
use crate::job::validated::{Job, Layer, LayerKind};
use crate::job::LayerDetail;

use super::*;

/// A kernel takes at least this long on the GPU however little it does (launch latency,
/// ramp-up and tail of a grid): ~2-4 us for an empty kernel on A100/H100.
pub(super) const KERNEL_MIN_US: f64 = 3.0;
/// cuBLAS/cuDNN output tiles: 128x128 with 8 warps (256 threads) where that fills the GPU,
/// else 64x64 tiles with 4 warps (what cuBLAS's heuristics pick for small problems).
pub(super) const GEMM_TILE: f64 = 128.0;
pub(super) const GEMM_SMALL_TILE: f64 = 64.0;
pub(super) const GEMM_WARPS: f64 = 8.0;
pub(super) const GEMM_SMALL_WARPS: f64 = 4.0;
/// The least reduction length one split-K block takes on.
pub(super) const SPLIT_K_MIN: f64 = 256.0;
/// Register and shared-memory use let about two GEMM blocks reside per SM.
pub(super) const GEMM_BLOCKS_PER_SM: f64 = 2.0;
/// PyTorch's elementwise kernels: 128 threads (4 warps) per block, 4 elements per thread
/// (`aten/src/ATen/native/cuda/Loops.cuh`); blocks per SM limited by warps (and at most 32).
pub(super) const ELEMENTWISE_WARPS: f64 = 4.0;
pub(super) const ELEMENTWISE_PER_BLOCK: f64 = 512.0;
/// `multi_tensor_apply` (foreach/fused optimizers): 512 threads per block, 65,536 elements
/// per chunk, at most 110 tensors per launch (depth 2; fewer with more lists: taken as 48).
pub(super) const FOREACH_WARPS: f64 = 16.0;
pub(super) const FOREACH_CHUNK: f64 = 65_536.0;
pub(super) const FOREACH_TENSORS_PER_LAUNCH: f64 = 48.0;
/// Flash/memory-efficient attention: one block per 128 query rows per head, 4 warps; head
/// dimension taken as 64 when the head count is unknown.
pub(super) const ATTENTION_ROWS_PER_BLOCK: f64 = 128.0;
pub(super) const ATTENTION_HEAD_DIM: f64 = 64.0;
/// Host-to-device copies of a pinned batch: ~12 GB/s effective over PCIe 4.0 x16.
pub(super) const PCIE_GB_S: f64 = 12.0;
/// Cross-entropy: log_softmax and nll forward, their two backward kernels, on fp32 logits.
pub(super) const LOSS_KERNELS: usize = 4;

/// Which peak a kernel runs at.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Unit {
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
pub(super) struct Kernel {
    pub(super) flops: f64,
    pub(super) bytes: f64,
    pub(super) unit: Unit,
    pub(super) blocks: f64,
    pub(super) warps_per_block: f64,
    /// Blocks one SM holds at once.
    pub(super) blocks_per_sm: f64,
}

pub(super) fn gemm(m: f64, n: f64, k: f64, element: f64, unit: Unit, sms: f64) -> Kernel {
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
pub(super) fn elementwise(elements: f64, bytes: f64, max_warps: f64) -> Kernel {
    Kernel {
        flops: elements,
        bytes,
        unit: Unit::Vector,
        blocks: (elements / ELEMENTWISE_PER_BLOCK).ceil().max(1.0),
        warps_per_block: ELEMENTWISE_WARPS,
        blocks_per_sm: (max_warps / ELEMENTWISE_WARPS).min(32.0),
    }
}

/// The dense peak (TFLOP/s) a kernel of `unit` runs at on `gpu` at `precision`.
pub(super) fn peak_tflops(gpu: &GpuPerformance, precision: Precision, unit: Unit) -> f64 {
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
pub(super) fn activation_bytes(precision: Precision) -> f64 {
    precision.compute_bytes()
}

/// What every layer's kernels share in one micro-batch.
#[derive(Clone, Copy)]
pub(super) struct Step<'a> {
    pub(super) job: &'a Job,
    /// Samples per micro-batch.
    pub(super) micro: f64,
    /// Tensor x context parallel degrees: the share of each activation one GPU holds.
    pub(super) split: f64,
    /// The sequence length of a token model (a 1-D `input_shape`).
    pub(super) seq: Option<f64>,
    /// Bytes of an activation element.
    pub(super) element: f64,
    /// Shapes read for the linear layers that come without them.
    pub(super) inferred: &'a [Option<Shape>],
    /// What each attention layer runs, read from its neighbours.
    pub(super) attention: &'a [Option<AttentionRead>],
}

/// The kernels of layer `i` for one pass over `micro` samples.
pub(super) fn layer_kernels(t: &mut Timeline, step: &Step, i: usize, pass: Pass, role: LayerRole) {
    let job = step.job;
    let layer = &job.layers()[i];
    let detail = job.layer_details().get(i);
    let work = LayerWork {
        step,
        i,
        layer,
        detail,
        given_flops: detail.and_then(|d| d.flops).map(|f| f as f64),
        sms: f64::from(t.gpu.sm_count),
        max_warps: f64::from(t.gpu.max_warps_per_sm),
        output: layer.output_size as f64 * step.micro / step.split,
        weights: layer.params as f64 / job.setup().parallelism.tensor as f64,
        forward: pass == Pass::Forward,
        role,
    };
    match layer.kind {
        LayerKind::Linear
        | LayerKind::Conv1d
        | LayerKind::Conv2d
        | LayerKind::Conv3d
        | LayerKind::ConvTranspose2d => matmul_kernels(t, &work),
        LayerKind::Attention => attention_kernels(t, &work),
        LayerKind::Embedding => embedding_kernels(t, &work),
        LayerKind::Identity | LayerKind::Flatten => {}
        _ => memory_bound_kernels(t, &work),
    }
}

/// What one layer's kernels read, worked out once.
#[derive(Clone, Copy)]
pub(super) struct LayerWork<'a> {
    step: &'a Step<'a>,
    i: usize,
    layer: &'a Layer,
    detail: Option<&'a LayerDetail>,
    /// The layer's own FLOPs, when the job gives them.
    given_flops: Option<f64>,
    sms: f64,
    max_warps: f64,
    /// Output elements of the micro-batch on this GPU.
    output: f64,
    /// Weights on this GPU.
    weights: f64,
    forward: bool,
    role: LayerRole,
}

impl LayerWork<'_> {
    /// A layer's own given FLOPs replace the derived ones (same shape, scaled work).
    fn scaled(&self, mut k: Kernel, derived_per_sample: f64) -> Kernel {
        if let Some(f) = self.given_flops.filter(|_| derived_per_sample > 0.0) {
            k.flops *= f / derived_per_sample;
        }
        k
    }
}

/// A linear layer or convolution: its GEMMs (dequantised or autocast weights first), the
/// input's and weights' gradients, LoRA's small GEMMs.
fn matmul_kernels(t: &mut Timeline, w: &LayerWork) {
    let LayerWork {
        step,
        i,
        layer,
        detail,
        sms,
        max_warps,
        output,
        weights,
        forward,
        role,
        ..
    } = *w;
    let Step {
        job,
        micro,
        seq,
        element,
        ..
    } = *step;
    let LayerRole {
        adapted,
        trains,
        input_grad,
        ..
    } = role;
    let kind = layer.kind;
    let scaled = |k: Kernel, derived_per_sample: f64| w.scaled(k, derived_per_sample);
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

/// An attention layer: one fused kernel, or the eager path's GEMMs around materialised scores.
fn attention_kernels(t: &mut Timeline, w: &LayerWork) {
    let LayerWork {
        step,
        i,
        max_warps,
        output,
        forward,
        ..
    } = *w;
    let Step {
        job,
        micro,
        element,
        ..
    } = *step;
    let scaled = |k: Kernel, derived_per_sample: f64| w.scaled(k, derived_per_sample);
    let AttentionRead::Shaped(shape) = step.attention[i].unwrap_or(AttentionRead::Shaped(None))
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

/// An embedding: a gather forward; zeroing and scatter-adding the table's gradient backward.
fn embedding_kernels(t: &mut Timeline, w: &LayerWork) {
    let LayerWork {
        step,
        max_warps,
        output,
        weights,
        forward,
        role,
        ..
    } = *w;
    let Step { element, .. } = *step;
    let LayerRole { trains, .. } = role;
    if forward {
        t.run(elementwise(output, 2.0 * output * element, max_warps), 1);
    } else if trains > 0.0 {
        // Zero the table's gradient, then scatter-add the rows (sorted indices).
        t.run(elementwise(weights, weights * element, max_warps), 1);
        t.run(elementwise(output, 3.0 * output * element, max_warps), 2);
    }
}

/// Every other layer: memory-bound passes over its input and output.
fn memory_bound_kernels(t: &mut Timeline, w: &LayerWork) {
    let LayerWork {
        step,
        layer,
        given_flops,
        max_warps,
        output,
        forward,
        role,
        ..
    } = *w;
    let Step {
        micro,
        split,
        element,
        ..
    } = *step;
    let LayerRole {
        trains, input_grad, ..
    } = role;
    let kind = layer.kind;
    // Memory-bound: read the input, write the output (backward: read the output's
    // gradient and what was saved, write the input's). Normalisations read twice
    // (statistics, then normalise) and reduce their weights' gradients; dropout
    // writes (reads back) a one-byte mask; pooling reads a window (2x2) per output.
    let (passes, kernels) = match (kind, forward) {
        (k, true) if k.is_normalisation() => (3.0, if k == LayerKind::BatchNorm { 2 } else { 1 }),
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

/// The optimizer's kernels over the trainable parameters of one GPU.
pub(super) fn optimizer_kernels(
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
