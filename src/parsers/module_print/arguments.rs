//! A module's printed constructor arguments: split, keywords, positions, tuples.

use super::*;

/// Module arguments split at top-level commas: `(64,), eps=1e-05` -> [`(64,)`, `eps=1e-05`].
pub(super) fn split_args(args: &str) -> Vec<&str> {
    split_top_level(args)
        .into_iter()
        .filter(|a| !a.is_empty())
        .collect()
}

pub(super) fn keyword_value<'a>(args: &'a str, key: &str) -> Option<&'a str> {
    split_args(args).into_iter().find_map(|arg| {
        arg.strip_prefix(key)
            .and_then(|rest| rest.trim_start().strip_prefix('='))
            .map(str::trim)
    })
}

pub(super) fn keyword(args: &str, key: &str) -> Result<Option<u64>, String> {
    keyword_value(args, key).map(parse_dim).transpose()
}

/// `bias=False`, `affine=True`; `None` when absent or not a boolean.
pub(super) fn flag(args: &str, key: &str) -> Option<bool> {
    match keyword_value(args, key)? {
        "True" => Some(true),
        "False" => Some(false),
        _ => None,
    }
}

pub(super) fn positional(args: &str, position: usize) -> Option<&str> {
    split_args(args)
        .into_iter()
        .filter(|arg| !arg.contains('='))
        .nth(position)
}

/// A positional integer argument; `None` when absent or not an integer.
pub(super) fn positional_dim(args: &str, position: usize) -> Result<Option<u64>, String> {
    match positional(args, position) {
        Some(raw) if raw.chars().all(|c| c.is_ascii_digit()) => parse_dim(raw).map(Some),
        _ => Ok(None),
    }
}

/// `(7, 7)`, `(3,)` or `3` (a value for every dimension); `None` entries for `None`.
pub(super) fn broadcast(raw: &str, dims: usize) -> Vec<Option<u64>> {
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
pub(super) fn tuple_arg(args: &str, key: &str, dims: usize) -> Result<Option<Vec<u64>>, String> {
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
pub(super) fn normalized_size(args: &str) -> Result<Option<u64>, String> {
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
