//! Model summaries pasted by users and the Hugging Face configurations they hand over, parsed
//! into layers.
//!
//! A `config.json` becomes the layers and saved tensors its model builds in [`transformer`];
//! the files users' tools write (Trainer arguments, PEFT, DeepSpeed) in [`files`]. Three families
//! of printed text are understood:
//! - [`SummaryFormat::Torchsummary`]: the tables of `torchsummary.summary` and of
//!   `torchinfo.summary` (tree prefixes, `depth-idx`, `--`, `(recursive)`).
//! - [`SummaryFormat::ModulePrint`]: `print(model)`, plain (parameters derived from the printed
//!   constructor arguments) or annotated with `, N params` per module, including the Hugging
//!   Face / PyTorch `(0-11): 12 x Block(` collapsing of repeated blocks.
//! - [`SummaryFormat::Keras`]: `model.summary()` of Keras 2 (plain columns) and Keras 3
//!   (box-drawn table).
//!
//! [`SummaryFormat::Auto`] tells them apart from the text.
//!
//! The text is untrusted: its size, layer count and nesting are bounded, every number is parsed
//! and combined with checked arithmetic, and nothing here indexes out of bounds, so any input
//! yields layers or a [`SummaryError`] naming a line, never a panic.

pub mod files;
pub mod transformer;
pub mod vocabulary;

use crate::job::echo;
use crate::job::validated::{Layer, LayerKind, MAX_LAYERS};

mod keras;
mod module_print;
mod table;
#[cfg(test)]
mod tests;

/// Largest summary text accepted. A 4,096-layer table is about 400 KiB.
pub const MAX_SUMMARY_BYTES: usize = 1 << 20;
/// Deepest module nesting accepted in a module print. Real models nest under 15 levels; the
/// bound keeps the (recursive) expansion of repeated blocks far from the stack limit.
pub const MAX_NESTING: usize = 64;

/// Which tool printed the summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SummaryFormat {
    /// Whichever of the others the text looks like ([`SummaryFormat::detect`]).
    Auto,
    /// A `torchsummary.summary` or `torchinfo.summary` table.
    Torchsummary,
    /// A PyTorch module print, plain or annotated with `, N params` on each module line.
    ModulePrint,
    /// A Keras `model.summary()` table (Keras 2 or 3).
    Keras,
}

impl SummaryFormat {
    /// Tells the formats apart by what only one of them prints: Keras's `(None, ...)` shapes,
    /// box-drawn header or `Model: "..."` title; the torch tables' `Layer (type` header; a
    /// module print otherwise (its first line is `Class(`).
    pub fn detect(text: &str) -> SummaryFormat {
        let mut table = false;
        for trimmed in text.lines().map(str::trim) {
            if trimmed.contains('┃')
                || trimmed.contains("(None")
                || trimmed.starts_with("Model: \"")
            {
                return SummaryFormat::Keras;
            }
            table |= trimmed.starts_with("Layer (type");
        }
        let first = text.lines().map(str::trim).find(|l| !l.is_empty());
        let opens_module = first.is_some_and(|line| {
            line.split_once('(')
                .is_some_and(|(class, _)| is_identifier(class))
        });
        if table || !opens_module {
            SummaryFormat::Torchsummary
        } else {
            SummaryFormat::ModulePrint
        }
    }

    fn as_str(self) -> &'static str {
        match self {
            SummaryFormat::Auto => "auto",
            SummaryFormat::Torchsummary => "torchsummary",
            SummaryFormat::ModulePrint => "module_print",
            SummaryFormat::Keras => "keras",
        }
    }
}

/// Why a summary was rejected: a line of the text at fault (1-based), or a request field that
/// the text needs (`seq_len`, `input_shape`), named first as every validation error is.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum SummaryError {
    #[error("summary.text line {line}: {reason}")]
    Text { line: usize, reason: String },
    #[error("{field}: {reason}")]
    Field { field: &'static str, reason: String },
}

impl SummaryError {
    fn new(line: usize, reason: impl Into<String>) -> SummaryError {
        SummaryError::Text {
            line,
            reason: reason.into(),
        }
    }

