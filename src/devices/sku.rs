//! The catalogue of GPU models (SKUs) gpucast knows, and parsing of driver names and user input
//! into them. The entries are data ([`crate::devices::catalogue`]: `data/gpus.json`, plus the
//! file given by `--gpus`); matching is generic over their ids, names and aliases.
//!
//! A name is read as lower-case alphanumeric tokens, vendor words (`nvidia`, `tesla`,
//! `geforce`, `quadro`) dropped and `40 GB` joined to `40gb`, in any order. It names an entry
//! when, in this order:
//! 1. its tokens are those of the entry's id, name or an alias (`NVIDIA A100-SXM4-40GB`);
//! 2. they are, form-factor words (`sxm4`, `pcie`, `hbm3`, ...) left out on both sides, those
//!    of exactly one entry (`V100 PCIe 16GB`); more than one is ambiguous;
//! 3. they are, memory sizes left out too, a family (`a100`) of which one entry matches the
//!    memory size given, or the family has only one entry; else ambiguous (`a100`, `v100`).

use std::collections::{HashMap, HashSet};
use std::fmt;

use crate::devices::performance::GpuPerformance;
use crate::job::echo;

/// One GPU model with its usable memory as `nvidia-smi` reports it (`memory.total`, MiB).
#[derive(Debug, Clone, PartialEq)]
pub struct Sku {
    /// Canonical id, lower case: `a100-40gb`. Also the calibration profile's file stem.
    pub id: String,
    /// A readable name: `NVIDIA A100 40GB`.
    pub name: String,
    /// Other names it goes by: what the driver prints (`NVIDIA A100-SXM4-40GB`), short forms.
    pub aliases: Vec<String>,
    /// What GPU Feature Discovery labels a node with this card (`nvidia.com/gpu.product`):
    /// the NVML names with spaces as dashes; none for a card it does not label (AMD).
    pub gfd_products: Vec<String>,
    pub capacity_mib: u64,
    /// The marketing memory size in GB (`40` for an A100 40GB): what users type.
    pub memory_gb: u32,
    /// Peak throughput, for the roofline performance model (NVIDIA cards only).
    pub performance: GpuPerformance,
    pub vendor: Vendor,
    /// `major.minor`, e.g. `8.0`.
    pub compute_capability: String,
    /// Where the figures come from.
    pub source: Source,
    /// What is nominal or approximate about the figures.
    pub note: Option<String>,
    pub origin: Origin,
}

/// Who makes the card: the roofline models NVIDIA's kernels only.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Vendor {
    #[default]
    Nvidia,
    Amd,
}

impl Vendor {
    pub fn as_str(self) -> &'static str {
        match self {
            Vendor::Nvidia => "nvidia",
            Vendor::Amd => "amd",
        }
    }
}

/// A public document the figures were taken from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Source {
    pub title: String,
    pub url: String,
}

/// Where an entry came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    /// `data/gpus.json`, built into the binary.
    Builtin,
    /// The file given by `--gpus`.
    File,
}

impl fmt::Display for Sku {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.id)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SkuError {
    #[error("unknown GPU `{input}`{suggestion}; known: {known}")]
    Unknown {
        input: String,
        /// `; did you mean rtx-4090?` when a name is near, else empty.
        suggestion: String,
        known: String,
    },
    #[error("`{0}` is ambiguous: say which, e.g. {1}")]
    Ambiguous(String, String),
    #[error("{0}")]
    Custom(String),
}

/// The GPU models a service knows: a runtime value (the built-in file, perhaps with `--gpus`),
/// indexed for parsing.
#[derive(Debug, Clone)]
pub struct Catalogue {
    skus: Vec<Sku>,
    /// Sorted tokens of every id, name and alias -> entry.
    exact: HashMap<Vec<String>, usize>,
    /// The same without form-factor words -> entries.
    loose: HashMap<Vec<String>, Vec<usize>>,
    /// The same without memory sizes -> entries.
    family: HashMap<Vec<String>, Vec<usize>>,
    /// Every token any entry's names hold: a requested name with another word is refused.
    vocabulary: HashSet<String>,
}

/// Ids shown in an "unknown GPU" message; `GET /v1/gpus` lists them all.
const SHOWN_IDS: usize = 12;

/// Whether a card's name asks for the attached GPU (`attached`, in any case).
pub fn is_attached(input: &str) -> bool {
    input.trim().eq_ignore_ascii_case("attached")
}

