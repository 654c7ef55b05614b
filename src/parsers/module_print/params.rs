//! Each module's parameters: printed, counted from a container's closing total, or derived
//! from its constructor's arguments.

use super::*;

/// Each module's own parameters (per copy), the parameters no line shows, and what was assumed.
pub(super) struct Counts {
    pub(super) own: Vec<u64>,
    /// Parameters owned by containers, all copies: the gap between a closing count and its
    /// children, or derived (`MultiheadAttention`'s input projection).
    pub(super) hidden: u64,
}

/// What a module's printed arguments say about its parameters.
pub(super) enum Derived {
    Params(u64),
    /// A norm that prints no width (`T5LayerNorm()`): this many parameters per feature.
    PerFeature(u64),
    Unknown,
}

pub(super) struct Counter<'t, 'a> {
    tree: &'t Tree<'a>,
    counts: Counts,
    /// The last width printed (a projection's output, an embedding's or a norm's size): the
    /// width of norms that print none.
    width: Option<u64>,
    /// The largest embedding of a plain print, which later copies may share.
    vocabulary: Option<Vocabulary>,
    /// Modules taken as tied to the vocabulary embedding.
    tied: Vec<String>,
    /// Modules whose parameters the print does not reveal, counted as 0.
    unrevealed: Vec<String>,
    /// Norms sized from their neighbours: (label, width).
    sized_from_neighbours: Vec<String>,
}

impl Counts {
    pub(super) fn of(tree: &Tree<'_>, warnings: &mut Warnings) -> Result<Counts, SummaryError> {
        let mut counter = Counter {
            tree,
            counts: Counts {
                own: vec![0; tree.nodes.len()],
                hidden: 0,
            },
            width: None,
            vocabulary: Vocabulary::of(tree),
            tied: Vec::new(),
            unrevealed: Vec::new(),
            sized_from_neighbours: Vec::new(),
        };
        let total = counter.count(tree.root, 1, warnings)?;
        if !tree.annotated {
            warnings.push(
                "parameters were derived from the printed constructor arguments (the print has \
                 no ', N params' annotations)",
            );
        }
        if let (Some(vocabulary), false) = (counter.vocabulary, counter.tied.is_empty()) {
            warnings.push(format!(
                "{} repeat the vocabulary embedding's {} x {} weights and were taken as tied \
                 to it (counted once), as Hugging Face models tie them by default",
                name_a_few(&counter.tied),
                vocabulary.entries,
                vocabulary.width
            ));
        }
        if !counter.sized_from_neighbours.is_empty() {
            warnings.push(format!(
                "norms that print no width took it from the neighbouring layers: {}",
                name_a_few(&counter.sized_from_neighbours)
            ));
        }
        if !counter.unrevealed.is_empty() {
            warnings.push(format!(
                "the print does not reveal the parameters of {}: counted as 0",
                name_a_few(&counter.unrevealed)
            ));
        }
        let root = tree.nodes.get(tree.root);
        let root_count = root.and_then(|node| node.closing.and_then(|(_, count)| count));
        if let (Some((footer, line)), Some(root_count)) = (tree.footer_total, root_count) {
            if footer != root_count {
                warnings.push(format!(
                    "summary.text line {line}: Total params {footer} differs from the model's \
                     closing line ({root_count}); the module lines are used ({total})"
                ));
            }
        }
        Ok(counter.counts)
    }
}

