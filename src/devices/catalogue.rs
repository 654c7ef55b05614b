//! The GPU catalogue file: `data/gpus.json` (embedded, the default) and the optional file given
//! by `--gpus`, which adds entries or replaces those with the same id. Every figure is checked
//! when the file is read, so a catalogue in use holds only sane cards.

use std::path::Path;

use serde::Deserialize;

use super::{valid_key, CUSTOM_PREFIX};
use crate::devices::performance::GpuPerformance;
use crate::devices::sku::{Catalogue, Origin, Sku, Source, Vendor};

/// The built-in catalogue.
pub const BUILTIN_JSON: &str = include_str!("../../data/gpus.json");

/// Most entries one file may hold.
pub const MAX_ENTRIES: usize = 1_000;
/// Most aliases one entry may have.
pub const MAX_ALIASES: usize = 32;
/// Longest id (a calibration profile key, so at most [`valid_key`]'s 64 bytes).
const MAX_ID_CHARS: usize = 64;
/// Longest name or alias.
const MAX_NAME_CHARS: usize = 96;
/// Longest source title, URL or note.
const MAX_TEXT_CHARS: usize = 1_024;
/// Largest memory accepted (MiB): 1 TiB.
const MAX_MEMORY_MIB: u64 = 1 << 20;
/// Largest throughput accepted (TFLOP/s): far beyond any card.
const MAX_TFLOPS: f64 = 1.0e6;

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CatalogueFile {
    gpus: Vec<EntryFile>,
}

/// One card as the file writes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct EntryFile {
    id: String,
    name: String,
    #[serde(default)]
    aliases: Vec<String>,
    /// The values GPU Feature Discovery writes for the node label `nvidia.com/gpu.product` on
    /// a node with this card: the NVML name with its spaces as dashes (`NVIDIA-A100-SXM4-40GB`).
    /// NVIDIA cards only; the admission webhook's node affinity lists them.
    #[serde(default)]
    gfd_products: Vec<String>,
    /// nvidia-smi's `memory.total`, MiB.
    memory_mib: u64,
    /// The marketing size in GB, which users type (`a100 40gb`).
    memory_gb: u32,
    sm_count: u32,
    max_warps_per_sm: u32,
    boost_clock_mhz: u32,
    memory_bandwidth_gb_s: f64,
    fp32_tflops: f64,
    #[serde(default)]
    tf32_tflops: Option<f64>,
    fp16_tflops: f64,
    #[serde(default)]
    bf16_tflops: Option<f64>,
    #[serde(default)]
    fp8_tflops: Option<f64>,
    /// GPU-to-GPU bandwidth each way, GB/s (default: PCIe 4.0 x16's).
    #[serde(default)]
    interconnect_gb_s: Option<f64>,
    /// What the link is (`NVLink 3: ...`), for people.
    #[serde(default)]
    interconnect: Option<String>,
    /// `nvidia` (the default) or `amd`.
    #[serde(default)]
    vendor: Vendor,
    /// `major.minor` for NVIDIA, the `gfx` target for AMD (`gfx942`).
    compute_capability: String,
    source: SourceFile,
    #[serde(default)]
    note: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct SourceFile {
    title: String,
    url: String,
}

#[derive(Debug, thiserror::Error)]
pub enum CatalogueError {
    #[error("GPU catalogue {file}: cannot read: {source}")]
    Read {
        file: String,
        source: std::io::Error,
    },
    #[error("GPU catalogue {file}: not a catalogue: {detail}")]
    Format { file: String, detail: String },
    #[error("GPU catalogue {file}: {detail}")]
    Invalid { file: String, detail: String },
}

