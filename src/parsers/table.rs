//! `torchsummary` and `torchinfo` tables.

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

pub(super) fn parse(
    text: &str,
    warnings: &mut Warnings,
) -> Result<(Vec<Layer>, Option<[u64; 3]>), SummaryError> {
    let mut columns: Vec<Column> = DEFAULT_COLUMNS.to_vec();
    let mut rows = Vec::new();
    let mut footer = None;
    let mut input_megabytes = None;
    // The batch the tool printed the shapes with (torchsummary's -1 stands for one sample).
    let mut printed_batch = None;
    let mut torchinfo = false;
    // The height of the first image-shaped output (`[B, C, H, W]`).
    let mut first_height = None;
    // Once the footer has begun, the table is over: what follows (a user's notes, as workload
    // files keep them beside a printout) is not read.
    let mut in_footer = false;
    let mut lines = text.lines().enumerate();
    for (index, raw) in lines.by_ref() {
        let line = index.saturating_add(1);
        let trimmed = raw.trim();
        if let Some(total) = footer_total(trimmed) {
            footer = total.ok().map(|total| (total, line));
            in_footer = true;
            continue;
        }
        if in_footer
            && !(trimmed.is_empty()
                || is_rule(trimmed)
                || is_footer(trimmed)
                || trimmed.starts_with("Input size (MB):"))
        {
            let last = lines.last().map_or(line, |(i, _)| i.saturating_add(1));
            let span = if last > line {
                format!("lines {line}-{last}")
            } else {
                format!("line {line}")
            };
            warnings.push(format!(
                "summary.text {span}: after the table's footer and not part of it; ignored"
            ));
            break;
        }
        if let Some(rest) = trimmed.strip_prefix("Input size (MB):") {
            input_megabytes = rest.trim().parse::<f64>().ok().filter(|mb| *mb > 0.0);
            continue;
        }
        if trimmed.starts_with("Layer (type:depth-idx)") {
            torchinfo = true;
        }
        if trimmed.is_empty() || is_rule(trimmed) || is_footer(trimmed) {
            continue;
        }
        if trimmed.starts_with("Layer (type") {
            columns = parse_header(trimmed).map_err(|reason| SummaryError::new(line, reason))?;
            continue;
        }
        let row = parse_row(trimmed, &columns, line).map_err(|reason| {
            SummaryError::new(
                line,
                format!("not a layer row ({reason}): '{}'", echo(trimmed)),
            )
        })?;
        if printed_batch.is_none() {
            printed_batch = leading_dimension(trimmed);
        }
        if first_height.is_none() {
            first_height = image_height(trimmed);
        }
        rows.push(row);
    }
    if rows.is_empty() {
        return Err(SummaryError::new(1, "no layer rows found"));
    }
    let layers = emit(&rows)?;
    check_footer_total(footer, &layers, warnings);
    // torchsummary prints MiB (bytes / 1024²), torchinfo MB (bytes / 10⁶), both of the fp32
    // input of the batch the shapes were printed with.
    let megabyte = if torchinfo { 1e6 } else { 1024.0 * 1024.0 };
    let input_elements =
        input_megabytes.map(|mb| mb * megabyte / 4.0 / printed_batch.unwrap_or(1).max(1) as f64);
    let input_shape = input_elements
        .zip(first_height)
        .and_then(|(elements, height)| image_shape(elements, height));
    Ok((layers.0, input_shape))
}

/// The square RGB image `[3, H, H]` of `elements` per sample whose first layer printed an
/// output `first_height` high (a stem's stride or a patch size), when one is within the 2 % a
/// footer's two printed decimals leave: 0.57 MB and a first output 112 high read as 224.
fn image_shape(elements: f64, first_height: u64) -> Option<[u64; 3]> {
    [1, 2, 4, 8, 14, 16, 32].into_iter().find_map(|stride| {
        let side = first_height.checked_mul(stride)?;
        let pixels = 3.0 * (side as f64) * (side as f64);
        ((pixels / elements - 1.0).abs() <= 0.02).then_some([3, side, side])
    })
}

/// The height of a row's output when it is one image batch `[B, C, H, W]`.
fn image_height(row: &str) -> Option<u64> {
    let shape = row.split_once('[')?.1;
    if shape.starts_with('[') {
        return None;
    }
    let dims: Vec<&str> = shape.split(']').next()?.split(',').map(str::trim).collect();
    if dims.len() != 4 {
        return None;
    }
    dims[2].parse().ok().filter(|&h: &u64| h > 0)
}

/// The first dimension of a row's first output shape (`[-1, 64, 56, 56]` -> 1, `[32, ...]`
/// -> 32): the batch the table was printed with.
fn leading_dimension(row: &str) -> Option<u64> {
    let shape = row.split_once('[')?.1.trim_start_matches('[');
    let first = shape.split([',', ']']).next()?.trim();
    match first {
        "-1" => Some(1),
        n => n.parse::<u64>().ok().filter(|&n| n > 0),
    }
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
            return Err("the header must have one 'Output Shape' and one 'Param #' column".into());
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
        return Err(format!("'{}' is not a layer name", echo(&tokens.join(" "))));
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
        .ok_or_else(|| format!("'{}' is not an output shape", echo(token)))?
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

fn emit(rows: &[Row<'_>]) -> Result<Layers, SummaryError> {
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
        let is_norm = matches!(
            layer.kind,
            LayerKind::BatchNorm | LayerKind::GroupNorm | LayerKind::LayerNorm
        );
        layers.push(layer, row.line)?;
        if row.depth.is_none() && is_norm && row.class.contains("NormAct") {
            runs_before_its_children(&mut layers.0);
        }
    }
    if layers.len() == 0 {
        return Err(SummaryError::new(1, "no layers found"));
    }
    Ok(layers)
}

/// torchsummary lists a module after the modules it calls (its hooks fire when it returns), so
/// timm's `BatchNormAct2d` (a batch norm that then runs its own `drop` and `act`) comes after
/// its activation. Moved back before the identity and activation rows of its size that end the
/// list, the norm reads the convolution's output and the activation its output, as they run:
/// what each keeps for backward (`physics::saved`) follows from that order.
fn runs_before_its_children(layers: &mut [Layer]) {
    let Some((norm, children)) = layers.split_last() else {
        return;
    };
    let moved_over = children
        .iter()
        .rev()
        .take_while(|l| {
            l.output_size == norm.output_size
                && (l.kind == LayerKind::Identity || l.kind.is_activation())
        })
        .count();
    let end = layers.len();
    if let Some(tail) = layers.get_mut(end.saturating_sub(moved_over + 1)..) {
        tail.rotate_right(1);
    }
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
