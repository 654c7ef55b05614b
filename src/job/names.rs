//! Module names of a layer list: PEFT's target and `modules_to_save` rules, and the repeated
//! blocks a decoder's or a ViT's names reveal (what checkpointing and sharding act on).
//!
//! [`within`], [`names_target`] and [`inside_named`] state each rule for one (layer, name)
//! pair; [`match_layers`] and [`module_spans`] apply a whole list to every layer at once, in
//! time linear in the names' and the list's bytes (a request may hold 4,096 layers and 256
//! names of 256 characters: matching pair by pair is what issue 34's 44 s of CPU was).

use std::ops::Range;

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
    /// A routed-experts module held as one layer (a config's mixture of experts).
    pub experts: Option<Experts>,
}

/// A mixture of experts' routed experts, as a config's builder holds them in one layer: `count`
/// gated MLPs, each `hidden` -> `intermediate` (gate and up) -> `hidden` (down).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Experts {
    pub count: u64,
    pub hidden: u64,
    pub intermediate: u64,
}

impl Experts {
    /// One expert's linear layers as transformers 4 builds them, an `nn.Linear` each
    /// (Mixtral's w1, w3 and w2; Qwen MoE's gate, up and down projections): (in, out).
    pub fn linears(self) -> [(u64, u64); 3] {
        let (h, i) = (self.hidden, self.intermediate);
        [(h, i), (h, i), (i, h)]
    }
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

/// What a list of names matches among the layers ([`match_layers`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Matched {
    /// For each layer: whether some name of the list names it.
    pub layers: Vec<bool>,
    /// For each name of the list, in its order (repeats included): whether it names a layer.
    pub named: Vec<bool>,
}

/// Which of `names` (the layers' names, `None` for a layer without one) each name of `list`
/// names under `rule`: [`Matched::layers`] as `list.iter().any(|m| rule(name, m))` per layer,
/// [`Matched::named`] as `names.iter().flatten().any(|n| rule(n, m))` per name, in time linear
/// in the bytes of both lists.
pub fn match_layers(names: &[Option<&str>], list: &[String], rule: Rule) -> Matched {
    let (automaton, entries) = Automaton::of(list, rule);
    let mut layers = vec![false; names.len()];
    // The first layer each distinct name matches, found by marking the automaton's nodes: a
    // node marked once has had its whole output chain marked, so no match is reported twice
    // and the pass stays linear however many names end at one place.
    let mut marked = vec![false; automaton.nodes()];
    let mut named = vec![false; automaton.patterns];
    for (layer, name) in names.iter().enumerate() {
        let Some(name) = name else { continue };
        automaton.scan(name, |node| {
            layers[layer] = true;
            let mut node = node;
            while node != NONE && !marked[node as usize] {
                marked[node as usize] = true;
                named[automaton.pattern[node as usize] as usize] = true;
                node = automaton.next_output(node);
            }
        });
    }
    Matched {
        layers,
        named: entries.iter().map(|&p| named[p]).collect(),
    }
}

/// For each module of `modules` in its order (repeats included), the layers it holds
/// ([`within`]) as the range from the first to the last of them; `None` for a module that holds
/// none. Linear in the bytes of both lists: a module's name is a prefix of the layer's, so each
/// name is walked from its start only as far as the longest module.
pub fn module_spans(names: &[Option<&str>], modules: &[String]) -> Vec<Option<Range<usize>>> {
    let (automaton, entries) = Automaton::of(modules, Rule::Within);
    let mut spans: Vec<Option<Range<usize>>> = vec![None; automaton.patterns];
    for (layer, name) in names.iter().enumerate() {
        let Some(name) = name else { continue };
        // Anchored at the name's start: every match is reported (no marking), but there are at
        // most as many as the longest module has bytes.
        automaton.scan(name, |node| {
            let mut node = node;
            while node != NONE {
                let span = &mut spans[automaton.pattern[node as usize] as usize];
                match span {
                    Some(range) => range.end = layer + 1,
                    None => *span = Some(layer..layer + 1),
                }
                node = automaton.next_output(node);
            }
        });
    }
    entries.iter().map(|&p| spans[p].clone()).collect()
}

