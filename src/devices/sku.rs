//! The catalogue of GPU models (SKUs) gpucast knows the capacity of, and parsing of driver names
//! and user input into them.

use std::fmt;

use crate::devices::performance::GpuPerformance;
use crate::domain::echo;

/// One GPU model with its usable memory as `nvidia-smi` reports it (`memory.total`, MiB).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sku {
    /// Canonical id, lower case: `a100-40gb`. Also the calibration profile's file stem.
    pub id: &'static str,
    /// A readable name: `NVIDIA A100 40GB`.
    pub name: &'static str,
    pub capacity_mib: u64,
    /// Peak throughput, for the roofline performance model.
    pub performance: GpuPerformance,
}

/// Known SKUs. Capacities are nvidia-smi's `memory.total` where it is well known (it is less
/// than the marketing size: ECC and driver reservations); for V100 the nominal GiB x 1024,
/// because the reported figure varies with board and driver.
pub const CATALOGUE: &[Sku] = &[
    Sku {
        id: "a100-40gb",
        name: "NVIDIA A100 40GB",
        capacity_mib: 40_960,
        performance: GpuPerformance {
            sm_count: 108,
            max_warps_per_sm: 64,
            boost_clock_mhz: 1410,
            memory_bandwidth_gb_s: 1555.0,
            fp32_tflops: 19.5,
            tf32_tflops: Some(156.0),
            fp16_tflops: 312.0,
            bf16_tflops: Some(312.0),
            fp8_tflops: None,
        },
    },
    Sku {
        id: "a100-80gb",
        name: "NVIDIA A100 80GB",
        capacity_mib: 81_920,
        performance: GpuPerformance {
            sm_count: 108,
            max_warps_per_sm: 64,
            boost_clock_mhz: 1410,
            memory_bandwidth_gb_s: 2039.0,
            fp32_tflops: 19.5,
            tf32_tflops: Some(156.0),
            fp16_tflops: 312.0,
            bf16_tflops: Some(312.0),
            fp8_tflops: None,
        },
    },
    Sku {
        id: "h100-80gb",
        name: "NVIDIA H100 80GB",
        capacity_mib: 81_559,
        performance: GpuPerformance {
            sm_count: 132,
            max_warps_per_sm: 64,
            boost_clock_mhz: 1980,
            memory_bandwidth_gb_s: 3350.0,
            fp32_tflops: 67.0,
            tf32_tflops: Some(494.7),
            fp16_tflops: 989.4,
            bf16_tflops: Some(989.4),
            fp8_tflops: Some(1978.9),
        },
    },
    Sku {
        id: "h200-141gb",
        name: "NVIDIA H200 141GB",
        capacity_mib: 143_771,
        performance: GpuPerformance {
            sm_count: 132,
            max_warps_per_sm: 64,
            boost_clock_mhz: 1980,
            memory_bandwidth_gb_s: 4800.0,
            fp32_tflops: 67.0,
            tf32_tflops: Some(494.7),
            fp16_tflops: 989.4,
            bf16_tflops: Some(989.4),
            fp8_tflops: Some(1978.9),
        },
    },
    Sku {
        id: "l4",
        name: "NVIDIA L4",
        capacity_mib: 23_034,
        performance: GpuPerformance {
            sm_count: 58,
            max_warps_per_sm: 48,
            boost_clock_mhz: 2040,
            memory_bandwidth_gb_s: 300.0,
            fp32_tflops: 30.3,
            tf32_tflops: Some(60.0),
            fp16_tflops: 121.0,
            bf16_tflops: Some(121.0),
            fp8_tflops: Some(242.0),
        },
    },
    Sku {
        id: "l40s",
        name: "NVIDIA L40S",
        capacity_mib: 46_068,
        performance: GpuPerformance {
            sm_count: 142,
            max_warps_per_sm: 48,
            boost_clock_mhz: 2520,
            memory_bandwidth_gb_s: 864.0,
            fp32_tflops: 91.6,
            tf32_tflops: Some(183.0),
            fp16_tflops: 362.0,
            bf16_tflops: Some(362.0),
            fp8_tflops: Some(733.0),
        },
    },
    Sku {
        id: "t4",
        name: "NVIDIA T4",
        capacity_mib: 15_360,
        performance: GpuPerformance {
            sm_count: 40,
            max_warps_per_sm: 32,
            boost_clock_mhz: 1590,
            memory_bandwidth_gb_s: 320.0,
            fp32_tflops: 8.1,
            tf32_tflops: None,
            fp16_tflops: 65.0,
            bf16_tflops: None,
            fp8_tflops: None,
        },
    },
    Sku {
        id: "v100-16gb",
        name: "NVIDIA V100 16GB",
        capacity_mib: 16_384,
        performance: GpuPerformance {
            sm_count: 80,
            max_warps_per_sm: 64,
            boost_clock_mhz: 1530,
            memory_bandwidth_gb_s: 900.0,
            fp32_tflops: 15.7,
            tf32_tflops: None,
            fp16_tflops: 125.0,
            bf16_tflops: None,
            fp8_tflops: None,
        },
    },
    Sku {
        id: "v100-32gb",
        name: "NVIDIA V100 32GB",
        capacity_mib: 32_768,
        performance: GpuPerformance {
            sm_count: 80,
            max_warps_per_sm: 64,
            boost_clock_mhz: 1530,
            memory_bandwidth_gb_s: 900.0,
            fp32_tflops: 15.7,
            tf32_tflops: None,
            fp16_tflops: 125.0,
            bf16_tflops: None,
            fp8_tflops: None,
        },
    },
];

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SkuError {
    #[error("unknown GPU `{0}`; known: {known}", known = known_ids())]
    Unknown(String),
    #[error("`{0}` is ambiguous: say which memory size, e.g. {1}")]
    Ambiguous(String, &'static str),
}

fn known_ids() -> String {
    CATALOGUE
        .iter()
        .map(|s| s.id)
        .collect::<Vec<_>>()
        .join(", ")
}

impl Sku {
    /// The catalogue entry with this canonical id.
    pub fn by_id(id: &str) -> Option<&'static Sku> {
        CATALOGUE.iter().find(|s| s.id == id)
    }

    /// Parses a driver name (`NVIDIA A100-SXM4-40GB`, `NVIDIA H100 80GB HBM3`, `Tesla T4`,
    /// `NVIDIA H200`) or what a user typed (`A100 40GB`, `a100-40gb`, `h100`), case-insensitively.
    pub fn parse(input: &str) -> Result<&'static Sku, SkuError> {
        let tokens = tokens(input);
        let unknown = || SkuError::Unknown(echo(input));
        // The first token that names a family decides; vendor words and form factors are noise.
        let family = tokens
            .iter()
            .find_map(|t| family_of(t))
            .ok_or_else(unknown)?;
        let gb = memory_gb(&tokens);
        // The H100 NVL (94 GB) names no size in its driver name; it is not in the catalogue.
        if family == "h100" && tokens.iter().any(|t| t == "nvl") {
            return Err(unknown());
        }
        let id = match (family, gb) {
            ("a100", Some(40)) => "a100-40gb",
            ("a100", Some(80)) => "a100-80gb",
            ("a100", None) => {
                return Err(SkuError::Ambiguous(echo(input), "a100-40gb or a100-80gb"))
            }
            ("h100", Some(80) | None) => "h100-80gb",
            ("h200", Some(141) | None) => "h200-141gb",
            ("l4", Some(24) | None) => "l4",
            ("l40s", Some(48) | None) => "l40s",
            ("t4", Some(16) | None) => "t4",
            ("v100", Some(16)) => "v100-16gb",
            ("v100", Some(32)) | ("v100s", Some(32) | None) => "v100-32gb",
            ("v100", None) => {
                return Err(SkuError::Ambiguous(echo(input), "v100-16gb or v100-32gb"))
            }
            _ => return Err(unknown()),
        };
        Ok(Sku::by_id(id).expect("every id above is in the catalogue"))
    }

    /// Like [`Sku::parse`] for a name the driver reported: `None` for models not in the catalogue.
    pub fn from_device_name(name: &str) -> Option<&'static Sku> {
        Sku::parse(name).ok()
    }
}

