//! `print(model)`: plain, or annotated with `, N params` per module (GPUMemNet's pipeline also
//! closes containers with `), N params` and adds a `Total params: N` footer).
//!
//! Parameters come from the annotations, or else from the printed constructor arguments
//! (`Linear(in_features=768, out_features=3072, bias=True)`). Output sizes are never printed:
//! they follow from `seq_len` (token layers) or from `input_shape` carried through the printed
//! convolutions and pools in print order.

use super::*;

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
    };
    emitter.emit(tree.root)?;
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
    // The copies outside each open container, innermost last.
    let mut outside: Vec<u64> = Vec::new();
    let mut copies: u64 = 1;
    let mut total: u64 = 0;
    for raw in text.lines() {
        let trimmed = raw.trim();
        let body = split_params(trimmed).map_or(trimmed, |(body, _)| body);
        let layers = if body == ")" {
            copies = outside.pop().unwrap_or(1);
            0
        } else {
            match parse_module_line(body) {
                Ok((_, repeat, _, args)) => {
                    let these = copies.saturating_mul(repeat);
                    if args.is_none() {
                        outside.push(copies);
                        copies = these;
                    }
                    these
                }
                Err(_) => copies,
            }
        };
        total = total.saturating_add(layers.saturating_mul(2));
        if total >= cap {
            return cap;
        }
    }
    total
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

// ---------------------------------------------------------------------------------------------
// Parameters.

/// Each module's own parameters (per copy), the parameters no line shows, and what was assumed.
struct Counts {
    own: Vec<u64>,
    /// Parameters owned by containers, all copies: the gap between a closing count and its
    /// children, or derived (`MultiheadAttention`'s input projection).
    hidden: u64,
}

/// What a module's printed arguments say about its parameters.
enum Derived {
    Params(u64),
    /// A norm that prints no width (`T5LayerNorm()`): this many parameters per feature.
    PerFeature(u64),
    Unknown,
}

struct Counter<'t, 'a> {
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
    fn of(tree: &Tree<'_>, warnings: &mut Warnings) -> Result<Counts, SummaryError> {
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
struct Vocabulary {
    /// Its first module.
    index: usize,
    entries: u64,
    width: u64,
}

impl Vocabulary {
    /// The plain print's largest embedding (annotated prints count shared weights themselves).
    fn of(tree: &Tree<'_>) -> Option<Vocabulary> {
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
fn subtree_end(nodes: &[Node<'_>], index: usize) -> usize {
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
fn holds_unprinted_parameters(class: &str) -> bool {
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
fn is_parameter_free(lower: &str) -> bool {
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
fn derive_params(class: &str, args: &str) -> Result<Derived, String> {
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
fn linear_shape(args: &str) -> Result<Option<(u64, u64)>, String> {
    Ok(keyword(args, "in_features")?.zip(keyword(args, "out_features")?))
}

/// `Embedding(50257, 768)` or with keywords: (entries, width).
fn embedding_shape(args: &str) -> Result<Option<(u64, u64)>, String> {
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
fn conv_dims(lower: &str) -> Option<(usize, bool)> {
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
fn printed_width(class: &str, args: &str) -> Result<Option<u64>, String> {
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

// ---------------------------------------------------------------------------------------------
// Output sizes.

/// How output sizes are derived.
enum Sizing {
    /// Token layers: `tokens x width`, width from the layer's arguments.
    Tokens(u64),
    /// Feature maps carried through the printed layers.
    Maps(Maps),
}

#[derive(Debug, Clone, PartialEq)]
struct Map {
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

struct Maps {
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
}

/// History searched for a branch's input: enough for any block, bounded for hostile text.
const MAX_HISTORY: usize = 256;

impl Sizing {
    fn choose(
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
fn map_from_input_shape(
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

struct Emitter<'n, 'a> {
    nodes: &'n [Node<'a>],
    counts: &'n Counts,
    sizing: Sizing,
    layers: Layers,
    /// The first layer the maps could not be carried through: (line, class).
    lost_track: Option<(usize, String)>,
}

impl Emitter<'_, '_> {
    /// Emits a module's layers, `repeat` times. Recursion depth is bounded by MAX_NESTING,
    /// and the work by MAX_LAYERS: only modules that add a layer are visited.
    fn emit(&mut self, index: usize) -> Result<(), SummaryError> {
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
    fn position_embedding(&self) -> Option<(u64, u64, u64)> {
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

fn tokens_times(tokens: u64, width: u64, line: usize) -> Result<u64, SummaryError> {
    tokens.checked_mul(width).ok_or_else(|| {
        SummaryError::new(line, "output size (tokens x width) does not fit in 64 bits")
    })
}

/// Class tokens a ViT puts before its patches (DeiT's distilled models add a second).
fn class_tokens_of(class: &str) -> u64 {
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
fn is_gate(class: &str) -> bool {
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
struct Window {
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

// ---------------------------------------------------------------------------------------------
// Arguments.

/// Module arguments split at top-level commas: `(64,), eps=1e-05` -> [`(64,)`, `eps=1e-05`].
fn split_args(args: &str) -> Vec<&str> {
    split_top_level(args)
        .into_iter()
        .filter(|a| !a.is_empty())
        .collect()
}

fn keyword_value<'a>(args: &'a str, key: &str) -> Option<&'a str> {
    split_args(args).into_iter().find_map(|arg| {
        arg.strip_prefix(key)
            .and_then(|rest| rest.trim_start().strip_prefix('='))
            .map(str::trim)
    })
}

fn keyword(args: &str, key: &str) -> Result<Option<u64>, String> {
    keyword_value(args, key).map(parse_dim).transpose()
}

/// `bias=False`, `affine=True`; `None` when absent or not a boolean.
fn flag(args: &str, key: &str) -> Option<bool> {
    match keyword_value(args, key)? {
        "True" => Some(true),
        "False" => Some(false),
        _ => None,
    }
}

fn positional(args: &str, position: usize) -> Option<&str> {
    split_args(args)
        .into_iter()
        .filter(|arg| !arg.contains('='))
        .nth(position)
}

/// A positional integer argument; `None` when absent or not an integer.
fn positional_dim(args: &str, position: usize) -> Result<Option<u64>, String> {
    match positional(args, position) {
        Some(raw) if raw.chars().all(|c| c.is_ascii_digit()) => parse_dim(raw).map(Some),
        _ => Ok(None),
    }
}

/// `(7, 7)`, `(3,)` or `3` (a value for every dimension); `None` entries for `None`.
fn broadcast(raw: &str, dims: usize) -> Vec<Option<u64>> {
    let values: Vec<Option<u64>> = raw
        .trim_matches(['(', ')', '[', ']'])
        .split(',')
        .map(str::trim)
        .filter(|v| !v.is_empty())
        .map(|v| parse_dim(v).ok())
        .collect();
    match values[..] {
        [single] => vec![single; dims],
        _ => values,
    }
}

/// A keyword's per-dimension integers (`kernel_size=(7, 7)`, `stride=2`); `None` when absent
/// or not integers (`padding=same`).
fn tuple_arg(args: &str, key: &str, dims: usize) -> Result<Option<Vec<u64>>, String> {
    let Some(raw) = keyword_value(args, key) else {
        return Ok(None);
    };
    let values = broadcast(raw, dims);
    if values.is_empty() || values.len() > 3 {
        return Ok(None);
    }
    Ok(values.into_iter().collect())
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
