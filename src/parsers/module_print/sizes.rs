//! Output sizes: tokens times width, or feature maps carried from `input_shape` through the
//! printed layers in print order.

use super::*;

/// How output sizes are derived.
pub(super) enum Sizing {
    /// Token layers: `tokens x width`, width from the layer's arguments.
    Tokens(u64),
    /// Feature maps carried through the printed layers.
    Maps(Maps),
}

#[derive(Debug, Clone, PartialEq)]
pub(super) struct Map {
    channels: u64,
    /// Spatial dimensions (`[H, W]`), or `[tokens]` once a conv stem became tokens, or empty
    /// once flattened.
    spatial: Vec<u64>,
}

impl Map {
    fn size(&self) -> Option<u64> {
        self.spatial
            .iter()
            .try_fold(self.channels, |p, &d| p.checked_mul(d))
    }
}

pub(super) struct Maps {
    current: Map,
    /// Earlier maps, so that a branch (a ResNet shortcut, an Inception branch) that reads an
    /// earlier input finds it by its channel count.
    history: Vec<Map>,
    /// Whether the model has attention: a conv stem followed by per-token projections then
    /// makes tokens (`H/stride x W/stride`, plus class tokens).
    attention: bool,
    class_tokens: u64,
    /// When a conv stem became tokens: (tokens, width).
    tokenized: Option<(u64, u64)>,
    /// The last linear layer whose printed `in_features` the carried map contradicts:
    /// (in_features, the features the map holds there).
    pub(super) mismatch: Option<(u64, u64)>,
}

/// History searched for a branch's input: enough for any block, bounded for hostile text.
pub(super) const MAX_HISTORY: usize = 256;

