//! Keras `model.summary()`: Keras 3's box-drawn table (`┃ Layer (type) ┃ Output Shape ┃ ...`,
//! cells between `│`) and Keras 2's plain columns (cells at the header titles' offsets). Both
//! wrap long cells onto continuation lines whose `Param #` cell is empty.

use super::*;

/// Where a row's cells are.
enum Columns {
    /// Keras 3: cells between `│`, in the header's order.
    Boxed,
    /// Keras 2: the character offset at which each header title starts.
    Offsets(Vec<usize>),
}

struct Header {
    columns: Columns,
    shape: usize,
    params: usize,
    count: usize,
}

/// One layer's row, its cells joined across continuation lines.
struct Row {
    line: usize,
    name: String,
    shape: String,
    params: String,
}

pub(super) fn parse(
    text: &str,
    sample: SampleShape<'_>,
    warnings: &mut Warnings,
) -> Result<Vec<Layer>, SummaryError> {
    let mut header: Option<Header> = None;
    let mut rows: Vec<Row> = Vec::new();
    let mut open_row = false;
    let mut footer = None;
    for (index, raw) in text.lines().enumerate() {
        let line = index.saturating_add(1);
        let trimmed = raw.trim();
        if let Some(total) = footer_total(trimmed) {
            footer = total.ok().map(|total| (total, line));
            open_row = false;
            continue;
        }
        if trimmed.is_empty() || is_box_rule(trimmed) || is_footer(trimmed) {
            open_row = false;
            continue;
        }
        let Some(header) = header.as_ref() else {
            if trimmed
                .trim_matches(['┃', '│', ' '])
                .starts_with("Layer (type")
            {
                header = Some(parse_header(raw).map_err(|reason| SummaryError::new(line, reason))?);
            } else if !trimmed.starts_with("Model:") {
                return Err(SummaryError::new(
                    line,
                    format!(
                        "expected the 'Layer (type)' header of a Keras summary: '{}'",
                        echo(trimmed)
                    ),
                ));
            }
            continue;
        };
        let cells = split_cells(raw, header).ok_or_else(|| {
            SummaryError::new(
                line,
                format!(
                    "expected {} cells between '│': '{}'",
                    header.count,
                    echo(trimmed)
                ),
            )
        })?;
        let cell = |at: usize| cells.get(at).map_or("", |c| c.trim());
        let (name, shape, params) = (cell(0), cell(header.shape), cell(header.params));
        match rows.last_mut() {
            // A wrapped cell continues on lines whose `Param #` cell is empty.
            Some(row) if open_row && params.is_empty() => {
                if row.name.len() < MAX_CELL && row.shape.len() < MAX_CELL {
                    row.name.push(' ');
                    row.name.push_str(name);
                    row.shape.push_str(shape);
                }
            }
            _ if params.is_empty() => {
                // Keras 3 prints the `Connected to` of a merge layer on its own lines.
                if !name.is_empty() || !shape.is_empty() {
                    return Err(SummaryError::new(
                        line,
                        format!("a layer row without 'Param #': '{}'", echo(trimmed)),
                    ));
                }
            }
            _ => {
                if rows.len() >= MAX_LAYERS {
                    return Err(SummaryError::new(
                        line,
                        format!("more than {MAX_LAYERS} layers"),
                    ));
                }
                rows.push(Row {
                    line,
                    name: name.to_string(),
                    shape: shape.to_string(),
                    params: params.to_string(),
                });
                open_row = true;
            }
        }
    }
    if header.is_none() {
        return Err(SummaryError::new(
            1,
            "no 'Layer (type)' header found: not a Keras summary",
        ));
    }
    let mut layers = Layers::default();
    let mut unknown_dims = false;
    for row in &rows {
        let at_line = |reason: String| SummaryError::new(row.line, reason);
        let (class, truncated) = class_of(&row.name)
            .ok_or_else(|| at_line(format!("expected 'name (Class)': '{}'", echo(&row.name))))?;
        let params = parse_count(row.params.split_whitespace().next().unwrap_or_default())
            .map_err(at_line)?;
        let Some(kind) = kind_for_keras_class(&class, truncated) else {
            continue;
        };
        let output_size = match parse_output_shape(&row.shape, sample.seq_len, &mut unknown_dims)
            .map_err(at_line)?
        {
            Some(size) => size,
            // Subclassed models print `multiple`: the size is the input's.
            None => layers.last_output_size(),
        };
        layers.push(
            Layer {
                kind,
                output_size,
                params,
            },
            row.line,
        )?;
    }
    if layers.len() == 0 {
        return Err(SummaryError::new(1, "no layers found"));
    }
    if unknown_dims {
        warnings.push(match sample.seq_len {
            Some(seq_len) => format!(
                "output shapes with a None dimension besides the batch were sized with seq_len \
                 {seq_len}"
            ),
            None => "output shapes with a None dimension besides the batch were sized as if it \
                     were 1; give seq_len to size them"
                .to_string(),
        });
    }
    check_footer_total(footer, &layers, warnings);
    Ok(layers.0)
}

