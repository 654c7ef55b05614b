//! The tensors autograd keeps for backward, derived from a layer list when nobody traced them.
//!
//! `gpucast_describe` traces a job's [`SavedTensors`] on the meta device, and the best learned
//! estimators need them (docs/design/models.md). A job read from a pasted summary has only its layers
//! (kind, output size per sample, parameters), so this module rebuilds what a training forward
//! pass saves from what each kind of layer keeps for its backward in PyTorch, fp32:
//!
//! - convolutions and linear layers keep their input (for the weight gradient);
//! - normalisations keep their input (and per-channel statistics, negligible here);
//! - ReLU, in-place leaky ReLU, sigmoid, tanh and softmax keep their output; GELU, SiLU, Mish,
//!   hardswish, ReLU6 and the others keep their input;
//! - pooling keeps its input, max pooling also the int64 index of each output;
//! - attention, as the memory-efficient kernel runs it, keeps q, k, v (three tensors of its
//!   output's size; their log-sum-exp is negligible) and its output, which is the input of the
//!   projection after it;
//! - identity, flatten, and dropout and drop path as timm builds them by default (p = 0: the
//!   op returns its input) keep nothing and pass their input on;
//! - a squeeze-and-excitation gate multiplies the block's wide tensor by a tiny one: the
//!   product keeps both factors, and the next layer's input is the product, as wide as the
//!   tensor before the squeeze; no layer of the list shows that product, so it is rebuilt;
//! - an unknown layer with parameters (layer scale, EvoNorm) is taken to keep one tensor of
//!   its output's size; one without parameters passes its input on;
//! - a container's own parameters (a row with parameters and no output, as describe and
//!   torchinfo list them) are layer-scale vectors: each keeps a tensor of the block's width.
//!
//! Each storage counts once: the input of layer i is the output of layer i - 1 in list order
//! (an approximation: branches and residual additions are not in a layer list), so a
//! convolution's output that its batch norm keeps as input counts once, and so does a ReLU's
//! output that the next convolution keeps. One branch shape is recognised: a convolution or
//! norm straight after a norm, as wide as it, reads the block input (a downsample shortcut, a
//! RepVGG branch), which is kept already.
//!
//! Calibrated against `describe`'s traced figures on the 531 timm descriptions of
//! `data/timm/descriptions.jsonl.gz` that are not test models; the constants below were chosen
//! among physical alternatives (3 or 4 attention tensors, max pool indices counted or not, an
//! unknown layer with parameters keeping 0, 1 or 2 tensors, ReLU6 and leaky ReLU keeping their
//! input or output, a container's own parameters keeping 0, 1, 2 tensors or one per vector),
//! branches recognised or not), holding out each architecture family in turn
//! (scripts/saved_tensors_check.py: held-out median |log(derived / traced)| cnn 0.020,
//! transformer 0.059). Derived / traced per sample on those descriptions: cnn median 1.00
//! (10th-90th percentile 0.81-1.02), transformer 0.99 (0.85-1.10); on the 100 test models,
//! never tuned on: cnn 0.99 (0.83-1.00), transformer 0.90 (0.83-1.04).

use crate::job::names::within;
use crate::job::validated::{Layer, LayerKind, SavedTensors, MAX_SAVED_BYTES};
use crate::job::LayerDetail;

/// Tensors of its output's size that attention keeps besides its output: q, k and v.
const ATTENTION_TENSORS: u64 = 3;

/// Max pooling keeps the int64 index of each output element: two fp32 elements' bytes.
const MAX_POOL_INDEX_ELEMENTS: u64 = 2;

/// A layer whose output is at least this many times smaller than the wide tensor before it
/// squeezes it (squeeze-and-excitation pools to one value per channel: 49x and more); a
/// stride-2 stage (4x) does not.
const SQUEEZE_FACTOR: u64 = 16;

/// The saved bytes of an element: the trace is fp32.
const ELEMENT_BYTES: u128 = 4;

/// What a layer keeps for its backward, of its input and output tensors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Keeps {
    Input,
    Output,
    Nothing,
}

