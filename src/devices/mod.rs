//! The GPUs this host has, behind a trait so that everything above it can be tested without one,
//! and what the service learns about each GPU model (SKU) from jobs it watched.
//!
//! - [`GpuDevices`]: list the GPUs (each with its driver version), read one process's GPU memory.
//!   [`nvml::NvmlDevices`] reads a real driver; [`NoDevices`] stands in where there is none (the
//!   service still starts); [`FakeDevices`] is scripted by tests.
//! - [`sku`]: the catalogue of known SKUs with their capacities and peaks, and name parsing;
//!   [`catalogue`]: the file it is read from (`data/gpus.json`, `--gpus`).
//! - [`derived`]: peaks of a card the catalogue lacks, from what NVML reports of it.
//! - [`watch`]: sample one process's GPU memory until it exits and report its peak.
//!
//! What is learned per GPU from the peaks lives in [`crate::calibration`].

pub mod catalogue;
pub mod derived;
pub mod fake;
pub mod nvml;
pub mod performance;
pub mod sku;
pub mod watch;

pub use fake::FakeDevices;

use serde::Serialize;

/// What the key of a card described in a request starts with (`custom-<slug>-<capacity>mib`).
pub const CUSTOM_PREFIX: &str = "custom-";

/// Whether `key` is a card key (a catalogue id, an attached card's slug, a custom card's key),
/// safe as a file stem and a calibration profile's id: 1 to 64 of `[a-z0-9-]`, starting
/// alphanumeric.
pub fn valid_key(key: &str) -> bool {
    (1..=64).contains(&key.len())
        && key
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
        && key.as_bytes()[0] != b'-'
}

/// One GPU as the driver reports it. Memory figures are MiB, as nvidia-smi shows them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct GpuDevice {
    /// NVML index (the order nvidia-smi lists GPUs in, not necessarily CUDA's order).
    pub index: u32,
    pub uuid: String,
    /// The driver's marketing name, e.g. `NVIDIA A100-SXM4-40GB`.
    pub name: String,
    /// The built-in catalogue's id (`a100-40gb`) when the name is a known SKU, else `None`;
    /// [`GpuDevice::profile_key`] gives a key for unknown SKUs too. The service reads the name
    /// again against its own catalogue (which `--gpus` may extend): see [`GpuDevice::sku_in`].
    pub sku: Option<String>,
    pub memory_total_mib: u64,
    pub memory_used_mib: u64,
    pub memory_free_mib: u64,
    /// `major.minor`, e.g. `8.0`; `None` when the driver cannot say.
    pub compute_capability: Option<String>,
    pub driver_version: String,
    /// Streaming multiprocessors; `None` when the driver cannot say.
    pub multiprocessor_count: Option<u32>,
    /// Highest SM clock, MHz.
    pub max_sm_clock_mhz: Option<u32>,
    /// Highest memory clock, MHz, as NVML reports it (data moves on both edges).
    pub max_memory_clock_mhz: Option<u32>,
    /// Memory bus width, bits.
    pub memory_bus_width_bits: Option<u32>,
}

impl GpuDevice {
    /// Builds a device record, filling [`GpuDevice::sku`] from the name.
    pub fn new(
        index: u32,
        uuid: impl Into<String>,
        name: impl Into<String>,
        memory_total_mib: u64,
    ) -> GpuDevice {
        let name = name.into();
        GpuDevice {
            index,
            uuid: uuid.into(),
            sku: sku::Catalogue::builtin()
                .from_device_name(&name)
                .map(|s| s.id.clone()),
            name,
            memory_total_mib,
            memory_used_mib: 0,
            memory_free_mib: memory_total_mib,
            compute_capability: None,
            driver_version: String::new(),
            multiprocessor_count: None,
            max_sm_clock_mhz: None,
            max_memory_clock_mhz: None,
            memory_bus_width_bits: None,
        }
    }

