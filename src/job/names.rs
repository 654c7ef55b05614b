//! Module names of a layer list: PEFT's target and `modules_to_save` rules, and the repeated
//! blocks a decoder's or a ViT's names reveal (what checkpointing and sharding act on).

/// A layer's name and linear shape, when the request gave them.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct LayerDetail {
    pub name: Option<String>,
    pub in_features: Option<u64>,
    pub out_features: Option<u64>,
    /// Forward FLOPs of the layer for one sample (multiply-add counted as 2), when the
    /// request gave them (`describe` counts them with torch's FlopCounterMode); the
    /// performance model ([`crate::physics::perf`]) derives them otherwise.
    pub flops: Option<u64>,
}

/// Whether `name` is `pattern` or a module inside it (`pattern.` prefix).
pub fn within(name: &str, pattern: &str) -> bool {
    name == pattern
        || (name.len() > pattern.len()
            && name.starts_with(pattern)
            && name.as_bytes()[pattern.len()] == b'.')
}

/// PEFT's target rule: the whole name, or its last dotted components.
pub fn names_target(name: &str, target: &str) -> bool {
    name == target
        || (name.len() > target.len()
            && name.ends_with(target)
            && name.as_bytes()[name.len() - target.len() - 1] == b'.')
}

/// Whether layer `name` is the module PEFT's `modules_to_save` entry `module` names, or inside
/// it: `module` is the whole name, its last dotted components, or such components followed by
/// more (`score` holds the layers `score`, `model.score` and `model.score.dense`).
pub fn inside_named(name: &str, module: &str) -> bool {
    names_target(name, module)
        || name.starts_with(&format!("{module}."))
        || name.contains(&format!(".{module}."))
}

/// The repeated blocks of a model: layers grouped by `prefix.<index>` at the first numeric
/// component of their names, for every prefix with at least two indices (a decoder's
/// `model.layers.0..31`, a ViT's `blocks.0..11`, each ResNet stage's blocks). Each block is
/// the range of layer indices it spans, in order.
pub fn blocks(details: &[LayerDetail]) -> Vec<std::ops::Range<usize>> {
    // Runs of layers in the same block, borrowed from the names: no allocation per layer (an
    // 80-layer decoder has ~900 of them).
    let mut runs: Vec<(Option<BlockName>, std::ops::Range<usize>)> = Vec::new();
    for (i, detail) in details.iter().enumerate() {
        let full = detail.name.as_deref();
        if let (Some(full), Some((Some(last), range))) = (full, runs.last_mut()) {
            // Inside the block of the layer before (`model.layers.12.` starts the name): the
            // same block without scanning the name again.
            let inside = full.len() > last.block.len()
                && full.as_bytes()[last.block.len()] == b'.'
                && full.starts_with(last.block);
            if inside {
                range.end = i + 1;
                continue;
            }
        }
        let name = full.and_then(BlockName::of);
        match runs.last_mut() {
            // Comparing blocks is enough: a block's name holds its prefix.
            Some((Some(last), range)) if name.is_some_and(|n| n.block == last.block) => {
                range.end = i + 1
            }
            _ => runs.push((name, i..i + 1)),
        }
    }
    let mut indices_per_prefix: std::collections::HashMap<&str, usize> = Default::default();
    for name in runs.iter().filter_map(|(name, _)| name.as_ref()) {
        *indices_per_prefix.entry(name.prefix).or_default() += 1;
    }
    runs.into_iter()
        .filter(|(name, _)| name.is_some_and(|n| indices_per_prefix[n.prefix] >= 2))
        .map(|(_, range)| range)
        .collect()
}

/// Where a module is among the repeated blocks, borrowed from its name.
#[derive(Clone, Copy)]
struct BlockName<'a> {
    /// The name up to its first numeric component (`model.layers.12`).
    block: &'a str,
    /// The name before that component (`model.layers`).
    prefix: &'a str,
}

impl<'a> BlockName<'a> {
    /// `None` for a name without a numeric component.
    fn of(name: &'a str) -> Option<BlockName<'a>> {
        // Split as bytes: the dot is ASCII, and splitting a `str` at a `char` pays for a
        // UTF-8 pattern search.
        let mut start = 0;
        for part in name.as_bytes().split(|&b| b == b'.') {
            if !part.is_empty() && part.iter().all(u8::is_ascii_digit) {
                return Some(BlockName {
                    block: &name[..start + part.len()],
                    prefix: &name[..start.saturating_sub(1)],
                });
            }
            start += part.len() + 1;
        }
        None
    }
}

/// The ranges of the layers inside the named modules (prefix match), in order.
pub fn modules_ranges(details: &[LayerDetail], modules: &[String]) -> Vec<std::ops::Range<usize>> {
    let mut ranges: Vec<std::ops::Range<usize>> = Vec::new();
    for module in modules {
        let inside: Vec<usize> = details
            .iter()
            .enumerate()
            .filter(|(_, d)| d.name.as_deref().is_some_and(|n| within(n, module)))
            .map(|(i, _)| i)
            .collect();
        if let (Some(&first), Some(&last)) = (inside.first(), inside.last()) {
            ranges.push(first..last + 1);
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    fn named(names: &[&str]) -> Vec<LayerDetail> {
        names
            .iter()
            .map(|n| LayerDetail {
                name: Some(n.to_string()),
                ..Default::default()
            })
            .collect()
    }

    #[test]
    fn names_match_as_peft_and_module_prefixes_do() {
        assert!(names_target("model.layers.0.self_attn.q_proj", "q_proj"));
        assert!(names_target(
            "model.layers.0.self_attn.q_proj",
            "self_attn.q_proj"
        ));
        assert!(!names_target("model.layers.0.self_attn.xq_proj", "q_proj"));
        assert!(within("model.layers.1.mlp", "model.layers.1"));
        assert!(!within("model.layers.10.mlp", "model.layers.1"));
    }

    #[test]
    fn blocks_are_the_runs_of_layers_under_a_repeated_numbered_prefix() {
        let details = named(&[
            "embed",
            "layers.0.attn",
            "layers.0.mlp",
            "layers.1.attn",
            "layers.1.mlp",
            "norm",
            "head",
        ]);
        assert_eq!(blocks(&details), vec![1..3, 3..5]);
        // A block whose number extends the one before is another block; a module named as the
        // block itself is inside it.
        let details = named(&[
            "layers.1",
            "layers.1.mlp",
            "layers.10.attn",
            "layers.10",
            "norm",
        ]);
        assert_eq!(blocks(&details), vec![0..2, 2..4]);
        // One numbered module alone is no stack of blocks.
        assert!(blocks(&named(&["stem.0", "head"])).is_empty());
        assert!(blocks(&[]).is_empty());
    }
}