fn keeps(kind: LayerKind) -> Keeps {
    use LayerKind::*;
    match kind {
        Linear | Conv1d | Conv2d | Conv3d | ConvTranspose2d => Keeps::Input,
        BatchNorm | LayerNorm | GroupNorm | InstanceNorm | RmsNorm => Keeps::Input,
        Gelu | Silu | Mish | Softplus | Elu | Selu | Hardswish | Hardsigmoid | Prelu | Relu6 => {
            Keeps::Input
        }
        MaxPool | AvgPool | AdaptiveAvgPool | AdaptiveMaxPool => Keeps::Input,
        // timm builds its leaky ReLUs in place: `leaky_relu_` keeps its result.
        Relu | LeakyRelu | Sigmoid | Tanh | Softmax => Keeps::Output,
        Embedding | Upsample | Identity | Flatten | Dropout | DropPath | Attention | Other => {
            Keeps::Nothing
        }
    }
}

/// Layers that return their input when their output has its size.
fn passes_input_on(kind: LayerKind) -> bool {
    matches!(
        kind,
        LayerKind::Identity | LayerKind::Flatten | LayerKind::Dropout | LayerKind::DropPath
    )
}

/// How many tensors of `next`'s output size a container's own `held` parameters keep: each
/// parameter vector a block multiplies its activations by (timm's `gamma` layer scales in
/// ConvNeXt and CaiT blocks) keeps the activation it scales. The vectors are as wide as the
/// block: when the block's first layer is a normalisation, its weight and bias give the width
/// (1 to 4 vectors); otherwise one.
fn held_scales(held: u64, next: &Layer) -> u64 {
    if next.kind.is_normalisation() && next.params > 0 {
        let vectors = held as f64 / (next.params as f64 / 2.0);
        vectors.round().clamp(1.0, MAX_HELD_SCALES as f64) as u64
    } else {
        1
    }
}

/// The most parameter vectors a container's own parameters are taken to be.
const MAX_HELD_SCALES: u64 = 4;

/// Above this share of the parameters in layers of unknown kind, a list hides the layers that
/// compute (a torchinfo table cut at its default depth 3 shows whole blocks as single rows) and
/// nothing can be derived from it: on the timm test models' torchinfo tables, derived / traced
/// fell from 0.98-1.00 at shares up to 0.19 to 0.09-0.40 from 0.20 on; torchsummary lists
/// every module (shares below 0.02).
pub const MAX_UNKNOWN_PARAM_SHARE: f64 = 0.1;

/// The share of the parameters held by layers of unknown kind, when it is above
/// [`MAX_UNKNOWN_PARAM_SHARE`]: the list hides its computation and [`derive`] should not be
/// trusted with it.
pub fn hidden_share(layers: &[Layer]) -> Option<f64> {
    let total: u128 = layers.iter().map(|l| u128::from(l.params)).sum();
    let unknown: u128 = layers
        .iter()
        .filter(|l| l.kind == LayerKind::Other)
        .map(|l| u128::from(l.params))
        .sum();
    let share = unknown as f64 / total.max(1) as f64;
    (share > MAX_UNKNOWN_PARAM_SHARE).then_some(share)
}

/// The forward pass as a chain of tensors, each kept at most once.
struct Chain {
    /// Elements per sample of each tensor, and whether backward keeps it.
    tensors: Vec<(u64, bool)>,
    /// Kept elements outside the chain (attention's q, k, v; unknown layers' tensors).
    extra: u128,
}

impl Chain {
    fn push(&mut self, elements: u64) -> usize {
        self.tensors.push((elements, false));
        self.tensors.len() - 1
    }

    fn size(&self, tensor: usize) -> u64 {
        self.tensors
            .get(tensor)
            .map_or(0, |&(elements, _)| elements)
    }

    fn keep(&mut self, tensor: usize) {
        if let Some(entry) = self.tensors.get_mut(tensor) {
            entry.1 = true;
        }
    }

    fn kept_elements(&self) -> u128 {
        let chain: u128 = self
            .tensors
            .iter()
            .filter(|&&(_, kept)| kept)
            .map(|&(elements, _)| u128::from(elements))
            .sum();
        chain + self.extra
    }
}