impl Sizing {
    pub(super) fn choose(
        tree: &Tree<'_>,
        sample: SampleShape<'_>,
        warnings: &mut Warnings,
    ) -> Result<Sizing, SummaryError> {
        let first_conv = tree.nodes.iter().find_map(|node| {
            let (dims, _) = conv_dims(&node.class.to_ascii_lowercase())?;
            let input = node
                .own()
                .and_then(|args| positional_dim(args, 0).ok().flatten());
            Some((dims, input))
        });
        let attention = tree.any(|node| is_attention_class(node.class));
        let tokens_needed =
            attention || tree.any(|node| kind_for_class(node.class) == LayerKind::Embedding);
        if let Some((dims, conv_input)) = first_conv.filter(|_| sample.seq_len.is_none()) {
            let given = sample
                .input_shape
                .and_then(|shape| map_from_input_shape(shape, dims, conv_input, warnings));
            let map = given.or_else(|| {
                // An ImageNet-sized image: what most 2-d convolution stacks are printed for.
                (dims == 2).then(|| {
                    let channels = conv_input.unwrap_or(3);
                    warnings.push(format!(
                        "input_shape missing or not [C, H, W]: assumed [{channels}, 224, 224]"
                    ));
                    Map {
                        channels,
                        spatial: vec![224, 224],
                    }
                })
            });
            let Some(map) = map else {
                return Err(SummaryError::field(
                    "input_shape",
                    format!(
                        "required to size the {dims}-d convolutions of a module print; give \
                         [C, {}] per sample",
                        ["L", "H, W", "D, H, W"]
                            .get(dims.saturating_sub(1))
                            .unwrap_or(&"...")
                    ),
                ));
            };
            let class_tokens = tree
                .nodes
                .get(tree.root)
                .map_or(0, |root| class_tokens_of(root.class));
            warnings.push(format!(
                "output sizes were derived by carrying input_shape [{}] through the printed \
                 layers in print order",
                std::iter::once(map.channels)
                    .chain(map.spatial.iter().copied())
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
            return Ok(Sizing::Maps(Maps {
                history: vec![map.clone()],
                current: map,
                attention,
                class_tokens,
                tokenized: None,
                mismatch: None,
            }));
        }
        let tokens = match (sample.seq_len, sample.input_shape) {
            (Some(seq_len), _) => seq_len,
            (None, Some(&[tokens])) if tokens_needed => {
                warnings.push(format!(
                    "seq_len not given: took the {tokens} tokens of input_shape"
                ));
                tokens
            }
            (None, _) if tokens_needed => {
                return Err(SummaryError::field(
                    "seq_len",
                    "required to size the layers of a module print; give the tokens per sample",
                ));
            }
            // Vectors: one per sample, or one per row of a [rows, features] input.
            (None, Some(shape)) => shape
                .split_last()
                .map_or(1, |(_, rows)| rows.iter().product::<u64>().max(1)),
            (None, None) => 1,
        };
        warnings.push(format!(
            "output sizes were derived as {tokens} token(s) per sample times each layer's \
             printed width"
        ));
        Ok(Sizing::Tokens(tokens))
    }
}

/// The map `input_shape` describes for a `dims`-d convolution stack: `[C, H, W]`, or, when
/// it is one short, the first convolution's input channels first; a channels-last `[H, W, C]`
/// is turned around.
pub(super) fn map_from_input_shape(
    shape: &[u64],
    dims: usize,
    conv_input: Option<u64>,
    warnings: &mut Warnings,
) -> Option<Map> {
    let (&first, rest) = shape.split_first()?;
    if shape.len() == dims.saturating_add(1) {
        if let (Some(channels), Some((&last, spatial))) = (conv_input, shape.split_last()) {
            if first != channels && last == channels {
                warnings.push("input_shape read as channels-last [H, W, C]".to_string());
                return Some(Map {
                    channels,
                    spatial: spatial.to_vec(),
                });
            }
        }
        return Some(Map {
            channels: first,
            spatial: rest.to_vec(),
        });
    }
    if shape.len() == dims {
        let channels = conv_input.unwrap_or(1);
        warnings.push(format!(
            "input_shape has no channel dimension: took the first convolution's {channels}"
        ));
        return Some(Map {
            channels,
            spatial: shape.to_vec(),
        });
    }
    None
}

pub(super) struct Emitter<'n, 'a> {
    pub(super) nodes: &'n [Node<'a>],
    pub(super) counts: &'n Counts,
    pub(super) sizing: Sizing,
    pub(super) layers: Layers,
    /// The first layer the maps could not be carried through: (line, class).
    pub(super) lost_track: Option<(usize, String)>,
    /// The first layer whose printed input size contradicts the map carried to it: (line,
    /// label, its in_features, the map's features).
    pub(super) contradiction: Option<(usize, String, u64, u64)>,
}

impl Emitter<'_, '_> {
    /// Emits a module's layers, `repeat` times. Recursion depth is bounded by MAX_NESTING,
    /// and the work by MAX_LAYERS: only modules that add a layer are visited.
    pub(super) fn emit(&mut self, index: usize) -> Result<(), SummaryError> {
        let nodes = self.nodes;
        let Some(node) = nodes.get(index) else {
            return Ok(());
        };
        let gate = is_gate(node.class);
        for _ in 0..node.repeat {
            let before = self.layers.len();
            let entry = self.current_map();
            if let Some(args) = node.own() {
                let layer = self.leaf(index, node, args)?;
                self.layers.push(layer, node.line)?;
            }
            if node.args.is_none() {
                for &child in &node.emitting {
                    self.emit(child)?;
                }
                if is_attention_class(node.class) && !node.attention_inside {
                    self.attention(node)?;
                }
            }
            // A gate (squeeze-and-excitation) scales its input: the map goes on unchanged.
            if let (true, Some(entry), Sizing::Maps(maps)) = (gate, entry, &mut self.sizing) {
                maps.current = entry;
            }
            if self.layers.len() == before {
                break;
            }
        }
        Ok(())
    }

    /// A ViT's class tokens and position embedding, which its print does not show:
    /// (patches, width, parameters), once the patch grid became tokens.
    pub(super) fn position_embedding(&self) -> Option<(u64, u64, u64)> {
        let Sizing::Maps(maps) = &self.sizing else {
            return None;
        };
        let (patches, width) = maps.tokenized?;
        let params = patches
            .checked_add(maps.class_tokens.saturating_mul(2))?
            .checked_mul(width)?;
        Some((patches, width, params))
    }

    fn current_map(&self) -> Option<Map> {
        match &self.sizing {
            Sizing::Maps(maps) => Some(maps.current.clone()),
            Sizing::Tokens(_) => None,
        }
    }

