//! Model summaries pasted by users, parsed into layers.
//!
//! Two families of text are understood:
//! - [`SummaryFormat::Torchsummary`]: the tables of `torchsummary.summary` and of
//!   `torchinfo.summary` (tree prefixes, `depth-idx`, `--`, `(recursive)`).
//! - [`SummaryFormat::ModulePrint`]: `print(model)` annotated with `, N params` per module,
//!   including the Hugging Face / PyTorch `(0-11): 12 x Block(` collapsing of repeated blocks.
//!
//! The text is untrusted: its size, layer count and nesting are bounded, every number is parsed
//! and combined with checked arithmetic, and nothing here indexes out of bounds, so any input
//! yields layers or a [`SummaryError`] naming a line, never a panic.

use super::job::{Layer, LayerKind, MAX_LAYERS};

/// Largest summary text accepted. A 4,096-layer table is about 400 KiB.
pub const MAX_SUMMARY_BYTES: usize = 1 << 20;
/// Deepest module nesting accepted in a module print. Real models nest under 15 levels; the
/// bound keeps the (recursive) expansion of repeated blocks far from the stack limit.
pub const MAX_NESTING: usize = 64;

/// Which tool printed the summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SummaryFormat {
    /// A `torchsummary.summary` or `torchinfo.summary` table.
    Torchsummary,
    /// A PyTorch module print annotated with `, N params` on each module line.
    ModulePrint,
}

/// Why a summary was rejected, with the 1-based line of the text at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
#[error("summary.text line {line}: {reason}")]
pub struct SummaryError {
    pub line: usize,
    pub reason: String,
}

impl SummaryError {
    fn new(line: usize, reason: impl Into<String>) -> SummaryError {
        SummaryError {
            line,
            reason: reason.into(),
        }
    }
}

/// Parses a pasted summary into layers, in the order the summary lists them.
///
/// `batch_size` is the job's batch size. Both formats already yield per-sample sizes (tables
/// drop their leading batch dimension, whatever batch the tool was run with; module prints
/// derive sizes from `seq_len`), so it does not change the result today; it is part of the
/// signature so that callers need not change if a format ever needs it.
/// `seq_len` (tokens per sample) is required for [`SummaryFormat::ModulePrint`], whose text
/// carries no shapes.
pub fn parse_summary(
    format: SummaryFormat,
    text: &str,
    batch_size: u64,
    seq_len: Option<u64>,
) -> Result<Vec<Layer>, SummaryError> {
    let _ = batch_size;
    if text.len() > MAX_SUMMARY_BYTES {
        // Name the line where the limit was crossed, so the user sees how far off they are.
        let newlines = text
            .as_bytes()
            .get(..MAX_SUMMARY_BYTES)
            .unwrap_or_default()
            .iter()
            .filter(|&&b| b == b'\n')
            .count();
        return Err(SummaryError::new(
            newlines.saturating_add(1),
            format!("the text is larger than {MAX_SUMMARY_BYTES} bytes"),
        ));
    }
    if text.trim().is_empty() {
        return Err(SummaryError::new(1, "the text is empty"));
    }
    match format {
        SummaryFormat::Torchsummary => table::parse(text),
        SummaryFormat::ModulePrint => {
            let seq_len = seq_len.ok_or_else(|| {
                SummaryError::new(
                    1,
                    "seq_len is required to size the layers of a module print",
                )
            })?;
            if seq_len == 0 {
                return Err(SummaryError::new(1, "seq_len must be at least 1"));
            }
            module_print::parse(text, seq_len)
        }
    }
}

/// The layers found so far, refusing to grow past [`MAX_LAYERS`].
#[derive(Default)]
struct Layers(Vec<Layer>);

impl Layers {
    fn push(&mut self, layer: Layer, line: usize) -> Result<(), SummaryError> {
        if self.0.len() >= MAX_LAYERS {
            return Err(SummaryError::new(
                line,
                format!("more than {MAX_LAYERS} layers"),
            ));
        }
        self.0.push(layer);
        Ok(())
    }

    fn len(&self) -> usize {
        self.0.len()
    }

    fn last_output_size(&self) -> u64 {
        self.0.last().map_or(0, |l| l.output_size)
    }

    fn total_params(&self) -> Option<u64> {
        self.0
            .iter()
            .try_fold(0u64, |sum, l| sum.checked_add(l.params))
    }
}

// ---------------------------------------------------------------------------------------------
// Helpers shared by both formats.

/// A short prefix of untrusted text, safe to echo in an error.
fn excerpt(raw: &str) -> String {
    const MAX_CHARS: usize = 64;
    let mut out: String = raw.chars().take(MAX_CHARS).collect();
    if raw.chars().nth(MAX_CHARS).is_some() {
        out.push('…');
    }
    out
}

/// `====` and `----` separators (also the box-drawing ones some tools emit).
fn is_rule(trimmed: &str) -> bool {
    !trimmed.is_empty()
        && trimmed
            .chars()
            .all(|c| matches!(c, '=' | '-' | '_' | '─' | '━' | ' '))
}