impl Catalogue {
    /// Indexes `builtin` and `added` entries (ids unique across both). A name of an added entry
    /// takes precedence over the same name of a built-in one; two entries of the same group
    /// with the same name are refused.
    pub fn new(builtin: Vec<Sku>, added: Vec<Sku>) -> Result<Catalogue, String> {
        let added_count = added.len();
        let mut skus = added;
        skus.extend(builtin);
        let mut ids = HashSet::new();
        for sku in &skus {
            if !ids.insert(sku.id.as_str()) {
                return Err(format!("id `{}` appears twice", sku.id));
            }
        }
        // A node's product label must say one card: a product held by two entries would place
        // a job by the wrong card's capacity. As with names, an added entry takes a product
        // from a built-in one (`skus` holds the added entries first).
        let mut products: HashMap<String, usize> = HashMap::new();
        for index in 0..skus.len() {
            let added = index < added_count;
            let mut kept = Vec::with_capacity(skus[index].gfd_products.len());
            for product in std::mem::take(&mut skus[index].gfd_products) {
                match products.get(&product) {
                    Some(&other) if other != index && (other < added_count) == added => {
                        return Err(format!(
                            "the GPU Feature Discovery product `{}` names both `{}` and `{}`",
                            echo(&product),
                            skus[other].id,
                            skus[index].id
                        ));
                    }
                    Some(&other) if other != index => continue,
                    Some(_) => {}
                    None => {
                        products.insert(product.clone(), index);
                    }
                }
                if !kept.contains(&product) {
                    kept.push(product);
                }
            }
            skus[index].gfd_products = kept;
        }
        let mut exact: HashMap<Vec<String>, usize> = HashMap::new();
        let mut loose: HashMap<Vec<String>, Vec<usize>> = HashMap::new();
        let mut family: HashMap<Vec<String>, Vec<usize>> = HashMap::new();
        let mut vocabulary = HashSet::new();
        for (index, sku) in skus.iter().enumerate() {
            let added = index < added_count;
            for name in sku.names() {
                let key = tokens(name);
                if key.is_empty() {
                    return Err(format!(
                        "`{}`: the name `{}` holds no letter or digit",
                        sku.id,
                        echo(name)
                    ));
                }
                vocabulary.extend(key.iter().cloned());
                match exact.get(&key) {
                    Some(&other) if other != index => {
                        let other_added = other < added_count;
                        // A built-in name an added entry holds already: the added one keeps it.
                        if other_added == added {
                            return Err(format!(
                                "the name `{}` names both `{}` and `{}`",
                                echo(name),
                                skus[other].id,
                                sku.id
                            ));
                        }
                        continue;
                    }
                    Some(_) => {}
                    None => {
                        exact.insert(key.clone(), index);
                    }
                }
                let without_form = without_form_factors(&key);
                let without_memory: Vec<String> = without_form
                    .iter()
                    .filter(|t| memory_gb_of(t).is_none())
                    .cloned()
                    .collect();
                push_unique(loose.entry(without_form).or_default(), index);
                push_unique(family.entry(without_memory).or_default(), index);
            }
        }
        Ok(Catalogue {
            skus,
            exact,
            loose,
            family,
            vocabulary,
        })
    }

    /// Every entry: those of the `--gpus` file first, then the built-in ones, each in file order.
    pub fn all(&self) -> &[Sku] {
        &self.skus
    }

    /// The entry whose GPU Feature Discovery products (`nvidia.com/gpu.product`) hold `product`.
    pub fn by_gfd_product(&self, product: &str) -> Option<&Sku> {
        self.skus
            .iter()
            .find(|s| s.gfd_products.iter().any(|p| p == product))
    }

    /// The entry with this canonical id.
    pub fn by_id(&self, id: &str) -> Option<&Sku> {
        self.skus.iter().find(|s| s.id == id)
    }

