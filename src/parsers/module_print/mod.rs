//! `print(model)`: plain, or annotated with `, N params` per module (GPUMemNet's pipeline also
//! closes containers with `), N params` and adds a `Total params: N` footer).
//!
//! Parameters come from the annotations, or else from the printed constructor arguments
//! (`Linear(in_features=768, out_features=3072, bias=True)`). Output sizes are never printed:
//! they follow from `seq_len` (token layers) or from `input_shape` carried through the printed
//! convolutions and pools in print order.

use super::*;

mod arguments;
mod params;
mod sizes;

use arguments::*;
use params::*;
use sizes::*;

struct Node<'a> {
    line: usize,
    name: Option<&'a str>,
    class: &'a str,
    /// `Some(args)` for a leaf `Class(args)`, `None` for a container `Class(`.
    args: Option<&'a str>,
    /// A container's own constructor arguments, which PyTorch prints on the line after
    /// `Class(`, before the children (timm's `BatchNormAct2d(\n  64, eps=1e-05, ...\n  (act)`).
    own_args: Option<&'a str>,
    /// From `(0-11): 12 x Class(`: the module stands for this many identical copies.
    repeat: u64,
    /// The `, N params` on the module's line (a leaf's own parameters).
    params: Option<u64>,
    children: Vec<usize>,
    /// The children that add a layer (see `emits`).
    emitting: Vec<usize>,
    /// A container's closing `), N params`: its total.
    closing: Option<(usize, Option<u64>)>,
    /// Whether an attention module is nested inside (only the innermost one counts).
    attention_inside: bool,
    /// Whether expanding the module yields any layer. Only emitting children are visited,
    /// so every module visited during expansion adds a layer.
    emits: bool,
}

impl Node<'_> {
    /// The arguments the module's own parameters and shape follow from.
    fn own(&self) -> Option<&str> {
        self.args.or(self.own_args)
    }

    fn label(&self) -> String {
        match self.name {
            Some(name) => format!("{} ({})", echo(name), self.class),
            None => self.class.to_string(),
        }
    }
}

/// Wrappers that hold the model as `(module): Model(` and add nothing of their own.
const WRAPPERS: [&str; 2] = ["DataParallel", "DistributedDataParallel"];

pub(super) fn parse(
    text: &str,
    sample: SampleShape<'_>,
    warnings: &mut Warnings,
) -> Result<Vec<Layer>, SummaryError> {
    let tree = Tree::parse(text, warnings)?;
    let counts = Counts::of(&tree, warnings)?;
    let sizing = Sizing::choose(&tree, sample, warnings)?;
    let mut emitter = Emitter {
        nodes: &tree.nodes,
        counts: &counts,
        sizing,
        layers: Layers::default(),
        lost_track: None,
        contradiction: None,
    };
    emitter.emit(tree.root)?;
    if let (Some((line, layer, printed, carried)), Some(shape)) =
        (emitter.contradiction.take(), sample.input_shape)
    {
        warnings.push(format!(
            "summary.text line {line}: {layer} takes {printed} features, but input_shape \
             {shape:?} carried through the printed layers gives {carried} there: the printout \
             was made for another input size (or a layer that resizes is not printed); the \
             sizes before it follow input_shape, so check it"
        ));
    }
    if let Some((line, class)) = emitter.lost_track.take() {
        warnings.push(format!(
            "summary.text line {line}: could not follow input_shape through {class}; the sizes \
             after it are approximate"
        ));
    }
    let mut hidden = counts.hidden;
    let is_vit = tree
        .nodes
        .get(tree.root)
        .is_some_and(|root| class_tokens_of(root.class) > 0);
    if is_vit && !tree.annotated {
        match emitter.position_embedding() {
            Some((patches, width, params)) => {
                warnings.push(format!(
                    "the class token and position embedding are not printed: estimated from \
                     the {patches} patches of width {width} as {params} parameters"
                ));
                hidden = hidden.saturating_add(params);
            }
            None => warnings.push(
                "the class token and position embedding are not printed: counted as 0 (give \
                 input_shape to estimate them from the patch grid)",
            ),
        }
    }
    let mut layers = emitter.layers;
    if hidden > 0 {
        // Parameters owned by containers themselves (`MultiheadAttention.in_proj_weight`)
        // appear on no module line: one `other` layer holds them.
        let line = tree.nodes.get(tree.root).map_or(1, |node| node.line);
        layers.push(
            Layer {
                kind: LayerKind::Other,
                output_size: 0,
                params: hidden,
            },
            line,
        )?;
    }
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
    /// Whether any line carries `, N params`.
    annotated: bool,
}