    fn field(field: &'static str, reason: impl Into<String>) -> SummaryError {
        SummaryError::Field {
            field,
            reason: reason.into(),
        }
    }

    /// The line at fault, when the text itself is.
    pub fn line(&self) -> Option<usize> {
        match self {
            SummaryError::Text { line, .. } => Some(*line),
            SummaryError::Field { .. } => None,
        }
    }
}

/// What the request says about one sample, for texts that print no shapes (module prints).
#[derive(Debug, Clone, Copy, Default)]
pub struct SampleShape<'a> {
    /// Tokens per sample.
    pub seq_len: Option<u64>,
    /// `[C, H, W]` (or `[C, L]`, `[C, D, H, W]`) per sample.
    pub input_shape: Option<&'a [u64]>,
}

/// What a summary yields: its layers, in the order the summary lists them, and what the parser
/// assumed or overrode to get them (said back to the caller as `warnings`).
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedSummary {
    pub layers: Vec<Layer>,
    pub warnings: Vec<String>,
    /// One sample's input `[3, H, H]`, read from a table's `Input size (MB)` footer (torchsummary,
    /// torchinfo; an fp32 RGB image) and its first image-shaped output; `None` for other formats,
    /// without the footer, or when no square RGB image fits them.
    pub input_shape: Option<[u64; 3]>,
}

/// Parses a pasted summary into layers, in the order the summary lists them.
///
/// `batch_size` is the job's batch size. Every format already yields per-sample sizes (tables
/// drop their leading batch dimension, whatever batch the tool was run with; module prints
/// derive sizes from `sample`), so it does not change the result today; it is part of the
/// signature so that callers need not change if a format ever needs it.
/// `sample` sizes a [`SummaryFormat::ModulePrint`], whose text carries no shapes: `seq_len`
/// for token layers, `input_shape` for convolutions.
pub fn parse_summary(
    format: SummaryFormat,
    text: &str,
    batch_size: u64,
    sample: SampleShape<'_>,
) -> Result<ParsedSummary, SummaryError> {
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
    if sample.seq_len == Some(0) {
        return Err(SummaryError::field("seq_len", "must be at least 1"));
    }
    let mut warnings = Warnings::default();
    let mut input_shape = None;
    let layers = match format {
        SummaryFormat::Auto => {
            let detected = SummaryFormat::detect(text);
            return parse_summary(detected, text, batch_size, sample).map_err(|err| match err {
                SummaryError::Text { line, reason } => SummaryError::new(
                    line,
                    format!(
                        "{reason} (read as {}, detected from the text)",
                        detected.as_str()
                    ),
                ),
                field @ SummaryError::Field { .. } => field,
            });
        }
        SummaryFormat::Torchsummary => {
            let (layers, input) = table::parse(text, &mut warnings)?;
            input_shape = input;
            Ok(layers)
        }
        SummaryFormat::ModulePrint => module_print::parse(text, sample, &mut warnings),
        SummaryFormat::Keras => keras::parse(text, sample, &mut warnings),
    }?;
    Ok(ParsedSummary {
        layers,
        warnings: warnings.0,
        input_shape,
    })
}

/// The most layers `text` can be read as, in any format, in one pass that parses nothing: two
/// a line (a module, and the attention its container adds), `print(model)`'s collapsed repeats
/// (`(0-11): 12 x Block(`) counted as the copies they stand for; at most `MAX_LAYERS + 1` (a
/// summary of more is refused as it is read). What a request is priced at before any work.
pub fn layers_bound(text: &str) -> u64 {
    module_print::layers_bound(text, MAX_LAYERS as u64 + 1)
}

/// How many times a convolution costs a linear layer's work to answer (its output sizes, its
/// kernels on the roofline): a release build answered 256 printouts of 4,095 convolutions in
/// 2.19 s of CPU, the same of linear layers in 0.53 s (scripts/request-cpu.py's shapes).
pub const CONVOLUTION_WEIGHT: u64 = 4;