impl Catalogue {
    /// The built-in catalogue (`data/gpus.json`), checked once.
    pub fn builtin() -> &'static Catalogue {
        static BUILTIN: std::sync::OnceLock<Catalogue> = std::sync::OnceLock::new();
        BUILTIN.get_or_init(|| {
            let skus = read_entries(BUILTIN_JSON, "data/gpus.json", Origin::Builtin)
                .expect("the built-in GPU catalogue is valid (a unit test checks it)");
            Catalogue::new(skus, vec![]).expect("the built-in GPU catalogue is consistent")
        })
    }

    /// The built-in catalogue with the entries of `text` (a file in the same format) added, or
    /// replacing the built-in entries with the same id. `file` names it in errors.
    pub fn with_overrides(text: &str, file: &str) -> Result<Catalogue, CatalogueError> {
        let added = read_entries(text, file, Origin::File)?;
        let builtin = Catalogue::builtin()
            .all()
            .iter()
            .filter(|b| !added.iter().any(|a| a.id == b.id))
            .cloned()
            .collect();
        Catalogue::new(builtin, added).map_err(|detail| CatalogueError::Invalid {
            file: file.to_string(),
            detail,
        })
    }

    /// [`Catalogue::with_overrides`] of the file at `path`.
    pub fn load(path: &Path) -> Result<Catalogue, CatalogueError> {
        let file = path.display().to_string();
        // Bounded before reading it all: 1,000 entries fit in far less.
        const MAX_BYTES: u64 = 8 * 1024 * 1024;
        let size = std::fs::metadata(path)
            .map_err(|source| CatalogueError::Read {
                file: file.clone(),
                source,
            })?
            .len();
        if size > MAX_BYTES {
            return Err(CatalogueError::Invalid {
                file,
                detail: format!("{size} bytes; at most {MAX_BYTES} are read"),
            });
        }
        let text = std::fs::read_to_string(path).map_err(|source| CatalogueError::Read {
            file: file.clone(),
            source,
        })?;
        Catalogue::with_overrides(&text, &file)
    }
}

/// Parses and checks every entry of a catalogue file.
fn read_entries(text: &str, file: &str, origin: Origin) -> Result<Vec<Sku>, CatalogueError> {
    let parsed: CatalogueFile = serde_json::from_str(text).map_err(|e| CatalogueError::Format {
        file: file.to_string(),
        detail: e.to_string(),
    })?;
    let invalid = |detail: String| CatalogueError::Invalid {
        file: file.to_string(),
        detail,
    };
    if parsed.gpus.len() > MAX_ENTRIES {
        return Err(invalid(format!(
            "gpus: {} entries; at most {MAX_ENTRIES} are accepted",
            parsed.gpus.len()
        )));
    }
    let mut skus: Vec<Sku> = Vec::with_capacity(parsed.gpus.len());
    for (index, entry) in parsed.gpus.into_iter().enumerate() {
        let label = format!("gpus[{index}] ({})", crate::job::echo(&entry.id));
        let sku = check_entry(entry, origin).map_err(|e| invalid(format!("{label}.{e}")))?;
        if skus.iter().any(|s| s.id == sku.id) {
            return Err(invalid(format!("{label}.id: `{}` appears twice", sku.id)));
        }
        skus.push(sku);
    }
    Ok(skus)
}