impl Counter<'_, '_> {
    /// A module's parameters per copy, in print order (so that `width` is the neighbours').
    /// `copies` is how many times the module occurs in the model. Recursion depth is bounded
    /// by MAX_NESTING; each module is visited once, whatever its repeat.
    fn count(
        &mut self,
        index: usize,
        copies: u64,
        warnings: &mut Warnings,
    ) -> Result<u64, SummaryError> {
        let tree = self.tree;
        let Some(node) = tree.nodes.get(index) else {
            return Ok(0);
        };
        // A sum is reported where it is printed: a container's closing line.
        let sum_line = node.closing.map_or(node.line, |(line, _)| line);
        let overflow =
            || SummaryError::new(sum_line, "the parameter counts add up to more than 64 bits");
        let at_line = |reason: String| SummaryError::new(node.line, reason);
        let own = match (node.args.and(node.params), node.own()) {
            (Some(annotated), _) => annotated,
            (None, Some(args)) => self.derive(index, node, args).map_err(at_line)?,
            (None, None) => 0,
        };
        if let Some(args) = node.own() {
            if let Some(width) = printed_width(node.class, args).map_err(at_line)? {
                self.width = Some(width);
            }
        }
        if let Some(slot) = self.counts.own.get_mut(index) {
            *slot = own;
        }
        let mut sum = own;
        for &child in &node.children {
            let repeat = tree.nodes.get(child).map_or(0, |c| c.repeat);
            let child_copies = copies.checked_mul(repeat).ok_or_else(overflow)?;
            let child_total = self.count(child, child_copies, warnings)?;
            sum = child_total
                .checked_mul(repeat)
                .and_then(|t| sum.checked_add(t))
                .ok_or_else(overflow)?;
        }
        let is_root = index == tree.root;
        let closing = node
            .closing
            .and_then(|(_, count)| count)
            .or_else(|| tree.footer_total.filter(|_| is_root).map(|(t, _)| t));
        let (total, owned) = match closing {
            Some(closing) => self.reconcile(index, closing, sum, warnings),
            None if tree.annotated => (sum, 0),
            None => {
                let owned = self.derived_hidden(node).map_err(at_line)?;
                (sum.checked_add(owned).ok_or_else(overflow)?, owned)
            }
        };
        if owned > 0 {
            let all_copies = owned.checked_mul(copies).ok_or_else(overflow)?;
            self.counts.hidden = self
                .counts
                .hidden
                .checked_add(all_copies)
                .ok_or_else(overflow)?;
        }
        if !tree.annotated && node.args.is_none() && holds_unprinted_parameters(node.class) {
            self.unrevealed.push(node.label());
        }
        Ok(total)
    }

    /// Compares a container's closing count with its modules' sum; returns its total and the
    /// parameters it owns itself (closing above the sum). Below the sum, parameters are shared
    /// (tied embeddings, counted once by `model.parameters()`): a later module whose count is
    /// exactly the excess and repeats an earlier one is taken to be the tied copy and dropped;
    /// otherwise the modules' sum stands.
    fn reconcile(
        &mut self,
        index: usize,
        closing: u64,
        sum: u64,
        warnings: &mut Warnings,
    ) -> (u64, u64) {
        let nodes = &self.tree.nodes;
        if let Some(owned) = closing.checked_sub(sum) {
            return (closing, owned);
        }
        let label = nodes.get(index).map_or_else(String::new, Node::label);
        let excess = sum.saturating_sub(closing);
        // The tied copies: for a count c with excess = k x c, the last k leaves of the subtree
        // holding c parameters, each repeating an earlier leaf of the same count (T5 holds its
        // embedding four times: three copies).
        let leaf_count = |at: usize| {
            nodes
                .get(at)
                .filter(|n| n.args.is_some() && n.repeat == 1)
                .and_then(|_| self.counts.own.get(at).copied())
                .filter(|&count| count > 0)
        };
        let end = subtree_end(nodes, index);
        let copies = (index..end).rev().find_map(|at| {
            let count = leaf_count(at)?;
            let k = usize::try_from(excess / count).ok()?;
            if !excess.is_multiple_of(count) || k == 0 {
                return None;
            }
            let holders: Vec<usize> = (0..end).filter(|&i| leaf_count(i) == Some(count)).collect();
            // the first holder is the original; copies are the last k inside the subtree
            let copies: Vec<usize> = holders
                .iter()
                .skip(1)
                .rev()
                .take(k)
                .copied()
                .filter(|&i| i >= index)
                .collect();
            (copies.len() == k).then_some((count, copies))
        });
        match copies {
            Some((count, copies)) => {
                let named: Vec<String> = copies
                    .iter()
                    .rev()
                    .filter_map(|&at| nodes.get(at))
                    .map(|copy| format!("{} (line {})", copy.label(), copy.line))
                    .collect();
                warnings.push(format!(
                    "{label}: the closing line says {closing} parameters, its modules add up \
                     to {sum}; {} repeat an earlier module's {count} parameters and are taken \
                     as shared (tied) copies, counted once",
                    named.join(", ")
                ));
                for at in copies {
                    if let Some(own) = self.counts.own.get_mut(at) {
                        *own = 0;
                    }
                }
                (closing, 0)
            }
            None => {
                warnings.push(format!(
                    "{label}: the closing line says {closing} parameters, its modules add up \
                     to {sum} (shared weights?); the modules' sum is used"
                ));
                (sum, 0)
            }
        }
    }