/// A joined cell longer than this is not a layer name or shape: stop growing it.
const MAX_CELL: usize = 4096;

/// Rules of both generations: `┏━━┳━━┓`, `├──┼──┤`, `└──┴──┘`, `_____`, `=====`.
fn is_box_rule(trimmed: &str) -> bool {
    is_rule(trimmed)
        || trimmed.chars().all(|c| {
            matches!(
                c,
                '─' | '━'
                    | '┼'
                    | '╇'
                    | '┩'
                    | '┡'
                    | '├'
                    | '┤'
                    | '└'
                    | '┘'
                    | '┴'
                    | '┬'
                    | '┌'
                    | '┐'
                    | '┏'
                    | '┓'
                    | '┳'
                    | '┗'
                    | '┛'
                    | '┻'
                    | '╋'
                    | ' '
            )
        })
}

fn parse_header(raw: &str) -> Result<Header, String> {
    let boxed = raw.contains('┃');
    let (titles, columns): (Vec<String>, Columns) = if boxed {
        let titles = raw
            .trim()
            .trim_matches('┃')
            .split('┃')
            .map(|t| t.trim().to_string())
            .collect();
        (titles, Columns::Boxed)
    } else {
        // Titles are separated by at least two spaces; they contain single spaces only.
        let chars: Vec<char> = raw.chars().collect();
        let mut titles = Vec::new();
        let mut offsets = Vec::new();
        let mut at = 0;
        while at < chars.len() {
            if chars.get(at) == Some(&' ') {
                at = at.saturating_add(1);
                continue;
            }
            let start = at;
            while at < chars.len() {
                let gap = chars.get(at) == Some(&' ')
                    && chars.get(at.saturating_add(1)).is_none_or(|&c| c == ' ');
                if gap {
                    break;
                }
                at = at.saturating_add(1);
            }
            titles.push(chars.get(start..at).unwrap_or_default().iter().collect());
            offsets.push(start);
        }
        // The name cell starts at the line's start, whatever the title's indent.
        if let Some(first) = offsets.first_mut() {
            *first = 0;
        }
        (titles, Columns::Offsets(offsets))
    };
    let find = |wanted: &str| titles.iter().position(|t| t == wanted);
    match (find("Output Shape"), find("Param #")) {
        (Some(shape), Some(params)) if shape > 0 && params > 0 => Ok(Header {
            count: titles.len(),
            columns,
            shape,
            params,
        }),
        _ => {
            Err("the header must have 'Layer (type)', 'Output Shape' and 'Param #' columns".into())
        }
    }
}

/// A row's cells; `None` when a boxed row has not the header's number of cells.
fn split_cells(raw: &str, header: &Header) -> Option<Vec<String>> {
    match &header.columns {
        Columns::Boxed => {
            let cells: Vec<String> = raw
                .trim()
                .strip_prefix('│')?
                .strip_suffix('│')?
                .split('│')
                .map(str::to_string)
                .collect();
            (cells.len() == header.count).then_some(cells)
        }
        Columns::Offsets(offsets) => {
            let chars: Vec<char> = raw.chars().collect();
            let ends = offsets.iter().skip(1).copied().map(Some).chain([None]);
            Some(
                offsets
                    .iter()
                    .zip(ends)
                    .map(|(&start, end)| {
                        let end = end.unwrap_or(chars.len()).min(chars.len());
                        chars
                            .get(start.min(end)..end)
                            .unwrap_or_default()
                            .iter()
                            .collect()
                    })
                    .collect(),
            )
        }
    }
}

/// `conv1_conv (Conv2D)` -> `Conv2D`, and whether Keras 3 cut it short (`(GlobalAveragePool…`).
/// A class wrapped onto two lines (`(MaxPooling2` `D)`) is joined back.
fn class_of(name: &str) -> Option<(String, bool)> {
    let (_, class) = name.trim().rsplit_once('(')?;
    let class: String = class.chars().filter(|c| !c.is_whitespace()).collect();
    let truncated = class.ends_with('…');
    let class = class.trim_end_matches([')', '…']);
    (is_identifier(class) && (truncated || name.trim_end().ends_with(')')))
        .then(|| (class.to_string(), truncated))
}