    /// The attention computation itself, which no child line represents: its output is
    /// `tokens x hidden`, hidden being what the last projection produces.
    fn attention(&mut self, node: &Node<'_>) -> Result<(), SummaryError> {
        let output_size = match self.sizing {
            Sizing::Tokens(tokens) => {
                let mut hidden = None;
                for child in node.children.iter().filter_map(|&c| self.nodes.get(c)) {
                    if let Some(args) = child.args {
                        if kind_for_class(child.class) == LayerKind::Linear {
                            if let Some(width) = printed_width(child.class, args)
                                .map_err(|reason| SummaryError::new(child.line, reason))?
                            {
                                hidden = Some(width);
                            }
                        }
                    }
                }
                match hidden {
                    Some(width) => tokens_times(tokens, width, node.line)?,
                    None => self.layers.last_output_size(),
                }
            }
            Sizing::Maps(ref maps) => maps.current.size().unwrap_or(0),
        };
        self.layers.push(
            Layer {
                kind: LayerKind::Attention,
                output_size,
                params: 0,
            },
            node.line,
        )
    }

    /// A module's own layer. With tokens its size is `tokens x width` for projections,
    /// embeddings and norms, the input's size for everything else; with maps, the map the
    /// module makes of its input.
    fn leaf(&mut self, index: usize, node: &Node<'_>, args: &str) -> Result<Layer, SummaryError> {
        let at_line = |reason: String| SummaryError::new(node.line, reason);
        let kind = kind_for_class(node.class);
        let output_size = match &mut self.sizing {
            Sizing::Tokens(tokens) => match printed_width(node.class, args).map_err(at_line)? {
                Some(width) => tokens_times(*tokens, width, node.line)?,
                None => self.layers.last_output_size(),
            },
            Sizing::Maps(maps) => {
                let followed = maps.follow(node.class, kind, args).map_err(at_line)?;
                if !followed && self.lost_track.is_none() {
                    self.lost_track = Some((node.line, node.label()));
                }
                if let Some((printed, carried)) = maps.mismatch.take() {
                    // Only where the maps were followed so far: after a layer they could not
                    // be carried through, the sizes are approximate anyway (said so).
                    if self.contradiction.is_none() && self.lost_track.is_none() {
                        self.contradiction = Some((node.line, node.label(), printed, carried));
                    }
                }
                maps.current
                    .size()
                    .ok_or_else(|| at_line("output size does not fit in 64 bits".to_string()))?
            }
        };
        Ok(Layer {
            kind,
            output_size,
            params: self.counts.own.get(index).copied().unwrap_or(0),
        })
    }
}

pub(super) fn tokens_times(tokens: u64, width: u64, line: usize) -> Result<u64, SummaryError> {
    tokens.checked_mul(width).ok_or_else(|| {
        SummaryError::new(line, "output size (tokens x width) does not fit in 64 bits")
    })
}

/// Class tokens a ViT puts before its patches (DeiT's distilled models add a second).
pub(super) fn class_tokens_of(class: &str) -> u64 {
    let lower = class.to_ascii_lowercase();
    if lower.contains("distilled") {
        2
    } else {
        u64::from(
            ["visiontransformer", "vit", "deit"]
                .iter()
                .any(|v| lower.contains(v)),
        )
    }
}

/// Squeeze-and-excitation blocks: their output scales their input.
pub(super) fn is_gate(class: &str) -> bool {
    let lower = class.to_ascii_lowercase();
    ["squeeze", "excit", "semodule", "selayer", "seblock"]
        .iter()
        .any(|gate| lower.contains(gate))
}

impl Maps {
    /// Carries the current map through a module. Returns false when the module did not fit
    /// the map (the map is then adjusted as well as can be).
    fn follow(&mut self, class: &str, kind: LayerKind, args: &str) -> Result<bool, String> {
        let lower = class.to_ascii_lowercase();
        let mut fits = true;
        if let Some((dims, transposed)) = conv_dims(&lower).filter(|_| class != "Conv1D") {
            if let Some(input) = positional_dim(args, 0)? {
                self.read_channels(input);
            }
            let output = positional_dim(args, 1)?.unwrap_or(self.current.channels);
            if self.current.spatial.len() != dims {
                fits = false;
                self.current.spatial = vec![1; dims];
            }
            let window = Window::of(args, dims)?;
            let spatial = window.apply(&self.current.spatial, transposed)?;
            self.set(Map {
                channels: output,
                spatial,
            });
            return Ok(fits);
        }
        match kind {
            LayerKind::MaxPool | LayerKind::AvgPool => {
                let dims = self.current.spatial.len();
                let kernel = tuple_arg(args, "kernel_size", dims)?;
                let window = Window::of(args, dims)?;
                let window = Window {
                    stride: match keyword_value(args, "stride") {
                        Some("None") | None => kernel.clone().unwrap_or_else(|| vec![1; dims]),
                        Some(_) => window.stride,
                    },
                    ..window
                };
                let spatial = window.apply(&self.current.spatial, false)?;
                self.set(Map {
                    spatial,
                    ..self.current.clone()
                });
            }
            // timm's `SelectAdaptivePool2d(pool_type=avg, flatten=...)` prints as one module.
            _ if lower.contains("adaptivepool") || lower.contains("globalpool") => {
                let channels = self.current.channels;
                let spatial = if args.contains("Flatten") {
                    Vec::new()
                } else {
                    vec![1; self.current.spatial.len()]
                };
                self.set(Map { channels, spatial });
            }
            LayerKind::AdaptiveAvgPool | LayerKind::AdaptiveMaxPool => {
                let dims = self.current.spatial.len();
                let sizes = keyword_value(args, "output_size")
                    .or_else(|| positional(args, 0))
                    .unwrap_or("1");
                let sizes = broadcast(sizes, dims);
                let spatial = self
                    .current
                    .spatial
                    .iter()
                    .zip(sizes.iter().chain(std::iter::repeat(&None)))
                    .map(|(&now, &set)| set.unwrap_or(now))
                    .collect();
                self.set(Map {
                    spatial,
                    ..self.current.clone()
                });
            }
            LayerKind::Linear => {
                let input = keyword(args, "in_features")?;
                let output = keyword(args, "out_features")?.unwrap_or(self.current.channels);
                let positions: u64 = self.current.spatial.iter().product();
                let flat = self.current.size();
                let per_position = input == Some(self.current.channels) && positions > 1;
                let merged_positions = match (input, flat) {
                    (Some(input), Some(flat))
                        if positions > 1
                            && input > self.current.channels
                            && flat > input
                            && flat % input == 0 =>
                    {
                        Some(flat / input)
                    }
                    _ => None,
                };
                if per_position {
                    if self.attention && self.tokenized.is_none() {
                        let tokens = positions.checked_add(self.class_tokens).ok_or("overflow")?;
                        self.tokenized = Some((positions, self.current.channels));
                        self.current.spatial = vec![tokens];
                    }
                    self.set(Map {
                        channels: output,
                        spatial: self.current.spatial.clone(),
                    });
                } else if let Some(merged) = merged_positions {
                    // Swin's patch merging: neighbouring positions concatenated, then projected.
                    self.set(Map {
                        channels: output,
                        spatial: vec![merged],
                    });
                } else {
                    fits = positions == 1 || input == flat || input.is_none();
                    // A flattened (or 1 x 1) map read by a layer printed for another size: the
                    // printout was made for another input than input_shape. Not with attention,
                    // whose widths the maps follow only roughly.
                    if let (Some(input), Some(flat), false) = (input, flat, self.attention) {
                        if positions == 1 && input != flat {
                            self.mismatch = Some((input, flat));
                        }
                    }
                    self.set(Map {
                        channels: output,
                        spatial: Vec::new(),
                    });
                }
            }
            LayerKind::BatchNorm | LayerKind::InstanceNorm => {
                if let Some(channels) = positional_dim(args, 0)? {
                    self.read_channels(channels);
                }
            }
            LayerKind::GroupNorm => {
                if let Some(channels) = positional_dim(args, 1)? {
                    self.read_channels(channels);
                }
            }
            LayerKind::Flatten => {
                let channels = self.current.size().ok_or("output size overflows")?;
                self.set(Map {
                    channels,
                    spatial: Vec::new(),
                });
            }
            LayerKind::Upsample => {
                let factor = keyword_value(args, "scale_factor")
                    .and_then(|f| f.trim_matches(['(', ')']).split(',').next())
                    .and_then(|f| f.trim().parse::<f64>().ok())
                    .filter(|f| f.is_finite() && *f >= 1.0 && *f <= 64.0)
                    .map_or(1, |f| f.round() as u64);
                let spatial = self
                    .current
                    .spatial
                    .iter()
                    .map(|&d| d.checked_mul(factor).ok_or("output size overflows"))
                    .collect::<Result<_, _>>()?;
                self.set(Map {
                    spatial,
                    ..self.current.clone()
                });
            }
            _ => {}
        }
        Ok(fits)
    }