    /// Parses a driver name (`NVIDIA A100-SXM4-40GB`, `NVIDIA H100 80GB HBM3`, `Tesla T4`,
    /// `NVIDIA GeForce RTX 4090`) or what a user typed (`A100 40GB`, `a100-40gb`, `h100`),
    /// case-insensitively.
    pub fn parse(&self, input: &str) -> Result<&Sku, SkuError> {
        let key = tokens(input);
        if let Some(&index) = self.exact.get(&key) {
            return Ok(&self.skus[index]);
        }
        let without_form = without_form_factors(&key);
        match self.loose.get(&without_form).map(Vec::as_slice) {
            Some([index]) => return Ok(&self.skus[*index]),
            Some(many @ [_, _, ..]) => return Err(self.ambiguous(input, many)),
            _ => {}
        }
        let memory: Vec<u32> = without_form
            .iter()
            .filter_map(|t| memory_gb_of(t))
            .collect();
        let family: Vec<String> = without_form
            .iter()
            .filter(|t| memory_gb_of(t).is_none())
            .cloned()
            .collect();
        let Some(members) = self.family.get(&family) else {
            return Err(self.unknown(input));
        };
        let matching: Vec<usize> = match memory.as_slice() {
            [] => members.clone(),
            [gb] => members
                .iter()
                .copied()
                .filter(|&i| self.skus[i].memory_gb == *gb)
                .collect(),
            _ => vec![],
        };
        match matching.as_slice() {
            [index] => Ok(&self.skus[*index]),
            [] => Err(self.unknown(input)),
            many => Err(self.ambiguous(input, many)),
        }
    }

    /// The other cards `input` could have meant when it resolved to `chosen` by a family name
    /// without a form factor (`H100` is the SXM card; `h100-pcie` shares its name and memory):
    /// the ids to name in a warning, none when `input` is an id or names a form factor.
    pub fn also_named(&self, input: &str, chosen: &Sku) -> Vec<&str> {
        let key = tokens(input);
        if input.trim().eq_ignore_ascii_case(&chosen.id)
            || key.iter().any(|t| FORM_FACTORS.contains(&t.as_str()))
        {
            return Vec::new();
        }
        let memory: Vec<u32> = key.iter().filter_map(|t| memory_gb_of(t)).collect();
        let family: Vec<String> = key
            .into_iter()
            .filter(|t| memory_gb_of(t).is_none())
            .collect();
        self.family
            .get(&family)
            .into_iter()
            .flatten()
            .map(|&i| &self.skus[i])
            .filter(|s| s.id != chosen.id && (memory.is_empty() || s.memory_gb == chosen.memory_gb))
            .map(|s| s.id.as_str())
            .collect()
    }

    /// Like [`Catalogue::parse`] for a name the driver reported: `None` for models not here.
    pub fn from_device_name(&self, name: &str) -> Option<&Sku> {
        self.parse(name).ok()
    }

    /// `attached` (any case) or a GPU name [`Catalogue::parse`] accepts, made only of words
    /// GPU names in the catalogue hold (and memory sizes and form factors): a request's `gpu`
    /// with other words in it is a mistake to refuse, not noise to read past.
    pub fn select(&self, input: &str) -> Result<GpuSelector<'_>, SkuError> {
        if is_attached(input) {
            return Ok(GpuSelector::Attached);
        }
        let known = |t: &String| {
            self.vocabulary.contains(t)
                || FORM_FACTORS.contains(&t.as_str())
                || memory_gb_of(t).is_some()
        };
        if !tokens(input).iter().all(known) {
            return Err(self.unknown(input));
        }
        self.parse(input).map(GpuSelector::Sku)
    }

    fn unknown(&self, input: &str) -> SkuError {
        let mut known: Vec<&str> = self
            .skus
            .iter()
            .take(SHOWN_IDS)
            .map(|s| s.id.as_str())
            .collect();
        let more = self.skus.len().saturating_sub(SHOWN_IDS);
        let more = if more > 0 {
            format!(" and {more} more (GET /v1/gpus and `gpucast gpus` list them)")
        } else {
            String::new()
        };
        // Ids are at most 64 characters, so the message stays bounded.
        known.truncate(SHOWN_IDS);
        let near = self.near(input);
        let suggestion = if near.is_empty() {
            String::new()
        } else {
            format!("; did you mean {}?", near.join(" or "))
        };
        SkuError::Unknown {
            input: echo(input),
            suggestion,
            known: format!("{}{more}", known.join(", ")),
        }
    }

    /// The ids whose names are nearest to `input` (at most three): a name holding it or held
    /// by it (`4090` in `rtx4090`), else within an edit distance of a third of its length
    /// (`a10o` for `a100`), compared on letters and digits alone, case aside.
    fn near(&self, input: &str) -> Vec<&str> {
        const SHOWN: usize = 3;
        let squash = |s: &str| -> String {
            s.chars()
                .filter(char::is_ascii_alphanumeric)
                .map(|c| c.to_ascii_lowercase())
                .collect()
        };
        let wanted = squash(input);
        if wanted.len() < 2 || wanted.len() > 64 {
            return Vec::new();
        }
        let reach = (wanted.len() / 3).max(1);
        let mut scored: Vec<(usize, &str)> = self
            .skus
            .iter()
            .filter_map(|sku| {
                let best = sku
                    .names()
                    .map(|name| {
                        let name = squash(name);
                        if name.contains(&wanted) || wanted.contains(&name) {
                            0
                        } else {
                            strsim::levenshtein(&name, &wanted)
                        }
                    })
                    .min()?;
                (best <= reach).then_some((best, sku.id.as_str()))
            })
            .collect();
        scored.sort();
        scored.into_iter().take(SHOWN).map(|(_, id)| id).collect()
    }

    fn ambiguous(&self, input: &str, candidates: &[usize]) -> SkuError {
        const SHOWN: usize = 5;
        let ids: Vec<&str> = candidates
            .iter()
            .take(SHOWN)
            .map(|&i| self.skus[i].id.as_str())
            .collect();
        SkuError::Ambiguous(echo(input), ids.join(" or "))
    }
}