/// A printout's layers weighted by what each costs to answer ([`CONVOLUTION_WEIGHT`]), at
/// most `MAX_LAYERS + 1` of the heaviest: what a request holding it is priced at.
pub fn layers_work_bound(text: &str) -> u64 {
    module_print::weighted_layers_bound(text, MAX_LAYERS as u64 + 1, |class| {
        if class.starts_with("Conv") {
            CONVOLUTION_WEIGHT
        } else {
            1
        }
    })
}

/// What the parser assumed or overrode, said back to the caller. Bounded: a hostile text
/// cannot make the answer grow past a few lines of warnings.
#[derive(Default)]
struct Warnings(Vec<String>);

impl Warnings {
    const MAX: usize = 16;

    fn push(&mut self, warning: impl Into<String>) {
        if self.0.len() < Self::MAX {
            self.0.push(warning.into());
        }
    }
}

/// Names a few things and counts the rest: `a, b, c and 4 more`.
fn name_a_few(names: &[String]) -> String {
    const SHOWN: usize = 5;
    let shown: Vec<&str> = names.iter().take(SHOWN).map(String::as_str).collect();
    let mut out = shown.join(", ");
    if let Some(more) = names.len().checked_sub(SHOWN).filter(|&more| more > 0) {
        out.push_str(&format!(" and {more} more"));
    }
    out
}

/// The `Total params: 25,636,712 (97.80 MB)` footer's count (Keras adds the size).
fn footer_total(trimmed: &str) -> Option<Result<u64, String>> {
    let rest = trimmed.strip_prefix("Total params:")?;
    Some(parse_count(
        rest.split_whitespace().next().unwrap_or_default(),
    ))
}

/// Warns when a table's `Total params` footer differs from its rows' sum (the rows are used:
/// they are what the layers carry).
fn check_footer_total(footer: Option<(u64, usize)>, layers: &Layers, warnings: &mut Warnings) {
    if let (Some((footer, line)), Some(sum)) = (footer, layers.total_params()) {
        if footer != sum {
            warnings.push(format!(
                "summary.text line {line}: Total params {footer} differs from the {sum} the \
                 layer rows add up to; the rows are used"
            ));
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

/// `====` and `----` separators (also the box-drawing ones some tools emit).
fn is_rule(trimmed: &str) -> bool {
    !trimmed.is_empty()
        && trimmed
            .chars()
            .all(|c| matches!(c, '=' | '-' | '_' | '─' | '━' | ' '))
}

/// The totals both tools print after the layers; they describe the model, not a layer.
fn is_footer(trimmed: &str) -> bool {
    const FOOTERS: [&str; 9] = [
        "Optimizer params",
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
        return Err(format!("'{}' is not a count", echo(raw)));
    }
    let digits: String = raw.chars().filter(char::is_ascii_digit).collect();
    digits
        .parse()
        .map_err(|_| format!("{} does not fit in 64 bits", echo(raw)))
}

/// A plain non-negative integer (a dimension or a module argument).
fn parse_dim(raw: &str) -> Result<u64, String> {
    if raw.is_empty() || !raw.chars().all(|c| c.is_ascii_digit()) {
        return Err(format!("'{}' is not a non-negative integer", echo(raw)));
    }
    raw.parse()
        .map_err(|_| format!("{} does not fit in 64 bits", echo(raw)))
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

/// Class names read exactly, before the case-insensitive [`LayerKind::parse`]: GPT-2's `Conv1D`
/// is a linear layer with transposed weights, not torch's `Conv1d`.
pub const CLASS_EXCEPTIONS: [(&str, LayerKind); 1] = [("Conv1D", LayerKind::Linear)];

/// Maps a PyTorch / Hugging Face class name to a layer kind. `LayerKind::parse` knows the
/// canonical spellings; this adds the common variants it does not (dimension suffixes, lazy
/// and quantised layers, HF activation wrappers, `...Attention`). Unknown classes are `Other`.
fn kind_for_class(class: &str) -> LayerKind {
    if let Some(&(_, kind)) = CLASS_EXCEPTIONS.iter().find(|(name, _)| *name == class) {
        return kind;
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
    } else if base.contains("batchnorm") {
        // timm's BatchNormAct2d too.
        LayerKind::BatchNorm
    } else if base.contains("groupnorm") {
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