    fn derive(&mut self, index: usize, node: &Node<'_>, args: &str) -> Result<u64, String> {
        Ok(match derive_params(node.class, args)? {
            Derived::Params(params) => self.untied(index, node, args, params)?,
            Derived::PerFeature(per_feature) => match self.width {
                Some(width) => {
                    self.sized_from_neighbours
                        .push(format!("{} ({width})", node.label()));
                    width
                        .checked_mul(per_feature)
                        .ok_or("the parameter count does not fit in 64 bits")?
                }
                None => {
                    self.unrevealed.push(node.label());
                    0
                }
            },
            Derived::Unknown => {
                self.unrevealed.push(node.label());
                0
            }
        })
    }

    /// A plain print shows a shared module wherever it is used. The vocabulary embedding is
    /// the one most often shared: printed again (T5's `shared` and `embed_tokens`), or as the
    /// output projection's transposed weight (GPT-2's `lm_head`, BERT's `decoder`, whose bias
    /// is its own). Those copies are taken as tied, as Hugging Face models tie them by default.
    fn untied(
        &mut self,
        index: usize,
        node: &Node<'_>,
        args: &str,
        params: u64,
    ) -> Result<u64, String> {
        let Some(vocabulary) = self.vocabulary.filter(|v| index > v.index) else {
            return Ok(params);
        };
        let kind = kind_for_class(node.class);
        let own = if kind == LayerKind::Embedding
            && embedding_shape(args)? == Some((vocabulary.entries, vocabulary.width))
        {
            0
        } else if kind == LayerKind::Linear
            && linear_shape(args)? == Some((vocabulary.width, vocabulary.entries))
        {
            // Only the bias is the projection's own.
            params.saturating_sub(vocabulary.entries.saturating_mul(vocabulary.width))
        } else {
            return Ok(params);
        };
        self.tied.push(node.label());
        Ok(own)
    }