impl Sku {
    /// Its id, name and aliases.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        [self.id.as_str(), self.name.as_str()]
            .into_iter()
            .chain(self.aliases.iter().map(String::as_str))
    }
}

/// Which GPU a request asks about: the one this host has, or a catalogue SKU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GpuSelector<'a> {
    Attached,
    Sku(&'a Sku),
}

/// Words of GPU names that say the form factor or memory type, not the model.
const FORM_FACTORS: [&str; 11] = [
    "sxm", "sxm2", "sxm3", "sxm4", "sxm5", "pcie", "hbm2", "hbm2e", "hbm3", "hbm3e", "gddr6",
];

/// Vendor and brand words: noise in any name.
const VENDOR_WORDS: [&str; 7] = [
    "nvidia", "tesla", "geforce", "quadro", "amd", "instinct", "radeon",
];

/// The matching key of a name: lower-case alphanumeric tokens, split where letters turn to
/// digits (`rtx4090` and `RTX 4090` alike, `a100` as `a 100`), vendor words dropped, `40 gb`
/// joined to `40gb`, sorted (word order does not matter).
fn tokens(input: &str) -> Vec<String> {
    let raw: Vec<String> = input
        .to_ascii_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| !t.is_empty() && !VENDOR_WORDS.contains(t))
        .flat_map(|t| {
            // Form factors (`sxm4`, `hbm2e`) are words of their own.
            let cut = (!FORM_FACTORS.contains(&t))
                .then(|| {
                    t.bytes()
                        .zip(t.bytes().skip(1))
                        .position(|(a, b)| a.is_ascii_alphabetic() && b.is_ascii_digit())
                })
                .flatten();
            match cut {
                Some(i) => vec![t[..=i].to_string(), t[i + 1..].to_string()],
                None => vec![t.to_string()],
            }
        })
        .filter(|t| !VENDOR_WORDS.contains(&t.as_str()))
        .collect();
    let mut joined: Vec<String> = Vec::with_capacity(raw.len());
    for token in raw {
        let number_before = joined
            .last()
            .is_some_and(|t| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()));
        if token == "gb" && number_before {
            joined.last_mut().expect("checked").push_str("gb");
        } else {
            joined.push(token);
        }
    }
    joined.sort_unstable();
    joined
}

fn without_form_factors(key: &[String]) -> Vec<String> {
    key.iter()
        .filter(|t| !FORM_FACTORS.contains(&t.as_str()))
        .cloned()
        .collect()
}

/// `40gb` -> 40.
fn memory_gb_of(token: &str) -> Option<u32> {
    let number = token.strip_suffix("gb")?;
    if number.is_empty() || number.len() > 4 || !number.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    number.parse().ok()
}

fn push_unique(list: &mut Vec<usize>, index: usize) {
    if !list.contains(&index) {
        list.push(index);
    }
}

