//! `print(model)` annotated with `, N params`.

use super::*;

struct Node<'a> {
    line: usize,
    class: &'a str,
    /// `Some(args)` for a leaf `Class(args)`, `None` for a container `Class(`.
    args: Option<&'a str>,
    /// From `(0-11): 12 x Class(`: the module stands for this many identical copies.
    repeat: u64,
    /// The `, N params` on the module's line (a leaf's own parameters).
    params: Option<u64>,
    children: Vec<usize>,
    /// A container's closing `), N params`: its total.
    closing: Option<(usize, Option<u64>)>,
    /// Whether an attention module is nested inside (only the innermost one counts).
    attention_inside: bool,
    /// Whether expanding the module yields any layer. Children that do not are dropped
    /// once the tree is built, so every module visited during expansion adds a layer.
    emits: bool,
}

pub(super) fn parse(text: &str, seq_len: u64) -> Result<Vec<Layer>, SummaryError> {
    let tree = Tree::parse(text)?;
    let mut emitter = Emitter {
        nodes: &tree.nodes,
        seq_len,
        layers: Layers::default(),
    };
    emitter.emit(tree.root)?;
    let mut layers = emitter.layers;
    reconcile_total(&tree, &mut layers)?;
    if layers.len() == 0 {
        return Err(SummaryError::new(1, "no layers found"));
    }
    Ok(layers.0)
}

struct Tree<'a> {
    nodes: Vec<Node<'a>>,
    root: usize,
    /// The footer's `Total params: N` and its line.
    footer_total: Option<(u64, usize)>,
}

impl<'a> Tree<'a> {
    fn parse(text: &'a str) -> Result<Tree<'a>, SummaryError> {
        let mut nodes: Vec<Node<'a>> = Vec::new();
        let mut open: Vec<usize> = Vec::new();
        let mut root_done = false;
        let mut footer_total = None;
        let mut annotated = false;
        for (index, raw) in text.lines().enumerate() {
            let line = index.saturating_add(1);
            let at_line = |reason: String| SummaryError::new(line, reason);
            let trimmed = raw.trim();
            if trimmed.is_empty() || is_rule(trimmed) {
                continue;
            }
            if let Some(total) = trimmed.strip_prefix("Total params:") {
                footer_total = Some((parse_count(total.trim()).map_err(at_line)?, line));
                continue;
            }
            if is_footer(trimmed) {
                continue;
            }
            if root_done {
                return Err(at_line(format!(
                    "unexpected text after the model's closing ')': '{}'",
                    excerpt(trimmed)
                )));
            }
            let (body, params) = split_params(trimmed).map_err(at_line)?;
            annotated |= params.is_some();
            if body == ")" {
                let closed = open
                    .pop()
                    .ok_or_else(|| at_line("')' closes no module".into()))?;
                if let Some(node) = nodes.get_mut(closed) {
                    node.closing = Some((line, params));
                }
                root_done = open.is_empty();
                continue;
            }
            let (repeat, class, args) = parse_module_line(body)
                .map_err(|reason| at_line(format!("{reason}: '{}'", excerpt(trimmed))))?;
            let index = nodes.len();
            if let Some(parent) = open.last().and_then(|&parent| nodes.get_mut(parent)) {
                parent.children.push(index);
            }
            nodes.push(Node {
                line,
                class,
                args,
                repeat,
                params,
                children: Vec::new(),
                closing: None,
                attention_inside: false,
                emits: false,
            });
            if args.is_none() {
                if open.len() >= MAX_NESTING {
                    return Err(at_line(format!(
                        "modules nest deeper than {MAX_NESTING} levels"
                    )));
                }
                open.push(index);
            } else if open.is_empty() {
                root_done = true;
            }
        }
        if let Some(node) = open.last().and_then(|&unclosed| nodes.get(unclosed)) {
            return Err(SummaryError::new(
                node.line,
                format!("'{}(' is never closed", node.class),
            ));
        }
        if nodes.is_empty() {
            return Err(SummaryError::new(1, "no module lines found"));
        }
        if !annotated {
            return Err(SummaryError::new(
                1,
                "no ', N params' annotations found: each module line must end with its \
                 parameter count",
            ));
        }
        // Children come after their parent, so a reverse pass sees them first.
        for index in (0..nodes.len()).rev() {
            let Some(node) = nodes.get(index) else {
                continue;
            };
            let children = || node.children.iter().filter_map(|&child| nodes.get(child));
            let inside =
                children().any(|child| is_attention_class(child.class) || child.attention_inside);
            let emits = node.repeat > 0
                && (node.args.is_some()
                    || children().any(|child| child.emits)
                    || (is_attention_class(node.class) && !inside));
            let emitting: Vec<usize> = node
                .children
                .iter()
                .copied()
                .filter(|&child| nodes.get(child).is_some_and(|child| child.emits))
                .collect();
            if let Some(node) = nodes.get_mut(index) {
                node.attention_inside = inside;
                node.emits = emits;
                node.children = emitting;
            }
        }
        Ok(Tree {
            nodes,
            root: 0,
            footer_total,
        })
    }
}

/// Splits `body, 12,608 params` into the body and the count.
fn split_params(trimmed: &str) -> Result<(&str, Option<u64>), String> {
    let Some(head) = trimmed
        .strip_suffix("params")
        .or_else(|| trimmed.strip_suffix("param"))
    else {
        return Ok((trimmed, None));
    };
    let (body, count) = head
        .trim_end()
        .rsplit_once(' ')
        .and_then(|(body, count)| Some((body.strip_suffix(',')?, count)))
        .ok_or("expected the line to end with ', N params'")?;
    Ok((body.trim_end(), Some(parse_count(count)?)))
}

/// `(name): 12 x Class(args)` with the name and repeat optional; `args` is `None` when the
/// line opens a container (`Class(` alone).
fn parse_module_line(body: &str) -> Result<(u64, &str, Option<&str>), String> {
    let mut rest = body;
    if let Some(named) = rest.strip_prefix('(') {
        let (_name, after) = named
            .split_once("): ")
            .ok_or("expected '(name): Class(...)'")?;
        rest = after.trim_start();
    }
    let mut repeat = 1;
    if let Some((count, after)) = rest.split_once(" x ") {
        if let Ok(count) = parse_dim(count) {
            repeat = count;
            rest = after.trim_start();
        }
    }
    let (class, args) = rest.split_once('(').ok_or("expected 'Class(...)'")?;
    if !is_identifier(class) {
        return Err(format!("'{}' is not a class name", excerpt(class)));
    }
    if args.is_empty() {
        return Ok((repeat, class, None));
    }
    let args = args
        .strip_suffix(')')
        .filter(|args| is_balanced(args))
        .ok_or("unbalanced parentheses")?;
    Ok((repeat, class, Some(args)))
}

fn is_balanced(text: &str) -> bool {
    let mut depth = 0usize;
    for c in text.chars() {
        match c {
            '(' | '[' | '{' => depth = depth.saturating_add(1),
            ')' | ']' | '}' => match depth.checked_sub(1) {
                Some(d) => depth = d,
                None => return false,
            },
            _ => {}
        }
    }
    depth == 0
}

struct Emitter<'n, 'a> {
    nodes: &'n [Node<'a>],
    seq_len: u64,
    layers: Layers,
}