impl fmt::Display for Sku {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.id)
    }
}

/// Which GPU a request asks about: the one this host has, or a catalogue SKU.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum GpuSelector {
    Attached,
    Sku(&'static Sku),
}

impl GpuSelector {
    /// `attached` (any case) or a GPU name [`Sku::parse`] accepts, made only of what GPU names
    /// hold (family, memory size, form factor): a request's `gpu` with other words in it is a
    /// mistake to refuse, not noise to read past as in a driver's name.
    pub fn parse(input: &str) -> Result<GpuSelector, SkuError> {
        if input.trim().eq_ignore_ascii_case("attached") {
            return Ok(GpuSelector::Attached);
        }
        let tokens = tokens(input);
        let allowed = |t: &String| {
            family_of(t).is_some()
                || FORM_FACTORS.contains(&t.as_str())
                || t.strip_suffix("gb")
                    .unwrap_or(t)
                    .bytes()
                    .all(|b| b.is_ascii_digit())
        };
        if !tokens.iter().all(allowed) {
            return Err(SkuError::Unknown(echo(input)));
        }
        Sku::parse(input).map(GpuSelector::Sku)
    }
}

/// Words of GPU names beside the family and the memory size.
const FORM_FACTORS: [&str; 10] = [
    "sxm", "sxm2", "sxm4", "sxm5", "pcie", "hbm2", "hbm2e", "hbm3", "hbm3e", "nvl",
];