/// How a list's names name layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rule {
    /// [`within`]: the module or a layer inside it (checkpointed and trainable modules).
    Within,
    /// [`names_target`]: PEFT's `target_modules` rule.
    Target,
    /// [`inside_named`]: PEFT's `modules_to_save` rule.
    Inside,
}

/// Framing that turns each rule into "the framed name holds the framed pattern": 0xFF never
/// occurs in UTF-8, so it anchors a pattern at the name's start or end.
///
/// - [`Rule::Within`]: `name == m` or `name` starts with `m.` iff `\xFF name .` holds
///   `\xFF m .` (necessarily at its start).
/// - [`Rule::Target`]: `name == t` or `name` ends with `.t` iff `. name \xFF` holds `. t \xFF`.
/// - [`Rule::Inside`]: `name` is `m` or ends with `.m` (PEFT's target rule), starts with `m.`
///   or holds `.m.` iff `. name .` holds `. m .` (a dot-bounded run of the name's components).
const ANCHOR: u8 = 0xFF;

fn frame(rule: Rule) -> (u8, u8) {
    match rule {
        Rule::Within => (ANCHOR, b'.'),
        Rule::Target => (b'.', ANCHOR),
        Rule::Inside => (b'.', b'.'),
    }
}

/// No node.
const NONE: u32 = u32::MAX;
const ROOT: u32 = 0;

/// An Aho-Corasick automaton over a list's distinct names, each framed for its rule: a trie of
/// the patterns with failure links (the longest proper suffix of a node's string that is also in
/// the trie) and output links (the nearest node down the failure chain that ends a pattern).
struct Automaton {
    frame: (u8, u8),
    /// Whether every pattern starts with [`ANCHOR`]: a scan stops once it leaves the trie.
    anchored: bool,
    /// The root's transitions, one per byte (most bytes of a name are read there).
    root: Box<[u32; 256]>,
    /// Every other node's transitions, sorted by byte.
    children: Vec<Vec<(u8, u32)>>,
    fail: Vec<u32>,
    /// The nearest node down the failure chain, this one included, that ends a pattern.
    output: Vec<u32>,
    /// The distinct pattern a node ends (meaningful where `output` is the node itself).
    pattern: Vec<u32>,
    /// Distinct patterns.
    patterns: usize,
}

impl Automaton {
    /// The automaton of `list`'s distinct names, and each entry's distinct pattern.
    fn of(list: &[String], rule: Rule) -> (Automaton, Vec<usize>) {
        let frame = frame(rule);
        let mut distinct: std::collections::HashMap<&str, usize> = Default::default();
        let entries: Vec<usize> = list
            .iter()
            .map(|name| {
                let next = distinct.len();
                *distinct.entry(name.as_str()).or_insert(next)
            })
            .collect();
        let mut automaton = Automaton {
            frame,
            anchored: frame.0 == ANCHOR,
            root: Box::new([NONE; 256]),
            children: vec![Vec::new()],
            fail: vec![ROOT],
            output: vec![NONE],
            pattern: vec![0],
            patterns: distinct.len(),
        };
        let mut patterns: Vec<(&str, usize)> = distinct.into_iter().collect();
        patterns.sort_unstable_by_key(|&(_, id)| id);
        for (name, id) in patterns {
            let bytes = std::iter::once(frame.0)
                .chain(name.bytes())
                .chain(std::iter::once(frame.1));
            let mut node = ROOT;
            for byte in bytes {
                node = match automaton.child(node, byte) {
                    NONE => automaton.add_child(node, byte),
                    child => child,
                };
            }
            automaton.output[node as usize] = node;
            automaton.pattern[node as usize] = id as u32;
        }
        automaton.link();
        (automaton, entries)
    }

    fn nodes(&self) -> usize {
        self.fail.len()
    }

    fn child(&self, node: u32, byte: u8) -> u32 {
        if node == ROOT {
            return self.root[byte as usize];
        }
        let children = &self.children[node as usize];
        children
            .binary_search_by_key(&byte, |&(b, _)| b)
            .map_or(NONE, |i| children[i].1)
    }