/// A file-name-safe key for any GPU name: lower case, alphanumerics joined by `-`, `nvidia`
/// and `tesla` dropped (`NVIDIA RTX 6000 Ada Generation` -> `rtx-6000-ada-generation`). The
/// profile key of an attached card the catalogue lacks: unchanged, so its profile stays found.
pub fn slug(name: &str) -> String {
    let joined = name
        .to_ascii_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| !t.is_empty() && *t != "nvidia" && *t != "tesla")
        .collect::<Vec<_>>()
        .join("-");
    if joined.is_empty() {
        "unknown".to_string()
    } else {
        joined
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn catalogue() -> &'static Catalogue {
        Catalogue::builtin()
    }

    fn id(input: &str) -> &'static str {
        catalogue()
            .parse(input)
            .unwrap_or_else(|e| panic!("{input}: {e}"))
            .id
            .as_str()
    }

    fn parse(input: &str) -> Result<&'static Sku, SkuError> {
        catalogue().parse(input)
    }

    #[test]
    fn driver_names_parse_to_catalogue_ids() {
        assert_eq!(id("NVIDIA A100-SXM4-40GB"), "a100-40gb");
        assert_eq!(id("NVIDIA A100-PCIE-40GB"), "a100-40gb");
        assert_eq!(id("NVIDIA A100-SXM4-80GB"), "a100-80gb");
        assert_eq!(id("NVIDIA A100 80GB PCIe"), "a100-80gb-pcie");
        assert_eq!(id("NVIDIA H100 80GB HBM3"), "h100-80gb");
        assert_eq!(id("NVIDIA H100 PCIe"), "h100-pcie");
        assert_eq!(id("NVIDIA H100 NVL"), "h100-nvl");
        assert_eq!(id("NVIDIA H200"), "h200-141gb");
        assert_eq!(id("NVIDIA H200 NVL"), "h200-141gb");
        assert_eq!(id("NVIDIA L4"), "l4");
        assert_eq!(id("NVIDIA L40"), "l40");
        assert_eq!(id("NVIDIA L40S"), "l40s");
        assert_eq!(id("Tesla T4"), "t4");
        assert_eq!(id("Tesla V100-SXM2-16GB"), "v100-16gb");
        assert_eq!(id("Tesla V100-PCIE-32GB"), "v100-32gb");
        assert_eq!(id("Tesla V100S-PCIE-32GB"), "v100-32gb");
        assert_eq!(id("NVIDIA GeForce RTX 4090"), "rtx-4090");
        assert_eq!(id("rtx4090"), "rtx-4090");
        assert_eq!(id("AMD Instinct MI300X"), "mi300x");
        assert_eq!(id("mi300x"), "mi300x");
        assert_eq!(id("MI250X"), "mi250x");
        assert_eq!(id("mi250"), "mi250");
        assert_eq!(id("AMD INSTINCT MI210"), "mi210");
        assert_eq!(id("RTX4090"), "rtx-4090");
        assert_eq!(id("rtx-4090"), "rtx-4090");
        assert_eq!(id("a10g"), "a10g");
        assert_eq!(id("l40s"), "l40s");
        assert_eq!(id("NVIDIA GeForce RTX 3090"), "rtx-3090");
        assert_eq!(id("NVIDIA A10G"), "a10g");
        assert_eq!(id("NVIDIA A10"), "a10");
        assert_eq!(id("NVIDIA B200"), "b200");
        assert_eq!(id("NVIDIA RTX 6000 Ada Generation"), "rtx-6000-ada");
        assert_eq!(id("NVIDIA RTX A6000"), "rtx-a6000");
    }

    #[test]
    fn a_family_name_without_its_form_factor_says_which_others_it_could_be() {
        let catalogue = Catalogue::builtin();
        let also = |input: &str| {
            let chosen = catalogue.parse(input).unwrap();
            catalogue.also_named(input, chosen)
        };
        assert_eq!(also("H100"), vec!["h100-pcie"]);
        assert_eq!(also("h100 80gb"), vec!["h100-pcie"]);
        assert!(also("h100-80gb").is_empty(), "an id is explicit");
        assert!(also("H100 SXM5").is_empty(), "a form factor is explicit");
        assert!(also("A100 40GB").is_empty(), "one card of that memory");
        assert!(also("rtx 4090").is_empty());
    }

    #[test]
    fn user_input_parses_case_insensitively_and_in_any_order() {
        assert_eq!(id("A100 40GB"), "a100-40gb");
        assert_eq!(id("a100-40gb"), "a100-40gb");
        assert_eq!(id("A100 80 GB"), "a100-80gb");
        assert_eq!(id("80gb a100 sxm4"), "a100-80gb");
        assert_eq!(id("  h200-141gb "), "h200-141gb");
        assert_eq!(id("H100"), "h100-80gb");
        assert_eq!(id("l40s"), "l40s");
        assert_eq!(id("rtx 4090"), "rtx-4090");
        assert_eq!(id("v100 pcie 16gb"), "v100-16gb");
        assert_eq!(id("L4 24 GB"), "l4");
    }

    #[test]
    fn every_entry_s_id_name_and_aliases_parse_to_itself() {
        for sku in catalogue().all() {
            for name in sku.names() {
                assert_eq!(id(name), sku.id, "{name}");
                assert!(
                    matches!(catalogue().select(name), Ok(GpuSelector::Sku(s)) if s.id == sku.id),
                    "{name}"
                );
            }
        }
    }

    #[test]
    fn unknown_and_ambiguous_names_are_refused() {
        assert!(matches!(parse("A100"), Err(SkuError::Ambiguous(..))));
        assert!(matches!(parse("v100"), Err(SkuError::Ambiguous(..))));
        assert!(matches!(
            parse("a100 80gb hbm2e"),
            Err(SkuError::Ambiguous(..))
        ));
        let message = parse("a100").unwrap_err().to_string();
        assert!(
            message.contains("a100-40gb") && message.contains("a100-80gb"),
            "{message}"
        );
        assert!(matches!(parse("l4 48gb"), Err(SkuError::Unknown { .. })));
        assert!(matches!(
            parse("NVIDIA GeForce RTX 2080"),
            Err(SkuError::Unknown { .. })
        ));
        assert!(matches!(parse(""), Err(SkuError::Unknown { .. })));
    }

    #[test]
    fn an_unknown_name_near_a_known_one_is_suggested() {
        let error = parse("4090").unwrap_err().to_string();
        assert!(error.contains("did you mean rtx-4090?"), "{error}");
        let error = parse("h10o").unwrap_err().to_string();
        assert!(error.contains("did you mean h100"), "{error}");
        let error = parse("zzzz-9999").unwrap_err().to_string();
        assert!(!error.contains("did you mean"), "{error}");
        assert!(error.contains("`gpucast gpus`"), "{error}");
        let message = parse("rtx").unwrap_err().to_string();
        assert!(message.contains("a100-40gb"), "{message}");
        assert!(message.contains("GET /v1/gpus"), "{message}");
        assert_eq!(
            catalogue().from_device_name("NVIDIA GeForce RTX 2080"),
            None
        );
    }

    #[test]
    fn the_selector_knows_attached() {
        let catalogue = catalogue();
        assert_eq!(catalogue.select("attached").unwrap(), GpuSelector::Attached);
        assert_eq!(catalogue.select("Attached").unwrap(), GpuSelector::Attached);
        assert_eq!(
            catalogue.select("t4").unwrap(),
            GpuSelector::Sku(catalogue.by_id("t4").unwrap())
        );
        assert!(catalogue.select("attachedx").is_err());
    }

    #[test]
    fn a_requested_gpu_with_other_words_around_it_is_refused() {
        let catalogue = catalogue();
        for junk in [
            "my a100 40gb please",
            "a100-40gb; drop table",
            "h100 80gb x",
            "t4 t4 lol",
            "t4 t4",
            "rtx 4090 please",
        ] {
            assert!(
                matches!(catalogue.select(junk), Err(SkuError::Unknown { .. })),
                "{junk}"
            );
        }
        for fine in [
            "NVIDIA A100-SXM4-40GB",
            "H100 80GB HBM3",
            "Tesla V100S-PCIE-32GB",
            "a100 80 gb",
            "rtx 4090",
        ] {
            assert!(catalogue.select(fine).is_ok(), "{fine}");
        }
        let long = format!("x{}", "y".repeat(10_000));
        assert!(catalogue.select(&long).unwrap_err().to_string().len() < 600);
        let long_known = "a100 ".repeat(5_000);
        assert!(catalogue.select(&long_known).unwrap_err().to_string().len() < 600);
    }

    #[test]
    fn slugs_are_file_name_safe() {
        assert_eq!(slug("NVIDIA GeForce RTX 4090"), "geforce-rtx-4090");
        assert_eq!(slug("../../etc/passwd"), "etc-passwd");
        assert_eq!(slug("NVIDIA"), "unknown");
    }
}