/// Lower-case alphanumeric tokens, vendor words dropped.
fn tokens(input: &str) -> Vec<String> {
    input
        .to_ascii_lowercase()
        .split(|c: char| !c.is_ascii_alphanumeric())
        .filter(|t| !t.is_empty() && *t != "nvidia" && *t != "tesla")
        .map(str::to_string)
        .collect()
}

fn family_of(token: &str) -> Option<&'static str> {
    ["a100", "h100", "h200", "l4", "l40s", "t4", "v100", "v100s"]
        .into_iter()
        .find(|f| *f == token)
}

/// The memory size named in the tokens: `40gb`, or `40` followed by `gb`.
fn memory_gb(tokens: &[String]) -> Option<u64> {
    tokens.iter().enumerate().find_map(|(i, t)| {
        if let Some(number) = t.strip_suffix("gb") {
            return number.parse().ok();
        }
        let next_is_gb = tokens.get(i + 1).is_some_and(|n| n == "gb");
        if next_is_gb {
            t.parse().ok()
        } else {
            None
        }
    })
}

/// A file-name-safe key for any GPU name: lower case, alphanumerics joined by `-`, vendor
/// words dropped (`NVIDIA RTX 6000 Ada Generation` -> `rtx-6000-ada-generation`).
pub fn slug(name: &str) -> String {
    let joined = tokens(name).join("-");
    if joined.is_empty() {
        "unknown".to_string()
    } else {
        joined
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id(input: &str) -> &'static str {
        Sku::parse(input)
            .unwrap_or_else(|e| panic!("{input}: {e}"))
            .id
    }

    #[test]
    fn driver_names_parse_to_catalogue_ids() {
        assert_eq!(id("NVIDIA A100-SXM4-40GB"), "a100-40gb");
        assert_eq!(id("NVIDIA A100-PCIE-40GB"), "a100-40gb");
        assert_eq!(id("NVIDIA A100-SXM4-80GB"), "a100-80gb");
        assert_eq!(id("NVIDIA A100 80GB PCIe"), "a100-80gb");
        assert_eq!(id("NVIDIA H100 80GB HBM3"), "h100-80gb");
        assert_eq!(id("NVIDIA H100 PCIe"), "h100-80gb");
        assert_eq!(id("NVIDIA H200"), "h200-141gb");
        assert_eq!(id("NVIDIA L4"), "l4");
        assert_eq!(id("NVIDIA L40S"), "l40s");
        assert_eq!(id("Tesla T4"), "t4");
        assert_eq!(id("Tesla V100-SXM2-16GB"), "v100-16gb");
        assert_eq!(id("Tesla V100-PCIE-32GB"), "v100-32gb");
        assert_eq!(id("Tesla V100S-PCIE-32GB"), "v100-32gb");
    }

    #[test]
    fn user_input_parses_case_insensitively() {
        assert_eq!(id("A100 40GB"), "a100-40gb");
        assert_eq!(id("a100-40gb"), "a100-40gb");
        assert_eq!(id("A100 80 GB"), "a100-80gb");
        assert_eq!(id("  h200-141gb "), "h200-141gb");
        assert_eq!(id("H100"), "h100-80gb");
        assert_eq!(id("l40s"), "l40s");
        for sku in CATALOGUE {
            assert_eq!(id(sku.id), sku.id, "every canonical id parses to itself");
            assert_eq!(id(sku.name), sku.id, "every readable name parses to its id");
        }
    }

    #[test]
    fn unknown_and_ambiguous_names_are_refused() {
        assert!(matches!(Sku::parse("A100"), Err(SkuError::Ambiguous(..))));
        assert!(matches!(Sku::parse("v100"), Err(SkuError::Ambiguous(..))));
        assert!(matches!(
            Sku::parse("NVIDIA L40"),
            Err(SkuError::Unknown(_))
        ));
        assert!(matches!(
            Sku::parse("NVIDIA H100 NVL 94GB"),
            Err(SkuError::Unknown(_))
        ));
        assert!(matches!(
            Sku::parse("NVIDIA H100 NVL"),
            Err(SkuError::Unknown(_))
        ));
        assert_eq!(id("NVIDIA H200 NVL"), "h200-141gb");
        assert!(matches!(
            Sku::parse("NVIDIA GeForce RTX 4090"),
            Err(SkuError::Unknown(_))
        ));
        assert!(matches!(Sku::parse(""), Err(SkuError::Unknown(_))));
        assert!(Sku::parse("rtx")
            .unwrap_err()
            .to_string()
            .contains("a100-40gb"));
        assert_eq!(Sku::from_device_name("NVIDIA GeForce RTX 4090"), None);
    }

    #[test]
    fn the_selector_knows_attached() {
        assert_eq!(
            GpuSelector::parse("attached").unwrap(),
            GpuSelector::Attached
        );
        assert_eq!(
            GpuSelector::parse("Attached").unwrap(),
            GpuSelector::Attached
        );
        assert_eq!(
            GpuSelector::parse("t4").unwrap(),
            GpuSelector::Sku(Sku::by_id("t4").unwrap())
        );
        assert!(GpuSelector::parse("attachedx").is_err());
    }

    #[test]
    fn a_requested_gpu_with_other_words_around_it_is_refused() {
        for junk in [
            "my a100 40gb please",
            "a100-40gb; drop table",
            "h100 80gb x",
            "t4 t4 lol",
        ] {
            assert!(
                matches!(GpuSelector::parse(junk), Err(SkuError::Unknown(_))),
                "{junk}"
            );
        }
        for fine in [
            "NVIDIA A100-SXM4-40GB",
            "H100 80GB HBM3",
            "Tesla V100S-PCIE-32GB",
            "a100 80 gb",
        ] {
            assert!(GpuSelector::parse(fine).is_ok(), "{fine}");
        }
        for sku in CATALOGUE {
            assert!(GpuSelector::parse(sku.name).is_ok(), "{}", sku.name);
        }
        let long = format!("x{}", "y".repeat(10_000));
        assert!(GpuSelector::parse(&long).unwrap_err().to_string().len() < 400);
    }

    #[test]
    fn slugs_are_file_name_safe() {
        assert_eq!(slug("NVIDIA GeForce RTX 4090"), "geforce-rtx-4090");
        assert_eq!(slug("../../etc/passwd"), "etc-passwd");
        assert_eq!(slug("NVIDIA"), "unknown");
    }
}