    fn add_child(&mut self, node: u32, byte: u8) -> u32 {
        let child = self.fail.len() as u32;
        self.children.push(Vec::new());
        self.fail.push(ROOT);
        self.output.push(NONE);
        self.pattern.push(0);
        if node == ROOT {
            self.root[byte as usize] = child;
        } else {
            let children = &mut self.children[node as usize];
            let at = children.partition_point(|&(b, _)| b < byte);
            children.insert(at, (byte, child));
        }
        child
    }

    /// Failure and output links, breadth first (a node's links read shallower nodes'; the
    /// root's children fail to the root).
    fn link(&mut self) {
        let mut queue: std::collections::VecDeque<u32> =
            self.root.iter().copied().filter(|&c| c != NONE).collect();
        while let Some(node) = queue.pop_front() {
            for k in 0..self.children[node as usize].len() {
                let (byte, child) = self.children[node as usize][k];
                let mut fallback = self.fail[node as usize];
                let target = loop {
                    match self.child(fallback, byte) {
                        NONE if fallback == ROOT => break ROOT,
                        NONE => fallback = self.fail[fallback as usize],
                        found => break found,
                    }
                };
                self.fail[child as usize] = target;
                if self.output[child as usize] == NONE {
                    self.output[child as usize] = self.output[target as usize];
                }
                queue.push_back(child);
            }
        }
    }

    /// The next node after `node` (which ends a pattern) down its output chain.
    fn next_output(&self, node: u32) -> u32 {
        self.output[self.fail[node as usize] as usize]
    }

    /// The automaton's next node from `node` on `byte`.
    fn step(&self, mut node: u32, byte: u8) -> u32 {
        loop {
            match self.child(node, byte) {
                NONE if node == ROOT => return ROOT,
                NONE => node = self.fail[node as usize],
                next => return next,
            }
        }
    }

    /// Reads the framed `name`, calling `found` with the output node wherever a pattern ends.
    fn scan(&self, name: &str, mut found: impl FnMut(u32)) {
        let bytes = std::iter::once(self.frame.0)
            .chain(name.bytes())
            .chain(std::iter::once(self.frame.1));
        let mut node = ROOT;
        for byte in bytes {
            node = self.step(node, byte);
            if node == ROOT && self.anchored {
                // Every pattern starts at the name's start: one that left the trie is done.
                return;
            }
            let output = self.output[node as usize];
            if output != NONE {
                found(output);
            }
        }
    }
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

    /// What the pairwise rules say, the way the physics asked before the matcher.
    fn pairwise(names: &[Option<&str>], list: &[String], rule: Rule) -> Matched {
        let rule: fn(&str, &str) -> bool = match rule {
            Rule::Within => within,
            Rule::Target => names_target,
            Rule::Inside => inside_named,
        };
        Matched {
            layers: names
                .iter()
                .map(|n| n.is_some_and(|n| list.iter().any(|m| rule(n, m))))
                .collect(),
            named: list
                .iter()
                .map(|m| names.iter().flatten().any(|n| rule(n, m)))
                .collect(),
        }
    }

    /// The former `modules_ranges`: each module's first..last layer, pair by pair.
    fn pairwise_spans(names: &[Option<&str>], modules: &[String]) -> Vec<Option<Range<usize>>> {
        modules
            .iter()
            .map(|m| {
                let inside: Vec<usize> = (0..names.len())
                    .filter(|&i| names[i].is_some_and(|n| within(n, m)))
                    .collect();
                Some(*inside.first()?..*inside.last()? + 1)
            })
            .collect()
    }

    fn strings(list: &[&str]) -> Vec<String> {
        list.iter().map(|s| s.to_string()).collect()
    }

    const RULES: [Rule; 3] = [Rule::Within, Rule::Target, Rule::Inside];