impl<'a> Tree<'a> {
    fn parse(text: &'a str, warnings: &mut Warnings) -> Result<Tree<'a>, SummaryError> {
        let mut nodes: Vec<Node<'a>> = Vec::new();
        let mut open: Vec<usize> = Vec::new();
        let mut root_done = false;
        let mut footer = None;
        let mut annotated = false;
        for (index, raw) in text.lines().enumerate() {
            let line = index.saturating_add(1);
            let at_line = |reason: String| SummaryError::new(line, reason);
            let trimmed = raw.trim();
            if trimmed.is_empty() || is_rule(trimmed) {
                continue;
            }
            if let Some(total) = footer_total(trimmed) {
                footer = Some((total.map_err(at_line)?, line));
                continue;
            }
            if is_footer(trimmed) {
                continue;
            }
            if root_done {
                return Err(at_line(format!(
                    "unexpected text after the model's closing ')': '{}'",
                    echo(trimmed)
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
            let parsed = parse_module_line(body);
            let (name, repeat, class, args) = match parsed {
                Ok(parsed) => parsed,
                Err(reason) => {
                    // A container's own arguments, on the line after its `Class(`.
                    // An `extra_repr` of several lines keeps its first.
                    let container = open
                        .last()
                        .and_then(|&at| nodes.get_mut(at))
                        .filter(|node| node.children.is_empty());
                    match container {
                        Some(node) if looks_like_arguments(body) => {
                            node.own_args.get_or_insert(body);
                            continue;
                        }
                        _ => {
                            return Err(at_line(format!("{reason}: '{}'", echo(trimmed))));
                        }
                    }
                }
            };
            let index = nodes.len();
            if let Some(parent) = open.last().and_then(|&parent| nodes.get_mut(parent)) {
                parent.children.push(index);
            }
            nodes.push(Node {
                line,
                name,
                class,
                args,
                own_args: None,
                repeat,
                params,
                children: Vec::new(),
                emitting: Vec::new(),
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
        // Children come after their parent, so a reverse pass sees them first.
        for index in (0..nodes.len()).rev() {
            let Some(node) = nodes.get(index) else {
                continue;
            };
            let children = || node.children.iter().filter_map(|&child| nodes.get(child));
            let inside =
                children().any(|child| is_attention_class(child.class) || child.attention_inside);
            let emits = node.repeat > 0
                && (node.own().is_some()
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
                node.emitting = emitting;
            }
        }
        let mut root = 0;
        if let Some(wrapper) = nodes.first().filter(|n| WRAPPERS.contains(&n.class)) {
            if let [model] = wrapper.children[..] {
                warnings.push(format!(
                    "the {} wrapper was ignored: the model inside it is estimated",
                    wrapper.class
                ));
                root = model;
            }
        }
        Ok(Tree {
            nodes,
            root,
            footer_total: footer,
            annotated,
        })
    }

    /// Whether any module (or a container's own arguments) satisfies `test`.
    fn any(&self, test: impl Fn(&Node<'_>) -> bool) -> bool {
        self.nodes.iter().any(test)
    }
}

/// `64, eps=1e-05, affine=True`: numbers, tuples and `key=value`s, as `extra_repr` prints them.
fn looks_like_arguments(body: &str) -> bool {
    is_balanced(body)
        && split_args(body).iter().all(|arg| {
            arg.contains('=')
                || arg.starts_with(|c: char| c.is_ascii_digit() || c == '(' || c == '[')
        })
}

/// The most layers a text can be read as, in one pass that builds nothing: each module line
/// twice (its layer, and the attention a container adds) times the copies it stands for (its
/// own `N x` and its containers'), any other line twice; saturating at `cap`. What a request
/// holding the text is priced at before it is parsed.
pub(super) fn layers_bound(text: &str, cap: u64) -> u64 {
    weighted_layers_bound(text, cap, |_| 1)
}

/// [`layers_bound`] with each module line's layers also counted `weight(class)` times (what
/// a printout's layers cost to answer, by their kind): the weighted count, scaled down in
/// proportion when the plain one reaches `cap`, so it lies between the capped count and
/// `cap` times the heaviest weight.
pub(super) fn weighted_layers_bound(text: &str, cap: u64, weight: impl Fn(&str) -> u64) -> u64 {
    // The copies outside each open container, innermost last.
    let mut outside: Vec<u64> = Vec::new();
    let mut copies: u64 = 1;
    let (mut total, mut weighted): (u64, u64) = (0, 0);
    for raw in text.lines() {
        let trimmed = raw.trim();
        let body = split_params(trimmed).map_or(trimmed, |(body, _)| body);
        let (layers, heavy) = if body == ")" {
            copies = outside.pop().unwrap_or(1);
            (0, 0)
        } else {
            match parse_module_line(body) {
                Ok((_, repeat, class, args)) => {
                    let these = copies.saturating_mul(repeat);
                    if args.is_none() {
                        outside.push(copies);
                        copies = these;
                        (these, these)
                    } else {
                        (these, these.saturating_mul(weight(class)))
                    }
                }
                Err(_) => (copies, copies),
            }
        };
        total = total.saturating_add(layers.saturating_mul(2));
        weighted = weighted.saturating_add(heavy.saturating_mul(2));
        if total >= cap {
            // The share of the weight in what was read, over the capped count.
            let scaled = u128::from(weighted) * u128::from(cap) / u128::from(total.max(1));
            return u64::try_from(scaled).unwrap_or(u64::MAX);
        }
    }
    weighted
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

type ModuleLine<'a> = (Option<&'a str>, u64, &'a str, Option<&'a str>);

/// `(name): 12 x Class(args)` with the name and repeat optional; `args` is `None` when the
/// line opens a container (`Class(` alone).
fn parse_module_line(body: &str) -> Result<ModuleLine<'_>, String> {
    let mut rest = body;
    let mut name = None;
    if let Some(named) = rest.strip_prefix('(') {
        let (label, after) = named
            .split_once("): ")
            .ok_or("expected '(name): Class(...)'")?;
        name = Some(label);
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
        return Err(format!("'{}' is not a class name", echo(class)));
    }
    if args.is_empty() {
        return Ok((name, repeat, class, None));
    }
    let args = args
        .strip_suffix(')')
        .filter(|args| is_balanced(args))
        .ok_or("unbalanced parentheses")?;
    Ok((name, repeat, class, Some(args)))
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
