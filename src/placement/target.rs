//! The card a request asks about: a catalogue card by id, name or alias, the card attached
//! to the host, or one the request describes by its memory alone.

use crate::devices::performance::GpuPerformance;
use crate::devices::sku::{Catalogue, GpuSelector, SkuError};
use crate::devices::{derived, CUSTOM_PREFIX};
use crate::devices::{DeviceError, GpuDevices};

/// The card the training data was measured on: estimates are for it unless a GPU is named.
pub const REFERENCE_SKU: &str = "a100-40gb";

/// Longest name of a custom card.
pub const MAX_CUSTOM_NAME_CHARS: usize = 64;
/// Largest memory of a custom card, MiB (1 TiB).
pub const MAX_CUSTOM_CAPACITY_MIB: u64 = 1 << 20;
/// Most custom cards with a calibration profile (each is a file and metric series).
pub const MAX_CUSTOM_PROFILES: usize = 256;

/// A GPU an estimate is placed on.
#[derive(Debug, Clone, PartialEq)]
pub struct Target {
    /// Profile key: a catalogue id (`h100-80gb`), the slug of an unknown attached GPU, or
    /// `custom-<slug>-<capacity>mib` for a card described in the request.
    pub gpu: String,
    pub capacity_mib: u64,
    /// Peak throughput for the performance model: the catalogue's figures, or for an attached
    /// card the catalogue lacks those derived from NVML ([`derived`]); `None` for a custom card
    /// or an attached one whose driver does not say enough.
    pub performance: Option<GpuPerformance>,
}

/// What a request names as its GPU, before it is resolved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GpuAsk<'a> {
    /// A catalogue id, name or alias, or `attached`.
    Name(&'a str),
    /// A card described by the request: known by its memory only.
    Custom { name: &'a str, capacity_mib: u64 },
}

#[derive(Debug, thiserror::Error)]
pub enum PlacementError {
    #[error("gpu: {0}")]
    Sku(#[from] SkuError),
    #[error("gpu: 'attached' was asked for, but {0}")]
    NoDevice(DeviceError),
}

impl Target {
    /// Resolves a request's `gpu` field in `catalogue`; `None` means the reference card.
    pub fn resolve(
        ask: Option<GpuAsk<'_>>,
        catalogue: &Catalogue,
        devices: &dyn GpuDevices,
    ) -> Result<Target, PlacementError> {
        let sku = match ask {
            None => catalogue
                .by_id(REFERENCE_SKU)
                .or_else(|| Catalogue::builtin().by_id(REFERENCE_SKU))
                .expect("the reference SKU is in the built-in catalogue"),
            Some(GpuAsk::Custom { name, capacity_mib }) => return Ok(custom(name, capacity_mib)?),
            Some(GpuAsk::Name(raw)) => match catalogue.select(raw)? {
                GpuSelector::Sku(sku) => sku,
                GpuSelector::Attached => {
                    let device = devices.attached().map_err(PlacementError::NoDevice)?;
                    let performance = match device.sku_in(catalogue) {
                        Some(sku) => Some(sku.performance),
                        None => derived::performance_of(&device),
                    };
                    return Ok(Target {
                        gpu: device.profile_key_in(catalogue),
                        capacity_mib: device.memory_total_mib,
                        performance,
                    });
                }
            },
        };
        Ok(Target {
            gpu: sku.id.clone(),
            capacity_mib: sku.capacity_mib,
            performance: Some(sku.performance),
        })
    }
}

/// A card described by a request: its name (1 to 64 letters, digits, spaces, `-`, `_`, `.`,
/// with at least one letter or digit) and memory (1 to 1,048,576 MiB). Its profile key is
/// `custom-`, a slug of the name, whatever the name, and the capacity: a custom card named
/// like a catalogue card (`a100-40gb`) is not that card (its memory is the request's), so it
/// learns apart from it (`custom-a100-40gb-40000mib`). Names that differ only in case or
/// punctuation share a key when their capacity is the same; a card declared with another
/// capacity is another card, so declaring a larger one cannot lift a reading past the real
/// card's above-capacity refusal into its profile.
fn custom(name: &str, capacity_mib: u64) -> Result<Target, SkuError> {
    let chars = name.chars().count();
    let safe = name
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || matches!(c, ' ' | '-' | '_' | '.'));
    if chars == 0 || chars > MAX_CUSTOM_NAME_CHARS || !safe {
        return Err(SkuError::Custom(format!(
            "name: must be 1 to {MAX_CUSTOM_NAME_CHARS} letters, digits, spaces, `-`, `_` or `.`, got `{}`",
            crate::job::echo(name)
        )));
    }
    if !(1..=MAX_CUSTOM_CAPACITY_MIB).contains(&capacity_mib) {
        return Err(SkuError::Custom(format!(
            "capacity_mib: must be 1 to {MAX_CUSTOM_CAPACITY_MIB}, got {capacity_mib}"
        )));
    }
    let slug: Vec<String> = name
        .to_ascii_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect();
    if slug.is_empty() {
        return Err(SkuError::Custom(
            "name: must hold at least one letter or digit".into(),
        ));
    }
    // A profile key is at most 64 bytes: the prefix and the capacity leave the rest to the
    // slug.
    let suffix = format!("-{capacity_mib}mib");
    let mut slug = slug.join("-");
    slug.truncate(64 - CUSTOM_PREFIX.len() - suffix.len());
    let key = format!("{CUSTOM_PREFIX}{}{suffix}", slug.trim_end_matches('-'));
    Ok(Target {
        gpu: key,
        capacity_mib,
        performance: None,
    })
}