    /// A module reads `channels` channels: the current map if it has them, else the latest
    /// earlier map that does (a branch reading the block's input), else the current map
    /// re-read with that many (a concatenation's output).
    fn read_channels(&mut self, channels: u64) {
        if self.current.channels == channels {
            return;
        }
        let earlier = self
            .history
            .iter()
            .rev()
            .take(MAX_HISTORY)
            .find(|map| map.channels == channels)
            .cloned();
        self.current = earlier.unwrap_or(Map {
            channels,
            spatial: self.current.spatial.clone(),
        });
    }

    fn set(&mut self, map: Map) {
        if self.history.len() >= MAX_HISTORY.saturating_mul(4) {
            self.history.drain(..MAX_HISTORY.saturating_mul(3));
        }
        self.history.push(map.clone());
        self.current = map;
    }
}

/// A convolution's or pool's window along each spatial dimension.
pub(super) struct Window {
    kernel: Vec<u64>,
    stride: Vec<u64>,
    padding: Vec<u64>,
    dilation: Vec<u64>,
    output_padding: Vec<u64>,
    ceil: bool,
    /// `padding=same`: the output keeps the input's size (before the stride).
    same: bool,
}

impl Window {
    fn of(args: &str, dims: usize) -> Result<Window, String> {
        let ones = || vec![1; dims];
        Ok(Window {
            kernel: tuple_arg(args, "kernel_size", dims)?.unwrap_or_else(ones),
            stride: tuple_arg(args, "stride", dims)?.unwrap_or_else(ones),
            padding: tuple_arg(args, "padding", dims)?.unwrap_or_else(|| vec![0; dims]),
            dilation: tuple_arg(args, "dilation", dims)?.unwrap_or_else(ones),
            output_padding: tuple_arg(args, "output_padding", dims)?
                .unwrap_or_else(|| vec![0; dims]),
            ceil: flag(args, "ceil_mode") == Some(true),
            same: keyword_value(args, "padding").is_some_and(|p| p.trim_matches('\'') == "same"),
        })
    }