/// The totals both tools print after the layers; they describe the model, not a layer.
fn is_footer(trimmed: &str) -> bool {
    const FOOTERS: [&str; 8] = [
        "Total params",
        "Trainable params",
        "Non-trainable params",
        "Total mult-adds",
        "Input size",
        "Forward/backward pass size",
        "Params size",
        "Estimated Total Size",
    ];
    FOOTERS.iter().any(|prefix| trimmed.starts_with(prefix))
}

/// A count as the tools print it: digits with optional thousands separators (`9,408`).
fn parse_count(raw: &str) -> Result<u64, String> {
    let well_formed = raw.starts_with(|c: char| c.is_ascii_digit())
        && raw.chars().all(|c| c.is_ascii_digit() || c == ',');
    if !well_formed {
        return Err(format!("'{}' is not a count", excerpt(raw)));
    }
    let digits: String = raw.chars().filter(char::is_ascii_digit).collect();
    digits
        .parse()
        .map_err(|_| format!("{} does not fit in 64 bits", excerpt(raw)))
}

/// A plain non-negative integer (a dimension or a module argument).
fn parse_dim(raw: &str) -> Result<u64, String> {
    if raw.is_empty() || !raw.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("'{}' is not a non-negative integer", excerpt(raw)));
    }
    raw.parse()
        .map_err(|_| format!("{} does not fit in 64 bits", excerpt(raw)))
}