    /// The entry of `catalogue` this device is, if any.
    pub fn sku_in<'c>(&self, catalogue: &'c sku::Catalogue) -> Option<&'c sku::Sku> {
        catalogue.from_device_name(&self.name)
    }

    /// The key of this device's calibration profile in `catalogue`: its id there, else a slug
    /// of the driver's name.
    pub fn profile_key_in(&self, catalogue: &sku::Catalogue) -> String {
        self.sku_in(catalogue)
            .map(|s| s.id.clone())
            .unwrap_or_else(|| sku::slug(&self.name))
    }

    /// The key under which this GPU's calibration profile is stored: the catalogue id for a
    /// known SKU, else a slug of the driver's name (`NVIDIA RTX PRO 6000` -> `rtx-pro-6000`),
    /// so unknown models learn too.
    pub fn profile_key(&self) -> String {
        self.sku.clone().unwrap_or_else(|| sku::slug(&self.name))
    }
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// No NVML (no NVIDIA driver, or a driver with no GPU): not a failure of the service.
    #[error("no NVML device is present: {0}")]
    Unavailable(String),
    /// The driver answered with an error.
    #[error("NVML call failed: {0}")]
    Nvml(String),
    /// The driver cannot report what was asked (e.g. per-process memory under MIG or WDDM).
    #[error("not supported by this device or driver: {0}")]
    Unsupported(String),
}

/// Read access to the GPUs of this host. Implementations are cheap to share across threads;
/// calls may block briefly on the driver, so async code should call them from `spawn_blocking`.
pub trait GpuDevices: Send + Sync + std::fmt::Debug {
    /// Every GPU, in NVML index order. [`DeviceError::Unavailable`] when there is no driver.
    fn list(&self) -> Result<Vec<GpuDevice>, DeviceError>;

    /// GPU memory (MiB) the process `pid` holds now, summed over every GPU it uses;
    /// `Ok(None)` when the process holds no GPU memory (not started on the GPU yet, or exited).
    fn process_memory_mib(&self, pid: u32) -> Result<Option<u64>, DeviceError>;

    /// Why there is no device, when there is none; `None` when the driver is present.
    fn unavailable_reason(&self) -> Option<&str> {
        None
    }

    /// The device `gpu: "attached"` refers to: the first GPU (NVML index 0).
    fn attached(&self) -> Result<GpuDevice, DeviceError> {
        self.list()?
            .into_iter()
            .next()
            .ok_or_else(|| DeviceError::Unavailable("the driver lists no GPU".into()))
    }
}

/// What the service uses when there is no NVIDIA driver: every call says so, with the reason.
#[derive(Debug, Clone)]
pub struct NoDevices {
    reason: String,
}

impl NoDevices {
    pub fn new(reason: impl Into<String>) -> NoDevices {
        NoDevices {
            reason: reason.into(),
        }
    }
}

impl GpuDevices for NoDevices {
    fn list(&self) -> Result<Vec<GpuDevice>, DeviceError> {
        Err(DeviceError::Unavailable(self.reason.clone()))
    }

    fn process_memory_mib(&self, _pid: u32) -> Result<Option<u64>, DeviceError> {
        Err(DeviceError::Unavailable(self.reason.clone()))
    }

    fn unavailable_reason(&self) -> Option<&str> {
        Some(&self.reason)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_devices_reports_its_reason_on_every_call() {
        let none = NoDevices::new("libnvidia-ml.so.1: cannot open shared object file");
        assert_eq!(
            none.unavailable_reason(),
            Some("libnvidia-ml.so.1: cannot open shared object file")
        );
        assert!(matches!(none.list(), Err(DeviceError::Unavailable(_))));
        assert!(matches!(
            none.process_memory_mib(1),
            Err(DeviceError::Unavailable(_))
        ));
        assert!(matches!(none.attached(), Err(DeviceError::Unavailable(_))));
        assert!(none
            .list()
            .unwrap_err()
            .to_string()
            .starts_with("no NVML device is present"));
    }

    #[test]
    fn a_device_record_knows_its_sku_and_profile_key() {
        let known = GpuDevice::new(0, "GPU-1", "NVIDIA A100-SXM4-40GB", 40960);
        assert_eq!(known.sku.as_deref(), Some("a100-40gb"));
        assert_eq!(known.profile_key(), "a100-40gb");
        let unknown = GpuDevice::new(1, "GPU-2", "NVIDIA RTX PRO 6000 Blackwell", 97887);
        assert_eq!(unknown.sku, None);
        assert_eq!(unknown.profile_key(), "rtx-pro-6000-blackwell");
    }

    #[test]
    fn attached_is_the_first_device() {
        let fake = FakeDevices::new(vec![
            GpuDevice::new(0, "GPU-a", "NVIDIA H100 80GB HBM3", 81559),
            GpuDevice::new(1, "GPU-b", "NVIDIA L4", 23034),
        ]);
        assert_eq!(fake.attached().unwrap().uuid, "GPU-a");
        assert!(matches!(
            FakeDevices::new(vec![]).attached(),
            Err(DeviceError::Unavailable(_))
        ));
    }
}