/// Keras class names (lower case) by prefix, more specific first. Keras's `Conv1D` is a
/// convolution, unlike Hugging Face's, so Keras names are read here before the PyTorch ones.
const KERAS_CLASSES: [(&str, LayerKind); 31] = [
    ("dense", LayerKind::Linear),
    ("einsumdense", LayerKind::Linear),
    ("conv1dtranspose", LayerKind::ConvTranspose2d),
    ("conv2dtranspose", LayerKind::ConvTranspose2d),
    ("conv3dtranspose", LayerKind::ConvTranspose2d),
    ("conv1d", LayerKind::Conv1d),
    ("conv2d", LayerKind::Conv2d),
    ("conv3d", LayerKind::Conv3d),
    ("depthwiseconv1d", LayerKind::Conv1d),
    ("depthwiseconv2d", LayerKind::Conv2d),
    ("separableconv1d", LayerKind::Conv1d),
    ("separableconv2d", LayerKind::Conv2d),
    ("batchnormalization", LayerKind::BatchNorm),
    ("layernormalization", LayerKind::LayerNorm),
    ("groupnormalization", LayerKind::GroupNorm),
    ("rmsnormalization", LayerKind::RmsNorm),
    // Keras applications use `Activation("relu")`; the function is not printed.
    ("activation", LayerKind::Relu),
    ("maxpooling", LayerKind::MaxPool),
    ("averagepooling", LayerKind::AvgPool),
    ("globalaveragepooling", LayerKind::AdaptiveAvgPool),
    ("globalmaxpooling", LayerKind::AdaptiveMaxPool),
    ("dropout", LayerKind::Dropout),
    ("spatialdropout", LayerKind::Dropout),
    ("flatten", LayerKind::Flatten),
    ("embedding", LayerKind::Embedding),
    ("multiheadattention", LayerKind::Attention),
    ("groupqueryattention", LayerKind::Attention),
    ("upsampling", LayerKind::Upsample),
    ("leakyrelu", LayerKind::LeakyRelu),
    ("relu", LayerKind::Relu),
    ("softmax", LayerKind::Softmax),
];

/// A Keras class's layer kind; `None` for the input, which is no layer. A class Keras cut
/// short matches the first known class it begins.
fn kind_for_keras_class(class: &str, truncated: bool) -> Option<LayerKind> {
    let key = class.to_ascii_lowercase();
    if "inputlayer".starts_with(&key) && key.len() >= 5 {
        return None;
    }
    let known = KERAS_CLASSES.iter().find(|(prefix, _)| {
        key == *prefix || (truncated && key.len() >= 4 && prefix.starts_with(&key))
    });
    let by_prefix = || {
        KERAS_CLASSES
            .iter()
            .filter(|(prefix, _)| key.starts_with(prefix))
            .max_by_key(|(prefix, _)| prefix.len())
    };
    Some(match known.or_else(by_prefix) {
        Some(&(_, kind)) => kind,
        None => kind_for_class(class),
    })
}

/// Elements per sample: `(None, 112, 112, 64)` without its batch dimension; a list of shapes
/// (`[(None, 224, 224, 3)]`, several outputs) adds up. `None` for `multiple` (no shape shown).
fn parse_output_shape(
    raw: &str,
    seq_len: Option<u64>,
    unknown_dims: &mut bool,
) -> Result<Option<u64>, String> {
    let raw = raw.trim();
    if raw.is_empty() || raw == "multiple" {
        return Ok(None);
    }
    let inner = raw
        .strip_prefix('[')
        .and_then(|r| r.strip_suffix(']'))
        .unwrap_or(raw);
    let mut total = 0u64;
    for shape in split_top_level(inner) {
        let dims = shape
            .strip_prefix('(')
            .and_then(|s| s.strip_suffix(')'))
            .ok_or_else(|| format!("'{}' is not an output shape", echo(raw)))?;
        let mut size = 1u64;
        for (at, dim) in dims.split(',').map(str::trim).enumerate() {
            let dim = match dim {
                "" => continue,
                "None" if at == 0 => continue,
                "None" => {
                    *unknown_dims = true;
                    seq_len.unwrap_or(1)
                }
                _ => parse_dim(dim)?,
            };
            size = size
                .checked_mul(dim)
                .ok_or("output size does not fit in 64 bits")?;
        }
        total = total
            .checked_add(size)
            .ok_or("output size does not fit in 64 bits")?;
    }
    Ok(Some(total))
}