/// Python class names: what both tools print as the layer type.
fn is_identifier(raw: &str) -> bool {
    raw.starts_with(|c: char| c.is_ascii_alphabetic() || c == '_')
        && raw.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

/// Attention classes, whatever the model family: `MultiheadAttention`, `BertSelfAttention`,
/// `GPT2Attention`, `LlamaFlashAttention2`.
fn is_attention_class(class: &str) -> bool {
    class
        .trim_end_matches(|c: char| c.is_ascii_digit())
        .ends_with("Attention")
}

/// Maps a PyTorch / Hugging Face class name to a layer kind. `LayerKind::parse` knows the
/// canonical spellings; this adds the common variants it does not (dimension suffixes, lazy
/// and quantised layers, HF activation wrappers, `...Attention`). Unknown classes are `Other`.
fn kind_for_class(class: &str) -> LayerKind {
    // GPT-2's `Conv1D` is a linear layer with transposed weights, not torch's `Conv1d`, which
    // `LayerKind::parse` (case-insensitive) would pick.
    if class == "Conv1D" {
        return LayerKind::Linear;
    }
    if let Some(kind) = LayerKind::parse(class) {
        return kind;
    }
    if is_attention_class(class) {
        return LayerKind::Attention;
    }
    let normalised: String = class
        .chars()
        .filter(char::is_ascii_alphanumeric)
        .map(|c| c.to_ascii_lowercase())
        .collect();
    let key = normalised
        .strip_suffix("activation")
        .filter(|k| !k.is_empty())
        .unwrap_or(&normalised);
    let key = key.strip_prefix("lazy").unwrap_or(key);
    let base = ["1d", "2d", "3d"]
        .iter()
        .find_map(|dims| key.strip_suffix(dims))
        .unwrap_or(key);
    if let Some(kind) = LayerKind::parse(key).or_else(|| LayerKind::parse(base)) {
        return kind;
    }
    if base.contains("gelu") {
        LayerKind::Gelu
    } else if base.ends_with("rmsnorm") {
        LayerKind::RmsNorm
    } else if base.ends_with("layernorm") {
        LayerKind::LayerNorm
    } else if base.ends_with("batchnorm") {
        LayerKind::BatchNorm
    } else if base.ends_with("groupnorm") {
        LayerKind::GroupNorm
    } else if base.contains("dropout") {
        LayerKind::Dropout
    } else if base.contains("droppath") || base.contains("stochasticdepth") {
        LayerKind::DropPath
    } else if base.ends_with("linear") {
        LayerKind::Linear
    } else if base.starts_with("convtranspose") {
        LayerKind::ConvTranspose2d
    } else if base.starts_with("upsampl") {
        LayerKind::Upsample
    } else if base.contains("softmax") {
        LayerKind::Softmax
    } else if base.ends_with("embedding") && !base.contains("rotary") {
        LayerKind::Embedding
    } else {
        LayerKind::Other
    }
}

// ---------------------------------------------------------------------------------------------

/// `torchsummary` and `torchinfo` tables.
mod table {
    use super::*;

    /// The value columns of a table, after the layer column.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Column {
        OutputShape,
        Params,
        /// Optional torchinfo columns (`Input Shape`, `Kernel Shape`, `Mult-Adds`, ...).
        Ignored,
    }

    /// Both tools print `Output Shape` then `Param #` unless asked for more columns.
    const DEFAULT_COLUMNS: [Column; 2] = [Column::OutputShape, Column::Params];

    struct Row<'a> {
        line: usize,
        class: &'a str,
        /// torchinfo's nesting depth (0 for the model row); `None` for torchsummary's flat rows.
        depth: Option<u64>,
        output_size: u64,
        params: u64,
    }

    /// Containers that torchsummary lists after their children with 0 parameters (it counts
    /// only a module's own `weight` and `bias`); their output repeats their last child's.
    const FLAT_CONTAINERS: [&str; 12] = [
        "Sequential",
        "ModuleList",
        "ModuleDict",
        "BasicBlock",
        "Bottleneck",
        "Conv2dNormActivation",
        "Conv3dNormActivation",
        "ConvNormActivation",
        "InvertedResidual",
        "SqueezeExcitation",
        "MBConv",
        "FusedMBConv",
    ];

    pub(super) fn parse(text: &str) -> Result<Vec<Layer>, SummaryError> {
        let mut columns: Vec<Column> = DEFAULT_COLUMNS.to_vec();
        let mut rows = Vec::new();
        for (index, raw) in text.lines().enumerate() {
            let line = index.saturating_add(1);
            let trimmed = raw.trim();
            if trimmed.is_empty() || is_rule(trimmed) || is_footer(trimmed) {
                continue;
            }
            if trimmed.starts_with("Layer (type") {
                columns =
                    parse_header(trimmed).map_err(|reason| SummaryError::new(line, reason))?;
                continue;
            }
            let row = parse_row(trimmed, &columns, line).map_err(|reason| {
                SummaryError::new(
                    line,
                    format!("not a layer row ({reason}): '{}'", excerpt(trimmed)),
                )
            })?;
            rows.push(row);
        }
        if rows.is_empty() {
            return Err(SummaryError::new(1, "no layer rows found"));
        }
        emit(&rows)
    }

    fn parse_header(header: &str) -> Result<Vec<Column>, String> {
        // Columns are padded with at least two spaces; titles contain single spaces only.
        let columns: Vec<Column> = header
            .split("  ")
            .map(str::trim)
            .filter(|title| !title.is_empty())
            .skip(1)
            .map(|title| match title {
                "Output Shape" => Column::OutputShape,
                "Param #" => Column::Params,
                _ => Column::Ignored,
            })
            .collect();
        for needed in DEFAULT_COLUMNS {
            if columns.iter().filter(|&&c| c == needed).count() != 1 {
                return Err(
                    "the header must have one 'Output Shape' and one 'Param #' column".into(),
                );
            }
        }
        Ok(columns)
    }

    fn parse_row<'a>(trimmed: &'a str, columns: &[Column], line: usize) -> Result<Row<'a>, String> {
        let body = trimmed.trim_start_matches(|c: char| {
            matches!(c, '│' | '├' | '└' | '─' | '|') || c.is_whitespace()
        });
        let tokens = tokenize(body)?;
        let name_len = tokens
            .len()
            .checked_sub(columns.len())
            .filter(|&n| n > 0)
            .ok_or_else(|| format!("expected a layer name and {} columns", columns.len()))?;
        let (name, values) = tokens.split_at(name_len);
        let (class, depth) = parse_name(name)?;
        let mut row = Row {
            line,
            class,
            depth,
            output_size: 0,
            params: 0,
        };
        for (column, value) in columns.iter().zip(values) {
            match column {
                Column::OutputShape => row.output_size = parse_shape(value)?,
                Column::Params => row.params = parse_params(value)?,
                Column::Ignored => {}
            }
        }
        Ok(row)
    }

    /// Splits on whitespace, keeping a bracketed shape such as `[1, 64, 56, 56]` as one token.
    fn tokenize(body: &str) -> Result<Vec<&str>, String> {
        let mut tokens = Vec::new();
        let mut start = None;
        let mut depth = 0usize;
        for (at, c) in body.char_indices() {
            if c.is_whitespace() && depth == 0 {
                if let Some(from) = start.take() {
                    tokens.extend(body.get(from..at));
                }
                continue;
            }
            start.get_or_insert(at);
            match c {
                '[' => depth = depth.saturating_add(1),
                ']' => depth = depth.checked_sub(1).ok_or("unbalanced ']'")?,
                _ => {}
            }
        }
        if depth != 0 {
            return Err("unclosed '['".into());
        }
        if let Some(from) = start {
            tokens.extend(body.get(from..));
        }
        Ok(tokens)
    }

    /// `Conv2d-1` (torchsummary), `Conv2d: 1-1` or `Conv2d (conv1): 1-1` (torchinfo), or the
    /// torchinfo model row `ResNet`; returns the class and the torchinfo depth.
    fn parse_name<'a>(tokens: &[&'a str]) -> Result<(&'a str, Option<u64>), String> {
        let (&first, rest) = tokens.split_first().ok_or("no layer name")?;
        let depth_idx = rest
            .last()
            .and_then(|last| last.split_once('-'))
            .filter(|(d, i)| {
                !d.is_empty()
                    && !i.is_empty()
                    && (d.chars().chain(i.chars())).all(|c| c.is_ascii_digit())
            });
        let (class, depth, var_names) = match (depth_idx, rest.split_last()) {
            (Some((depth, _)), Some((_, var_names))) => {
                let depth = parse_dim(depth)?;
                let labelled = var_names.last().copied().unwrap_or(first);
                if !labelled.ends_with(':') {
                    return Err("expected 'Class: depth-idx'".into());
                }
                (first.trim_end_matches(':'), Some(depth), var_names)
            }
            _ => match first.rsplit_once('-') {
                Some((class, index)) if rest.is_empty() && parse_dim(index).is_ok() => {
                    (class, None, rest)
                }
                _ => (first, Some(0), rest),
            },
        };
        // torchinfo's `row_settings=("var_names",)` adds `(conv1)` after the class.
        let var_names_ok = var_names
            .iter()
            .all(|v| v.starts_with('(') && v.trim_end_matches(':').ends_with(')'));
        if !is_identifier(class) || !var_names_ok {
            return Err(format!(
                "'{}' is not a layer name",
                excerpt(&tokens.join(" "))
            ));
        }
        Ok((class, depth))
    }

    /// Elements per sample: the product of the dimensions after the leading batch dimension
    /// (`-1` for torchsummary, the batch given to torchinfo otherwise). Modules returning
    /// several tensors print `[[-1, 10, 64], [-1, 10, 10]]`: their sizes add up. `--` (no
    /// output recorded) is 0.
    fn parse_shape(token: &str) -> Result<u64, String> {
        if token == "--" {
            return Ok(0);
        }
        let inner = token
            .strip_prefix('[')
            .and_then(|t| t.strip_suffix(']'))
            .ok_or_else(|| format!("'{}' is not an output shape", excerpt(token)))?
            .trim();
        if !inner.starts_with('[') {
            return flat_shape_size(inner);
        }
        split_top_level(inner)
            .into_iter()
            .try_fold(0u64, |sum, part| {
                let part = part
                    .strip_prefix('[')
                    .and_then(|p| p.strip_suffix(']'))
                    .ok_or("malformed list of shapes")?;
                sum.checked_add(flat_shape_size(part)?)
                    .ok_or_else(|| "output size does not fit in 64 bits".to_string())
            })
    }

    fn flat_shape_size(dims: &str) -> Result<u64, String> {
        if dims.trim().is_empty() {
            return Ok(0);
        }
        let mut dims = dims.split(',').map(str::trim);
        match dims.next() {
            Some("-1") => {}
            Some(batch) => {
                parse_dim(batch)?;
            }
            None => {}
        }
        dims.try_fold(1u64, |product, dim| {
            product
                .checked_mul(parse_dim(dim)?)
                .ok_or_else(|| "output size does not fit in 64 bits".to_string())
        })
    }

    /// `9,408`; `--` (none); `(9,408)` (torchinfo: frozen); `(recursive)` (torchinfo: a module
    /// called again, whose parameters were already counted).
    fn parse_params(token: &str) -> Result<u64, String> {
        match token {
            "--" | "(recursive)" => Ok(0),
            _ => parse_count(
                token
                    .strip_prefix('(')
                    .and_then(|t| t.strip_suffix(')'))
                    .unwrap_or(token),
            ),
        }
    }

    fn emit(rows: &[Row<'_>]) -> Result<Vec<Layer>, SummaryError> {
        let nested_attention = nested_attention(rows);
        let mut layers = Layers::default();
        let mut next_rows = rows.iter().skip(1);
        for (row, &has_attention_inside) in rows.iter().zip(&nested_attention) {
            let next_depth = next_rows.next().and_then(|next| next.depth);
            let is_container =
                matches!((row.depth, next_depth), (Some(depth), Some(next)) if next > depth);
            if is_container {
                // Containers are listed before their children, which hold their parameters
                // (torchinfo shows only parameters a container owns directly, e.g. a ViT's
                // position embedding). The innermost attention container stands for the
                // attention computation, which no child row represents.
                if is_attention_class(row.class) && !has_attention_inside {
                    let layer = Layer {
                        kind: LayerKind::Attention,
                        output_size: row.output_size,
                        params: row.params,
                    };
                    layers.push(layer, row.line)?;
                } else if row.params > 0 {
                    layers.push(
                        Layer {
                            kind: LayerKind::Other,
                            output_size: 0,
                            params: row.params,
                        },
                        row.line,
                    )?;
                }
                continue;
            }
            if row.depth.is_none() && row.params == 0 && FLAT_CONTAINERS.contains(&row.class) {
                continue;
            }
            let layer = Layer {
                kind: kind_for_class(row.class),
                output_size: row.output_size,
                params: row.params,
            };
            layers.push(layer, row.line)?;
        }
        if layers.len() == 0 {
            return Err(SummaryError::new(1, "no layers found"));
        }
        Ok(layers.0)
    }

    /// For each row, whether an attention module is nested inside it (so that only the
    /// innermost of `BertAttention` > `BertSelfAttention` counts as the attention).
    fn nested_attention(rows: &[Row<'_>]) -> Vec<bool> {
        let mut flags = vec![false; rows.len()];
        // Open rows as (index, depth); flags propagate to the parent when a row closes.
        let mut open: Vec<(usize, u64)> = Vec::new();
        for (index, row) in rows.iter().enumerate() {
            let depth = row.depth.unwrap_or(0);
            while let Some(&(top, top_depth)) = open.last() {
                if top_depth < depth {
                    break;
                }
                open.pop();
                close(&mut flags, top, open.last());
            }
            if is_attention_class(row.class) {
                if let Some(flag) = open.last().and_then(|&(parent, _)| flags.get_mut(parent)) {
                    *flag = true;
                }
            }
            open.push((index, depth));
        }
        while let Some((top, _)) = open.pop() {
            close(&mut flags, top, open.last());
        }
        flags
    }

    fn close(flags: &mut [bool], closed: usize, parent: Option<&(usize, u64)>) {
        if flags.get(closed).copied().unwrap_or(false) {
            if let Some(flag) = parent.and_then(|&(parent, _)| flags.get_mut(parent)) {
                *flag = true;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------

/// `print(model)` annotated with `, N params`.
mod module_print {
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
                let inside = children()
                    .any(|child| is_attention_class(child.class) || child.attention_inside);
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
}

/// Splits at commas outside brackets and parentheses, trimming each part.
fn split_top_level(text: &str) -> Vec<&str> {
    let mut parts = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (at, c) in text.char_indices() {
        match c {
            '(' | '[' | '{' => depth = depth.saturating_add(1),
            ')' | ']' | '}' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                parts.extend(text.get(start..at).map(str::trim));
                start = at.saturating_add(1);
            }
            _ => {}
        }
    }
    parts.extend(text.get(start..).map(str::trim));
    parts
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(layers: &[Layer]) -> Vec<&'static str> {
        layers.iter().map(|l| l.kind.as_str()).collect()
    }

    fn total_params(layers: &[Layer]) -> u64 {
        layers.iter().map(|l| l.params).sum()
    }

    fn layer(kind: LayerKind, output_size: u64, params: u64) -> Layer {
        Layer {
            kind,
            output_size,
            params,
        }
    }

    fn error_line(format: SummaryFormat, text: &str, seq_len: Option<u64>) -> usize {
        match parse_summary(format, text, 8, seq_len) {
            Ok(layers) => panic!("expected an error, got {} layers", layers.len()),
            Err(err) => err.line,
        }
    }

    const TINY_LM: &str = include_str!("../../tests/fixtures/summaries/tiny_lm_module_print.txt");

    // resnet18 as `torchsummary.summary(model, (3, 224, 224))` prints it, abridged after the
    // first block (rows 12-66 removed).
    const RESNET18_TORCHSUMMARY: &str =
        include_str!("../../tests/fixtures/summaries/resnet18_torchsummary.txt");

    // resnet18 as `torchinfo.summary(model, (1, 3, 224, 224))` prints it, abridged.
    const RESNET18_TORCHINFO: &str =
        include_str!("../../tests/fixtures/summaries/resnet18_torchinfo.txt");

    // bert-base-uncased, printed with `, N params` per module (embeddings and encoder intact,
    // the classifier-free pooler at the end). 12 x BertLayer of 7,087,872 parameters each.
    const BERT_BASE: &str =
        include_str!("../../tests/fixtures/summaries/bert_base_module_print.txt");

    // gpt2 (GPT2LMHeadModel): lm_head shares wte's weight, so the total counts it once.
    const GPT2: &str = include_str!("../../tests/fixtures/summaries/gpt2_module_print.txt");

    #[test]
    fn the_tiny_lm_print_yields_its_leaves_sized_by_seq_len() {
        let layers = parse_summary(SummaryFormat::ModulePrint, TINY_LM, 8, Some(128)).unwrap();
        assert_eq!(
            layers,
            vec![
                layer(LayerKind::Embedding, 128 * 64, 64_000),
                layer(LayerKind::Linear, 128 * 192, 12_480),
                layer(LayerKind::LayerNorm, 128 * 64, 128),
                layer(LayerKind::Dropout, 128 * 64, 0),
            ]
        );
        assert_eq!(total_params(&layers), 76_608);
    }

    #[test]
    fn a_torchsummary_table_yields_its_rows_without_batch_dim_and_block_rows() {
        let layers =
            parse_summary(SummaryFormat::Torchsummary, RESNET18_TORCHSUMMARY, 8, None).unwrap();
        assert_eq!(
            kinds(&layers),
            [
                "conv2d",
                "batch_norm",
                "relu",
                "max_pool",
                "conv2d",
                "batch_norm",
                "relu",
                "conv2d",
                "batch_norm",
                "relu",
                "adaptive_avg_pool",
                "linear"
            ]
        );
        assert_eq!(layers[0], layer(LayerKind::Conv2d, 64 * 112 * 112, 9_408));
        assert_eq!(layers[3], layer(LayerKind::MaxPool, 64 * 56 * 56, 0));
        assert_eq!(layers[10], layer(LayerKind::AdaptiveAvgPool, 512, 0));
        assert_eq!(layers[11], layer(LayerKind::Linear, 1000, 513_000));
        assert_eq!(
            total_params(&layers),
            9_408 + 128 + 2 * (36_864 + 128) + 513_000
        );
    }

    #[test]
    fn a_torchinfo_table_keeps_leaf_rows_and_reads_dashes_as_zero() {
        let layers =
            parse_summary(SummaryFormat::Torchsummary, RESNET18_TORCHINFO, 8, None).unwrap();
        let from_torchsummary =
            parse_summary(SummaryFormat::Torchsummary, RESNET18_TORCHSUMMARY, 8, None).unwrap();
        assert_eq!(layers, from_torchsummary);
    }

    #[test]
    fn torchinfo_attention_containers_leftover_params_and_extra_columns_are_understood() {
        let text = "\
==========================================================================================================
Layer (type (var_name):depth-idx)        Input Shape          Output Shape         Param #      Trainable
==========================================================================================================
VisionTransformer (VisionTransformer)    [4, 3, 32, 32]       [4, 10]              --           True
├─Conv2d (conv_proj): 1-1                [4, 3, 32, 32]       [4, 64, 4, 4]        12,352       True
├─Encoder (encoder): 1-2                 [4, 17, 64]          [4, 17, 64]          1,088        True
│    └─Dropout (dropout): 2-1            [4, 17, 64]          [4, 17, 64]          --           --
│    └─EncoderBlock (0): 2-2             [4, 17, 64]          [4, 17, 64]          --           True
│    │    └─LayerNorm (ln_1): 3-1        [4, 17, 64]          [4, 17, 64]          128          True
│    │    └─MultiheadAttention (self_attention): 3-2  [4, 17, 64]  [4, 17, 64]    12,480       True
│    │    │    └─NonDynamicallyQuantizableLinear (out_proj): 4-1  --  --          4,160        True
│    │    └─ReLU (act): 3-3              [4, 17, 64]          [4, 17, 64]          --           --
│    │    └─ReLU (act): 3-4              [4, 17, 64]          [4, 17, 64]          (recursive)  --
│    │    └─Frobnicator (frob): 3-5      [4, 17, 64]          [[4, 17, 64], [4, 2]]  (256)      False
├─Linear (heads): 1-3                    [4, 64]              [4, 10]              650          True
==========================================================================================================
Total params: 31,114
";
        let layers = parse_summary(SummaryFormat::Torchsummary, text, 4, None).unwrap();
        assert_eq!(
            layers,
            vec![
                layer(LayerKind::Conv2d, 64 * 4 * 4, 12_352),
                layer(LayerKind::Other, 0, 1_088),
                layer(LayerKind::Dropout, 17 * 64, 0),
                layer(LayerKind::LayerNorm, 17 * 64, 128),
                layer(LayerKind::Attention, 17 * 64, 12_480),
                layer(LayerKind::Linear, 0, 4_160),
                layer(LayerKind::Relu, 17 * 64, 0),
                layer(LayerKind::Relu, 17 * 64, 0),
                layer(LayerKind::Other, 17 * 64 + 2, 256),
                layer(LayerKind::Linear, 10, 650),
            ]
        );
        assert_eq!(total_params(&layers), 31_114);
    }

    #[test]
    fn torchsummary_tuple_outputs_and_custom_batch_sizes_are_per_sample() {
        let text = "\
        Layer (type)               Output Shape         Param #
================================================================
         Embedding-1              [16, 10, 64]          64,000
MultiheadAttention-2  [[-1, 10, 64], [-1, 10, 10]]               0
         LayerNorm-3              [16, 10, 64]             128
";
        let layers = parse_summary(SummaryFormat::Torchsummary, text, 16, None).unwrap();
        assert_eq!(
            layers,
            vec![
                layer(LayerKind::Embedding, 640, 64_000),
                layer(LayerKind::Attention, 640 + 100, 0),
                layer(LayerKind::LayerNorm, 640, 128),
            ]
        );
    }

    #[test]
    fn a_bert_print_repeats_its_twelve_layers_and_adds_one_attention_per_layer() {
        let layers = parse_summary(SummaryFormat::ModulePrint, BERT_BASE, 8, Some(128)).unwrap();
        // 5 embedding leaves, 12 x (12 leaves + 1 attention), 2 pooler leaves.
        assert_eq!(layers.len(), 5 + 12 * 13 + 2);
        assert_eq!(total_params(&layers), 109_482_240);
        let attention: Vec<_> = layers
            .iter()
            .filter(|l| l.kind == LayerKind::Attention)
            .collect();
        assert_eq!(
            attention.len(),
            12,
            "BertAttention wraps BertSelfAttention: counted once"
        );
        assert!(attention
            .iter()
            .all(|l| l.output_size == 128 * 768 && l.params == 0));
        assert_eq!(
            kinds(&layers[5..18]),
            [
                "linear",
                "linear",
                "linear",
                "dropout",
                "attention",
                "linear",
                "layer_norm",
                "dropout",
                "linear",
                "gelu",
                "linear",
                "layer_norm",
                "dropout"
            ]
        );
        assert_eq!(
            kinds(&layers[5..18]),
            kinds(&layers[148..161]),
            "the last block repeats the first"
        );
        assert_eq!(
            layers[8].output_size,
            128 * 768,
            "dropout keeps the value projection's size"
        );
        assert_eq!(layers[13].output_size, 128 * 3072);
        assert_eq!(layers[14].kind, LayerKind::Gelu);
        assert_eq!(layers[14].output_size, 128 * 3072);
        assert_eq!(
            layers[0],
            layer(LayerKind::Embedding, 128 * 768, 23_440_896)
        );
        assert_eq!(layers.last(), Some(&layer(LayerKind::Tanh, 128 * 768, 0)));
    }

    #[test]
    fn a_gpt2_print_reads_conv1d_as_linear_and_drops_the_tied_lm_head_copy() {
        let layers = parse_summary(SummaryFormat::ModulePrint, GPT2, 8, Some(1024)).unwrap();
        // 3 embedding leaves, 12 x (10 leaves + 1 attention), ln_f, lm_head.
        assert_eq!(layers.len(), 3 + 12 * 11 + 2);
        assert_eq!(total_params(&layers), 124_439_808);
        assert_eq!(layers[4], layer(LayerKind::Linear, 1024 * 2304, 1_771_776));
        assert_eq!(layers[8], layer(LayerKind::Attention, 1024 * 768, 0));
        assert_eq!(layers[12], layer(LayerKind::Gelu, 1024 * 768, 0));
        let lm_head = layers.last().unwrap();
        assert_eq!(*lm_head, layer(LayerKind::Linear, 1024 * 50_257, 0));
    }

    #[test]
    fn parameters_owned_by_containers_go_into_one_other_layer() {
        let text = "\
Encoder(
  (self_attn): MultiheadAttention(
    (out_proj): NonDynamicallyQuantizableLinear(in_features=64, out_features=64, bias=True), 4,160 params
  ), 16,640 params
  (act): ReLU(), 0 params
), 16,640 params
";
        let layers = parse_summary(SummaryFormat::ModulePrint, text, 8, Some(10)).unwrap();
        assert_eq!(
            layers,
            vec![
                layer(LayerKind::Linear, 640, 4_160),
                layer(LayerKind::Attention, 640, 0),
                layer(LayerKind::Relu, 640, 0),
                layer(LayerKind::Other, 0, 12_480),
            ]
        );
    }

    #[test]
    fn class_names_map_to_kinds_beyond_the_canonical_spellings() {
        for (class, kind) in [
            ("Conv1D", LayerKind::Linear),
            ("Conv1d", LayerKind::Conv1d),
            ("LazyConv3d", LayerKind::Conv3d),
            ("MaxPool1d", LayerKind::MaxPool),
            ("Dropout2d", LayerKind::Dropout),
            ("NewGELUActivation", LayerKind::Gelu),
            ("SiLUActivation", LayerKind::Silu),
            ("LlamaRMSNorm", LayerKind::RmsNorm),
            ("FrozenBatchNorm2d", LayerKind::BatchNorm),
            ("LlamaFlashAttention2", LayerKind::Attention),
            ("BertSelfAttention", LayerKind::Attention),
            ("NonDynamicallyQuantizableLinear", LayerKind::Linear),
            ("ConvTranspose1d", LayerKind::ConvTranspose2d),
            ("LlamaRotaryEmbedding", LayerKind::Other),
            ("Frobnicator", LayerKind::Other),
        ] {
            assert_eq!(kind_for_class(class), kind, "{class}");
        }
    }

    #[test]
    fn a_garbage_line_is_reported_on_its_own_line() {
        let mut table: Vec<&str> = RESNET18_TORCHSUMMARY.lines().collect();
        table.insert(6, "this is not a layer row");
        assert_eq!(
            error_line(SummaryFormat::Torchsummary, &table.join("\n"), None),
            7
        );
        let mut print: Vec<&str> = TINY_LM.lines().collect();
        print.insert(3, "    what is this?");
        assert_eq!(
            error_line(SummaryFormat::ModulePrint, &print.join("\n"), Some(128)),
            4
        );
        let err = parse_summary(SummaryFormat::Torchsummary, "hello", 8, None).unwrap_err();
        assert!(
            err.to_string()
                .starts_with("summary.text line 1: not a layer row"),
            "{err}"
        );
    }

    #[test]
    fn a_module_print_needs_seq_len() {
        let err = parse_summary(SummaryFormat::ModulePrint, TINY_LM, 8, None).unwrap_err();
        assert_eq!(err.line, 1);
        assert!(err.reason.contains("seq_len"), "{err}");
    }

    #[test]
    fn empty_and_oversized_texts_are_rejected() {
        assert_eq!(error_line(SummaryFormat::Torchsummary, "", None), 1);
        assert_eq!(error_line(SummaryFormat::ModulePrint, " \n\n", Some(1)), 1);
        let huge = "x\n".repeat(MAX_SUMMARY_BYTES / 2 + 1);
        assert_eq!(
            error_line(SummaryFormat::Torchsummary, &huge, None),
            MAX_SUMMARY_BYTES / 2 + 1
        );
    }

    #[test]
    fn the_layer_after_the_limit_is_reported() {
        let rows = "Linear-1  [-1, 10]  110\n".repeat(MAX_LAYERS + 1);
        assert_eq!(
            error_line(SummaryFormat::Torchsummary, &rows, None),
            MAX_LAYERS + 1
        );
        let repeated =
            "M(\n  (0-99999999999): 99999999999 x B(\n    (a): ReLU(), 0 params\n  )\n), 0 params\n";
        assert_eq!(error_line(SummaryFormat::ModulePrint, repeated, Some(4)), 3);
        let empty_blocks =
            "M(\n  (0-99999999999): 99999999999 x B(\n  )\n  (a): ReLU(), 0 params\n), 0 params\n";
        assert_eq!(
            parse_summary(SummaryFormat::ModulePrint, empty_blocks, 8, Some(4))
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn deep_or_unbalanced_nesting_is_rejected() {
        let deep = "(m): M(\n".repeat(MAX_NESTING + 1);
        assert_eq!(
            error_line(SummaryFormat::ModulePrint, &deep, Some(4)),
            MAX_NESTING + 1
        );
        let unclosed = "M(\n  (a): N(\n    (b): ReLU(), 0 params\n";
        assert_eq!(error_line(SummaryFormat::ModulePrint, unclosed, Some(4)), 2);
        let extra_close = "M(\n  (b): ReLU(), 0 params\n), 0 params\n), 0 params\n";
        assert_eq!(
            error_line(SummaryFormat::ModulePrint, extra_close, Some(4)),
            4
        );
        let bad_args = "M(\n  (b): Linear((((((out_features=3), 0 params\n), 0 params\n";
        assert_eq!(error_line(SummaryFormat::ModulePrint, bad_args, Some(4)), 2);
        let bad_shape = "Conv2d-1  [[[[-1, 3]]]  9\n";
        assert_eq!(error_line(SummaryFormat::Torchsummary, bad_shape, None), 1);
        let nested_shape = format!(
            "Conv2d-1  {}-1{}  9\n",
            "[".repeat(10_000),
            "]".repeat(10_000)
        );
        assert_eq!(
            error_line(SummaryFormat::Torchsummary, &nested_shape, None),
            1
        );
    }

    #[test]
    fn numbers_beyond_64_bits_are_errors_not_panics() {
        let params = "Linear-1  [-1, 10]  99,999,999,999,999,999,999\n";
        assert_eq!(error_line(SummaryFormat::Torchsummary, params, None), 1);
        let shape = "Linear-1  [-1, 4294967296, 4294967296]  1\n";
        assert_eq!(error_line(SummaryFormat::Torchsummary, shape, None), 1);
        let dim = "Linear-1  [-1, 18446744073709551616]  1\n";
        assert_eq!(error_line(SummaryFormat::Torchsummary, dim, None), 1);
        let width =
            "M(\n  (a): Linear(in_features=1, out_features=18446744073709551615), 2 params\n\
                     ), 2 params\n";
        assert_eq!(error_line(SummaryFormat::ModulePrint, width, Some(2)), 2);
        let sum =
            "M(\n  (a): ReLU(), 18446744073709551615 params\n  (b): ReLU(), 1 params\n), 5 params\n";
        assert_eq!(error_line(SummaryFormat::ModulePrint, sum, Some(2)), 4);
    }

    #[test]
    fn a_footer_total_that_contradicts_the_model_is_rejected() {
        let text = TINY_LM.replace("Total params: 76,608", "Total params: 76,609");
        assert_eq!(error_line(SummaryFormat::ModulePrint, &text, Some(128)), 12);
    }

    #[test]
    fn a_plain_print_without_annotations_is_rejected() {
        let text = "M(\n  (a): Linear(in_features=1, out_features=2, bias=True)\n)\n";
        assert_eq!(error_line(SummaryFormat::ModulePrint, text, Some(2)), 1);
    }

    /// xorshift64*: deterministic pseudo-random numbers without a dependency.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: usize) -> usize {
            (self.next() % n.max(1) as u64) as usize
        }
    }

    fn parse_all_ways(text: &str) {
        for format in [SummaryFormat::Torchsummary, SummaryFormat::ModulePrint] {
            for seq_len in [None, Some(1), Some(u64::MAX)] {
                if let Ok(layers) = parse_summary(format, text, 8, seq_len) {
                    assert!(!layers.is_empty() && layers.len() <= MAX_LAYERS);
                }
            }
        }
    }

    #[test]
    fn random_bytes_and_shuffled_lines_never_panic() {
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let alphabet: Vec<char> = "([{}])-,:x =│├└─0123456789 params\nLinearConv2dReLU9,4-1é"
            .chars()
            .collect();
        for _ in 0..3_000 {
            let len = rng.below(120);
            let text: String = if rng.below(2) == 0 {
                let bytes: Vec<u8> = (0..len).map(|_| rng.next() as u8).collect();
                String::from_utf8_lossy(&bytes).into_owned()
            } else {
                (0..len)
                    .map(|_| alphabet[rng.below(alphabet.len())])
                    .collect()
            };
            parse_all_ways(&text);
        }
        let fixtures = [
            TINY_LM,
            RESNET18_TORCHSUMMARY,
            RESNET18_TORCHINFO,
            BERT_BASE,
            GPT2,
        ];
        for _ in 0..600 {
            let fixture = fixtures[rng.below(fixtures.len())];
            let mut lines: Vec<&str> = fixture.lines().collect();
            match rng.below(3) {
                0 => {
                    for i in (1..lines.len()).rev() {
                        lines.swap(i, rng.below(i + 1));
                    }
                }
                1 => {
                    let i = rng.below(lines.len());
                    lines.remove(i);
                }
                _ => {
                    let (i, j) = (rng.below(lines.len()), rng.below(lines.len()));
                    lines.insert(i, lines[j]);
                }
            }
            let mut text = lines.join("\n");
            // Cut at a random character boundary too.
            let cut = text
                .char_indices()
                .map(|(i, _)| i)
                .nth(rng.below(text.len() + 1));
            if let Some(cut) = cut.filter(|_| rng.below(3) == 0) {
                text.truncate(cut);
            }
            parse_all_ways(&text);
        }
    }
}