    /// Parameters a container owns that no child line shows: `MultiheadAttention`'s input
    /// projection (`3E x E` weights and `3E` biases, E being `out_proj`'s width).
    fn derived_hidden(&self, node: &Node<'_>) -> Result<u64, String> {
        if node.class != "MultiheadAttention" {
            return Ok(0);
        }
        let out_proj = node
            .children
            .iter()
            .filter_map(|&child| self.tree.nodes.get(child))
            .find_map(|child| child.args.filter(|_| child.name == Some("out_proj")));
        let Some(args) = out_proj else {
            return Ok(0);
        };
        let embed = keyword(args, "in_features")?.unwrap_or(0);
        let bias = if flag(args, "bias") == Some(false) {
            0
        } else {
            1
        };
        embed
            .checked_add(bias)
            .and_then(|per_row| per_row.checked_mul(embed))
            .and_then(|p| p.checked_mul(3))
            .ok_or_else(|| "the parameter count does not fit in 64 bits".to_string())
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Vocabulary {
    /// Its first module.
    index: usize,
    entries: u64,
    width: u64,
}

impl Vocabulary {
    /// The plain print's largest embedding (annotated prints count shared weights themselves).
    pub(super) fn of(tree: &Tree<'_>) -> Option<Vocabulary> {
        if tree.annotated {
            return None;
        }
        let mut largest: Option<Vocabulary> = None;
        for (index, node) in tree.nodes.iter().enumerate() {
            let Some(args) = node.args else { continue };
            if kind_for_class(node.class) != LayerKind::Embedding {
                continue;
            }
            if let Ok(Some((entries, width))) = embedding_shape(args) {
                if largest.is_none_or(|l| entries > l.entries) {
                    largest = Some(Vocabulary {
                        index,
                        entries,
                        width,
                    });
                }
            }
        }
        largest
    }
}

/// One past the last node of `index`'s subtree (nodes are in print order, children after
/// their parent).
pub(super) fn subtree_end(nodes: &[Node<'_>], index: usize) -> usize {
    let mut end = index.saturating_add(1);
    let mut at = index;
    while let Some(&last) = nodes.get(at).and_then(|n| n.children.last()) {
        end = last.saturating_add(1);
        at = last;
    }
    end
}

/// Containers known to own parameters that `print(model)` does not show: a ViT's class token
/// and position embedding, a ConvNeXt block's layer scale, a Swin window's position bias.
pub(super) fn holds_unprinted_parameters(class: &str) -> bool {
    // ViTs' are estimated apart (`Maps::position_embedding`).
    const HOLDERS: [&str; 8] = [
        "windowattention",
        "cnblock",
        "convnextblock",
        "beit",
        "maxvit",
        "cait",
        "xcit",
        "crossvit",
    ];
    let lower = class.to_ascii_lowercase();
    HOLDERS.iter().any(|holder| lower.contains(holder))
}

/// Parameter-free classes whose kind is `other`: padding, reshaping, positional encodings
/// computed on the fly, empty containers.
pub(super) fn is_parameter_free(lower: &str) -> bool {
    const FREE: [&str; 16] = [
        "rotary",
        "pad",
        "permute",
        "shuffle",
        "flatten",
        "identity",
        "pool",
        "upsampl",
        "drop",
        "activation",
        "softm",
        "reshape",
        "transpose",
        "sequential",
        "modulelist",
        "moduledict",
    ];
    FREE.iter().any(|free| lower.contains(free)) || lower.ends_with("lu") || lower.ends_with("act")
}

/// A module's parameters from its printed arguments, as PyTorch's constructors define them.
pub(super) fn derive_params(class: &str, args: &str) -> Result<Derived, String> {
    let overflow = || "the parameter count does not fit in 64 bits".to_string();
    let lower = class.to_ascii_lowercase();
    let product = |factors: &[u64]| {
        factors
            .iter()
            .try_fold(1u64, |p, &f| p.checked_mul(f))
            .ok_or_else(overflow)
    };
    let plus_bias = |weights: u64, bias: u64| weights.checked_add(bias).ok_or_else(overflow);
    if class == "Conv1D" {
        // Hugging Face's transposed linear layer: weight nx x nf, bias nf.
        return match (keyword(args, "nf")?, keyword(args, "nx")?) {
            (Some(nf), Some(nx)) => Ok(Derived::Params(plus_bias(product(&[nf, nx])?, nf)?)),
            _ => Ok(Derived::Unknown),
        };
    }
    let bias_of = |out: u64| {
        if flag(args, "bias") == Some(false) {
            0
        } else {
            out
        }
    };
    if let Some((dims, transposed)) = conv_dims(&lower) {
        let (Some(input), Some(output)) = (positional_dim(args, 0)?, positional_dim(args, 1)?)
        else {
            return Ok(Derived::Unknown);
        };
        let kernel = tuple_arg(args, "kernel_size", dims)?.unwrap_or_else(|| vec![1; dims]);
        let groups = keyword(args, "groups")?.unwrap_or(1);
        // Weights are out x in/groups x k (transposed: in x out/groups x k).
        let (fan, per_group) = if transposed {
            (input, output.checked_div(groups))
        } else {
            (output, input.checked_div(groups))
        };
        let per_group = per_group.ok_or("groups=0")?;
        let mut factors = vec![fan, per_group];
        factors.extend(kernel);
        return Ok(Derived::Params(plus_bias(
            product(&factors)?,
            bias_of(output),
        )?));
    }
    let affine = |key: &str, default: bool| flag(args, key).unwrap_or(default);
    let per_feature_norm = |per_feature: u64| -> Result<Derived, String> {
        Ok(match normalized_size(args)? {
            Some(size) => Derived::Params(product(&[size, per_feature])?),
            None => Derived::PerFeature(per_feature),
        })
    };
    let kind = kind_for_class(class);
    match kind {
        LayerKind::Linear => match (
            keyword(args, "in_features")?,
            keyword(args, "out_features")?,
        ) {
            (Some(input), Some(output)) => Ok(Derived::Params(plus_bias(
                product(&[input, output])?,
                bias_of(output),
            )?)),
            _ => Ok(Derived::Unknown),
        },
        LayerKind::Embedding => {
            let num = match positional_dim(args, 0)? {
                Some(num) => Some(num),
                None => keyword(args, "num_embeddings")?,
            };
            let dim = match positional_dim(args, 1)? {
                Some(dim) => Some(dim),
                None => keyword(args, "embedding_dim")?,
            };
            match (num, dim) {
                (Some(num), Some(dim)) => Ok(Derived::Params(product(&[num, dim])?)),
                _ => Ok(Derived::Unknown),
            }
        }
        _ if !affine("elementwise_affine", true) => Ok(Derived::Params(0)),
        // RMS norms (and T5's, which prints nothing) have a weight and no bias.
        LayerKind::RmsNorm => per_feature_norm(1),
        LayerKind::LayerNorm if lower.starts_with("t5") => per_feature_norm(1),
        LayerKind::LayerNorm => per_feature_norm(if flag(args, "bias") == Some(false) {
            1
        } else {
            2
        }),
        LayerKind::BatchNorm | LayerKind::InstanceNorm | LayerKind::GroupNorm => {
            // FrozenBatchNorm2d holds buffers only; InstanceNorm defaults to affine=False.
            let learnable =
                !lower.starts_with("frozen") && affine("affine", kind != LayerKind::InstanceNorm);
            let channels = if kind == LayerKind::GroupNorm {
                match positional_dim(args, 1)? {
                    Some(channels) => Some(channels),
                    None => keyword(args, "num_channels")?,
                }
            } else {
                match positional_dim(args, 0)? {
                    Some(channels) => Some(channels),
                    None => keyword(args, "num_features")?,
                }
            };
            match channels {
                Some(_) if !learnable => Ok(Derived::Params(0)),
                Some(channels) => Ok(Derived::Params(product(&[channels, 2])?)),
                None => Ok(Derived::Unknown),
            }
        }
        LayerKind::Prelu => Ok(Derived::Params(
            keyword(args, "num_parameters")?.unwrap_or(1),
        )),
        LayerKind::Other if lower.contains("layerscale") => Ok(Derived::PerFeature(1)),
        LayerKind::Other | LayerKind::Attention => Ok(if is_parameter_free(&lower) {
            Derived::Params(0)
        } else {
            Derived::Unknown
        }),
        _ => Ok(Derived::Params(0)),
    }
}

/// `Linear(in_features=768, out_features=3072, ...)`: (inputs, outputs).
pub(super) fn linear_shape(args: &str) -> Result<Option<(u64, u64)>, String> {
    Ok(keyword(args, "in_features")?.zip(keyword(args, "out_features")?))
}

/// `Embedding(50257, 768)` or with keywords: (entries, width).
pub(super) fn embedding_shape(args: &str) -> Result<Option<(u64, u64)>, String> {
    let entries = match positional_dim(args, 0)? {
        Some(entries) => Some(entries),
        None => keyword(args, "num_embeddings")?,
    };
    let width = match positional_dim(args, 1)? {
        Some(width) => Some(width),
        None => keyword(args, "embedding_dim")?,
    };
    Ok(entries.zip(width))
}

/// `conv2d`, `convtranspose1d`, timm's `stdconv2d`, `conv2dsame`: the spatial dimensions and
/// whether the convolution is transposed.
pub(super) fn conv_dims(lower: &str) -> Option<(usize, bool)> {
    [(1, "1d"), (2, "2d"), (3, "3d")]
        .into_iter()
        .find_map(|(dims, suffix)| {
            if lower.contains(&format!("convtranspose{suffix}")) {
                Some((dims, true))
            } else if lower.contains(&format!("conv{suffix}")) {
                Some((dims, false))
            } else {
                None
            }
        })
}

/// The width a module prints (a projection's outputs, an embedding's or a norm's size).
pub(super) fn printed_width(class: &str, args: &str) -> Result<Option<u64>, String> {
    if class == "Conv1D" {
        return keyword(args, "nf");
    }
    match kind_for_class(class) {
        LayerKind::Linear => keyword(args, "out_features"),
        LayerKind::Embedding => Ok(embedding_shape(args)?.map(|(_, width)| width)),
        LayerKind::LayerNorm | LayerKind::RmsNorm => normalized_size(args),
        _ => Ok(None),
    }
}