    #[test]
    fn the_matcher_answers_as_the_pairwise_rules_on_tricky_names() {
        let names = [
            Some("score"),
            Some("model.score"),
            Some("model.score.dense"),
            Some("model.scores.dense"),
            Some("model.xscore"),
            None,
            Some("model.layers.1.mlp"),
            Some("model.layers.10.mlp"),
            Some("model.layers.1"),
            Some("layers.1.self_attn.q_proj"),
            Some("model.layers.0.self_attn.xq_proj"),
            Some("model.layers.0.self_attn.q_proj"),
            Some("a..b"),
            Some(".lead"),
            Some("trail."),
            Some("lm_head"),
            Some("model.embed_tokens"),
            Some("ünï.cödé.q_proj"),
            Some(""),
        ];
        let lists = [
            strings(&["score"]),
            strings(&["model.score"]),
            strings(&["score.dense", "dense"]),
            strings(&["model.layers.1", "model.layers.1"]),
            strings(&["layers.1"]),
            strings(&["q_proj", "self_attn.q_proj", "xq_proj", "proj"]),
            strings(&["a.", ".b", "a..b", "."]),
            strings(&["lead", ".lead", "trail", "trail."]),
            strings(&["lm_head", "embed_tokens", "model"]),
            strings(&["cödé", "ünï.cödé", "ödé"]),
            strings(&["nothing", "model.layers.2"]),
            strings(&["model.score.dense.more"]),
            Vec::new(),
        ];
        for rule in RULES {
            for list in &lists {
                assert_eq!(
                    match_layers(&names, list, rule),
                    pairwise(&names, list, rule),
                    "{rule:?} {list:?}"
                );
            }
        }
        for list in &lists {
            assert_eq!(
                module_spans(&names, list),
                pairwise_spans(&names, list),
                "{list:?}"
            );
        }
        // `score` holds `score`, `model.score` and `model.score.dense`, not `model.scores.dense`.
        let saved = match_layers(&names, &strings(&["score"]), Rule::Inside);
        assert_eq!(&saved.layers[..5], &[true, true, true, false, false]);
    }

    #[test]
    fn the_matcher_answers_as_the_pairwise_rules_on_every_small_name() {
        // Every name of up to 5 characters over `a`, `b` and the dot (with empty, leading and
        // trailing components), against lists drawn from the same names: prefixes, suffixes and
        // runs of components that share their starts.
        let alphabet = ['a', 'b', '.'];
        let mut all: Vec<String> = vec![String::new()];
        let mut frontier: Vec<String> = vec![String::new()];
        for _ in 0..5 {
            frontier = frontier
                .iter()
                .flat_map(|s| alphabet.iter().map(move |c| format!("{s}{c}")))
                .collect();
            all.extend(frontier.iter().cloned());
        }
        let names: Vec<Option<&str>> = all.iter().map(|s| Some(s.as_str())).collect();
        // A fixed walk through the names as lists of 1 to 4 (a linear congruential generator).
        let mut state: u64 = 34;
        let mut next = |n: usize| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (state >> 33) as usize % n
        };
        for _ in 0..300 {
            let list: Vec<String> = (0..1 + next(4))
                .map(|_| all[1 + next(all.len() - 1)].clone())
                .collect();
            for rule in RULES {
                assert_eq!(
                    match_layers(&names, &list, rule),
                    pairwise(&names, &list, rule),
                    "{rule:?} {list:?}"
                );
            }
            assert_eq!(
                module_spans(&names, &list),
                pairwise_spans(&names, &list),
                "{list:?}"
            );
        }
    }

    #[test]
    fn many_names_ending_at_one_place_are_each_found_once() {
        // `.a.`, `.a.a.`, ... all end at every dot of `a.a.a...`: each is found, and the scan
        // reports each distinct name once however often it occurs.
        let list: Vec<String> = (1..=40).map(|k| vec!["a"; k].join(".")).collect();
        let long = vec!["a"; 2000].join(".");
        let short = vec!["a"; 20].join(".");
        let names = [Some(long.as_str()), Some(short.as_str()), Some("b")];
        for rule in RULES {
            assert_eq!(
                match_layers(&names, &list, rule),
                pairwise(&names, &list, rule),
                "{rule:?}"
            );
        }
        assert_eq!(module_spans(&names, &list), pairwise_spans(&names, &list));
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
