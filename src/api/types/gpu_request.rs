//! The card(s) a request names: one, a list to rank, or a card the catalogue lacks.

use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use super::*;

/// Most cards a `gpu` list may name: enough for any cluster's kinds, bounded for the CPU.
pub const MAX_GPU_CHOICES: usize = 16;

/// One card, or a list of cards to rank.
#[derive(Debug, Clone, PartialEq, Serialize)]
#[serde(untagged)]
pub enum GpuChoice {
    One(GpuRequest),
    Many(Vec<GpuRequest>),
}

// By hand: the derive cannot bound the list's length, which the parser does.
impl utoipa::PartialSchema for GpuChoice {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        use utoipa::openapi::schema::{ArrayBuilder, OneOfBuilder};
        let card = utoipa::openapi::Ref::from_schema_name("GpuRequest");
        OneOfBuilder::new()
            .item(card.clone())
            .item(
                ArrayBuilder::new()
                    .items(card)
                    .min_items(Some(1))
                    .max_items(Some(MAX_GPU_CHOICES)),
            )
            .description(Some("One card, or a list of cards to rank."))
            .into()
    }
}

impl ToSchema for GpuChoice {
    fn schemas(
        schemas: &mut Vec<(
            String,
            utoipa::openapi::RefOr<utoipa::openapi::schema::Schema>,
        )>,
    ) {
        schemas.push((
            "GpuRequest".into(),
            <GpuRequest as utoipa::PartialSchema>::schema(),
        ));
        <GpuRequest as ToSchema>::schemas(schemas);
    }
}

impl GpuChoice {
    /// The cards asked about, in the caller's order.
    pub fn cards(&self) -> &[GpuRequest] {
        match self {
            GpuChoice::One(card) => std::slice::from_ref(card),
            GpuChoice::Many(cards) => cards,
        }
    }
}

impl From<GpuRequest> for GpuChoice {
    fn from(card: GpuRequest) -> GpuChoice {
        GpuChoice::One(card)
    }
}

// By hand, like `GpuRequest`: a list is bounded before its items are read.
impl<'de> Deserialize<'de> for GpuChoice {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::Array(items) => {
                if items.is_empty() || items.len() > MAX_GPU_CHOICES {
                    return Err(D::Error::custom(format!(
                        "a list of GPUs holds 1 to {MAX_GPU_CHOICES} cards, got {}",
                        items.len()
                    )));
                }
                items
                    .into_iter()
                    .enumerate()
                    .map(|(i, item)| {
                        serde_json::from_value(item)
                            .map_err(|e| D::Error::custom(format!("gpu[{i}]: {e}")))
                    })
                    .collect::<Result<_, _>>()
                    .map(GpuChoice::Many)
            }
            one => serde_json::from_value(one)
                .map(GpuChoice::One)
                .map_err(D::Error::custom),
        }
    }
}

/// A GPU a request names: a catalogue id, name or alias (`h100-80gb`, `A100 80GB`,
/// `NVIDIA GeForce RTX 4090`; matched case-insensitively, `GET /v1/gpus` lists them) or
/// `attached` (this host's first GPU); or a card the catalogue lacks, described by its name and
/// memory.
#[derive(Debug, Clone, PartialEq, Serialize, ToSchema)]
#[serde(untagged)]
pub enum GpuRequest {
    #[schema(example = "h100-80gb")]
    Name(String),
    Custom(CustomGpuRequest),
}

/// A card known by its memory only. Its calibration profile is `custom-`, a slug of its name
/// and its capacity (`custom-lab-card-2-24000mib`: even a name the catalogue knows is not a
/// catalogue card, and another capacity is another card); it has no
/// peak figures, so answers give no utilization for it.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize, ToSchema)]
#[serde(deny_unknown_fields)]
#[schema(example = json!({"name": "lab-card-2", "capacity_mib": 24000}))]
pub struct CustomGpuRequest {
    /// 1 to 64 letters, digits, spaces, `-`, `_` or `.`.
    #[schema(min_length = 1, max_length = 64, pattern = "^[A-Za-z0-9 ._-]{1,64}$")]
    pub name: String,
    /// Usable memory, MiB, as nvidia-smi reports it (`memory.total`).
    #[serde(deserialize_with = "whole_number::one")]
    #[schema(minimum = 1, maximum = 1048576)]
    pub capacity_mib: u64,
}

impl GpuRequest {
    /// What the request asks for, for [`crate::placement::Target::resolve`].
    pub fn ask(&self) -> crate::placement::GpuAsk<'_> {
        use crate::placement::GpuAsk;
        match self {
            GpuRequest::Name(name) => GpuAsk::Name(name),
            GpuRequest::Custom(custom) => GpuAsk::Custom {
                name: &custom.name,
                capacity_mib: custom.capacity_mib,
            },
        }
    }
}

// By hand rather than `untagged`, so that a wrong value says what is expected.
impl<'de> Deserialize<'de> for GpuRequest {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        use serde::de::Error;
        match serde_json::Value::deserialize(deserializer)? {
            serde_json::Value::String(name) => Ok(GpuRequest::Name(name)),
            object @ serde_json::Value::Object(_) => serde_json::from_value(object)
                .map(GpuRequest::Custom)
                .map_err(|e| D::Error::custom(format!("a custom GPU: {e}"))),
            _ => Err(D::Error::custom(
                "expected a GPU name or an object {\"name\": ..., \"capacity_mib\": ...}",
            )),
        }
    }
}