/// One entry's checks; the error is `field: what is wrong`.
fn check_entry(e: EntryFile, origin: Origin) -> Result<Sku, String> {
    if e.id.chars().count() > MAX_ID_CHARS || !valid_key(&e.id) {
        return Err(format!(
            "id: must be 1 to {MAX_ID_CHARS} lower-case letters, digits and `-`, not starting with `-`"
        ));
    }
    // Custom cards' profiles are `custom-...`: a catalogue card must not share one.
    if e.id.starts_with(CUSTOM_PREFIX) {
        return Err("id: `custom-` is kept for cards described in requests".into());
    }
    text("name", &e.name, MAX_NAME_CHARS)?;
    if e.aliases.len() > MAX_ALIASES {
        return Err(format!(
            "aliases: {} given; at most {MAX_ALIASES}",
            e.aliases.len()
        ));
    }
    for (i, alias) in e.aliases.iter().enumerate() {
        text(&format!("aliases[{i}]"), alias, MAX_NAME_CHARS)?;
    }
    if e.gfd_products.len() > MAX_ALIASES {
        return Err(format!(
            "gfd_products: {} given; at most {MAX_ALIASES}",
            e.gfd_products.len()
        ));
    }
    if e.vendor != Vendor::Nvidia && !e.gfd_products.is_empty() {
        return Err("gfd_products: GPU Feature Discovery labels NVIDIA cards only".into());
    }
    for (i, product) in e.gfd_products.iter().enumerate() {
        if !valid_label_value(product) {
            return Err(format!(
                "gfd_products[{i}]: must be a Kubernetes label value (1 to 63 letters, digits, \
                 `-`, `_` or `.`, a letter or digit at each end), as GPU Feature Discovery \
                 writes the NVML name with its spaces as dashes, got `{}`",
                crate::job::echo(product)
            ));
        }
    }
    if !(1..=MAX_MEMORY_MIB).contains(&e.memory_mib) {
        return Err(format!(
            "memory_mib: must be 1 to {MAX_MEMORY_MIB}, got {}",
            e.memory_mib
        ));
    }
    if !(1..=1_024).contains(&e.memory_gb) {
        return Err(format!("memory_gb: must be 1 to 1024, got {}", e.memory_gb));
    }
    let counts = [
        ("sm_count", e.sm_count, 10_000),
        ("max_warps_per_sm", e.max_warps_per_sm, 1_024),
        ("boost_clock_mhz", e.boost_clock_mhz, 100_000),
    ];
    for (field, value, max) in counts {
        if !(1..=max).contains(&value) {
            return Err(format!("{field}: must be 1 to {max}, got {value}"));
        }
    }
    positive("memory_bandwidth_gb_s", e.memory_bandwidth_gb_s, 1.0e6)?;
    positive("fp32_tflops", e.fp32_tflops, MAX_TFLOPS)?;
    positive("fp16_tflops", e.fp16_tflops, MAX_TFLOPS)?;
    for (field, value) in [
        ("tf32_tflops", e.tf32_tflops),
        ("bf16_tflops", e.bf16_tflops),
        ("fp8_tflops", e.fp8_tflops),
    ] {
        if let Some(value) = value {
            positive(field, value, MAX_TFLOPS)?;
        }
    }
    if let Some(link) = e.interconnect_gb_s {
        positive("interconnect_gb_s", link, 1.0e5)?;
    }
    if let Some(link) = &e.interconnect {
        text("interconnect", link, MAX_TEXT_CHARS)?;
    }
    let gfx = |v: &str| {
        v.strip_prefix("gfx")
            .is_some_and(|t| (3..=5).contains(&t.len()) && t.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    match e.vendor {
        Vendor::Nvidia if !valid_compute_capability(&e.compute_capability) => {
            return Err("compute_capability: must be `major.minor`, e.g. `8.0`".into());
        }
        Vendor::Amd if !gfx(&e.compute_capability) => {
            return Err(
                "compute_capability: an AMD card's is its gfx target, e.g. `gfx942`".into(),
            );
        }
        _ => {}
    }
    text("source.title", &e.source.title, MAX_TEXT_CHARS)?;
    text("source.url", &e.source.url, MAX_TEXT_CHARS)?;
    if let Some(note) = &e.note {
        text("note", note, MAX_TEXT_CHARS)?;
    }
    Ok(Sku {
        id: e.id,
        name: e.name,
        aliases: e.aliases,
        gfd_products: e.gfd_products,
        capacity_mib: e.memory_mib,
        memory_gb: e.memory_gb,
        vendor: e.vendor,
        performance: GpuPerformance {
            sm_count: e.sm_count,
            max_warps_per_sm: e.max_warps_per_sm,
            boost_clock_mhz: e.boost_clock_mhz,
            memory_bandwidth_gb_s: e.memory_bandwidth_gb_s,
            fp32_tflops: e.fp32_tflops,
            tf32_tflops: e.tf32_tflops,
            fp16_tflops: e.fp16_tflops,
            bf16_tflops: e.bf16_tflops,
            fp8_tflops: e.fp8_tflops,
            interconnect_gb_s: e
                .interconnect_gb_s
                .unwrap_or(crate::devices::performance::DEFAULT_INTERCONNECT_GB_S),
        },
        compute_capability: e.compute_capability,
        source: Source {
            title: e.source.title,
            url: e.source.url,
        },
        note: e.note,
        origin,
    })
}

fn text(field: &str, value: &str, max: usize) -> Result<(), String> {
    let chars = value.chars().count();
    if value.trim().is_empty() || chars > max || value.chars().any(char::is_control) {
        return Err(format!(
            "{field}: must be 1 to {max} characters without control characters, got {chars}"
        ));
    }
    Ok(())
}

fn positive(field: &str, value: f64, max: f64) -> Result<(), String> {
    if value.is_finite() && value > 0.0 && value <= max {
        Ok(())
    } else {
        // A huge figure printed in full would be hundreds of digits.
        let shown = if value.abs() < 1e12 {
            format!("{value}")
        } else {
            format!("{value:e}")
        };
        Err(format!(
            "{field}: must be a positive finite number up to {max}, got {shown}"
        ))
    }
}

/// A Kubernetes label value (not empty here): at most 63 characters of `[A-Za-z0-9._-]`,
/// beginning and ending with a letter or digit.
pub fn valid_label_value(value: &str) -> bool {
    let bytes = value.as_bytes();
    let inner = |b: &u8| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.');
    (1..=63).contains(&bytes.len())
        && bytes.iter().all(inner)
        && bytes[0].is_ascii_alphanumeric()
        && bytes[bytes.len() - 1].is_ascii_alphanumeric()
}

/// `8.0`, `10.0`, `12.1`.
pub fn valid_compute_capability(value: &str) -> bool {
    let Some((major, minor)) = value.split_once('.') else {
        return false;
    };
    let digits = |s: &str| (1..=2).contains(&s.len()) && s.bytes().all(|b| b.is_ascii_digit());
    digits(major) && digits(minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(id: &str) -> serde_json::Value {
        serde_json::json!({
            "id": id, "name": format!("Card {id}"), "aliases": [format!("NVIDIA Card {id}")],
            "memory_mib": 16384, "memory_gb": 16, "sm_count": 40, "max_warps_per_sm": 48,
            "boost_clock_mhz": 2000, "memory_bandwidth_gb_s": 500.0, "fp32_tflops": 20.0,
            "tf32_tflops": 40.0, "fp16_tflops": 80.0, "bf16_tflops": 80.0, "fp8_tflops": null,
            "compute_capability": "8.9",
            "source": {"title": "a test", "url": "https://example.com"}
        })
    }

    fn file(entries: Vec<serde_json::Value>) -> String {
        serde_json::json!({ "gpus": entries }).to_string()
    }

    fn error(entries: Vec<serde_json::Value>) -> String {
        Catalogue::with_overrides(&file(entries), "extra.json")
            .expect_err("refused")
            .to_string()
    }

    #[test]
    fn the_builtin_catalogue_is_valid_and_keeps_the_original_ids() {
        let catalogue = Catalogue::builtin();
        assert!(catalogue.all().len() >= 25);
        for id in [
            "a100-40gb",
            "a100-80gb",
            "h100-80gb",
            "h200-141gb",
            "l4",
            "l40s",
            "t4",
            "v100-16gb",
            "v100-32gb",
        ] {
            assert!(catalogue.by_id(id).is_some(), "{id}");
        }
        assert!(catalogue.all().iter().all(|s| s.origin == Origin::Builtin));
    }

    #[test]
    fn a_file_adds_entries_and_replaces_those_with_the_same_id() {
        let mut t4 = entry("t4");
        t4["memory_mib"] = 15_000.into();
        let catalogue =
            Catalogue::with_overrides(&file(vec![entry("my-card"), t4]), "extra.json").unwrap();
        let added = catalogue.by_id("my-card").unwrap();
        assert_eq!(added.origin, Origin::File);
        assert_eq!(
            catalogue.parse("NVIDIA Card my-card").unwrap().id,
            "my-card"
        );
        let t4 = catalogue.by_id("t4").unwrap();
        assert_eq!((t4.capacity_mib, t4.origin), (15_000, Origin::File));
        assert_eq!(catalogue.all().len(), Catalogue::builtin().all().len() + 1);
    }

    #[test]
    fn a_file_alias_takes_a_name_from_the_builtin_entry() {
        let mut nvl = entry("h200-nvl");
        nvl["aliases"] = serde_json::json!(["NVIDIA H200 NVL"]);
        let catalogue = Catalogue::with_overrides(&file(vec![nvl]), "extra.json").unwrap();
        assert_eq!(catalogue.parse("NVIDIA H200 NVL").unwrap().id, "h200-nvl");
        assert_eq!(catalogue.parse("NVIDIA H200").unwrap().id, "h200-141gb");
    }

    #[test]
    fn every_nvidia_card_carries_its_gfd_products_as_gfd_writes_them() {
        // GPU Feature Discovery labels `nvidia.com/gpu.product` with the NVML name, spaces
        // as dashes: each product is one of the entry's names so rewritten.
        for sku in Catalogue::builtin().all() {
            match sku.vendor {
                Vendor::Nvidia => assert!(!sku.gfd_products.is_empty(), "{}", sku.id),
                Vendor::Amd => assert!(sku.gfd_products.is_empty(), "{}", sku.id),
            }
            for product in &sku.gfd_products {
                assert!(
                    sku.names().any(|name| name.replace(' ', "-") == *product),
                    "{}: {product}",
                    sku.id
                );
            }
        }
        let catalogue = Catalogue::builtin();
        for (product, id) in [
            ("NVIDIA-A100-SXM4-80GB", "a100-80gb"),
            ("NVIDIA-H100-80GB-HBM3", "h100-80gb"),
            ("NVIDIA-GeForce-RTX-4090", "rtx-4090"),
            ("Tesla-V100-SXM2-16GB", "v100-16gb"),
        ] {
            assert_eq!(catalogue.by_gfd_product(product).unwrap().id, id);
        }
    }

    #[test]
    fn gfd_products_are_label_values_of_nvidia_cards_held_by_one_entry() {
        let mut bad = entry("bad");
        bad["gfd_products"] = serde_json::json!(["NVIDIA Card bad"]);
        assert!(error(vec![bad]).contains("gfd_products[0]"));
        let mut amd = entry("amd-card");
        amd["vendor"] = "amd".into();
        amd["compute_capability"] = "gfx942".into();
        amd["gfd_products"] = serde_json::json!(["AMD-Card"]);
        assert!(error(vec![amd]).contains("NVIDIA cards only"));
        let (mut a, mut b) = (entry("a"), entry("b"));
        a["gfd_products"] = serde_json::json!(["NVIDIA-Card"]);
        b["gfd_products"] = serde_json::json!(["NVIDIA-Card"]);
        assert!(error(vec![a, b]).contains("names both"));
        // An added card takes a product from a built-in one, as it takes a name.
        let mut nvl = entry("h200-nvl");
        nvl["gfd_products"] = serde_json::json!(["NVIDIA-H200-NVL"]);
        let catalogue = Catalogue::with_overrides(&file(vec![nvl]), "extra.json").unwrap();
        assert_eq!(
            catalogue.by_gfd_product("NVIDIA-H200-NVL").unwrap().id,
            "h200-nvl"
        );
        let h200 = catalogue.by_id("h200-141gb").unwrap();
        assert_eq!(h200.gfd_products, ["NVIDIA-H200"]);
    }

    #[test]
    fn bad_figures_are_refused_naming_the_entry_and_field() {
        for (field, value) in [
            ("memory_mib", serde_json::json!(0)),
            ("fp32_tflops", serde_json::json!(-1.0)),
            ("fp16_tflops", serde_json::json!(1e300)),
            ("tf32_tflops", serde_json::json!(0.0)),
            ("sm_count", serde_json::json!(0)),
            ("compute_capability", serde_json::json!("eight")),
            ("name", serde_json::json!("x".repeat(500))),
            ("id", serde_json::json!("Bad Id")),
            ("id", serde_json::json!("custom-card")),
        ] {
            let mut bad = entry("bad");
            bad[field] = value;
            let message = error(vec![bad]);
            assert!(
                message.contains("gpus[0]") && message.contains(field),
                "{field}: {message}"
            );
            assert!(message.len() < 400, "{message}");
        }
        let mut missing = entry("bad");
        missing.as_object_mut().unwrap().remove("fp32_tflops");
        assert!(error(vec![missing]).contains("fp32_tflops"));
    }

    #[test]
    fn duplicate_ids_and_aliases_and_too_many_entries_are_refused() {
        assert!(error(vec![entry("a"), entry("a")]).contains("appears twice"));
        let mut clash = entry("b");
        clash["aliases"] = serde_json::json!(["NVIDIA Card a"]);
        let message = error(vec![entry("a"), clash]);
        assert!(message.contains("names both"), "{message}");
        let many = (0..=MAX_ENTRIES).map(|i| entry(&format!("c{i}"))).collect();
        assert!(error(many).contains("at most 1000"));
        let junk = Catalogue::with_overrides("{\"gpus\": 3}", "extra.json")
            .err()
            .unwrap();
        assert!(matches!(junk, CatalogueError::Format { .. }), "{junk}");
    }

    #[test]
    fn loading_a_missing_file_says_which() {
        let error = Catalogue::load(Path::new("/nonexistent/gpus.json"))
            .err()
            .unwrap();
        assert!(error.to_string().contains("/nonexistent/gpus.json"));
    }
}