impl Emitter<'_, '_> {
    /// Emits a module's layers, `repeat` times. Recursion depth is bounded by MAX_NESTING,
    /// and the work by MAX_LAYERS: only modules that add a layer are visited.
    fn emit(&mut self, index: usize) -> Result<(), SummaryError> {
        let nodes = self.nodes;
        let Some(node) = nodes.get(index) else {
            return Ok(());
        };
        for _ in 0..node.repeat {
            let before = self.layers.len();
            match node.args {
                Some(args) => {
                    let (layer, _) = self.leaf(node, args)?;
                    self.layers.push(layer, node.line)?;
                }
                None => {
                    for &child in &node.children {
                        self.emit(child)?;
                    }
                    if is_attention_class(node.class) && !node.attention_inside {
                        self.attention(node)?;
                    }
                }
            }
            if self.layers.len() == before {
                break;
            }
        }
        Ok(())
    }

    /// The attention computation itself, which no child line represents: its output is
    /// `seq_len * hidden`, hidden being what the last projection produces.
    fn attention(&mut self, node: &Node<'_>) -> Result<(), SummaryError> {
        let mut hidden = None;
        for child in node
            .children
            .iter()
            .filter_map(|&child| self.nodes.get(child))
        {
            if let Some(args) = child.args {
                if let (_, Some(width)) = self.leaf(child, args)? {
                    hidden = Some(width);
                }
            }
        }
        let output_size = match hidden {
            Some(width) => self.tokens_times(width, node.line)?,
            None => self.layers.last_output_size(),
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

    /// A leaf's layer, plus its output width when it is a linear projection. Outputs are
    /// not printed, so they are derived from the arguments: `[seq_len, width]` for
    /// projections, embeddings and norms; the input's size for everything else.
    fn leaf(&self, node: &Node<'_>, args: &str) -> Result<(Layer, Option<u64>), SummaryError> {
        let at_line = |reason: String| SummaryError::new(node.line, reason);
        let kind = kind_for_class(node.class);
        let width = if node.class == "Conv1D" {
            keyword(args, "nf").map_err(at_line)?
        } else {
            match kind {
                LayerKind::Linear => keyword(args, "out_features").map_err(at_line)?,
                LayerKind::Embedding => match positional(args, 1) {
                    Some(dim) => Some(parse_dim(dim).map_err(at_line)?),
                    None => keyword(args, "embedding_dim").map_err(at_line)?,
                },
                LayerKind::LayerNorm | LayerKind::RmsNorm => {
                    normalized_size(args).map_err(at_line)?
                }
                _ => None,
            }
        };
        let output_size = match width {
            Some(width) => self.tokens_times(width, node.line)?,
            None => self.layers.last_output_size(),
        };
        let layer = Layer {
            kind,
            output_size,
            params: node.params.unwrap_or(0),
        };
        Ok((layer, width.filter(|_| kind == LayerKind::Linear)))
    }

    fn tokens_times(&self, width: u64, line: usize) -> Result<u64, SummaryError> {
        self.seq_len.checked_mul(width).ok_or_else(|| {
            SummaryError::new(
                line,
                "output size (seq_len x width) does not fit in 64 bits",
            )
        })
    }
}

/// Module arguments split at top-level commas: `(64,), eps=1e-05` -> [`(64,)`, `eps=1e-05`].
fn split_args(args: &str) -> Vec<&str> {
    split_top_level(args)
        .into_iter()
        .filter(|a| !a.is_empty())
        .collect()
}

fn keyword(args: &str, key: &str) -> Result<Option<u64>, String> {
    split_args(args)
        .into_iter()
        .find_map(|arg| {
            arg.strip_prefix(key)
                .and_then(|rest| rest.strip_prefix('='))
        })
        .map(|value| parse_dim(value.trim()))
        .transpose()
}

fn positional(args: &str, position: usize) -> Option<&str> {
    split_args(args)
        .into_iter()
        .filter(|arg| !arg.contains('='))
        .nth(position)
}

/// `LayerNorm((768,), ...)`: the product of the normalised shape. `None` when the
/// arguments do not start with one (e.g. `T5LayerNorm()`).
fn normalized_size(args: &str) -> Result<Option<u64>, String> {
    let Some(shape) = positional(args, 0) else {
        return Ok(None);
    };
    let dims: Vec<&str> = shape
        .trim_start_matches('(')
        .trim_end_matches(')')
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .collect();
    if dims.is_empty() || !dims.iter().all(|d| d.chars().all(|c| c.is_ascii_digit())) {
        return Ok(None);
    }
    dims.into_iter()
        .try_fold(1u64, |product, dim| {
            product
                .checked_mul(parse_dim(dim)?)
                .ok_or_else(|| "normalized shape does not fit in 64 bits".to_string())
        })
        .map(Some)
}

/// Makes the layers' parameters add up to the model's total. Parameters owned directly by
/// containers (e.g. `MultiheadAttention.in_proj_weight`) appear on no leaf line: they
/// become one `other` layer. A total below the leaves' sum means shared parameters (tied
/// embeddings, counted once by `model.parameters()`): when a later leaf repeats exactly the
/// excess, it is taken to be the tied copy and its count dropped.
fn reconcile_total(tree: &Tree<'_>, layers: &mut Layers) -> Result<(), SummaryError> {
    let root = tree.nodes.get(tree.root);
    let (root_line, root_total) = match root {
        Some(node) if node.args.is_some() => (node.line, node.params),
        Some(node) => node.closing.unwrap_or((node.line, None)),
        None => (1, None),
    };
    if let (Some((footer, line)), Some(root_total)) = (tree.footer_total, root_total) {
        if footer != root_total {
            return Err(SummaryError::new(
                line,
                format!(
                    "Total params {footer} does not match the model's closing line \
                     ({root_total})"
                ),
            ));
        }
    }
    let Some(total) = root_total.or(tree.footer_total.map(|(total, _)| total)) else {
        return Ok(());
    };
    let sum = layers.total_params().ok_or_else(|| {
        SummaryError::new(
            root_line,
            "the parameter counts add up to more than 64 bits",
        )
    })?;
    if let Some(missing) = total.checked_sub(sum).filter(|&m| m > 0) {
        layers.push(
            Layer {
                kind: LayerKind::Other,
                output_size: 0,
                params: missing,
            },
            root_line,
        )?;
    } else if let Some(excess) = sum.checked_sub(total).filter(|&e| e > 0) {
        let first = layers.0.iter().position(|l| l.params == excess);
        let last = layers.0.iter().rposition(|l| l.params == excess);
        if let (Some(first), Some(last)) = (first, last) {
            if let Some(tied) = layers.0.get_mut(last).filter(|_| first < last) {
                tied.params = 0;
            }
        }
    }
    Ok(())
}