/// The saved tensors of one training forward pass of `layers`, fp32, per sample (no fixed
/// part: the traced one is a fraction of a MiB for nearly every model). `input_elements` is the
/// model input per sample when known (the first layer keeps it); without it the first layer's
/// input is taken to be as large as its output. Saturates at [`MAX_SAVED_BYTES`], so that any
/// valid layer list gets a valid figure.
pub fn derive(layers: &[Layer], input_elements: Option<u64>) -> SavedTensors {
    let mut chain = Chain {
        tensors: Vec::with_capacity(layers.len().saturating_add(1)),
        extra: 0,
    };
    // The tensor flowing into the next layer, the widest recent one (before a squeeze), and
    // whether the last layer was a gate.
    let mut current: Option<usize> = None;
    let mut trunk = 0;
    let mut after_gate = false;
    // Parameters of containers seen since the last computing layer.
    let mut held: u64 = 0;
    // The kind of the last layer that computed something.
    let mut previous: Option<LayerKind> = None;
    for layer in layers {
        let (kind, output) = (layer.kind, layer.output_size);
        if output == 0 {
            // A row that only holds parameters (a container's own), not a computation. Past
            // the model's own (position embeddings, class tokens: added, nothing kept), they
            // scale the block's output (layer scale): see [`held_scales`].
            if current.is_some() {
                held = held.saturating_add(layer.params);
            }
            continue;
        }
        if held > 0 {
            chain.extra += u128::from(held_scales(held, layer)) * u128::from(output);
            held = 0;
        }
        let input = match current {
            Some(input) => input,
            None => {
                let first = chain.push(input_elements.unwrap_or(output));
                trunk = first;
                first
            }
        };
        current = Some(input);
        let input_size = chain.size(input);
        if kind == LayerKind::Attention {
            // Listed beside its projections (before them by describe, after them by
            // torchsummary): q, k and v are kept; its output is the projection's input.
            chain.extra += u128::from(ATTENTION_TENSORS) * u128::from(output);
            continue;
        }
        if passes_input_on(kind) && input_size == output {
            continue;
        }
        if kind == LayerKind::Other && input_size == output {
            if layer.params > 0 {
                chain.extra += u128::from(output);
            }
            continue;
        }
        let mut input = input;
        if after_gate
            && keeps(kind) == Keeps::Input
            && chain.size(trunk) >= input_size.saturating_mul(4)
        {
            // `x * gate`: the product keeps both factors and is this layer's input.
            chain.keep(trunk);
            chain.keep(input);
            input = chain.push(chain.size(trunk));
        }
        after_gate = matches!(kind, LayerKind::Sigmoid | LayerKind::Hardsigmoid);
        // A convolution or a norm right after a norm, as wide as its output, starts a parallel
        // branch (a ResNet downsample shortcut, a RepVGG branch) on the block's input, which
        // the block's first layer already keeps: in a chain an activation comes between.
        let branch = previous.is_some_and(LayerKind::is_normalisation)
            && input_size == output
            && (kind.is_normalisation() || kind.is_convolution());
        previous = Some(kind);
        let out = chain.push(output);
        if kind == LayerKind::MaxPool {
            chain.extra += u128::from(MAX_POOL_INDEX_ELEMENTS) * u128::from(output);
        }
        match keeps(kind) {
            Keeps::Input if branch => {}
            Keeps::Input => chain.keep(input),
            Keeps::Output => chain.keep(out),
            Keeps::Nothing => {}
        }
        if output.saturating_mul(SQUEEZE_FACTOR) > chain.size(trunk) {
            trunk = out;
        }
        current = Some(out);
    }
    let bytes = chain.kept_elements().saturating_mul(ELEMENT_BYTES);
    SavedTensors {
        per_sample_bytes: u64::try_from(bytes)
            .unwrap_or(u64::MAX)
            .min(MAX_SAVED_BYTES),
        fixed_bytes: 0,
    }
}

/// How far back a linear layer's input is looked for among the layers before it (past sibling
/// linears, dropouts and a mismatched activation): a bounded walk, linear in the list.
const MAX_PRODUCER_DISTANCE: usize = 8;

