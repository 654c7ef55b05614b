//! What the step knows of each layer's shape: linear and convolution GEMMs, attention read from
//! its neighbours, shapes inferred for linear layers that come without them, repeated blocks.

use crate::job::names;
use crate::job::validated::{Job, Layer, LayerKind};
use crate::job::LayerDetail;

pub(super) use crate::physics::shapes::{linear_shape, Shape};

/// A convolution's output positions and implicit-GEMM (in, out). Without a channel count the
/// kernel is taken as 3x3 with as many input as output channels, so that out_channels =
/// sqrt(params / 9) (a ResNet body's convolution); positions = output_size / out_channels.
pub(super) fn conv_shape(layer: &Layer, detail: Option<&LayerDetail>) -> Shape {
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

/// What an attention layer runs, read from the layers around it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) enum AttentionRead {
    /// A container holding the attention that follows it in the list: no kernel.
    Container,
    /// The attention over (tokens, width), or an elementwise pass when no shape is found.
    Shaped(Option<(f64, f64)>),
}

pub(super) fn attention_read(job: &Job, i: usize, inferred: &[Option<Shape>]) -> AttentionRead {
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
pub(super) struct LayerKey {
    pub(super) layer: Layer,
    pub(super) in_features: Option<u64>,
    pub(super) out_features: Option<u64>,
    pub(super) flops: Option<u64>,
    pub(super) inferred: Option<Shape>,
    pub(super) attention: Option<AttentionRead>,
    pub(super) role: LayerRole,
    pub(super) recomputed: bool,
}

/// The runs of adjacent repeated blocks within the first `stage` layers whose layers are
/// `same` pairwise, as (the first block, how many): each run is timed once.
pub(super) fn repeats(
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
pub(super) struct LayerRole {
    /// It carries LoRA adapters.
    pub(super) adapted: bool,
    /// The share of its weights that train (their gradient GEMMs run).
    pub(super) trains: f64,
    /// Its input's gradient is needed (something before it trains).
    pub(super) input_grad: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pass {
    Forward,
    Backward,
}

/// The width and tokens of the attention at layer `i`: from the nearest linear layer with
/// shapes after it (the query projection), else before it (the output projection).
pub(super) fn attention_shape(
    job: &Job,
    i: usize,
    inferred: &[Option<Shape>],
) -> Option<(f64, f64)> {
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
pub(super) fn inferred_linear_shapes(job: &Job) -> Vec<Option<Shape>> {
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
