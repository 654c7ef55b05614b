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

/// What a summary yields: its layers, in the order the summary lists them, and what the parser
/// assumed or overrode to get them (said back to the caller as `warnings`).
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedSummary {
    pub layers: Vec<Layer>,
    pub warnings: Vec<String>,
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
    let layers = match format {
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
    }?;
    Ok(ParsedSummary {
        layers,
        warnings: Vec::new(),
    })
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