/// Elements per sample that no layer keeps once the linear layers for which `frozen` holds
/// stop keeping their inputs: a linear keeps its input for its weight's gradient alone (its
/// input's gradient needs only the weight), so autograd saves nothing for a frozen one
/// (PyTorch saves an operand only for the gradients it will compute). A tensor stays kept
/// while a linear reading it trains, or where the layer that made it keeps its output
/// (attention's output, read by its output projection; ReLU's, sigmoid's, softmax's).
///
/// Which tensor a linear reads, from the list's order: the nearest earlier layer, past linears
/// (siblings reading the same tensor: q, k, v; gate and up) and layers that pass their input
/// on, whose output is as large as the linear's input; a linear inside an attention module
/// (by name) reads what the attention module does, but its last one reads the attention's
/// output. A linear whose input is not found keeps it (nothing is freed on a guess). Layers
/// before `from` are left out (the caller counts nothing of them).
pub fn frozen_linear_inputs(
    layers: &[Layer],
    details: &[LayerDetail],
    from: usize,
    frozen: impl Fn(usize) -> bool,
) -> u64 {
    let name = |i: usize| details.get(i).and_then(|d| d.name.as_deref());
    // Each attention module's last linear inside it (by name): its output projection.
    let mut output_projection = vec![false; layers.len()];
    let mut inside_attention = vec![false; layers.len()];
    let mut attention: Option<usize> = None;
    let mut last_inside: Option<usize> = None;
    for (i, layer) in layers.iter().enumerate() {
        if layer.kind == LayerKind::Attention {
            if let Some(last) = last_inside.take() {
                output_projection[last] = true;
            }
            attention = Some(i);
        } else if layer.kind == LayerKind::Linear {
            let inside = attention
                .and_then(|a| Some((name(a)?, name(i)?)))
                .is_some_and(|(a, l)| within(l, a));
            if inside {
                inside_attention[i] = true;
                last_inside = Some(i);
            }
        }
    }
    if let Some(last) = last_inside {
        output_projection[last] = true;
    }
    // Per tensor read (its producer's index): its elements, and whether every reader is frozen.
    let mut read: std::collections::BTreeMap<usize, (u64, bool)> = Default::default();
    for (i, layer) in layers.iter().enumerate().skip(from) {
        if layer.kind != LayerKind::Linear {
            continue;
        }
        let detail = details.get(i);
        let inputs = detail.and_then(|d| {
            let (i_features, o_features) = (d.in_features?, d.out_features?);
            Some(layer.output_size / o_features.max(1) * i_features)
        });
        let producer = if output_projection[i] {
            None
        } else {
            (i.saturating_sub(MAX_PRODUCER_DISTANCE)..i)
                .rev()
                .filter(|&j| {
                    let kind = layers[j].kind;
                    layers[j].output_size > 0
                        && kind != LayerKind::Linear
                        && kind != LayerKind::Attention
                        && !passes_input_on(kind)
                })
                .find(|&j| inputs.is_none_or(|n| layers[j].output_size == n))
                // Past an attention module only from inside it (by name): any other linear
                // after one may read its output.
                .filter(|&j| {
                    inside_attention[i]
                        || !layers[j + 1..i]
                            .iter()
                            .any(|l| l.kind == LayerKind::Attention)
                })
        };
        let Some(producer) = producer.filter(|&j| j >= from) else {
            // Its input is kept by what made it, or not found: it stays.
            continue;
        };
        let entry = read
            .entry(producer)
            .or_insert((layers[producer].output_size, true));
        if keeps(layers[producer].kind) == Keeps::Output || !frozen(i) {
            entry.1 = false;
        }
    }
    read.values()
        .filter(|&&(_, freed)| freed)
        .map(|&(elements, _)| elements)
        .fold(0u64, u64::saturating_add)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layer(kind: LayerKind, output_size: u64) -> Layer {
        Layer {
            kind,
            output_size,
            params: 0,
        }
    }

    fn with_params(kind: LayerKind, output_size: u64, params: u64) -> Layer {
        Layer {
            kind,
            output_size,
            params,
        }
    }

    fn elements(layers: &[Layer], input: Option<u64>) -> u64 {
        derive(layers, input).per_sample_bytes / 4
    }

    #[test]
    fn a_conv_bn_relu_chain_keeps_each_storage_once() {
        use LayerKind::*;
        // conv keeps the image (3), bn the conv output (10), relu its output (10), which the
        // second conv keeps too; the second bn keeps the second conv's output (5).
        let layers = [
            layer(Conv2d, 10),
            layer(BatchNorm, 10),
            layer(Relu, 10),
            layer(Conv2d, 5),
            layer(BatchNorm, 5),
        ];
        assert_eq!(elements(&layers, Some(3)), 3 + 10 + 10 + 5);
        // Without the input shape the first input is taken as large as the first output.
        assert_eq!(elements(&layers, None), 10 + 10 + 10 + 5);
    }

    #[test]
    fn gelu_keeps_its_input_so_a_linear_gelu_linear_keeps_three_tensors() {
        use LayerKind::*;
        let layers = [layer(Linear, 8), layer(Gelu, 8), layer(Linear, 2)];
        assert_eq!(elements(&layers, Some(4)), 4 + 8 + 8);
        // Identity and p = 0 dropout pass their input on and keep nothing.
        let layers = [
            layer(Linear, 8),
            layer(Dropout, 8),
            layer(Identity, 8),
            layer(Gelu, 8),
            layer(Linear, 2),
        ];
        assert_eq!(elements(&layers, Some(4)), 4 + 8 + 8);
    }

    #[test]
    fn attention_keeps_q_k_v_wherever_it_is_listed() {
        use LayerKind::*;
        let before = [
            layer(LayerNorm, 6),
            layer(Attention, 6),
            layer(Linear, 18),
            layer(Linear, 6),
        ];
        let after = [
            layer(LayerNorm, 6),
            layer(Linear, 18),
            layer(Linear, 6),
            layer(Attention, 6),
        ];
        // ln keeps the input (6), qkv the ln output (6), proj the qkv output (18, standing for
        // the attention output), attention q, k, v (18).
        assert_eq!(elements(&before, Some(6)), 6 + 6 + 18 + 18);
        assert_eq!(elements(&after, Some(6)), elements(&before, Some(6)));
    }

    #[test]
    fn a_squeeze_excitation_gate_rebuilds_the_gated_product() {
        use LayerKind::*;
        let layers = [
            layer(Conv2d, 1000),
            layer(BatchNorm, 1000),
            layer(Silu, 1000),
            layer(Conv2d, 4),
            layer(Silu, 4),
            layer(Conv2d, 16),
            layer(Sigmoid, 16),
            layer(Conv2d, 500),
        ];
        // conv 10, bn 1000, silu 1000 (its input), the SE convs keep the silu output (1000),
        // the small silu (4) and its output (4); the gate keeps its output (16); the product
        // keeps the wide tensor (the silu output, once) and the gate, and the last conv keeps
        // the product (1000).
        assert_eq!(
            elements(&layers, Some(10)),
            10 + 1000 + 1000 + 1000 + 4 + 4 + 16 + 1000
        );
    }

    #[test]
    fn unknown_layers_keep_a_tensor_only_when_they_have_parameters() {
        use LayerKind::*;
        let scale = [layer(Linear, 8), with_params(Other, 8, 8), layer(Linear, 8)];
        assert_eq!(elements(&scale, Some(8)), 8 + 8 + 8);
        let shortcut = [layer(Linear, 8), layer(Other, 8), layer(Linear, 8)];
        assert_eq!(elements(&shortcut, Some(8)), 8 + 8);
        // Parameter-only rows (output 0) are not computations.
        let holder = [
            with_params(Other, 0, 100),
            layer(Linear, 8),
            layer(Linear, 8),
        ];
        assert_eq!(elements(&holder, Some(8)), 8 + 8);
    }

    #[test]
    fn a_blocks_own_parameters_keep_one_tensor_per_scale_vector() {
        use LayerKind::*;
        let block = |held: u64, first: Layer| {
            vec![
                layer(Linear, 8),
                with_params(Other, 0, held),
                first,
                layer(Linear, 8),
            ]
        };
        // Two vectors as wide as the norm (weight and bias: 2 x 4): two tensors of 8.
        let cait = block(8, with_params(LayerNorm, 8, 8));
        assert_eq!(elements(&cait, Some(8)), 8 + 8 + 8 + 2 * 8);
        // After a convolution the width is unknown: one.
        let convnext = block(8, with_params(Conv2d, 8, 400));
        assert_eq!(elements(&convnext, Some(8)), 8 + 8 + 8 + 8);
        // The model's own parameters, before any computation, keep nothing.
        let root = [with_params(Other, 0, 1000), layer(Linear, 8)];
        assert_eq!(elements(&root, Some(8)), 8);
    }

    #[test]
    fn a_downsample_shortcut_reads_the_block_input_and_max_pool_keeps_indices() {
        use LayerKind::*;
        let layers = [
            layer(Conv2d, 4),
            layer(Relu, 4),
            layer(MaxPool, 2),
            layer(Conv2d, 8),
            layer(BatchNorm, 8),
            layer(Conv2d, 8),
            layer(BatchNorm, 8),
            layer(Relu, 8),
        ];
        // conv the input (4), relu its output (4), max pool its indices (2 x 2), the block's
        // conv the pool output (2), its bn the conv output (8); the shortcut conv reads the
        // pool output, kept already; its bn keeps its output (8); relu its output (8).
        assert_eq!(elements(&layers, Some(4)), 4 + 4 + 4 + 2 + 8 + 8 + 8);
    }

    #[test]
    fn a_list_whose_unknown_layers_hold_the_parameters_hides_its_computation() {
        use LayerKind::*;
        let cut = [with_params(Conv2d, 8, 10), with_params(Other, 8, 90)];
        assert_eq!(hidden_share(&cut), Some(0.9));
        let full = [with_params(Conv2d, 8, 95), with_params(Other, 8, 5)];
        assert_eq!(hidden_share(&full), None);
        assert_eq!(hidden_share(&[layer(Relu, 8)]), None);
    }

    #[test]
    fn absurd_sizes_saturate_at_the_largest_accepted_figure() {
        let huge = vec![layer(LayerKind::Gelu, 10_000_000_000_000); 4096];
        assert_eq!(derive(&huge, None).per_sample_bytes, MAX_SAVED_BYTES);
        assert_eq!(derive(&[], None).per_sample_bytes, 0);
    }

    /// A listed layer: kind, output per sample, name, (in, out).
    type Row = (LayerKind, u64, &'static str, Option<(u64, u64)>);

    /// A GPT-2 block as describe lists it.
    fn gpt2_block() -> (Vec<Layer>, Vec<LayerDetail>) {
        use LayerKind::*;
        let rows: [Row; 9] = [
            (LayerNorm, 8, "h.0.ln_1", None),
            (Attention, 8, "h.0.attn", None),
            (Linear, 24, "h.0.attn.c_attn", Some((8, 24))),
            (Linear, 8, "h.0.attn.c_proj", Some((8, 8))),
            (Dropout, 8, "h.0.attn.resid_dropout", None),
            (LayerNorm, 8, "h.0.ln_2", None),
            (Linear, 32, "h.0.mlp.c_fc", Some((8, 32))),
            (Gelu, 32, "h.0.mlp.act", None),
            (Linear, 8, "h.0.mlp.c_proj", Some((32, 8))),
        ];
        rows.iter()
            .map(|&(kind, output, name, shape)| {
                (
                    layer(kind, output),
                    LayerDetail {
                        name: Some(name.into()),
                        in_features: shape.map(|s| s.0),
                        out_features: shape.map(|s| s.1),
                        flops: None,
                        experts: None,
                    },
                )
            })
            .unzip()
    }

    #[test]
    fn a_frozen_linear_frees_its_input_unless_a_trained_reader_or_its_maker_keeps_it() {
        let (layers, details) = gpt2_block();
        // LoRA on c_attn: c_fc's input (ln_2's output, 8) and mlp.c_proj's (gelu's output, 32)
        // are freed; c_attn's adapter keeps ln_1's output; attention keeps its own output,
        // which attn.c_proj reads.
        let adapted = |i: usize| i == 2;
        assert_eq!(
            frozen_linear_inputs(&layers, &details, 0, |i| !adapted(i)),
            8 + 32
        );
        // Everything frozen: ln_1's output too.
        assert_eq!(
            frozen_linear_inputs(&layers, &details, 0, |_| true),
            8 + 8 + 32
        );
        assert_eq!(frozen_linear_inputs(&layers, &details, 0, |_| false), 0);
        // Layers before `from` are not counted.
        assert_eq!(frozen_linear_inputs(&layers, &details, 6, |_| true), 32);
        // Without names no linear after the attention is known to read past it.
        let unnamed = vec![LayerDetail::default(); layers.len()];
        assert_eq!(frozen_linear_inputs(&layers, &unnamed, 0, |_| true), 8 + 32);
    }
}