    /// PyTorch's output size formulas, per dimension; never below 1.
    fn apply(&self, input: &[u64], transposed: bool) -> Result<Vec<u64>, String> {
        let overflow = || "output size does not fit in 64 bits".to_string();
        input
            .iter()
            .enumerate()
            .map(|(at, &size)| {
                let get = |v: &Vec<u64>, default: u64| v.get(at).copied().unwrap_or(default);
                let (k, s, p, d) = (
                    get(&self.kernel, 1),
                    get(&self.stride, 1).max(1),
                    get(&self.padding, 0),
                    get(&self.dilation, 1),
                );
                let reach = d.checked_mul(k.saturating_sub(1)).ok_or_else(overflow)?;
                if transposed {
                    // (in - 1) * s - 2p + d(k - 1) + output_padding + 1
                    let grown = size
                        .saturating_sub(1)
                        .checked_mul(s)
                        .and_then(|g| g.checked_add(reach))
                        .and_then(|g| g.checked_add(get(&self.output_padding, 0)))
                        .and_then(|g| g.checked_add(1))
                        .ok_or_else(overflow)?;
                    return Ok(grown.saturating_sub(p.saturating_mul(2)).max(1));
                }
                if self.same {
                    return Ok(size.div_ceil(s).max(1));
                }
                // floor_or_ceil((in + 2p - d(k - 1) - 1) / s) + 1
                let span = size
                    .checked_add(p.checked_mul(2).ok_or_else(overflow)?)
                    .ok_or_else(overflow)?
                    .saturating_sub(reach)
                    .saturating_sub(1);
                let steps = if self.ceil {
                    span.div_ceil(s)
                } else {
                    span / s
                };
                Ok(steps.saturating_add(1))
            })
            .collect()
    }
}
